"""Gradient signal-to-noise ratio and the learning-rate factor it drives (DESIGN §2, "SNR-driven learning rate").

With μ the true gradient, Σ the per-sample covariance and N the samples in an optimizer step, the step size that
minimises the paper's loss bound is

    η_t = η_max · N·SNR_t / (1 + N·SNR_t),   SNR_t = ‖μ‖² / tr(Σ),

i.e. η_max / (1 + B_noise/N) with B_noise = tr(Σ)/‖μ‖², McCandlish et al.'s simple noise scale. OBLR-PO multiplies the
scheduled learning rate by f_t = N·SNR/(1 + N·SNR) ∈ (0, 1].

Everything here is plain arithmetic on scalars: the trainer measures squared gradient norms and hands them over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BiasCorrectedEMA",
    "NoiseEstimate",
    "SNRLearningRateController",
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
    """Two-batch estimator of ‖μ‖² and tr(Σ) (DESIGN §2; McCandlish et al. 2018, appendix A.1).

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
    """Per-sample estimator of ‖μ‖² and tr(Σ) (DESIGN §2), from squared norms only.

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


def snr_lr_factor(grad_sq_norm: float, trace_cov: float, num_samples: float, floor: float = 0.0) -> float:
    """f = N·SNR / (1 + N·SNR) = N‖μ‖² / (N‖μ‖² + tr Σ), clipped to [floor, 1] (DESIGN §2).

    Negative estimates (noise) are read as zero: no measurable signal gives f = floor, no measurable noise gives
    f = 1. With neither (a zero gradient) the step does nothing whatever the learning rate, and f = 1.
    """
    signal = num_samples * max(grad_sq_norm, 0.0)
    noise = max(trace_cov, 0.0)
    factor = 1.0 if signal + noise == 0.0 else signal / (signal + noise)
    return min(1.0, max(floor, factor))


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


class SNRLearningRateController:
    """Smooths per-step noise estimates and turns them into the learning-rate factor f_t (DESIGN §2).

    ‖μ‖² and tr(Σ) are smoothed separately with bias-corrected EMAs and the factor uses their ratio (as gpt-neox and
    AdaScale do): the ratio of two noisy estimates is far noisier than either. Until ``warmup_steps`` finite estimates
    have been seen the factor is 1 (the estimate is not trusted yet); afterwards it is never below ``floor``, so a flat
    reward landscape cannot stall training (the paper's learning-rate collapse). Non-finite estimates are skipped and
    counted.
    """

    def __init__(self, ema_decay: float, warmup_steps: int, floor: float):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0; got {warmup_steps}.")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1]; got {floor}.")
        self.grad_sq_norm = BiasCorrectedEMA(ema_decay)
        self.trace_cov = BiasCorrectedEMA(ema_decay)
        self.warmup_steps = warmup_steps
        self.floor = floor
        self.skipped = 0

    def update(self, estimate: NoiseEstimate) -> bool:
        """Fold one step's estimate into the averages; returns False (and counts it) if it was not finite."""
        if not estimate.is_finite:
            self.skipped += 1
            return False
        self.grad_sq_norm.update(estimate.grad_sq_norm)
        self.trace_cov.update(estimate.trace_cov)
        return True

    @property
    def warmed_up(self) -> bool:
        return self.grad_sq_norm.count >= max(self.warmup_steps, 1)

    @property
    def snr(self) -> float:
        """Smoothed ‖μ‖²/tr(Σ); NaN before the first estimate, inf when no noise is measured."""
        if self.grad_sq_norm.count == 0:
            return float("nan")
        signal, noise = max(self.grad_sq_norm.value, 0.0), max(self.trace_cov.value, 0.0)
        if noise > 0.0:
            return signal / noise
        return float("inf") if signal > 0.0 else float("nan")

    def factor(self, num_samples: float) -> float:
        """f_t for a step of ``num_samples`` samples: 1 during warm-up, else in [floor, 1]."""
        if not self.warmed_up:
            return 1.0
        return snr_lr_factor(self.grad_sq_norm.value, self.trace_cov.value, num_samples, self.floor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_sq_norm": self.grad_sq_norm.state_dict(),
            "trace_cov": self.trace_cov.state_dict(),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the averages; ``warmup_steps`` and ``floor`` stay as configured now."""
        self.grad_sq_norm.load_state_dict(state["grad_sq_norm"])
        self.trace_cov.load_state_dict(state["trace_cov"])
        self.skipped = int(state["skipped"])
