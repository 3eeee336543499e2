"""Acceptance 5: the SNR estimators, the smoothing, the factor and its guards."""

import math

import pytest
import torch

from oblr_trl.snr import (
    BiasCorrectedEMA,
    NoiseEstimate,
    SNRLearningRateController,
    per_sample_noise_estimate,
    snr_lr_factor,
    two_batch_noise_estimate,
)


def test_two_batch_estimator_inverts_the_expected_norms():
    grad_sq, trace, b, n = 0.3, 12.0, 4, 64
    estimate = two_batch_noise_estimate(grad_sq + trace / b, b, grad_sq + trace / n, n)
    assert estimate.grad_sq_norm == pytest.approx(grad_sq)
    assert estimate.trace_cov == pytest.approx(trace)
    with pytest.raises(ValueError, match="0 < b < N"):
        two_batch_noise_estimate(1.0, 8, 1.0, 8)


def test_per_sample_estimator_equals_the_sample_covariance():
    samples = torch.randn(10, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    mean = samples.mean(0)
    estimate = per_sample_noise_estimate(samples.pow(2).sum().item(), mean.pow(2).sum().item(), 10)
    trace = torch.trace(torch.cov(samples.T)).item()
    assert estimate.trace_cov == pytest.approx(trace)
    assert estimate.grad_sq_norm == pytest.approx(mean.pow(2).sum().item() - trace / 10)
    with pytest.raises(ValueError, match="at least 2"):
        per_sample_noise_estimate(1.0, 1.0, 1)


def test_bias_corrected_ema_is_exact_on_a_constant_and_round_trips():
    ema = BiasCorrectedEMA(0.9)
    assert math.isnan(ema.value)
    for _ in range(3):
        ema.update(2.5)
    assert ema.value == pytest.approx(2.5)
    clone = BiasCorrectedEMA(0.5)
    clone.load_state_dict(ema.state_dict())
    assert clone.value == ema.value and clone.decay == 0.9
    with pytest.raises(ValueError, match="decay"):
        BiasCorrectedEMA(1.0)


@pytest.mark.parametrize(
    ("grad_sq", "trace", "n", "floor", "expected"),
    [
        (1.0, 1.0, 1, 0.0, 0.5),  # N·SNR = 1
        (1.0, 3.0, 3, 0.0, 0.5),
        (0.01, 10.0, 8, 0.1, 0.1),  # collapse held at the floor
        (-1.0, 5.0, 8, 0.2, 0.2),  # no measurable signal
        (1.0, -5.0, 8, 0.2, 1.0),  # no measurable noise
        (0.0, 0.0, 8, 0.2, 1.0),  # zero gradient: the rate does nothing
    ],
)
def test_snr_lr_factor(grad_sq, trace, n, floor, expected):
    assert snr_lr_factor(grad_sq, trace, n, floor) == pytest.approx(expected)


def test_controller_warm_up_floor_and_skips():
    controller = SNRLearningRateController(ema_decay=0.5, warmup_steps=2, floor=0.25)
    assert controller.factor(16) == 1.0 and math.isnan(controller.snr)
    assert controller.update(NoiseEstimate(0.01, 10.0))
    assert controller.factor(16) == 1.0  # one estimate, warm-up is 2
    assert not controller.update(NoiseEstimate(float("nan"), 1.0))
    assert not controller.update(NoiseEstimate(1.0, float("inf")))
    assert controller.skipped == 2 and controller.factor(16) == 1.0
    controller.update(NoiseEstimate(0.01, 10.0))
    assert controller.factor(16) == 0.25  # 16·0.001/(1 + 0.016) < floor
    assert controller.snr == pytest.approx(0.001)
    controller.update(NoiseEstimate(100.0, 1.0))
    assert 0.25 < controller.factor(16) <= 1.0

    restored = SNRLearningRateController(ema_decay=0.5, warmup_steps=2, floor=0.25)
    restored.load_state_dict(controller.state_dict())
    assert restored.factor(16) == controller.factor(16) and restored.skipped == 2


@pytest.mark.parametrize(("kwargs", "match"), [({"warmup_steps": -1}, "warmup"), ({"floor": 0.0}, "floor")])
def test_controller_rejects_bad_guards(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SNRLearningRateController(**{"ema_decay": 0.9, "warmup_steps": 0, "floor": 0.1, **kwargs})


def test_two_batch_agrees_with_per_sample_on_a_tiny_model(tiny_policy_pools):
    """On exact per-sample REINFORCE gradients of a tiny transformer, both estimators of ‖μ‖² and tr Σ agree with
    each other and with the population values, averaged over 60 steps, within 3 standard errors of the average.

    Each step draws N = 32 completions; the two-batch estimator sees only the norms of the 8 micro-batch means (b = 4)
    and of the step mean, the per-sample one the 32 per-sample norms.
    """
    _, pool = tiny_policy_pools
    rewards = pool.lengths
    per_sample_grads = (rewards - rewards.mean()).unsqueeze(1) * pool.gradients  # (r − b)·∇ log π
    true_mean = per_sample_grads.mean(0)
    true_grad_sq = true_mean.pow(2).sum().item()
    true_trace = (per_sample_grads - true_mean).pow(2).sum(1).mean().item()

    steps, n, b = 60, 32, 4
    gen = torch.Generator().manual_seed(3)
    two_batch, per_sample = [], []
    for _ in range(steps):
        x = per_sample_grads[torch.randint(0, len(rewards), (n,), generator=gen)]
        full_sq = x.mean(0).pow(2).sum().item()
        small_sq = x.view(n // b, b, -1).mean(1).pow(2).sum(1).mean().item()
        two_batch.append(two_batch_noise_estimate(small_sq, b, full_sq, n))
        per_sample.append(per_sample_noise_estimate(x.pow(2).sum().item(), full_sq, n))

    def mean_and_se(values):
        values = torch.tensor(values, dtype=torch.float64)
        return values.mean().item(), values.std().item() / math.sqrt(len(values))

    for field, truth in (("grad_sq_norm", true_grad_sq), ("trace_cov", true_trace)):
        tb_mean, tb_se = mean_and_se([getattr(e, field) for e in two_batch])
        ps_mean, ps_se = mean_and_se([getattr(e, field) for e in per_sample])
        diff_mean, diff_se = mean_and_se([getattr(t, field) - getattr(p, field) for t, p in zip(two_batch, per_sample)])
        print(f"\n{field}: population {truth:.4f}, two-batch {tb_mean:.4f}±{tb_se:.4f}, per-sample {ps_mean:.4f}±{ps_se:.4f}")
        assert abs(diff_mean) <= 3 * diff_se
        assert abs(tb_mean - truth) <= 3 * tb_se
        assert abs(ps_mean - truth) <= 3 * ps_se
