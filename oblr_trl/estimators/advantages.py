"""From rewards and weights to OBLR-PO advantages A_i = r_i − b_i (docs/math.md).

Pure tensor code. Completions are laid out group by group, ``G`` consecutive entries per prompt, as TRL gathers them.
A reward that is not finite (NaN for "every reward function returned None", ±inf from a faulty function) marks the
completion as unscorable: it takes no part in any baseline and its advantage is 0, as TRL does for NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .baselines import gradient_weighted_baseline, pooled_slope_baseline

__all__ = [
    "AdvantageResult", "advantage_summary", "aggregate_rewards", "gradient_weighted_advantages", "nanstd",
    "rows_whose_weights_matter",
]

SCALE_EPS = 1e-4  # the epsilon TRL adds to the standard deviation when it scales rewards


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages and the quantities the trainer logs, all of shape ``(N,)``.

    Attributes:
        advantages: finite advantages; 0 for unscorable completions and where no baseline exists.
        baseline: b_i, NaN where undefined.
        fallback: True where the weighted baseline fell back to the uniform mean.
        scored: True where the completion's reward is finite.
    """

    advantages: torch.Tensor
    baseline: torch.Tensor
    fallback: torch.Tensor
    scored: torch.Tensor


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN entries; NaN where fewer than two values remain."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    sq_dev = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True)
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp(min=1)).sqrt(), torch.full_like(mean, float("nan")))
    return std if keepdim else std.squeeze(dim)


def aggregate_rewards(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    group_size: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Combine several reward functions into one reward per completion, as TRL's ``multi_objective_aggregation``.

    - ``"sum_then_normalize"``: r_i = Σ_k λ_k r_ik over the functions that scored i (NaN entries skipped).
    - ``"normalize_then_sum"`` (GDPO): each function's rewards are first standardised within the group,
      (r_ik − mean_k)/(std_k + 1e-4), then summed with the weights λ_k.

    A completion that no function scored (all NaN) gets a NaN reward, and so does one with a non-finite sum.

    Args:
        rewards_per_func: ``(N, K)`` rewards, NaN where a function returned None.
        reward_weights: ``(K,)`` weights λ_k.
        group_size: G.
        aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.

    Returns:
        ``(N,)`` rewards.
    """
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = reward_weights.to(rewards_per_func)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, group_size, rewards_per_func.shape[1])
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = nanstd(grouped, dim=1, keepdim=True)
        standardised = ((grouped - mean) / (std + SCALE_EPS)).view_as(rewards_per_func)
        rewards = (standardised * weights).nansum(dim=1)
    else:
        raise ValueError(
            f"aggregation must be 'sum_then_normalize' or 'normalize_then_sum'; got {aggregation!r}."
        )
    return torch.where(unscorable | ~torch.isfinite(rewards), torch.full_like(rewards, float("nan")), rewards)


def rows_whose_weights_matter(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N,)`` bool: True for the completions of groups whose scored rewards are not all equal (docs/math.md).

    Every estimate of b* = E[w r]/E[w] from a group whose scored rewards are all r is r, whatever the weights (the
    baselines take a mean of identical rewards exactly, `baselines._baseline_over`), and such a group adds nothing to
    the pooled slope's fit (its reward variance is 0): its weights cannot change an advantage, so they need not be
    measured. The same holds for a group with fewer than two scored completions (no leave-one-out baseline at all).
    """
    grouped = rewards.view(-1, group_size)
    finite = torch.isfinite(grouped)
    largest = torch.where(finite, grouped, torch.full_like(grouped, float("-inf"))).amax(-1)
    smallest = torch.where(finite, grouped, torch.full_like(grouped, float("inf"))).amin(-1)
    spread = (finite.sum(-1) >= 2) & (largest > smallest)
    return spread.unsqueeze(-1).expand_as(grouped).reshape(-1)


def gradient_weighted_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    leave_one_out: bool = True,
    scale_rewards: str = "none",
    estimator: str = "weighted",
    slope: float | torch.Tensor = 0.0,
) -> AdvantageResult:
    """A_i = (r_i − b_i) / s with a gradient-weighted baseline b_i (docs/math.md).

    b_i estimates b* = E[w r]/E[w] from the group, leave-one-out or over the whole group: ``estimator`` `"weighted"`
    ([`gradient_weighted_loo_baseline`] / [`group_weighted_baseline`]) or `"pooled_slope"` ([`pooled_slope_baseline`],
    with ``slope`` ρ̂ from earlier batches). The optional scale s follows
    TRL's ``scale_rewards``: ``"none"`` (s = 1, the default of the theory, which has no std scaling), ``"group"`` (std
    of the group's scored rewards + 1e-4) or ``"batch"`` (std over the whole batch + 1e-4). Any scaling makes the
    estimator biased, since the std depends on r_i.

    Args:
        rewards: ``(N,)`` rewards, N = num_groups·G, non-finite for unscorable completions.
        weights: ``(N,)`` weights w_i.
        group_size: G.
        leave_one_out: leave-one-out baseline (unbiased) or whole-group baseline.
        scale_rewards: ``"none"``, ``"group"`` or ``"batch"``.
        estimator, slope: which estimate of b* (see above) and its parameter.

    Returns:
        An [`AdvantageResult`] whose ``advantages`` are always finite.
    """
    if rewards.shape != weights.shape or rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards and weights must both be (N,) with N a multiple of G={group_size}; got "
            f"{tuple(rewards.shape)} and {tuple(weights.shape)}."
        )
    rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
    grouped = rewards.view(-1, group_size)
    grouped_weights = weights.view(-1, group_size)
    if estimator == "weighted":
        result = gradient_weighted_baseline(grouped, grouped_weights, leave_one_out=leave_one_out)
    elif estimator == "pooled_slope":
        result = pooled_slope_baseline(grouped, slope, leave_one_out=leave_one_out)
    else:
        raise ValueError(f"estimator must be 'weighted' or 'pooled_slope'; got {estimator!r}.")
    advantages = grouped - result.baseline

    if scale_rewards == "group":
        advantages = advantages / (nanstd(grouped, dim=1, keepdim=True) + SCALE_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(grouped) + SCALE_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'none', 'group' or 'batch'; got {scale_rewards!r}.")

    advantages = torch.nan_to_num(advantages.reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
    return AdvantageResult(
        advantages=advantages,
        baseline=result.baseline.reshape(-1),
        fallback=result.fallback.reshape(-1),
        scored=torch.isfinite(rewards),
    )


def advantage_summary(result: AdvantageResult, weights: torch.Tensor, group_size: int) -> dict[str, float]:
    """What a generation batch's advantages and weights look like, for the log: the share of completions that could
    not be scored (``unscorable_frac``), and over the scored ones the mean baseline, the advantages' mean and
    (population) standard deviation, the share whose leave-one-out weights fell back to the uniform mean
    (``loo_fallback_frac``), the mean finite weight (``weights/mean``) and the mean over groups of the largest ÷ the
    smallest weight (``weights/group_max_min_ratio``, groups with a positive smallest weight); docs/metrics.md."""
    scored = result.scored
    summary = {"unscorable_frac": 1.0 - scored.float().mean().item()}
    if not scored.any():
        return summary
    summary["baseline_mean"] = torch.nanmean(result.baseline).item()
    summary["advantage_mean"] = result.advantages[scored].mean().item()
    summary["advantage_std"] = result.advantages[scored].std(unbiased=False).item()
    summary["loo_fallback_frac"] = result.fallback[scored].float().mean().item()
    usable = scored & torch.isfinite(weights)
    if usable.any():
        summary["weights/mean"] = weights[usable].mean().item()
    grouped = torch.where(usable, weights, torch.full_like(weights, float("nan"))).view(-1, group_size)
    largest = torch.nan_to_num(grouped, nan=-torch.inf).amax(dim=1)
    smallest = torch.nan_to_num(grouped, nan=torch.inf).amin(dim=1)
    spread = (largest / smallest)[(smallest > 0) & torch.isfinite(largest)]
    if spread.numel():
        summary["weights/group_max_min_ratio"] = spread.mean().item()
    return summary
