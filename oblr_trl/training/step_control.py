"""Each optimizer step's learning-rate factor, and whether the step runs at all.

[`OptimizerStepControl`] is the trainer's collaborator for the optimizer step, as `StepNoiseRecorder` is for the
SNR: it puts the two hooks of `training.optim_hooks` on the innermost torch optimizer (once per optimizer object;
DeepSpeed builds its own in `prepare`), fixes the step's factor before its first micro-batch (DeepSpeed steps inside
the last `backward`, before the step's own statistics exist), refuses a step whose loss, gradient norm or factor is
not finite on any process, and logs the factor of an applied step or the skip of a refused one, once per step
(DeepSpeed's ZeRO optimizers call the torch optimizer's `step` once per param group).

The factor is the SNR factor f times the trust-region factor g (`estimators.trust_region`), which is computed on the
rate the SNR rule alone would use, scheduled × f, and the schedule's peak (the rate the scheduler multiplies, its
``initial_lr``): lr = scheduled · f · g. The scheduler never sees either. The rate used is logged as `oblr/lr` (and,
for one release, under its old name `snr/effective_lr`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, MutableMapping

import torch

from .optim_hooks import OptimizerStepGate, StepLearningRateScale, innermost_optimizer

__all__ = ["OptimizerStepControl"]


class OptimizerStepControl:
    """The gate and the learning-rate factor of every optimizer step.

    Args:
        accelerator: the Trainer's accelerator (device, processes, gather).
        metrics: where the step's factor and skips are logged (the trainer's train metrics).
        snr_factor: the SNR factor of the next step, read when it begins; None: no SNR factor.
        trust_factor: ``(base_lr, peak_lr) ->`` the trust-region factor on the rate ``base_lr`` = scheduled × SNR
            factor, ``peak_lr`` the schedule's peak; None: no trust region.
        gate: refuse non-finite steps (`skip_nonfinite_steps`).
        current_step: the optimizer steps done so far, for the warning of a skipped step.
    """

    def __init__(
        self,
        accelerator,
        metrics: MutableMapping[str, list],
        snr_factor: Callable[[], float] | None,
        trust_factor: Callable[[float, float], float] | None,
        gate: bool,
        current_step: Callable[[], int],
    ):
        self.accelerator = accelerator
        self.metrics = metrics
        self.snr_factor, self.trust_factor = snr_factor, trust_factor
        self.gate = gate
        self.current_step = current_step
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
        if self.snr_factor is not None or self.trust_factor is not None:
            self.lr_scale = StepLearningRateScale(optimizer, lambda: self.factor, self._log_factor)

    def begin_step(self) -> None:
        """Before the step's first micro-batch: its factor, from the measurements of the steps before it."""
        self.snr_part = self.snr_factor() if self.snr_factor is not None else 1.0
        self.trust_part = 1.0
        if self.trust_factor is not None and self.optimizer is not None:
            group = self.optimizer.param_groups[0]
            scheduled = float(group["lr"])  # the scheduler has set this step's
            peak = float(group.get("initial_lr", scheduled))  # what the schedule multiplies (torch's LRScheduler)
            self.trust_part = self.trust_factor(scheduled * self.snr_part, peak)
        self.factor = self.snr_part * self.trust_part
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
        """The step's pre-clip gradient norm, where it is known before the step (DeepSpeed computes it inside).

        A step with a zero gradient (every group scored alike) moves the parameters by Adam's momentum alone and
        measures nothing, so the trust region may not raise its rate above the scheduled × SNR rate: the target form
        otherwise drifted the policy at up to ``max_ratio`` × the schedule on such steps, and collapsed a run that had
        learned (CHANGELOG.md). Lowering stays: a step the curvature says is too large is too large with or
        without a gradient."""
        self.grad_norm = None if grad_norm is None else float(grad_norm)
        self.grad_norm_finite = self.grad_norm is None or math.isfinite(self.grad_norm)
        if self.grad_norm == 0.0 and self.trust_part > 1.0:
            self.trust_part = 1.0
            self.factor = self.snr_part

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
        if self.snr_factor is not None:
            self.metrics["snr/lr_factor"].append(self.snr_part)
        if self.trust_factor is not None:
            self.metrics["oblr/trust_region_factor"].append(self.trust_part)
        self.metrics["oblr/lr"].append(self._scaled_lr)
        self.metrics["snr/effective_lr"].append(self._scaled_lr)  # the old name, until the next minor release

    @property
    def applied_lr(self) -> float | None:
        """The rate the step that just ran used; None if it was refused."""
        if self._allowed_now is False:
            return None
        if self._scaled_lr is not None:
            return self._scaled_lr
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None
