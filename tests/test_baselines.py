"""Acceptance 2: the vectorised baselines equal a naive per-sample loop, fallbacks included; advantages and
reward aggregation follow TRL's conventions."""

import math

import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from oblr_trl.estimators.advantages import aggregate_rewards, gradient_weighted_advantages, nanstd
from oblr_trl.estimators.baselines import gradient_weighted_loo_baseline, group_weighted_baseline

INF, NAN = float("inf"), float("nan")


def naive_baseline(rewards: list[float], weights: list[float], i: int, leave_one_out: bool):
    """(baseline, fell_back) for completion i, written as plainly as possible (docs/math.md)."""
    if not math.isfinite(rewards[i]):
        return NAN, False
    others = [j for j in range(len(rewards)) if (j != i or not leave_one_out) and math.isfinite(rewards[j])]
    if not others:
        return NAN, False
    uniform = sum(rewards[j] for j in others) / len(others)
    denominator = sum(weights[j] for j in others)
    weighted = sum(weights[j] * rewards[j] for j in others) / denominator if denominator > 0 else NAN
    fell_back = not (math.isfinite(denominator) and denominator > 0 and math.isfinite(weighted))
    if all(rewards[j] == rewards[others[0]] for j in others):
        return rewards[others[0]], False  # any mean of identical values, taken exactly: no weights needed
    return (uniform if fell_back else weighted), fell_back


def assert_matches_naive(rewards, weights, leave_one_out):
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    weights_t = torch.tensor(weights, dtype=torch.float64)
    fn = gradient_weighted_loo_baseline if leave_one_out else group_weighted_baseline
    result = fn(rewards_t, weights_t)
    for n, (group_r, group_w) in enumerate(zip(rewards, weights)):
        for i in range(len(group_r)):
            expected, fell_back = naive_baseline(group_r, group_w, i, leave_one_out)
            got = result.baseline[n, i].item()
            if math.isnan(expected):
                assert math.isnan(got), (n, i, got)
                assert not result.defined[n, i]
            else:
                assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), (n, i)
                assert result.defined[n, i]
            assert bool(result.fallback[n, i]) == fell_back, (n, i)


EDGE_CASES = {
    "plain": ([[1.0, 0.0, 2.0, 5.0]], [[1.0, 2.0, 3.0, 4.0]]),
    "zero_weights": ([[1.0, 0.0, 2.0, 5.0]], [[0.0, 0.0, 0.0, 4.0]]),
    "all_zero_weights": ([[1.0, 0.0, 2.0, 5.0]], [[0.0, 0.0, 0.0, 0.0]]),
    "inf_weight": ([[1.0, 0.0, 2.0, 5.0]], [[1.0, INF, 3.0, 4.0]]),
    "nan_weight": ([[1.0, 0.0, 2.0, 5.0]], [[NAN, 1.0, 3.0, 4.0]]),
    "nan_rewards": ([[1.0, NAN, 2.0, NAN]], [[1.0, 2.0, 3.0, 4.0]]),
    "inf_reward": ([[1.0, INF, 2.0, 3.0]], [[1.0, 2.0, 3.0, 4.0]]),
    "one_scored": ([[NAN, NAN, 2.0, NAN]], [[1.0, 2.0, 3.0, 4.0]]),
    "none_scored": ([[NAN, NAN, NAN, NAN]], [[1.0, 2.0, 3.0, 4.0]]),
    "all_equal": ([[0.3, 0.3, 0.3, 0.3]], [[1.0, 7.0, 0.1, 4.0]]),
    "g2": ([[1.0, 3.0], [2.0, NAN], [4.0, 4.0]], [[5.0, 1.0], [1.0, 1.0], [0.0, 0.0]]),
    "overflowing_product": ([[3e38, -3e38, 1.0]], [[3e38, 3e38, 1.0]]),
}


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_baseline_matches_naive_loop(case, leave_one_out):
    rewards, weights = EDGE_CASES[case]
    assert_matches_naive(rewards, weights, leave_one_out)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_baseline_matches_naive_loop_on_random_groups(leave_one_out):
    gen = torch.Generator().manual_seed(0)
    for group_size in (2, 3, 8):
        rewards = torch.randn(50, group_size, generator=gen, dtype=torch.float64)
        weights = torch.rand(50, group_size, generator=gen, dtype=torch.float64) * 10
        rewards[torch.rand(rewards.shape, generator=gen) < 0.15] = NAN
        weights[torch.rand(weights.shape, generator=gen) < 0.15] = 0.0
        weights[torch.rand(weights.shape, generator=gen) < 0.05] = INF
        assert_matches_naive(rewards.tolist(), weights.tolist(), leave_one_out)


def test_g2_leave_one_out_is_the_other_reward():
    result = gradient_weighted_loo_baseline(torch.tensor([[1.0, 3.0]]), torch.tensor([[100.0, 0.5]]))
    assert result.baseline.tolist() == [[3.0, 1.0]]


def test_uniform_weights_give_rloo_and_group_mean():
    rewards = torch.tensor([[1.0, 2.0, 6.0]])
    ones = torch.ones_like(rewards)
    assert torch.allclose(gradient_weighted_loo_baseline(rewards, ones).baseline, torch.tensor([[4.0, 3.5, 1.5]]))
    assert torch.allclose(group_weighted_baseline(rewards, ones).baseline, torch.tensor([[3.0, 3.0, 3.0]]))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="G=1"):
        gradient_weighted_loo_baseline(torch.ones(3, 1), torch.ones(3, 1))
    with pytest.raises(ValueError, match="num_groups"):
        gradient_weighted_loo_baseline(torch.ones(4), torch.ones(4))


# ----------------------------------------------------------------------------------------------------------------
# Advantages and reward aggregation
# ----------------------------------------------------------------------------------------------------------------


def test_advantages_are_reward_minus_baseline_and_finite():
    rewards = torch.tensor([1.0, 0.0, NAN, 2.0, INF, 5.0, 5.0, 5.0])
    weights = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0, 1.0, 9.0, 0.1])
    result = gradient_weighted_advantages(rewards, weights, group_size=4)
    assert torch.isfinite(result.advantages).all()
    # b_0 = (2·0 + 0·2)/2, b_1 = (1·1 + 0·2)/1, the NaN reward gets 0, b_3 = (1·1 + 2·0)/3
    assert torch.allclose(result.advantages[:4], torch.tensor([1.0, -1.0, 0.0, 2.0 - 1 / 3]))
    # inf reward is unscorable; all-equal remaining rewards give exactly zero advantages
    assert result.advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert result.scored.tolist() == [True, True, False, True, False, True, True, True]


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_uniform_group_baseline_reproduces_trl_grpo_advantages(scale):
    """leave_one_out=False with uniform weights is GRPO's (r − mean)/(std + 1e-4), as TRL computes it."""
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(24, generator=gen)
    rewards[5] = NAN
    result = gradient_weighted_advantages(rewards, torch.ones(24), 4, leave_one_out=False, scale_rewards=scale)
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = trl_nanstd(grouped, dim=1).unsqueeze(1) if scale == "group" else trl_nanstd(rewards)
    expected = torch.nan_to_num(((grouped - mean) / (std + 1e-4)).reshape(-1), nan=0.0)
    assert torch.allclose(result.advantages, expected, atol=1e-6)


def test_scale_rewards_none_leaves_scale_and_rejects_unknown():
    rewards, weights = torch.tensor([0.0, 10.0]), torch.ones(2)
    assert gradient_weighted_advantages(rewards, weights, 2).advantages.tolist() == [-10.0, 10.0]
    with pytest.raises(ValueError, match="scale_rewards"):
        gradient_weighted_advantages(rewards, weights, 2, scale_rewards="groups")


def test_nanstd_matches_trl():
    values = torch.tensor([[1.0, NAN, 3.0, 4.0], [NAN, NAN, 1.0, NAN]])
    assert torch.allclose(nanstd(values, dim=1), trl_nanstd(values, dim=1), equal_nan=True)


def test_aggregate_sum_then_normalize_skips_none_and_marks_unscorable():
    per_func = torch.tensor([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [1.0, INF]])
    rewards = aggregate_rewards(per_func, torch.tensor([1.0, 0.5]), group_size=2)
    assert rewards[:2].tolist() == [2.0, 1.5]
    assert math.isnan(rewards[2]) and math.isnan(rewards[3])


def test_aggregate_normalize_then_sum_standardises_each_function_per_group():
    per_func = torch.tensor([[1.0, 10.0], [3.0, 30.0], [0.0, 0.0], [2.0, 0.0]])
    rewards = aggregate_rewards(per_func, torch.tensor([1.0, 1.0]), 2, "normalize_then_sum")
    std = math.sqrt(2.0)
    z = 1.0 / (std + 1e-4)
    assert torch.allclose(rewards[:2], torch.tensor([-z - 10 / (10 * std + 1e-4), z + 10 / (10 * std + 1e-4)]))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_rewards(per_func, torch.ones(2), 2, "mean")


# ----------------------------------------------------------------------------------------------------------------
# The lower-variance estimate of b*: the pooled slope
# ----------------------------------------------------------------------------------------------------------------


def naive_mean_and_variance(values):
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / len(values)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_pooled_slope_baseline_equals_a_naive_loop(leave_one_out):
    from oblr_trl.estimators.baselines import pooled_slope_baseline

    rewards = [[1.0, 0.0, 1.0, 0.0, 1.0], [0.5, NAN, 0.0, 1.0, 1.0]]
    weights = [[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 1.0, 7.0, 0.5, 1.0]]
    pooled = pooled_slope_baseline(torch.tensor(rewards), 0.7, leave_one_out).baseline
    for n, (group_r, group_w) in enumerate(zip(rewards, weights)):
        for i in range(len(group_r)):
            if math.isnan(group_r[i]):
                assert math.isnan(pooled[n, i])
                continue
            others = [j for j in range(len(group_r)) if (j != i or not leave_one_out) and math.isfinite(group_r[j])]
            mean, variance = naive_mean_and_variance([group_r[j] for j in others])
            assert pooled[n, i].item() == pytest.approx(mean + 0.7 * variance, rel=1e-6)


def test_pooled_slope_of_zero_is_rloo():
    from oblr_trl.estimators.baselines import pooled_slope_baseline

    generator = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (6, 8), generator=generator).double()
    rloo = gradient_weighted_loo_baseline(rewards, torch.ones_like(rewards)).baseline
    assert torch.allclose(pooled_slope_baseline(rewards, 0.0).baseline, rloo)
    same = torch.full((1, 4), 0.3, dtype=torch.float64)  # no reward spread: advantages of exactly 0
    assert torch.equal(pooled_slope_baseline(same, 5.0).baseline, same)


def test_pooled_slope_is_the_weighted_least_squares_slope_and_round_trips():
    """Weights heavier for right answers (w = 1 + r): b* lies above the mean, and the fitted ρ̂ is the slope that
    minimises Σ w (r − p̂ − ρ v̂)² over the batch — smaller than for ρ = 0 (RLOO) or for half or twice ρ̂."""
    from oblr_trl.estimators.baselines import PooledSlope, pooled_slope_baseline

    generator = torch.Generator().manual_seed(1)
    p = torch.rand(4000, 1, generator=generator, dtype=torch.float64) * 0.3 + 0.1
    rewards = (torch.rand(4000, 8, generator=generator, dtype=torch.float64) < p).double()
    weights = 1.0 + rewards
    fit = PooledSlope(decay=0.0)
    fit.update(rewards, weights)
    assert fit.value > 0

    def weighted_error(slope):
        return (weights * (rewards - pooled_slope_baseline(rewards, slope).baseline) ** 2).sum().item()

    best = weighted_error(fit.value)
    assert best < weighted_error(0.0) and best < weighted_error(fit.value / 2) and best < weighted_error(2 * fit.value)
    restored = PooledSlope(0.5)
    restored.load_state_dict(fit.state_dict())
    assert restored.value == fit.value
    fit.update(torch.ones(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64))  # no spread: no update
    assert fit.value == restored.value


@pytest.mark.parametrize("correct", range(9))
def test_without_weights_the_slope_of_a_group_follows_its_majority(correct):
    """Uniform weights, binary rewards, k right of G: Σ_i (r_i − p̂₋ᵢ)·v̂₋ᵢ = k(G−k)(2k−G)/(G−1)³ (docs/math.md,
    "ρ̂ without weights"): the leave-one-out mean and variance move together, so the slope is not 0 but takes the
    sign of the batch's accuracy − ½."""
    from oblr_trl.estimators.baselines import PooledSlope

    group_size = 8
    rewards = torch.tensor([[1.0] * correct + [0.0] * (group_size - correct)], dtype=torch.float64)
    fit = PooledSlope(decay=0.0)
    fit.update(rewards, torch.ones_like(rewards))
    expected = correct * (group_size - correct) * (2 * correct - group_size) / (group_size - 1) ** 3
    assert fit.numerator * group_size == pytest.approx(expected, abs=1e-12)  # the fit divides its sums by n·mean w


@pytest.mark.parametrize("accuracy, slope", [(0.1, -0.71795), (0.25, -0.35897), (0.5, 0.0), (0.75, 0.35897)])
def test_without_weights_the_fitted_slope_is_the_shrinkage_of_the_loo_mean(accuracy, slope):
    """Groups of 8 from one accuracy p: ρ̂ fitted with uniform weights converges to its binomial expectation
    Σ_k P(k) Σ_i e v̂ / Σ_k P(k) Σ_i v̂² (the values: the exact sums over k = 0..8), negative below p = ½; b_i =
    p̂₋ᵢ + ρ̂ v̂₋ᵢ then pulls the leave-one-out mean toward p and has a smaller squared error to it than RLOO."""
    from oblr_trl.estimators.baselines import PooledSlope, pooled_slope_baseline

    generator = torch.Generator().manual_seed(0)
    rewards = (torch.rand(20000, 8, generator=generator, dtype=torch.float64) < accuracy).double()
    fit = PooledSlope(decay=0.0)
    fit.update(rewards, torch.ones_like(rewards))
    assert fit.value == pytest.approx(slope, abs=0.02)  # ~5 standard errors at 20 000 groups
    if slope:
        error = lambda rho: ((pooled_slope_baseline(rewards, rho).baseline - accuracy) ** 2).mean().item()
        assert error(fit.value) < error(0.0)


def test_advantages_dispatch_to_the_estimator():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    weights = torch.tensor([1.0, 9.0, 2.0, 3.0, 1.0, 1.0, 5.0, 2.0], dtype=torch.float64)
    default = gradient_weighted_advantages(rewards, weights, 4)
    other = gradient_weighted_advantages(rewards, weights, 4, estimator="pooled_slope", slope=0.8)
    assert not torch.allclose(default.advantages, other.advantages)
    for retired in ("median", "shrunk"):
        with pytest.raises(ValueError, match="estimator"):
            gradient_weighted_advantages(rewards, weights, 4, estimator=retired)


def test_rows_whose_weights_matter_are_those_of_groups_with_reward_spread():
    from oblr_trl.estimators.advantages import rows_whose_weights_matter

    rewards = torch.tensor([1.0, 0.0, 1.0,    # spread
                            0.5, 0.5, 0.5,    # all alike
                            NAN, 0.2, 0.2,    # alike among the scored
                            NAN, NAN, 0.7,    # one scored: no baseline at all
                            NAN, 0.1, 0.3])   # spread among the scored
    expected = [True] * 3 + [False] * 9 + [True] * 3
    assert rows_whose_weights_matter(rewards, 3).tolist() == expected


@pytest.mark.parametrize("estimator", ["weighted", "pooled_slope"])
@pytest.mark.parametrize("leave_one_out", [True, False])
def test_weights_of_groups_without_spread_change_no_advantage_and_no_fallback(estimator, leave_one_out):
    """What lets `exact` skip measuring them: NaN (not measured), 0 or any weight there gives the same advantages, no
    fallback is counted, and the pooled slope's fit is the one it would be were they the measured rows' mean."""
    from oblr_trl.estimators.advantages import rows_whose_weights_matter
    from oblr_trl.estimators.baselines import PooledSlope

    generator = torch.Generator().manual_seed(3)
    rewards = (torch.rand(40, 4, generator=generator, dtype=torch.float64) < 0.3).double().view(-1)
    weights = torch.rand(160, generator=generator, dtype=torch.float64) + 0.1
    matters = rows_whose_weights_matter(rewards, 4)
    assert 0 < matters.sum() < len(matters)
    unmeasured = torch.where(matters, weights, torch.full_like(weights, NAN))
    mean_filled = torch.where(matters, weights, weights[matters].mean())
    zero_filled = torch.where(matters, weights, torch.zeros_like(weights))
    results = [gradient_weighted_advantages(rewards, w, 4, leave_one_out, estimator=estimator, slope=0.4)
               for w in (unmeasured, mean_filled, zero_filled)]
    for result in results[1:]:
        assert torch.equal(result.advantages, results[0].advantages)
    assert not any(result.fallback.any() for result in results)
    fits = [PooledSlope(0.5) for _ in range(2)]
    for fit, w in zip(fits, (unmeasured, mean_filled)):
        fit.update(rewards.view(-1, 4), w.view(-1, 4), leave_one_out)
        fit.update(rewards.view(-1, 4).flip(0), w.view(-1, 4).flip(0), leave_one_out)
    assert fits[0].value == pytest.approx(fits[1].value, rel=1e-12) and fits[0].value != 0
