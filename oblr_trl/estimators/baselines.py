"""Variance-optimal, gradient-weighted baselines for group policy-gradient estimators (docs/math.md).

For a prompt q with a group of G completions o_1..o_G, rewards r_i and weights w_i ∝ ‖∇_θ log π(o_i|q)‖², the
baseline that minimises the trace of the covariance of the REINFORCE estimator (r − b)·g is

    b*(q) = E[w r] / E[w].

Estimated from a group, leave-one-out (so that the baseline of completion i does not depend on o_i and the estimator
stays unbiased), any baseline b_i pays for its own error: for b_i independent of o_i,

    E[w_i (r_i − b_i)²] = E[w (r − b*)²] + E[w]·E[(b_i − b*)²],

so leave-one-out baselines rank by their mean squared error to b*. The plain weighted mean of the G − 1 others
(`"weighted"`, the paper's) is the natural estimate but a noisy one when weights spread widely (an effective sample of
~3 of 7 completions for a 55× spread). A lower-variance estimate of the same b*:

* `"pooled_slope"`: b* = p + Cov(w, r)/E[w], and for a reward in [0, 1] the shift Cov(w, r)/E[w] is close to ρ·v with
  v = Var(r) the reward spread of the prompt and ρ a property of the policy shared across prompts (how much heavier
  the gradients of right answers are than wrong ones). So b_i = p̂₋ᵢ + ρ̂·v̂₋ᵢ, with p̂₋ᵢ, v̂₋ᵢ the mean and variance of
  the other completions' rewards and ρ̂ fitted on *earlier* batches ([`PooledSlope`]): still independent of o_i, and
  ρ̂ = 0 is RLOO.

The functions here are pure tensor code: they take rewards and weights shaped ``(num_groups, G)`` and know nothing about
trainers, models or processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


__all__ = [
    "BaselineResult",
    "PooledSlope",
    "gradient_weighted_baseline",
    "gradient_weighted_loo_baseline",
    "group_weighted_baseline",
    "pooled_slope_baseline",
]

@dataclass(frozen=True)
class BaselineResult:
    """A baseline per completion, with the bookkeeping the trainer logs.

    Attributes:
        baseline: ``(num_groups, G)`` baseline b_i for every completion; NaN where no baseline exists (the reward of
            completion i is missing, or no other completion of its group has a reward).
        fallback: ``(num_groups, G)`` bool, True where the weighted baseline was unusable (zero or non-finite weight
            sum, or non-finite weighted mean) and the uniform mean of the same rewards was used instead; never where
            those rewards are all equal (their mean needs no weights; `exact` weights are not measured there).
        defined: ``(num_groups, G)`` bool, True where ``baseline`` is finite.
    """

    baseline: torch.Tensor
    fallback: torch.Tensor
    defined: torch.Tensor


def _baseline_over(rewards: torch.Tensor, weights: torch.Tensor, include: torch.Tensor) -> BaselineResult:
    """b_i = Σ_j include_ij w_j r_j / Σ_j include_ij w_j, ``include`` of shape ``(n, G, G)``, for scored i only.

    Falls back to the uniform mean Σ_j include_ij r_j / Σ_j include_ij where the weighted one is unusable. Masked
    entries are removed with ``where`` rather than multiplied by zero so that an infinite or NaN weight outside the
    set never leaks in (0·inf is NaN).
    """
    r = rewards.unsqueeze(-2).expand_as(include)
    w = weights.to(rewards.dtype).unsqueeze(-2).expand_as(include)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    count = include.sum(-1)
    weight_sum = torch.where(include, w, zero).sum(-1)
    weighted_mean = torch.where(include, w * r, zero).sum(-1) / weight_sum
    uniform_mean = torch.where(include, r, zero).sum(-1) / count.clamp(min=1)
    usable = torch.isfinite(weight_sum) & (weight_sum > 0) & torch.isfinite(weighted_mean)
    baseline = torch.where(usable, weighted_mean, uniform_mean)
    # Any mean of identical rewards is that reward; take it exactly so that a group with no reward spread gets
    # advantages of exactly zero rather than rounding noise (which reward scaling would then blow up).
    smallest = torch.where(include, r, torch.full_like(r, float("inf"))).amin(-1)
    largest = torch.where(include, r, torch.full_like(r, float("-inf"))).amax(-1)
    baseline = torch.where(smallest == largest, largest, baseline)

    defined = (count > 0) & torch.isfinite(rewards)
    return BaselineResult(
        baseline=torch.where(defined, baseline, torch.full_like(baseline, float("nan"))),
        fallback=defined & ~usable & (smallest != largest),  # identical rewards: no weights needed, none missed
        defined=defined,
    )


def gradient_weighted_loo_baseline(rewards: torch.Tensor, weights: torch.Tensor) -> BaselineResult:
    """Leave-one-out gradient-weighted baseline (docs/math.md).

        b_i = Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j

    Only completions with a finite reward take part (a NaN reward marks an unscorable completion, as in TRL). Because
    b_i does not depend on o_i, the estimator (r_i − b_i)·g_i stays unbiased (the paper's Assumption 1). With G = 2 the
    baseline is the other completion's reward. If Σ_{j≠i} w_j is zero or not finite, b_i falls back to the uniform
    leave-one-out mean of the same rewards and ``fallback`` marks it.

    Args:
        rewards: ``(num_groups, G)`` rewards; NaN for unscorable completions.
        weights: ``(num_groups, G)`` non-negative weights, w_i ∝ ‖∇_θ log π(o_i|q)‖², up to a common scale.

    Returns:
        A [`BaselineResult`]; ``baseline`` is NaN where completion i has no reward or no other completion in its group
        has one.
    """
    _check_shapes(rewards, weights)
    return _baseline_over(rewards, weights, _included(rewards, leave_one_out=True))


def group_weighted_baseline(rewards: torch.Tensor, weights: torch.Tensor) -> BaselineResult:
    """Whole-group gradient-weighted baseline, b = Σ_j w_j r_j / Σ_j w_j (docs/math.md; verl's OPO/OTB form).

    Every completion of a group gets the same baseline, which includes its own reward: the estimator is biased by
    O(1/G) (measured in ``tests/test_estimator_properties.py``). Falls back to the uniform group mean when Σ_j w_j is
    zero or not finite. Arguments and return value as in [`gradient_weighted_loo_baseline`].
    """
    _check_shapes(rewards, weights)
    return _baseline_over(rewards, weights, _included(rewards, leave_one_out=False))


def _included(rewards: torch.Tensor, leave_one_out: bool) -> torch.Tensor:
    """``(n, G, G)``: which rewards enter the baseline of each completion (scored ones, without i itself for LOO)."""
    group_size = rewards.shape[-1]
    include = torch.isfinite(rewards).unsqueeze(-2).expand(*rewards.shape[:-1], group_size, group_size)
    if leave_one_out:
        include = include & ~torch.eye(group_size, dtype=torch.bool, device=rewards.device)
    return include


def gradient_weighted_baseline(rewards: torch.Tensor, weights: torch.Tensor, leave_one_out: bool = True) -> BaselineResult:
    """Dispatch to [`gradient_weighted_loo_baseline`] or [`group_weighted_baseline`]."""
    if leave_one_out:
        return gradient_weighted_loo_baseline(rewards, weights)
    return group_weighted_baseline(rewards, weights)


def _mean_and_variance_over(rewards: torch.Tensor, include: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) variance of the included rewards of each completion, ``(n, G)`` each; NaN if none."""
    r = rewards.unsqueeze(-2).expand_as(include)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    # through `_baseline_over` so that identical rewards give their value exactly, and a variance of exactly 0
    mean = _baseline_over(rewards, torch.ones_like(rewards), include).baseline
    variance = torch.where(include, (r - mean.unsqueeze(-1)) ** 2, zero).sum(-1) / include.sum(-1)
    return mean, variance


def pooled_slope_baseline(
    rewards: torch.Tensor, slope: float | torch.Tensor, leave_one_out: bool = True
) -> BaselineResult:
    """b_i = p̂_i + ρ·v̂_i with p̂_i, v̂_i the mean and variance of the other (or all) rewards of the group (module
    docstring, `"pooled_slope"`). ``slope`` ρ (a number, or a tensor broadcastable to ``(num_groups, 1)``) must not
    depend on this batch (fit it on earlier ones) for the leave-one-out estimator to stay unbiased. ρ = 0 is RLOO.
    Uses no weights, so it never falls back."""
    if rewards.dim() != 2 or rewards.shape[-1] < 2:
        raise ValueError(f"rewards must be (num_groups, G) with G >= 2; got {tuple(rewards.shape)}.")
    include = _included(rewards, leave_one_out)
    mean, variance = _mean_and_variance_over(rewards, include)
    defined = (include.sum(-1) > 0) & torch.isfinite(rewards)
    baseline = torch.where(defined, mean + slope * variance, torch.full_like(mean, float("nan")))
    return BaselineResult(baseline=baseline, fallback=torch.zeros_like(defined), defined=defined)


class PooledSlope:
    """ρ̂ of the `"pooled_slope"` baseline: a weighted least-squares slope fitted across groups and batches.

    For every scored completion, e_i = r_i − p̂_i is regressed on v̂_i with weight w_i (the baseline minimising
    E[w (r − b)²] among b = p̂ + ρ v̂): ρ̂ = Σ w e v̂ / Σ w v̂². Numerator and denominator are moving averages over
    batches (decay β; their ratio needs no bias correction) of each batch's sums divided by n·mean(w), and a batch
    updates ρ̂ only after its own baselines are computed. A NaN weight (not measured) leaves its row out of the sums.
    With uniform weights ρ̂ is not 0: p̂ and v̂ come from the same rewards, and the slope shrinks the leave-one-out mean
    toward the batch's accuracy (docs/math.md, "ρ̂ without weights").
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1); got {decay}.")
        self.decay = decay
        self.numerator = self.denominator = 0.0
        self.count = 0

    @property
    def value(self) -> float:
        """ρ̂ (0, RLOO, before any batch with reward spread)."""
        return self.numerator / self.denominator if self.denominator > 0 else 0.0

    def update(self, rewards: torch.Tensor, weights: torch.Tensor, leave_one_out: bool = True) -> None:
        """Fold one batch, rewards and weights ``(num_groups, G)``, into the fit."""
        _check_shapes(rewards, weights)
        mean, variance = _mean_and_variance_over(rewards, _included(rewards, leave_one_out))
        w = weights.to(rewards.dtype)
        usable = torch.isfinite(rewards) & torch.isfinite(mean) & torch.isfinite(w) & (w >= 0)
        zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        numerator = torch.where(usable, w * (rewards - mean) * variance, zero).sum().item()
        denominator = torch.where(usable, w * variance**2, zero).sum().item()
        if denominator <= 0 or not (math.isfinite(numerator) and math.isfinite(denominator)):
            return  # no reward spread in this batch: nothing to learn about ρ
        # normalised per batch so that the weights' scale (which drifts in training) does not weigh batches unevenly:
        # by the mean weight times the number of completions, so that rows whose weight was not measured (NaN: groups
        # without reward spread, which add nothing above) count as the others do
        counted = torch.isfinite(rewards) & torch.isfinite(mean)
        scale = torch.where(usable, w, zero).sum().item() * counted.sum().item() / usable.sum().item()
        self.count += 1
        self.numerator = self.decay * self.numerator + (1 - self.decay) * numerator / scale
        self.denominator = self.decay * self.denominator + (1 - self.decay) * denominator / scale

    def state_dict(self) -> dict[str, float | int]:
        return {"decay": self.decay, "numerator": self.numerator, "denominator": self.denominator, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.count = float(state["decay"]), int(state["count"])
        self.numerator, self.denominator = float(state["numerator"]), float(state["denominator"])


def _check_shapes(rewards: torch.Tensor, weights: torch.Tensor) -> None:
    if rewards.shape != weights.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards and weights must both be (num_groups, G); got {tuple(rewards.shape)} and {tuple(weights.shape)}."
        )
    if rewards.shape[-1] < 2:
        raise ValueError(f"a baseline needs at least 2 completions per group; got G={rewards.shape[-1]}.")
