"""Gradient signal-to-noise ratio and the learning-rate factor it drives (docs/math.md).

With μ the true gradient, Σ the per-sample covariance and N the samples in an optimizer step, the step size that
minimises the paper's loss bound is

    η_t = η_max · N·SNR_t / (1 + N·SNR_t),   SNR_t = ‖μ‖² / tr(Σ),

i.e. η_max / (1 + B_noise/N) with B_noise = tr(Σ)/‖μ‖², McCandlish et al.'s simple noise scale. η_max is unknown.
Read as the configured rate ("absolute", the paper's reading) the factor f_t = N·SNR/(1 + N·SNR) ∈ (0, 1] multiplies
a rate the user tuned for typical noise, which counts the noise twice; the default ("calibrated") takes the configured
rate as the rate at the SNR measured early in training and scales it by f_t / f_ref.

Everything here is plain arithmetic on scalars: the trainer measures squared gradient norms and hands them over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BiasCorrectedEMA",
    "CalibrationWindow",
    "NoiseEstimate",
    "SNRLearningRateController",
    "SNRReading",
    "cross_step_noise_estimate",
    "gradient_noise_scale",
    "per_sample_noise_estimate",
    "snr_lr_factor",
    "two_batch_noise_estimate",
]


@dataclass(frozen=True)
class NoiseEstimate:
    """Unbiased (hence possibly negative) estimates of ‖μ‖² and tr(Σ) from one optimizer step."""

    grad_sq_norm: float
    trace_cov: float

    @property
    def is_finite(self) -> bool:
        return math.isfinite(self.grad_sq_norm) and math.isfinite(self.trace_cov)


def two_batch_noise_estimate(
    small_batch_sq_norm: float, small_batch_size: float, full_batch_sq_norm: float, full_batch_size: float
) -> NoiseEstimate:
    """Two-batch estimator of ‖μ‖² and tr(Σ) (docs/math.md; McCandlish et al. 2018, appendix A.1).

    For a mean gradient G_B over B samples, E|G_B|² = ‖μ‖² + tr(Σ)/B. Two batch sizes b < N give two equations:

        ‖μ‖² ≈ (N|G_N|² − b|G_b|²) / (N − b),    tr(Σ) ≈ (|G_b|² − |G_N|²) / (1/b − 1/N).

    Args:
        small_batch_sq_norm: |G_b|², ideally averaged over the N/b small batches of the step.
        small_batch_size: b.
        full_batch_sq_norm: |G_N|².
        full_batch_size: N > b.
    """
    if not full_batch_size > small_batch_size > 0:
        raise ValueError(
            f"the two-batch estimator needs 0 < b < N; got b={small_batch_size}, N={full_batch_size}."
        )
    b, n = float(small_batch_size), float(full_batch_size)
    grad_sq_norm = (n * full_batch_sq_norm - b * small_batch_sq_norm) / (n - b)
    trace_cov = (small_batch_sq_norm - full_batch_sq_norm) / (1.0 / b - 1.0 / n)
    return NoiseEstimate(grad_sq_norm=grad_sq_norm, trace_cov=trace_cov)


def per_sample_noise_estimate(
    per_sample_sq_norm_sum: float, mean_grad_sq_norm: float, num_samples: float
) -> NoiseEstimate:
    """Per-sample estimator of ‖μ‖² and tr(Σ) (docs/math.md), from squared norms only.

    With per-sample gradient estimates g_1..g_N of μ and their mean ḡ, Σ_i ‖g_i − ḡ‖² = Σ_i ‖g_i‖² − N‖ḡ‖², so

        tr(Σ) ≈ (Σ_i ‖g_i‖² − N‖ḡ‖²) / (N − 1),    ‖μ‖² ≈ ‖ḡ‖² − tr(Σ)/N.

    Args:
        per_sample_sq_norm_sum: Σ_i ‖g_i‖², each g_i scaled as an estimate of μ on its own.
        mean_grad_sq_norm: ‖ḡ‖².
        num_samples: N ≥ 2.
    """
    if num_samples < 2:
        raise ValueError(f"the per-sample estimator needs at least 2 samples; got N={num_samples}.")
    n = float(num_samples)
    trace_cov = (per_sample_sq_norm_sum - n * mean_grad_sq_norm) / (n - 1.0)
    return NoiseEstimate(grad_sq_norm=mean_grad_sq_norm - trace_cov / n, trace_cov=trace_cov)


def cross_step_noise_estimate(step_sq_norm: float, cross_step_dot: float, num_units: float) -> NoiseEstimate:
    """Cross-step estimator of ‖μ‖² and tr(Σ), with the prompt (group) as the sample unit (docs/math.md).

    Two optimizer steps whose data were generated from disjoint prompt batches have independent gradient noise, and
    while the policy moves little between them they share the true gradient μ. So, for the step gradients G_t and
    G_s of such a pair, each the mean over n independently drawn groups,

        E⟨G_t, G_s⟩ = ‖μ‖²,    E‖G_t‖² = ‖μ‖² + tr(Σ)/n   ⇒   tr(Σ) ≈ n (‖G_t‖² − ⟨G_t, G_s⟩).

    Σ here is the covariance of one group's gradient: between-prompt variance and the dependence of completions of
    one prompt are counted as noise, as they are sampled. Completion-level estimators (micro-batches, per-sample
    norms) treat the completions of a prompt as independent and overstate ‖μ‖². It needs no second batch size, so it
    works with one micro-batch per step; drift of μ between the two steps biases ‖μ‖² down (by ⟨μ_t, μ_t − μ_s⟩).

    The factor f = N·SNR/(1 + N·SNR) it yields with N = n is ⟨G_t, G_s⟩/‖G_t‖², whatever n is.

    Args:
        step_sq_norm: ‖G_t‖².
        cross_step_dot: ⟨G_t, G_s⟩ (exact, or from sketches: `oblr_trl.estimators.sketch.GradientSketch`).
        num_units: n, the groups (prompts) in a step.
    """
    if num_units <= 0:
        raise ValueError(f"the cross-step estimator needs n > 0 groups per step; got n={num_units}.")
    return NoiseEstimate(grad_sq_norm=cross_step_dot, trace_cov=num_units * (step_sq_norm - cross_step_dot))


def snr_lr_factor(grad_sq_norm: float, trace_cov: float, num_samples: float, floor: float = 0.0) -> float:
    """f = N·SNR / (1 + N·SNR) = N‖μ‖² / (N‖μ‖² + tr Σ), clipped to [floor, 1] (docs/math.md).

    Negative estimates (noise) are read as zero: no measurable signal gives f = floor, no measurable noise gives
    f = 1. With neither (a zero gradient) the step does nothing whatever the learning rate, and f = 1.
    """
    signal = num_samples * max(grad_sq_norm, 0.0)
    noise = max(trace_cov, 0.0)
    factor = 1.0 if signal + noise == 0.0 else signal / (signal + noise)
    return min(1.0, max(floor, factor))


def gradient_noise_scale(trace_cov: float, grad_sq_norm: float, completions_per_sample: float = 1.0) -> float:
    """B_noise = tr(Σ) / ‖μ‖², McCandlish et al. 2018's "simple noise scale" (docs/math.md), in completions.

    tr(Σ) and ‖μ‖² are per sample of the estimator (a completion, or a prompt's group for the cross-step estimator), so
    B_noise counts samples; ``completions_per_sample`` (G for the cross-step estimator, else 1) turns it into
    completions. It is the batch beyond which more completions a step stop shortening training: the step's f =
    1/(1 + B_noise/N). NaN where ‖μ‖² is not positive (no measured signal) or either estimate is not finite.
    """
    if not (math.isfinite(trace_cov) and math.isfinite(grad_sq_norm)) or grad_sq_norm <= 0.0:
        return float("nan")
    return max(trace_cov, 0.0) / grad_sq_norm * completions_per_sample


class BiasCorrectedEMA:
    """Exponential moving average with Adam's bias correction: m_t = β m_{t−1} + (1 − β) x_t, read as m_t/(1 − β^t)."""

    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1); got {decay}.")
        self.decay = decay
        self.average = 0.0
        self.count = 0

    def update(self, value: float) -> None:
        self.average = self.decay * self.average + (1.0 - self.decay) * value
        self.count += 1

    @property
    def value(self) -> float:
        if self.count == 0:
            return float("nan")
        return self.average / (1.0 - self.decay**self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "average": self.average, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.average, self.count = float(state["decay"]), float(state["average"]), int(state["count"])


CALIBRATION_MIN_T = 2.0
"""t-statistic at which the calibration window's mean ‖μ‖² estimate counts as told apart from noise."""


class CalibrationWindow:
    """The reference factor f_ref of the calibrated SNR learning rate (docs/math.md).

    A user's learning rate is tuned for the noise their runs typically have; the calibrated mode reads it as the rate
    at the SNR measured early in training, after the learning-rate warm-up: η_t = η_sched(t) · f_t / f_ref. f_ref is
    N·m_s/(N·m_s + m_n) for the means m_s, m_n of the per-step ‖μ‖² and tr Σ estimates over the window.

    The window opens after ``start`` measured steps and holds at least ``steps`` estimates. The reference is
    *resolved* once the window's mean ‖μ‖² estimate is positive with a t-statistic ≥ ``min_t`` (mean over its
    standard error); until then the window keeps growing and the factor stays 1: a signal that cannot be told from
    noise never shrinks the step.
    """

    def __init__(self, start: int, steps: int, min_t: float = CALIBRATION_MIN_T):
        if start < 0 or steps < 2:
            raise ValueError(f"a calibration window needs start >= 0 and steps >= 2; got start={start}, steps={steps}.")
        self.start, self.steps, self.min_t = start, steps, min_t
        self.seen = 0
        self.count = 0
        self.signal_sum = self.signal_sq_sum = self.noise_sum = 0.0
        self.resolved = False

    def open_after(self, estimates: int) -> None:
        """Open the window after ``estimates`` estimates instead of ``start`` (known once training starts, as the
        learning-rate warm-up is); what the window holds stays."""
        if estimates < 0:
            raise ValueError(f"a calibration window opens after >= 0 estimates; got {estimates}.")
        self.start = estimates

    def update(self, estimate: NoiseEstimate) -> None:
        """Count a finite step estimate; fold it into the window once it is open and until it is resolved."""
        self.seen += 1
        if self.resolved or self.seen <= self.start:
            return
        self.count += 1
        self.signal_sum += estimate.grad_sq_norm
        self.signal_sq_sum += estimate.grad_sq_norm**2
        self.noise_sum += estimate.trace_cov
        self.resolved = self.count >= self.steps and self.t_statistic >= self.min_t

    @property
    def t_statistic(self) -> float:
        """Mean ‖μ‖² estimate of the window over its standard error (NaN with fewer than 2 estimates)."""
        if self.count < 2:
            return float("nan")
        mean = self.signal_sum / self.count
        variance = max(self.signal_sq_sum / self.count - mean**2, 0.0) * self.count / (self.count - 1)
        if variance == 0.0:
            return math.inf if mean > 0 else float("nan")
        return mean / math.sqrt(variance / self.count)

    def reference(self, num_samples: float) -> float:
        """f_ref, or NaN while the reference is not resolved."""
        if not self.resolved:
            return float("nan")
        return snr_lr_factor(self.signal_sum / self.count, self.noise_sum / self.count, num_samples)

    def state_dict(self) -> dict[str, Any]:
        keys = ("seen", "count", "signal_sum", "signal_sq_sum", "noise_sum", "resolved")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.count = int(state["seen"]), int(state["count"])
        self.signal_sum, self.signal_sq_sum = float(state["signal_sum"]), float(state["signal_sq_sum"])
        self.noise_sum, self.resolved = float(state["noise_sum"]), bool(state["resolved"])


@dataclass(frozen=True)
class SNRReading:
    """What the SNR controller holds after a step, for the log: the smoothed ‖μ‖² and tr Σ, their ratio, the bound's
    factor f_t, whether the factor is driven by the measurement, the calibration's t-statistic and reference f_ref
    (NaN where not known or not calibrated) and the estimates skipped as non-finite."""

    grad_sq_norm: float
    trace_cov: float
    snr: float
    bound_factor: float
    resolved: bool
    calibration_t: float
    reference_factor: float
    skipped: int


class SNRLearningRateController:
    """Smooths per-step noise estimates and turns them into the learning-rate factor (docs/math.md).

    ‖μ‖² and tr(Σ) are smoothed separately with bias-corrected EMAs and the factor uses their ratio (as gpt-neox and
    AdaScale do): the ratio of two noisy estimates is far noisier than either. f_t = N·SNR/(1 + N·SNR) of the smoothed
    SNR is then used in one of two ways:

    - ``reference="absolute"`` (the paper's reading, the configured rate is η_max): the factor is f_t, 1 until
      ``warmup_steps`` finite estimates have been seen and never below ``floor`` afterwards (so a flat reward
      landscape cannot stall training: the paper's learning-rate collapse).
    - ``reference="calibrated"``: the factor is clip(f_t / f_ref, min_ratio, max_ratio) with f_ref from a
      [`CalibrationWindow`] that opens after ``calibration_start`` estimates and holds ``calibration_steps``; 1 until
      f_ref is resolved.

    Non-finite estimates are skipped and counted.
    """

    def __init__(
        self,
        ema_decay: float,
        warmup_steps: int,
        floor: float,
        reference: str = "absolute",
        calibration_start: int = 0,
        calibration_steps: int = 20,
        min_ratio: float = 1.0,
        max_ratio: float = 2.0,
    ):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0; got {warmup_steps}.")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1]; got {floor}.")
        if reference not in ("absolute", "calibrated"):
            raise ValueError(f"reference must be 'absolute' or 'calibrated'; got {reference!r}.")
        if not 0.0 < min_ratio <= 1.0 <= max_ratio:
            raise ValueError(f"need 0 < min_ratio <= 1 <= max_ratio; got {min_ratio}, {max_ratio}.")
        self.grad_sq_norm = BiasCorrectedEMA(ema_decay)
        self.trace_cov = BiasCorrectedEMA(ema_decay)
        self.warmup_steps = warmup_steps
        self.floor = floor
        self.reference = reference
        self.calibration = CalibrationWindow(calibration_start, calibration_steps)
        self.min_ratio, self.max_ratio = min_ratio, max_ratio
        self.skipped = 0

    def open_calibration_after(self, steps: int) -> None:
        """The calibration window opens after ``steps`` estimates (the schedule's warm-up, say) and not before the
        factor's own warm-up, so that f_ref is measured once the rate has reached its scheduled value."""
        self.calibration.open_after(max(self.warmup_steps, steps))

    def update(self, estimate: NoiseEstimate) -> bool:
        """Fold one step's estimate into the averages; returns False (and counts it) if it was not finite."""
        if not estimate.is_finite:
            self.skipped += 1
            return False
        self.grad_sq_norm.update(estimate.grad_sq_norm)
        self.trace_cov.update(estimate.trace_cov)
        self.calibration.update(estimate)
        return True

    @property
    def warmed_up(self) -> bool:
        return self.grad_sq_norm.count >= max(self.warmup_steps, 1)

    @property
    def resolved(self) -> bool:
        """Whether the factor is driven by the measurement (else it is 1)."""
        return self.calibration.resolved if self.reference == "calibrated" else self.warmed_up

    @property
    def snr(self) -> float:
        """Smoothed ‖μ‖²/tr(Σ); NaN before the first estimate, inf when no noise is measured."""
        if self.grad_sq_norm.count == 0:
            return float("nan")
        signal, noise = max(self.grad_sq_norm.value, 0.0), max(self.trace_cov.value, 0.0)
        if noise > 0.0:
            return signal / noise
        return float("inf") if signal > 0.0 else float("nan")

    def bound_factor(self, num_samples: float) -> float:
        """f_t = N·SNR/(1 + N·SNR) ∈ [0, 1] of the smoothed estimates, unclipped (NaN before the first estimate)."""
        if self.grad_sq_norm.count == 0:
            return float("nan")
        return snr_lr_factor(self.grad_sq_norm.value, self.trace_cov.value, num_samples)

    def factor(self, num_samples: float) -> float:
        """The learning-rate factor for a step of ``num_samples`` samples (see the class docstring)."""
        if not self.resolved:
            return 1.0
        if self.reference == "absolute":
            return max(self.floor, self.bound_factor(num_samples))
        ratio = self.bound_factor(num_samples) / self.calibration.reference(num_samples)
        return min(self.max_ratio, max(self.min_ratio, ratio))

    def reading(self, num_samples: float) -> SNRReading:
        """The controller's state for a step of ``num_samples`` samples (`SNRReading`)."""
        calibrated = self.reference == "calibrated"
        return SNRReading(
            grad_sq_norm=self.grad_sq_norm.value, trace_cov=self.trace_cov.value, snr=self.snr,
            bound_factor=self.bound_factor(num_samples), resolved=self.resolved,
            calibration_t=self.calibration.t_statistic if calibrated else float("nan"),
            reference_factor=self.calibration.reference(num_samples) if calibrated else float("nan"),
            skipped=self.skipped,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_sq_norm": self.grad_sq_norm.state_dict(),
            "trace_cov": self.trace_cov.state_dict(),
            "calibration": self.calibration.state_dict(),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the averages and the calibration; the options stay as configured now."""
        self.grad_sq_norm.load_state_dict(state["grad_sq_norm"])
        self.trace_cov.load_state_dict(state["trace_cov"])
        if "calibration" in state:
            self.calibration.load_state_dict(state["calibration"])
        self.skipped = int(state["skipped"])
