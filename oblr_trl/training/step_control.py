"""Each optimizer step's learning-rate factor applied, the measurements its rule asks for, and whether the step runs.

[`OptimizerStepControl`] is the training-layer side of `estimators.step_rate.StepRateRule`, which decides the rate
of every step (lr = scheduled × f × g; the scheduler never sees the factor): it hands the rule the schedule's rate and
peak before a step's first micro-batch (DeepSpeed steps inside the last `backward`, before the step's own statistics
exist), its gradient norm, noise estimate, KL and Adam's update size after it, and applies the rule's factor through
the two hooks of `training.optim_hooks` on the innermost torch optimizer (once per optimizer object; DeepSpeed builds
its own in `prepare`). It refuses a step whose loss, gradient norm or factor is not finite on any process, and logs
the factor of an applied step or the skip of a refused one, once per step (DeepSpeed's ZeRO optimizers call the
torch optimizer's `step` once per param group). The rate used is logged as `oblr/lr`.

`step_rate_rule` builds the rule from the options, for the trainer and the synthetic testbed alike.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import torch

from ..estimators.choices import TRUST_REGION_CURVATURES, TRUST_REGION_MODES
from ..estimators.snr import NoiseEstimate, SNRLearningRateController, gradient_noise_scale
from ..estimators.step_rate import StepRateRule
from ..estimators.trust_region import TrustRegionRate, adam_update_square_sum
from .optim_hooks import OptimizerStepGate, StepLearningRateScale, innermost_optimizer
from .options import OBLRPOOptions, check_one_of

__all__ = ["OptimizerStepControl", "RateRuleTuning", "step_rate_rule"]


@dataclass(frozen=True)
class RateRuleTuning:
    """The constants of the rate rule, at the values it ships with (docs/rate_rule.md gives the measurement behind
    each). They are not configuration: the benchmarks' ablations vary them (`OBLRPOTrainer.rate_tuning`)."""

    snr_ema_decay: float = 0.9  # β of the moving averages of ‖μ‖² and tr Σ
    snr_warmup_steps: int = 5  # estimates seen before the SNR factor acts
    snr_calibration_steps: int | None = None  # smallest calibration window; None: max(20, ⌈2/(1 − β)⌉)
    snr_lr_min_ratio: float = 1.0  # the calibrated factor f_t / f_ref is clipped to [min, max]
    snr_lr_max_ratio: float = 2.0
    snr_lr_floor: float = 0.1  # smallest factor of the `absolute` reference
    lr_trust_region_mode: str = "peak"  # `cap` and `target`: the forms before the peak form (CHANGELOG.md)
    lr_trust_region_min_ratio: float = 0.01  # smallest trust-region factor, and the probe's
    lr_trust_region_max_ratio: float = 10.0
    lr_trust_region_ema_decay: float = 0.5  # of the curvature's moving average
    lr_trust_region_curvature: str = "per_update"  # `per_rate`: KL/lr² alone
    lr_trust_region_measure_steps: int = 16  # measure every k-th step with a gradient

    @classmethod
    def split(cls, settings: dict) -> tuple[RateRuleTuning, dict]:
        """``settings`` as the constants among them and the rest (config fields): ``(tuning, rest)``."""
        tuning = cls(**{key: value for key, value in settings.items() if key in cls.__dataclass_fields__})
        return tuning, {key: value for key, value in settings.items() if key not in cls.__dataclass_fields__}

    def __post_init__(self):
        check_one_of("lr_trust_region_mode", self.lr_trust_region_mode, TRUST_REGION_MODES)
        check_one_of("lr_trust_region_curvature", self.lr_trust_region_curvature, TRUST_REGION_CURVATURES)

    @property
    def resolved_snr_calibration_steps(self) -> int:
        if self.snr_calibration_steps is not None:
            return self.snr_calibration_steps
        return max(20, math.ceil(round(2.0 / (1.0 - self.snr_ema_decay), 6)))


def step_rate_rule(options: OBLRPOOptions, tuning: RateRuleTuning = RateRuleTuning()) -> StepRateRule:
    """The rate rule the options configure, with the constants of ``tuning`` (the calibration window opens after
    `snr_warmup_steps`; the trainer moves it past the learning-rate warm-up when training starts)."""
    snr = SNRLearningRateController(
        tuning.snr_ema_decay, tuning.snr_warmup_steps, tuning.snr_lr_floor, reference=options.snr_lr_reference,
        calibration_start=tuning.snr_warmup_steps, calibration_steps=tuning.resolved_snr_calibration_steps,
        min_ratio=tuning.snr_lr_min_ratio, max_ratio=tuning.snr_lr_max_ratio,
    ) if options.use_snr_lr else None
    per_update = tuning.lr_trust_region_curvature == "per_update"
    trust_region = None if options.lr_trust_region_kl is None else TrustRegionRate(
        options.lr_trust_region_kl, tuning.lr_trust_region_mode, tuning.lr_trust_region_ema_decay,
        tuning.lr_trust_region_min_ratio, tuning.lr_trust_region_max_ratio, per_update=per_update,
    )
    return StepRateRule(snr, trust_region, log_kl=options.log_step_kl,
                        measure_every=tuning.lr_trust_region_measure_steps, short_early_gaps=per_update)


class OptimizerStepControl:
    """The gate and the learning-rate factor of every optimizer step, and the measurements its rule asks for.

    Args:
        accelerator: the Trainer's accelerator (device, processes, gather, reduce).
        metrics: where the step's factor, measurements and skips are logged (the trainer's train metrics).
        rule: decides each step's factor and what to measure (`step_rate_rule`).
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
            self.lr_scale = StepLearningRateScale(optimizer, lambda: self.factor, self._log_factor)

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
        self._logged = False  # the factor of an applied step, or the skip of a refused one

    def note_loss(self, loss: torch.Tensor) -> None:
        """A training micro-batch's loss (kept on its device: no sync per micro-batch)."""
        self.loss_finite = self.loss_finite.to(loss.device) & torch.isfinite(loss.detach()).all()

    def note_grad_norm(self, grad_norm) -> None:
        """The step's pre-clip gradient norm, where it is known before the step (DeepSpeed computes it inside): the
        rule may amend the step's factor (`StepRateRule.note_grad_norm`)."""
        self.grad_norm = None if grad_norm is None else float(grad_norm)
        self.grad_norm_finite = self.grad_norm is None or math.isfinite(self.grad_norm)
        self.factor = self.rule.note_grad_norm(self.grad_norm)

    # After the step --------------------------------------------------------------------------------------------------

    def observe_noise(self, estimate: NoiseEstimate | None, units: float, samples: float) -> None:
        """The step's noise estimate over ``units`` samples of the estimator (``samples`` completions): the rule fixes
        the next step's SNR factor; its smoothed state is logged."""
        rule, metrics = self.rule, self.metrics
        rule.observe_noise(estimate, units)
        if rule.snr is None:
            return
        reading = rule.snr.reading(units)
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

    def after_step(self) -> None:
        """The optimizer step ran (or was refused): measure what the rule asks for, log it and hand it to the rule."""
        if self.step_kl is None:
            return
        lr = self.applied_lr
        if lr is None:  # refused on every process alike: no move to measure
            self.step_kl(False)
            return
        rule, metrics = self.rule, self.metrics
        due = rule.measurements_due(lr, self.grad_norm)
        if due.aimed_kl is not None:  # what the curvature known before the step predicted, beside what it did
            metrics["oblr/step_kl_target"].append(due.aimed_kl)
        # Adam's update size: every step where the rule reads per update, else only beside a measurement (its
        # collective and host sync stay off the steps that measure nothing)
        mean_square = self._update_mean_square() if due.update_size else None
        if mean_square is not None:
            metrics["oblr/update_rms"].append(math.sqrt(mean_square))
        kl = self.step_kl(due.kl)
        if kl is not None:
            metrics["oblr/step_kl"].append(kl)
        rule.observe_step(lr, self.grad_norm, kl, mean_square)
        if rule.trust_region_rate is not None:  # the rate the rule leaves for the next step
            metrics["oblr/trust_region_rate"].append(rule.trust_region_rate)

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

    # The gate and the log --------------------------------------------------------------------------------------------

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

    def _log_factor(self, scheduled_lr: float, factor: float) -> None:
        if self._logged:
            return
        self._logged = True
        self._scaled_lr = scheduled_lr * factor
        if self.rule.snr is not None:
            self.metrics["snr/lr_factor"].append(self.rule.snr_part)
        if self.rule.trust_region is not None:
            self.metrics["oblr/trust_region_factor"].append(self.rule.trust_part)
        self.metrics["oblr/lr"].append(self._scaled_lr)

    @property
    def applied_lr(self) -> float | None:
        """The rate the step that just ran used; None if it was refused."""
        if self._allowed_now is False:
            return None
        if self._scaled_lr is not None:
            return self._scaled_lr
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None
