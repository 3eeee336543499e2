"""Variance-optimal, gradient-weighted baselines for group policy-gradient estimators (DESIGN §2).

For a prompt q with a group of G completions o_1..o_G, rewards r_i and weights w_i ∝ ‖∇_θ log π(o_i|q)‖², the
baseline that minimises the trace of the covariance of the REINFORCE estimator (r − b)·g is

    b*(q) = E[w r] / E[w].

The functions here are pure tensor code: they take rewards and weights shaped ``(num_groups, G)`` and know nothing about
trainers, models or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BaselineResult", "gradient_weighted_baseline", "gradient_weighted_loo_baseline", "group_weighted_baseline"]


@dataclass(frozen=True)
class BaselineResult:
    """A baseline per completion, with the bookkeeping the trainer logs.

    Attributes:
        baseline: ``(num_groups, G)`` baseline b_i for every completion; NaN where no baseline exists (the reward of
            completion i is missing, or no other completion of its group has a reward).
        fallback: ``(num_groups, G)`` bool, True where the weighted baseline was unusable (zero or non-finite weight
            sum, or non-finite weighted mean) and the uniform mean of the same rewards was used instead.
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
        fallback=defined & ~usable,
        defined=defined,
    )


def gradient_weighted_loo_baseline(rewards: torch.Tensor, weights: torch.Tensor) -> BaselineResult:
    """Leave-one-out gradient-weighted baseline (DESIGN §2, "Leave-one-out").

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
    others = ~torch.eye(rewards.shape[-1], dtype=torch.bool, device=rewards.device)
    return _baseline_over(rewards, weights, others & torch.isfinite(rewards).unsqueeze(-2))


def group_weighted_baseline(rewards: torch.Tensor, weights: torch.Tensor) -> BaselineResult:
    """Whole-group gradient-weighted baseline, b = Σ_j w_j r_j / Σ_j w_j (DESIGN §2; verl's OPO/OTB form).

    Every completion of a group gets the same baseline, which includes its own reward: the estimator is biased by
    O(1/G) (measured in ``tests/test_estimator_properties.py``). Falls back to the uniform group mean when Σ_j w_j is
    zero or not finite. Arguments and return value as in [`gradient_weighted_loo_baseline`].
    """
    _check_shapes(rewards, weights)
    group_size = rewards.shape[-1]
    include = torch.isfinite(rewards).unsqueeze(-2).expand(*rewards.shape[:-1], group_size, group_size)
    return _baseline_over(rewards, weights, include)


def gradient_weighted_baseline(rewards: torch.Tensor, weights: torch.Tensor, leave_one_out: bool = True) -> BaselineResult:
    """Dispatch to [`gradient_weighted_loo_baseline`] or [`group_weighted_baseline`]."""
    if leave_one_out:
        return gradient_weighted_loo_baseline(rewards, weights)
    return group_weighted_baseline(rewards, weights)


def _check_shapes(rewards: torch.Tensor, weights: torch.Tensor) -> None:
    if rewards.shape != weights.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards and weights must both be (num_groups, G); got {tuple(rewards.shape)} and {tuple(weights.shape)}."
        )
    if rewards.shape[-1] < 2:
        raise ValueError(f"a baseline needs at least 2 completions per group; got G={rewards.shape[-1]}.")
