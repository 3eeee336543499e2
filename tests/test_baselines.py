"""Acceptance 2: the vectorised baselines equal a naive per-sample loop, fallbacks included; advantages and
reward aggregation follow TRL's conventions."""

import math

import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from oblr_trl.advantages import aggregate_rewards, gradient_weighted_advantages, nanstd
from oblr_trl.baselines import gradient_weighted_loo_baseline, group_weighted_baseline

INF, NAN = float("inf"), float("nan")


def naive_baseline(rewards: list[float], weights: list[float], i: int, leave_one_out: bool):
    """(baseline, fell_back) for completion i, written as plainly as possible (DESIGN §2)."""
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
        return rewards[others[0]], fell_back  # any mean of identical values, taken exactly
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
