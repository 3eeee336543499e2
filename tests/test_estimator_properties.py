"""Acceptance 3 and 4: the leave-one-out gradient-weighted estimator is unbiased, and b* minimises the variance.

Both tests print the figures they measure (run with ``-s``); the closing notes quote them.
"""

import pytest
import torch

from oblr_trl.estimators.baselines import gradient_weighted_baseline
from oblr_trl.estimators.weights import log_sum_sq_probs, logit_proxy_weights


def softmax_policy_group_estimates(num_groups: int, group_size: int, leave_one_out: bool, seed: int = 0):
    """Policy-gradient estimates on a 5-armed softmax policy π = softmax(θ) with noisy rewards.

    The score of arm k is ∇_θ log π_k = e_k − π and its squared norm is exactly the logit proxy 1 − 2π_k + Σπ², so
    the weights are the exact ones. The exact gradient is ∇J = π ⊙ (E[r|k] − J).
    """
    gen = torch.Generator().manual_seed(seed)
    theta = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.5], dtype=torch.float64)
    pi = torch.softmax(theta, 0)
    mean_reward = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    exact_gradient = pi * (mean_reward - (pi * mean_reward).sum())

    arms = torch.multinomial(pi, num_groups * group_size, replacement=True, generator=gen).view(num_groups, group_size)
    rewards = mean_reward[arms] + 0.5 * torch.randn(arms.shape, generator=gen, dtype=torch.float64)
    log_probs = torch.log(pi)[arms].reshape(-1, 1)
    log_sum_sq = log_sum_sq_probs(theta).expand_as(log_probs)
    weights = logit_proxy_weights(log_probs, log_sum_sq, torch.ones_like(log_probs)).view_as(rewards).double()
    score = torch.nn.functional.one_hot(arms, len(pi)).double() - pi
    baseline = gradient_weighted_baseline(rewards, weights, leave_one_out=leave_one_out).baseline
    estimates = ((rewards - baseline).unsqueeze(-1) * score).mean(dim=1)
    return estimates, exact_gradient


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_leave_one_out_estimator_is_unbiased(group_size):
    estimates, exact = softmax_policy_group_estimates(200_000, group_size, leave_one_out=True)
    mean, standard_error = estimates.mean(0), estimates.std(0) / estimates.shape[0] ** 0.5
    z = (mean - exact) / standard_error
    print(f"\nG={group_size} LOO: z-scores {[round(v, 2) for v in z.tolist()]}")
    assert z.abs().max() < 3.0


@pytest.mark.parametrize("group_size", [4, 8])
def test_whole_group_estimator_bias_is_measured(group_size):
    """The non-LOO variant includes r_i in its own baseline: its bias is large and detected by the same test."""
    estimates, exact = softmax_policy_group_estimates(200_000, group_size, leave_one_out=False)
    mean, standard_error = estimates.mean(0), estimates.std(0) / estimates.shape[0] ** 0.5
    z = (mean - exact) / standard_error
    relative_bias = ((mean - exact).norm() / exact.norm()).item()
    shrink = (mean @ exact / exact.dot(exact)).item()
    print(f"\nG={group_size} non-LOO: relative bias {relative_bias:.3f}, E[g]·∇J/|∇J|² = {shrink:.3f}")
    assert z.abs().max() > 3.0
    assert 0.5 / group_size < relative_bias < 2.0 / group_size


# ----------------------------------------------------------------------------------------------------------------
# Optimality on a tiny transformer with exact per-sample gradients
# ----------------------------------------------------------------------------------------------------------------


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks = torch.stack([a.argsort().argsort(), b.argsort().argsort()]).double()
    return torch.corrcoef(ranks)[0, 1].item()


def test_optimal_baseline_minimises_estimator_variance(tiny_policy_pools):
    """b* = E[w r]/E[w] from exact norms gives the smallest variance (docs/math.md; correctness).

    b* is estimated on one pool of completions and the variances are measured on another (no tautology). The
    optimality is a theorem for any reward; the margin over other constant baselines is E[w](b − b*)², visible above
    Monte-Carlo noise only when the reward correlates with ‖g‖², so the reward here is the completion length, which
    does (as it often does in reasoning RL, where truncated or short answers score differently).
    """
    pool_a, pool_b = tiny_policy_pools
    rewards_a, rewards_b = pool_a.lengths, pool_b.lengths
    exact_a, exact_b, grads_b, proxy_b = pool_a.exact_weights, pool_b.exact_weights, pool_b.gradients, pool_b.logit_weights
    b_star = (exact_a * rewards_a).sum() / exact_a.sum()
    value = rewards_a.mean()

    def single_sample_variance(b):  # tr Cov[(r − b) g] under pool B, in closed form
        centred = rewards_b - b
        return ((exact_b * centred**2).mean() - (centred.unsqueeze(1) * grads_b).mean(0).pow(2).sum()).item()

    group_size, draws = 8, 20_000
    index = torch.randint(0, len(rewards_b), (draws, group_size), generator=torch.Generator().manual_seed(2))
    r, w, proxy = rewards_b[index], exact_b[index], proxy_b[index]
    gram = grads_b @ grads_b.T

    def group_variance(baseline):
        """tr Cov of ĝ_s = (1/G) Σ_i c_si g_(s,i), c = r − b, over resampled groups s, through the Gram matrix."""
        coefficients = (r - baseline) / group_size
        sq_norms = torch.einsum("si,sj,sij->s", coefficients, coefficients, gram[index[:, :, None], index[:, None, :]])
        pooled = torch.zeros(len(rewards_b), dtype=torch.float64).index_add_(0, index.reshape(-1), coefficients.reshape(-1))
        return (sq_norms.mean() - pooled @ gram @ pooled / draws**2).item()

    variances = {
        "b* (exact norms, fixed)": group_variance(b_star),
        "group mean (GRPO)": group_variance(r.mean(1, keepdim=True)),
        "uniform LOO (RLOO)": group_variance(gradient_weighted_baseline(r, torch.ones_like(r)).baseline),
        "exact-weight LOO": group_variance(gradient_weighted_baseline(r, w).baseline),
        "logit-weight LOO": group_variance(gradient_weighted_baseline(r, proxy).baseline),
    }
    correlation = torch.corrcoef(torch.stack([exact_b, proxy_b]))[0, 1].item()
    print(f"\nsingle-sample tr Cov: b*={single_sample_variance(b_star):.4f}  E[r]={single_sample_variance(value):.4f}")
    for name, variance in variances.items():
        ratio = variance / variances["uniform LOO (RLOO)"]
        print(f"G={group_size} {name:26s} tr Cov = {variance:.4f}  ({ratio:.3f}× RLOO)")
    print(f"logit proxy vs exact ‖g‖²: Pearson {correlation:.3f}, Spearman {spearman(exact_b, proxy_b):.3f}")

    assert single_sample_variance(b_star) <= single_sample_variance(value)
    assert variances["b* (exact norms, fixed)"] <= variances["group mean (GRPO)"]
    assert variances["b* (exact norms, fixed)"] <= variances["uniform LOO (RLOO)"]
    assert variances["exact-weight LOO"] <= variances["uniform LOO (RLOO)"]
    assert correlation > 0


def test_the_pooled_slope_leave_one_out_estimator_is_unbiased():
    """The closed-form softmax policy again: a slope fixed before the batch keeps the baseline of completion i
    independent of o_i, so the estimator stays unbiased."""
    from oblr_trl.estimators.baselines import pooled_slope_baseline

    gen = torch.Generator().manual_seed(3)
    theta = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.5], dtype=torch.float64)
    pi = torch.softmax(theta, 0)
    mean_reward = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    exact = pi * (mean_reward - (pi * mean_reward).sum())
    arms = torch.multinomial(pi, 200_000 * 4, replacement=True, generator=gen).view(200_000, 4)
    rewards = mean_reward[arms] + 0.5 * torch.randn(arms.shape, generator=gen, dtype=torch.float64)
    baseline = pooled_slope_baseline(rewards, 0.8).baseline
    score = torch.nn.functional.one_hot(arms, len(pi)).double() - pi
    estimates = ((rewards - baseline).unsqueeze(-1) * score).mean(dim=1)
    z = (estimates.mean(0) - exact) / (estimates.std(0) / estimates.shape[0] ** 0.5)
    print(f"\npooled-slope LOO: z-scores {[round(v, 2) for v in z.tolist()]}")
    assert z.abs().max() < 3.0
