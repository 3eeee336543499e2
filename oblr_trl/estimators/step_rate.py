"""The learning rate of every optimizer step, decided and sequenced in one place (docs/rate_rule.md).

The rate of step t is

    lr_t = scheduled_t × f_t × g_t

with ``scheduled_t`` the user's schedule (the scheduler never sees the two factors), f_t the SNR factor
(`snr.SNRLearningRateController`, from the noise estimates of the steps before t: a batch's own noise does not size
its own step) and g_t the trust-region factor (`trust_region.TrustRegionRate`, from the KL that earlier steps moved the
policy by, on the rate scheduled_t × f_t and the schedule's peak).

[`StepRateRule`] is driven like a learning-rate scheduler, by the trainer (`training.step_control`); the caller says
what it knows when it knows it:

    factor = rule.begin_step(scheduled, peak)         # a step is about to run: its factor f × g
    factor = rule.note_grad_norm(grad_norm)           # its gradient norm, where known before the optimizer steps
    reading = rule.observe_noise(estimate, units)     # its noise estimate: f of the next step; the SNR reading
    ...                                               # the optimizer steps at scheduled × factor
    record = rule.end_step(lr, step_kl=..., update_mean_square=...)   # measures what it needs; a `StepRecord`

and logs what the calls return. The parts of the decision:

* **the probe**: g = r_min until a step has moved the policy (`TrustRegionRate`);
* **the zero-gradient rule**: a step whose gradient is zero (every group scored alike) moves the parameters by Adam's
  momentum alone, far less than a gradient step of the same rate, so it is never raised by the trust region (g ≤ 1:
  raised, such steps drift a policy that has learned) and is not folded into the curvature (its KL/η² understates the
  curvature the next gradient step meets);
* **when to measure**: the step KL on the first step, every ``measure_every``-th step with a gradient after that, and
  every step while the rule has no curvature or only the probe's provisional reading; the steps between use the
  curvature last measured, which is mostly noise from one step to the next anyway
  (benchmarks/results/overhead/step_kl_sampling.md). With ``short_early_gaps`` the steps 1, 2, 4, … apart are measured
  before the gap reaches k, because the curvature falls fastest over a run's first steps
  (benchmarks/results/stability/kl_prediction.md). Adam's update size is read after every step with a trust region
  (the curvature is per unit of it) and beside every KL measured.

[`RateRuleTuning`] holds the rule's constants and [`step_rate_rule`] builds the rule from the options. Everything here
is plain arithmetic on floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .choices import SNR_LR_REFERENCES, check_one_of, invalid_value
from .snr import NoiseEstimate, SNRLearningRateController, SNRReading
from .trust_region import TrustRegionRate

__all__ = ["RATE_RULE_OPTIONS", "RateRuleOptions", "RateRuleTuning", "StepRateRule", "StepRecord", "step_rate_rule"]


@dataclass(frozen=True)
class StepRecord:
    """What the rule did with one optimizer step, for the caller to log (`StepRateRule.end_step`).

    Attributes:
        lr: the rate the step used; None: the step was refused (nothing else of it is measured).
        snr_factor: f, the SNR factor it ran with (None without an SNR factor).
        trust_region_factor: g, the trust-region factor it ran with (None without a trust region).
        aimed_kl: the KL the curvature known before the step predicted for its rate (None while probing, without a
            trust region or on a refused step).
        kl: its measured KL(π_t ‖ π_{t+1}) (None: not measured).
        update_rms: the root mean square of Adam's update per unit rate (None: not read).
        trust_region_rate: η_δ, the peak rate the trust region leaves for the next step (NaN before any reading; None
            without a trust region or on a refused step).
    """

    lr: float | None
    snr_factor: float | None
    trust_region_factor: float | None
    aimed_kl: float | None = None
    kl: float | None = None
    update_rms: float | None = None
    trust_region_rate: float | None = None


class StepRateRule:
    """The factor f_t × g_t of every optimizer step, and the sequence of a step's measurements (module docstring).

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
        self.unmeasured_steps = self.measure_every - 1  # gradient steps since the last measured: the first is due
        self.readings = 0  # measured gradient steps folded into the curvature after the probe: they set the `gap`
        self._snr_factor = self._trust_factor = 1.0  # f and g of the current step
        self._grad_norm: float | None = None  # of the current step, once noted (None: not known)
        self._kl_planned = self.measures_kl  # whether the current step is measured, should its gradient not be zero

    @property
    def scales_rate(self) -> bool:
        """Whether any factor acts on the scheduled rate."""
        return self.snr is not None or self.trust_region is not None

    def open_calibration_after(self, steps: int) -> None:
        """The SNR factor's calibration window opens after ``steps`` estimates (the schedule's warm-up, known when
        training starts), not before the factor's own warm-up (`SNRLearningRateController.open_calibration_after`)."""
        if self.snr is not None:
            self.snr.open_calibration_after(steps)

    # Before a step ---------------------------------------------------------------------------------------------------

    def begin_step(self, scheduled_lr: float | None, peak_lr: float | None = None) -> float:
        """A step is about to run at scheduled rate ``scheduled_lr`` with schedule peak ``peak_lr`` (the rate the
        scheduler multiplies; ``scheduled_lr`` when None): its factor f × g. ``scheduled_lr`` None (no optimizer yet):
        g = 1."""
        self._snr_factor = self.next_snr_factor if self.snr is not None else 1.0
        self._trust_factor = 1.0
        self._grad_norm = None
        self._kl_planned = self.measures_kl and (
            self.measure_every == 1 or self.unmeasured_steps + 1 >= self.gap or self.trust_region.needs_measurement)
        if self.trust_region is not None and scheduled_lr is not None:
            peak = scheduled_lr if peak_lr is None else peak_lr
            self._trust_factor = self.trust_region.factor(scheduled_lr * self._snr_factor, peak)
        return self._snr_factor * self._trust_factor

    @property
    def kl_planned(self) -> bool:
        """Whether the step begun will be measured (`end_step` asks for its KL), unless its gradient turns out zero:
        known before its first micro-batch, so that a step the rule will not measure keeps nothing for it."""
        return self._kl_planned

    def note_grad_norm(self, grad_norm: float | None, *, stepped: bool = False) -> float:
        """The step's pre-clip gradient norm (None: unknown); returns the step's factor. Before the optimizer steps, a
        zero gradient is never raised by the trust region (module docstring); lowering stays, since a step the
        curvature says is too large is too large with or without a gradient. ``stepped``: the optimizer has stepped
        already (DeepSpeed steps inside the last backward, before the norm is known): the factor the step ran with
        stands, and the norm decides only whether the step is measured and folded in."""
        self._grad_norm = grad_norm
        if not stepped and grad_norm == 0.0 and self._trust_factor > 1.0:
            self._trust_factor = 1.0
        return self._snr_factor * self._trust_factor

    def observe_noise(self, estimate: NoiseEstimate | None, units: float) -> SNRReading | None:
        """The step's ‖μ‖², tr Σ estimate (None: no independent pair; not finite: counted as skipped) over ``units``
        samples: fixes the SNR factor of the next step. Returns the controller's reading for the log (None without an
        SNR factor)."""
        if self.snr is None:
            return None
        if estimate is not None:
            self.snr.update(estimate)
        self.next_snr_factor = self.snr.factor(units)
        return self.snr.reading(units)

    # After a step ----------------------------------------------------------------------------------------------------

    def end_step(self, lr: float | None, *, step_kl: Callable[[bool], float | None] | None = None,
                 update_mean_square: Callable[[], float | None] | None = None) -> StepRecord:
        """The step ran at rate ``lr`` (None: refused, nothing moved): measure what the rule needs, fold it in, and
        return what happened.

        Args:
            lr: the rate the step used, or None.
            step_kl: ``measure ->`` the step's KL(π_t ‖ π_{t+1}) when ``measure`` (None where nothing was kept to
                measure); called exactly once after every step of a rule that `measures_kl`, with False where no
                measurement is due, so that what was kept for it can go. Needed where the rule measures the KL.
            update_mean_square: ``->`` the mean square of Adam's update per unit rate of the step (None without
                Adam's state); called, before ``step_kl``, after every step with a trust region and beside every KL
                measured. Needed where the rule measures the KL.
        """
        f = self._snr_factor if self.snr is not None else None
        g = self._trust_factor if self.trust_region is not None else None
        if self.measures_kl and (step_kl is None or update_mean_square is None):
            raise ValueError("a rule that measures the step KL needs `step_kl` and `update_mean_square`.")
        if lr is None:
            if self.measures_kl:
                step_kl(False)
            return StepRecord(lr=None, snr_factor=f, trust_region_factor=g)
        rule = self.trust_region
        aimed = rule.aimed_kl(lr) if rule is not None and not rule.probing else None
        kl_due = self.measures_kl and self._kl_due()
        mean_square = update_mean_square() if kl_due or rule is not None else None
        kl = step_kl(kl_due) if self.measures_kl else None
        if rule is not None and self._grad_norm != 0.0:
            rule.note_update(mean_square)
            if kl is not None and rule.update(kl, lr) and not rule.probing:
                self.readings += 1
        return StepRecord(
            lr=lr, snr_factor=f, trust_region_factor=g, aimed_kl=aimed, kl=kl,
            update_rms=None if mean_square is None else math.sqrt(mean_square),
            trust_region_rate=self.trust_region_rate,
        )

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

    def _kl_due(self) -> bool:
        """Whether the step just taken is measured (`gap`); counts it among the unmeasured otherwise. Until a measured
        step has moved the policy the rule has no curvature to size the steps in between with, so every step with a
        gradient is measured: a warm-up that starts at rate 0 would otherwise hold the probe's factor for k steps; the
        step after the probe is measured too (`TrustRegionRate.needs_measurement`). A step whose gradient is zero is
        not measured when k > 1 (it would not be folded in) and does not count."""
        if self.measure_every == 1:
            return True
        if self._grad_norm == 0.0:
            return False
        if self._kl_planned:  # the gap and the probe's state do not change between `begin_step` and here
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


# The rule the options configure -----------------------------------------------------------------------------------


class RateRuleOptions(Protocol):
    """The options the rule is built from: fields of `OBLRPOOptions` (an `OBLRPOConfig` is one as it is)."""

    use_snr_lr: bool
    snr_lr_reference: str
    lr_trust_region_kl: float | None
    log_step_kl: bool


RATE_RULE_OPTIONS = tuple(RateRuleOptions.__annotations__)  # their names


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
    lr_trust_region_min_ratio: float = 0.01  # smallest trust-region factor, and the probe's
    lr_trust_region_max_ratio: float = 10.0
    lr_trust_region_ema_decay: float = 0.5  # of the curvature's moving average
    lr_trust_region_measure_steps: int = 16  # measure every k-th step with a gradient
    lr_trust_region_short_early_gaps: bool = True  # before every k-th, measure 1, 2, 4, … steps apart

    @classmethod
    def split(cls, settings: dict) -> tuple[RateRuleTuning, dict]:
        """``settings`` as the constants among them and the rest (config fields): ``(tuning, rest)``."""
        tuning = cls(**{key: value for key, value in settings.items() if key in cls.__dataclass_fields__})
        return tuning, {key: value for key, value in settings.items() if key not in cls.__dataclass_fields__}

    @property
    def resolved_snr_calibration_steps(self) -> int:
        if self.snr_calibration_steps is not None:
            return self.snr_calibration_steps
        return max(20, math.ceil(round(2.0 / (1.0 - self.snr_ema_decay), 6)))


def step_rate_rule(options: RateRuleOptions, tuning: RateRuleTuning = RateRuleTuning()) -> StepRateRule:
    """The rate rule the options configure, with the constants of ``tuning`` (the calibration window opens after
    `snr_warmup_steps`; the trainer moves it past the learning-rate warm-up when training starts). Raises ValueError
    naming an option whose value the rule cannot take."""
    check_one_of("snr_lr_reference", options.snr_lr_reference, SNR_LR_REFERENCES)
    kl = options.lr_trust_region_kl
    if kl is not None and (isinstance(kl, bool) or not isinstance(kl, (int, float)) or not math.isfinite(kl)
                           or kl <= 0):
        raise invalid_value("lr_trust_region_kl", kl, "None or a finite float > 0")
    snr = SNRLearningRateController(
        tuning.snr_ema_decay, tuning.snr_warmup_steps, tuning.snr_lr_floor, reference=options.snr_lr_reference,
        calibration_start=tuning.snr_warmup_steps, calibration_steps=tuning.resolved_snr_calibration_steps,
        min_ratio=tuning.snr_lr_min_ratio, max_ratio=tuning.snr_lr_max_ratio,
    ) if options.use_snr_lr else None
    trust_region = None if kl is None else TrustRegionRate(
        kl, tuning.lr_trust_region_ema_decay, tuning.lr_trust_region_min_ratio, tuning.lr_trust_region_max_ratio,
    )
    return StepRateRule(snr, trust_region, log_kl=options.log_step_kl,
                        measure_every=tuning.lr_trust_region_measure_steps,
                        short_early_gaps=tuning.lr_trust_region_short_early_gaps)
