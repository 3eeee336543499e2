"""Each optimizer step's learning-rate factor applied, the measurements its rule asks for, and whether the step runs.

[`OptimizerStepControl`] is the training-layer side of `estimators.step_rate.StepRateRule`, which decides the rate
of every step (lr = scheduled × f × g; the scheduler never sees the factor) and sequences its measurements. It drives
the rule through a step as the rule's caller: the schedule's rate and peak before the step's first micro-batch
(DeepSpeed steps inside the last `backward`, before the step's own statistics exist), its gradient norm and noise
estimate when the Trainer has them, and after the step the measurements the rule asks for (the step's KL, through the
function it is handed, and Adam's update size, over every process). It applies the factor through the two hooks of
`training.optim_hooks` on the innermost torch optimizer (once per optimizer object; DeepSpeed builds its own in
`prepare`), refuses a step whose loss, gradient norm or factor is not finite on any process, and logs what the rule's
calls return: the SNR reading, and once per step the factor of an applied step (`oblr/lr`, the rate used) or the skip
of a refused one (DeepSpeed's ZeRO optimizers call the torch optimizer's `step` once per param group).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, MutableMapping

import torch

from ..estimators.snr import NoiseEstimate, gradient_noise_scale
from ..estimators.step_rate import StepRateRule
from ..estimators.trust_region import adam_update_square_sum
from .optim_hooks import OptimizerStepGate, StepLearningRateScale, innermost_optimizer

__all__ = ["OptimizerStepControl"]


class OptimizerStepControl:
    """The gate and the learning-rate factor of every optimizer step, and the measurements its rule asks for.

    Args:
        accelerator: the Trainer's accelerator (device, processes, gather, reduce).
        metrics: where the step's factor, measurements and skips are logged (the trainer's train metrics).
        rule: decides each step's factor and what to measure (`estimators.step_rate.step_rate_rule`).
        gate: refuse non-finite steps (`skip_nonfinite_steps`).
        current_step: the optimizer steps done so far, for the warning of a skipped step.
        step_kl: ``measure ->`` the KL of the step that just ran (None: nothing measured), which also forgets its
            micro-batches; called after every step where the rule measures KL.
    """

    def __init__(
        self,
        accelerator,
        metrics: MutableMapping[str, list],
        rule: StepRateRule,
        gate: bool,
        current_step: Callable[[], int],
        step_kl: Callable[[bool], float | None] | None = None,
    ):
        if rule.measures_kl and step_kl is None:
            raise ValueError("a rule that measures the step KL needs `step_kl` to measure it.")
        self.accelerator = accelerator
        self.metrics = metrics
        self.rule = rule
        self.gate = gate
        self.current_step = current_step
        self.step_kl = step_kl
        self.skipped = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scale: StepLearningRateScale | None = None
        self.step_gate: OptimizerStepGate | None = None
        self.begin_step()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook the optimizer that updates the parameters (once per optimizer object). The gate goes on first: a refused
        step does not reach the learning-rate hooks."""
        optimizer = innermost_optimizer(optimizer)
        if optimizer is self.optimizer:
            return
        self.optimizer = optimizer
        for hooks in (self.step_gate, self.lr_scale):
            if hooks is not None:
                hooks.remove()
        if self.gate:
            self.step_gate = OptimizerStepGate(optimizer, self._allowed, self._log_skipped)
        if self.rule.scales_rate:
            self.lr_scale = StepLearningRateScale(optimizer, lambda: self.factor, self._note_scaled)

    # Before the step -------------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Before the step's first micro-batch: its factor, from the measurements of the steps before it."""
        scheduled = peak = None
        if self.optimizer is not None:
            group = self.optimizer.param_groups[0]
            scheduled = float(group["lr"])  # the scheduler has set this step's
            peak = float(group.get("initial_lr", scheduled))  # what the schedule multiplies (torch's LRScheduler)
        self.factor = self.rule.begin_step(scheduled, peak)
        self._scaled_lr: float | None = None  # the rate a scaled step used, once it ran
        self.loss_finite = torch.ones((), dtype=torch.bool)
        self.grad_norm_finite = True
        self.grad_norm: float | None = None  # None: not known before the step
        self._allowed_now: bool | None = None
        self._logged = False  # the skip of a refused step (DeepSpeed refuses it once per param group)

    def note_loss(self, loss: torch.Tensor) -> None:
        """A training micro-batch's loss (kept on its device: no sync per micro-batch)."""
        self.loss_finite = self.loss_finite.to(loss.device) & torch.isfinite(loss.detach()).all()

    def note_grad_norm(self, grad_norm) -> None:
        """The step's pre-clip gradient norm: before the step the rule may amend its factor; under DeepSpeed, which
        computes the norm inside its step, the step has run by now (its hooks have) and the factor stands
        (`StepRateRule.note_grad_norm`)."""
        self.grad_norm = None if grad_norm is None else float(grad_norm)
        self.grad_norm_finite = self.grad_norm is None or math.isfinite(self.grad_norm)
        stepped = self._allowed_now is not None or self._scaled_lr is not None
        self.factor = self.rule.note_grad_norm(self.grad_norm, stepped=stepped)

    # After the step --------------------------------------------------------------------------------------------------

    def observe_noise(self, estimate: NoiseEstimate | None, units: float, samples: float) -> None:
        """The step's noise estimate over ``units`` samples of the estimator (``samples`` completions): the rule fixes
        the next step's SNR factor; the SNR reading it returns is logged."""
        reading = self.rule.observe_noise(estimate, units)
        if reading is None:
            return
        metrics = self.metrics
        metrics["snr/skipped_steps"].append(float(reading.skipped))
        metrics["snr/grad_sq_norm_ema"].append(reading.grad_sq_norm)
        metrics["snr/trace_cov_ema"].append(reading.trace_cov)
        finite = math.isfinite(reading.snr)
        metrics["snr/snr"].append(reading.snr if finite else float("nan"))
        metrics["snr/noise_scale"].append(1.0 / reading.snr if finite and reading.snr > 0 else float("nan"))
        # the same in completions, beside the completions the step used: the batch-size counterpart of the step size
        metrics["oblr/noise_scale"].append(
            gradient_noise_scale(reading.trace_cov, reading.grad_sq_norm, samples / units if units else 1.0)
        )
        metrics["snr/bound_factor"].append(reading.bound_factor)
        metrics["snr/resolved"].append(float(reading.resolved))
        if math.isfinite(reading.calibration_t):
            metrics["snr/calibration_t"].append(reading.calibration_t)
        if math.isfinite(reading.reference_factor):
            metrics["snr/reference_factor"].append(reading.reference_factor)

    @property
    def measures_step_kl(self) -> bool:
        """Whether the rule will measure the KL of the step begun (`StepRateRule.kl_planned`): only such a step needs
        its micro-batches kept."""
        return self.rule.kl_planned

    def after_step(self) -> bool:
        """The optimizer step ran (or was refused): the rule measures what it asks for (`StepRateRule.end_step`) and
        what it returns is logged. Returns whether the step's KL was measured (a forward ran after the step)."""
        record = self.rule.end_step(self.applied_lr, step_kl=self.step_kl, update_mean_square=self._update_mean_square)
        metrics = self.metrics
        if self._scaled_lr is not None:  # the factor acted on a step that ran
            if record.snr_factor is not None:
                metrics["snr/lr_factor"].append(record.snr_factor)
            if record.trust_region_factor is not None:
                metrics["oblr/trust_region_factor"].append(record.trust_region_factor)
            metrics["oblr/lr"].append(record.lr)
        if record.aimed_kl is not None:  # what the curvature known before the step predicted, beside what it did
            metrics["oblr/step_kl_target"].append(record.aimed_kl)
        if record.update_rms is not None:
            metrics["oblr/update_rms"].append(record.update_rms)
        if record.kl is not None:
            metrics["oblr/step_kl"].append(record.kl)
        if record.trust_region_rate is not None:  # the rate the rule leaves for the next step
            metrics["oblr/trust_region_rate"].append(record.trust_region_rate)
        return record.kl is not None

    def _update_mean_square(self) -> float | None:
        """The mean square of the step's update per unit rate over every process's coordinates (one collective on
        every process alike), or None without an Adam state."""
        if self.optimizer is None:
            return None
        device = self.accelerator.device
        local = adam_update_square_sum(self.optimizer)
        local = torch.zeros(2, device=device) if local is None else local.to(device)
        total, count = self.accelerator.reduce(local, reduction="sum").tolist()
        return total / count if count > 0 else None

    # The gate and the hooks' notes -----------------------------------------------------------------------------------

    def _allowed(self) -> bool:
        """Every process agrees: the step's losses, gradient norm and factor are all finite."""
        if self._allowed_now is not None:
            return self._allowed_now
        device = self.accelerator.device
        finite = self.loss_finite.to(device) & torch.tensor(
            self.grad_norm_finite and math.isfinite(self.factor), device=device
        )
        if self.accelerator.num_processes > 1:
            finite = self.accelerator.gather(finite.reshape(1)).all()
        self._allowed_now = bool(finite)
        return self._allowed_now

    def _log_skipped(self) -> None:
        if self._logged:
            return
        self._logged = True
        self.skipped += 1
        self.metrics["oblr/skipped_nonfinite_steps"].append(float(self.skipped))
        warnings.warn(
            f"Optimizer step {self.current_step() + 1} skipped: non-finite loss, gradient norm or learning-rate "
            f"factor ({self.skipped} skipped so far). The parameters and optimizer state are unchanged."
        )

    def _note_scaled(self, scheduled_lr: float, factor: float) -> None:
        if self._scaled_lr is None:  # the first of DeepSpeed's calls, one per param group
            self._scaled_lr = scheduled_lr * factor

    @property
    def applied_lr(self) -> float | None:
        """The rate the step that just ran used; None if it was refused."""
        if self._allowed_now is False:
            return None
        if self._scaled_lr is not None:
            return self._scaled_lr
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None
