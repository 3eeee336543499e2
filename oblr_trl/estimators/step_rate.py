"""The learning rate of every optimizer step, decided in one place (docs/rate_rule.md).

The rate of step t is

    lr_t = scheduled_t × f_t × g_t

with ``scheduled_t`` the user's schedule (the scheduler never sees the two factors), f_t the SNR factor
(`snr.SNRLearningRateController`, from the noise estimates of the steps before t: a batch's own noise does not size
its own step) and g_t the trust-region factor (`trust_region.TrustRegionRate`, from the KL that earlier steps moved the
policy by). [`StepRateRule`] owns every part of that decision:

* **before a step** (`begin_step`): f_t, then g_t on the rate scheduled_t × f_t and the schedule's peak; the probe
  (g = r_min) until a step has moved the policy;
* **the zero-gradient rule** (`note_grad_norm`): a step whose gradient is zero (every group scored alike) moves the
  parameters by Adam's momentum alone, so it is never raised by the trust region (g ≤ 1); it is not folded into the
  curvature either (`observe_step`), since momentum moves the policy far less than a gradient step of the same rate;
* **when to measure** (`measurements_due`): the step KL on the first step, every ``measure_every``-th step with a
  gradient after that, and every step while the rule has no curvature or only the probe's provisional reading; the
  steps between use the curvature last measured, which is mostly noise from one step to the next anyway
  (benchmarks/results/overhead/step_kl_sampling.md). With ``short_early_gaps`` the steps 1, 2, 4, … apart are measured
  before the gap reaches k, because the curvature falls fastest over a run's first steps
  (benchmarks/results/stability/kl_prediction.md). Adam's update size is read where the curvature is per update;
* **what was observed** (`observe_noise`, `observe_step`): the step's noise estimate, its KL and update size.

The training layer measures what `measurements_due` asks for and applies `factor`; the synthetic testbed
(benchmarks/synthetic_learning.py) runs the same object. Everything here is plain arithmetic on floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .snr import NoiseEstimate, SNRLearningRateController
from .trust_region import TrustRegionRate

__all__ = ["StepMeasurements", "StepRateRule"]


@dataclass(frozen=True)
class StepMeasurements:
    """What to measure of the optimizer step that just ran.

    Attributes:
        kl: its KL(π_t ‖ π_{t+1}) on its completions.
        update_size: the mean square of Adam's update per unit rate (`trust_region.adam_update_square_sum`).
        aimed_kl: the KL the curvature known before the step predicted for its rate (None while probing or without a
            trust region).
    """

    kl: bool
    update_size: bool
    aimed_kl: float | None


class StepRateRule:
    """The factor f_t × g_t of every optimizer step and the measurements it needs (module docstring).

    Args:
        snr: the SNR factor's controller; None: f = 1.
        trust_region: the trust-region rule; None: g = 1.
        log_kl: measure every step's KL without a trust region (for logging only).
        measure_every: k: with a trust region, measure the first step and then every k-th step with a gradient
            after the last one measured; the steps between use the curvature last measured.
        short_early_gaps: after the first reading, measure the steps with a gradient 1, 2, 4, … apart until the gap
            reaches k (`gap`).
    """

    def __init__(self, snr: SNRLearningRateController | None = None, trust_region: TrustRegionRate | None = None, *,
                 log_kl: bool = False, measure_every: int = 1, short_early_gaps: bool = False):
        if isinstance(measure_every, bool) or not isinstance(measure_every, int) or measure_every < 1:
            raise ValueError(f"measure_every must be an integer >= 1; got {measure_every!r}.")
        self.snr, self.trust_region = snr, trust_region
        self.measures_kl = log_kl or trust_region is not None
        self.measure_every = measure_every if trust_region is not None else 1  # logging alone measures every step
        self.short_early_gaps = short_early_gaps
        self.next_snr_factor = 1.0  # f of the next step, from the estimates of the steps so far
        self.unmeasured_steps = self.measure_every - 1  # steps with a gradient since the last measured: the first is due
        self.readings = 0  # measured gradient steps folded into the curvature after the probe: they set the `gap`
        self.snr_part = self.trust_part = 1.0  # f and g of the current step

    @property
    def scales_rate(self) -> bool:
        """Whether any factor acts on the scheduled rate."""
        return self.snr is not None or self.trust_region is not None

    @property
    def factor(self) -> float:
        """f × g of the current step."""
        return self.snr_part * self.trust_part

    def open_calibration_after(self, steps: int) -> None:
        """The SNR factor's calibration window opens after ``steps`` estimates (the schedule's warm-up, say) and not
        before the factor's own warm-up, so that f_ref is measured once the rate has reached its scheduled value."""
        if self.snr is not None:
            self.snr.calibration.start = max(self.snr.warmup_steps, steps)

    # Before a step ---------------------------------------------------------------------------------------------------

    def begin_step(self, scheduled_lr: float | None, peak_lr: float | None = None) -> float:
        """The factor of the step about to run, at scheduled rate ``scheduled_lr`` with schedule peak ``peak_lr`` (the
        rate the scheduler multiplies; ``scheduled_lr`` when None). ``scheduled_lr`` None (no optimizer yet): g = 1."""
        self.snr_part = self.next_snr_factor if self.snr is not None else 1.0
        self.trust_part = 1.0
        if self.trust_region is not None and scheduled_lr is not None:
            peak = scheduled_lr if peak_lr is None else peak_lr
            self.trust_part = self.trust_region.factor(scheduled_lr * self.snr_part, peak)
        return self.factor

    def note_grad_norm(self, grad_norm: float | None) -> float:
        """The step's pre-clip gradient norm, where it is known before the optimizer steps (None: unknown, as under
        DeepSpeed); returns the step's factor. A zero gradient is never raised by the trust region: the target form
        otherwise drifted a policy that had learned at up to r_max × the schedule by momentum alone until it
        collapsed (CHANGELOG.md). Lowering stays: a step the curvature says is too large is too large with or without
        a gradient."""
        if grad_norm == 0.0 and self.trust_part > 1.0:
            self.trust_part = 1.0
        return self.factor

    # After a step ----------------------------------------------------------------------------------------------------

    def observe_noise(self, estimate: NoiseEstimate | None, units: float) -> bool:
        """The step's ‖μ‖², tr Σ estimate (None: no independent pair) over ``units`` samples; fixes the SNR factor of
        the next step. Returns whether the estimate was folded in (None or not finite: not)."""
        if self.snr is None:
            return False
        counted = estimate is not None and self.snr.update(estimate)
        self.next_snr_factor = self.snr.factor(units)
        return counted

    def measurements_due(self, lr: float, grad_norm: float | None) -> StepMeasurements:
        """What to measure of the step that just ran at rate ``lr`` (applied: a refused step asks nothing) on a
        gradient of norm ``grad_norm``; counts the step towards the next measurement."""
        rule = self.trust_region
        aimed = rule.aimed_kl(lr) if rule is not None and not rule.probing else None
        kl = self.measures_kl and self._kl_due(grad_norm)
        return StepMeasurements(kl=kl, update_size=kl or (rule is not None and rule.per_update), aimed_kl=aimed)

    def observe_step(self, lr: float, grad_norm: float | None, kl: float | None = None,
                     update_mean_square: float | None = None) -> None:
        """The step that just ran at rate ``lr`` moved the policy by ``kl`` (None: not measured), with Adam's update
        per unit rate of mean square ``update_mean_square`` (None: not read). A step whose gradient is zero is not
        folded in (module docstring)."""
        rule = self.trust_region
        if rule is None or grad_norm == 0.0:
            return
        rule.note_update(update_mean_square)
        if kl is not None and rule.update(kl, lr) and not rule.probing:
            self.readings += 1

    @property
    def trust_region_rate(self) -> float | None:
        """η_δ the trust region leaves for the next step (NaN before any measurement); None without one."""
        if self.trust_region is None:
            return None
        rate = self.trust_region.rate
        return rate if math.isfinite(rate) else math.nan

    @property
    def gap(self) -> int:
        """Steps with a gradient from one measurement to the next: ``measure_every``, or with ``short_early_gaps``
        1, 2, 4, … after the first readings until it reaches ``measure_every``. The curvature a step meets falls
        fastest over a run's first steps (Adam's update shrinks as v̂ accumulates, the policy sharpens), so a reading
        taken then goes stale soonest."""
        if not self.short_early_gaps:
            return self.measure_every
        return min(self.measure_every, 2 ** max(self.readings - 1, 0))

    def _kl_due(self, grad_norm: float | None) -> bool:
        """Whether the step just taken is measured (`gap`); counts it among the unmeasured otherwise. Until a measured
        step has moved the policy the rule has no curvature to size the steps in between with, so every step with a
        gradient is measured: a warm-up that starts at rate 0 would otherwise hold the probe's factor for k steps; in
        the ``"peak"`` form the step after the probe is measured too (`TrustRegionRate.needs_measurement`). A step
        whose gradient is zero is not measured when k > 1 (it would not be folded in) and does not count."""
        if self.measure_every == 1:
            return True
        if grad_norm == 0.0:
            return False
        if self.unmeasured_steps + 1 >= self.gap or self.trust_region.needs_measurement:
            self.unmeasured_steps = 0
            return True
        self.unmeasured_steps += 1
        return False

    # Checkpoints -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"next_snr_factor": self.next_snr_factor, "unmeasured_steps": self.unmeasured_steps,
                                 "readings": self.readings}
        if self.snr is not None:
            state["snr"] = self.snr.state_dict()
        if self.trust_region is not None:
            state["trust_region"] = self.trust_region.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what was measured; the options stay as configured now (a part saved but turned off is dropped)."""
        self.next_snr_factor = float(state.get("next_snr_factor", 1.0))
        self.unmeasured_steps = int(state.get("unmeasured_steps", self.measure_every - 1))
        self.readings = int(state.get("readings", self.measure_every))  # not saved: past the short gaps
        if self.snr is not None and "snr" in state:
            self.snr.load_state_dict(state["snr"])
        if self.trust_region is not None and "trust_region" in state:
            self.trust_region.load_state_dict(state["trust_region"])
