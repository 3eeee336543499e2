"""Acceptance 5: the SNR estimators, the smoothing, the factor and its guards."""

import math

import pytest
import torch

from oblr_trl.estimators.snr import (
    BiasCorrectedEMA,
    NoiseEstimate,
    SNRLearningRateController,
    cross_step_noise_estimate,
    per_sample_noise_estimate,
    snr_lr_factor,
    two_batch_noise_estimate,
)


def test_two_batch_estimator_inverts_the_expected_norms():
    grad_sq, trace, b, n = 0.3, 12.0, 4, 64
    small_sq, full_sq = grad_sq + trace / b, grad_sq + trace / n
    estimate = two_batch_noise_estimate(small_sq, b, full_sq, n)
    # differences of N|G_N|² and b|G_b|²: float64 round-off in the scale of those terms, not of the result
    assert estimate.grad_sq_norm == pytest.approx(grad_sq, abs=1e-12 * (n * full_sq + b * small_sq))
    assert estimate.trace_cov == pytest.approx(trace, abs=1e-12 * b * (small_sq + full_sq))
    with pytest.raises(ValueError, match="0 < b < N"):
        two_batch_noise_estimate(1.0, 8, 1.0, 8)


def test_per_sample_estimator_equals_the_sample_covariance():
    samples = torch.randn(10, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    mean = samples.mean(0)
    estimate = per_sample_noise_estimate(samples.pow(2).sum().item(), mean.pow(2).sum().item(), 10)
    trace = torch.trace(torch.cov(samples.T)).item()
    terms = samples.pow(2).sum().item()  # Σ‖g_i‖², the larger of the two terms both estimates are differences of
    assert estimate.trace_cov == pytest.approx(trace, abs=1e-12 * terms)
    assert estimate.grad_sq_norm == pytest.approx(mean.pow(2).sum().item() - trace / 10, abs=1e-12 * terms)
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


def test_cross_step_estimator_inverts_the_expected_values_and_gives_the_ratio_factor():
    grad_sq, trace, n = 0.2, 6.0, 4
    step_sq = grad_sq + trace / n  # E‖G_t‖²; E⟨G_t, G_s⟩ = ‖μ‖²
    estimate = cross_step_noise_estimate(step_sq, grad_sq, n)
    assert estimate.grad_sq_norm == grad_sq  # ⟨G_t, G_s⟩ itself
    assert estimate.trace_cov == pytest.approx(trace, abs=1e-12 * n * step_sq)  # n(‖G_t‖² − ⟨G_t, G_s⟩)
    # f = N·SNR/(1 + N·SNR) with N = n groups is ⟨G_t, G_s⟩ / ‖G_t‖², whatever n is
    assert snr_lr_factor(estimate.grad_sq_norm, estimate.trace_cov, n) == pytest.approx(grad_sq / step_sq)
    with pytest.raises(ValueError, match="n > 0"):
        cross_step_noise_estimate(1.0, 0.5, 0)


def _bandit_completion_gradients(features, teacher, group_size, generator):
    """Per-completion REINFORCE terms A_i ∇ log π(a_i|x) / G (RLOO advantages) of a linear-softmax contextual bandit,
    exact, float64, shaped (prompts, G, parameters): a group's gradient is their sum."""
    logits = features @ teacher.T  # (n, V): the policy's parameters are `teacher`-shaped, evaluated at `teacher`
    probs = torch.softmax(logits, -1)
    actions = torch.multinomial(probs, group_size, replacement=True, generator=generator)  # (n, G)
    rewards = (actions == logits.argmax(-1, keepdim=True)).double() + 0.3 * (actions == 1).double()
    loo = (rewards.sum(-1, keepdim=True) - rewards) / (group_size - 1)
    advantages = rewards - loo
    score = torch.nn.functional.one_hot(actions, probs.size(-1)).double() - probs.unsqueeze(1)  # ∂ log π/∂ logits
    # ∇_W: (e_a − p) xᵀ
    terms = torch.einsum("ng,ngv,nd->ngvd", advantages, score, features) / group_size
    return terms.reshape(features.size(0), group_size, -1)


def test_cross_step_estimator_counts_prompt_level_noise_where_completion_level_estimators_do_not():
    """Several prompts per step, groups of correlated completions: the cross-step estimator matches the population
    ‖μ‖² and tr Σ (per group) within sampling error, while the micro-batch (two-batch) estimator over completions
    overstates ‖μ‖² (issue 13: between-prompt variance is noise, not signal)."""
    generator = torch.Generator().manual_seed(0)
    dim, vocab, group_size, prompts = 4, 5, 4, 4
    teacher = torch.randn(vocab, dim, generator=generator, dtype=torch.float64)

    def draw_completions(n):
        return _bandit_completion_gradients(torch.randn(n, dim, generator=generator, dtype=torch.float64), teacher,
                                            group_size, generator)

    population = draw_completions(400_000).sum(1)
    true_mu_sq = population.mean(0).pow(2).sum().item()
    true_trace = population.var(0).sum().item()

    steps = 20_000
    completions = draw_completions(steps * prompts).view(steps, prompts, group_size, -1)
    step_grads = completions.sum(2).mean(1)
    step_sq = step_grads.pow(2).sum(-1)
    dots = (step_grads[1:] * step_grads[:-1]).sum(-1)
    cross = [cross_step_noise_estimate(s, d, prompts) for s, d in zip(step_sq[1:].tolist(), dots.tolist(), strict=True)]
    mu_sq = sum(e.grad_sq_norm for e in cross) / len(cross)
    trace = sum(e.trace_cov for e in cross) / len(cross)
    stderr = torch.tensor([e.grad_sq_norm for e in cross]).std().item() / len(cross) ** 0.5
    assert abs(mu_sq - true_mu_sq) < 4 * stderr
    assert trace == pytest.approx(true_trace, rel=0.05)

    # two micro-batches, each with half of every group's completions (TRL shuffles a generation batch before it splits
    # it), completions taken as the samples: ‖μ‖² comes out too large
    halves = torch.stack([completions[:, :, : group_size // 2], completions[:, :, group_size // 2 :]], 1)
    small_sq = (2 * halves.sum(3).mean(2)).pow(2).sum(-1).mean(-1)
    samples = prompts * group_size
    two_batch = [
        two_batch_noise_estimate(s, samples / 2, f, samples)
        for s, f in zip(small_sq.tolist(), step_sq.tolist(), strict=True)
    ]
    two_batch_mu_sq = sum(e.grad_sq_norm for e in two_batch) / len(two_batch)
    assert two_batch_mu_sq > true_mu_sq + 10 * stderr


def test_calibration_resolves_only_a_clear_signal_and_keeps_the_factor_at_one_until_then():
    controller = SNRLearningRateController(0.5, 0, 0.1, reference="calibrated", calibration_start=2,
                                           calibration_steps=4)
    noise_only = [1.0, -1.0, 1.2, -0.9, 0.8, -1.1, 0.9, -1.0]
    for value in noise_only:
        controller.update(NoiseEstimate(value, 10.0))
        assert controller.factor(8) == 1.0 and not controller.resolved
    assert math.isnan(controller.calibration.reference(8))

    steady = SNRLearningRateController(0.5, 0, 0.1, reference="calibrated", calibration_start=2, calibration_steps=4)
    for value in [5.0, 5.0, 1.0, 1.1, 0.9, 1.0]:  # the first two are before the window opens
        assert steady.factor(8) == 1.0
        steady.update(NoiseEstimate(value, 10.0))
    assert steady.resolved
    assert steady.calibration.reference(8) == pytest.approx(snr_lr_factor(1.0, 10.0, 8))


@pytest.mark.parametrize(("signal", "expected"), [(1.0, None), (4.0, "larger"), (0.6, "smaller"), (-1.0, 0.5),
                                                  (100.0, 2.0)])
def test_calibrated_factor_follows_the_snr_relative_to_the_reference_within_its_clamps(signal, expected):
    controller = SNRLearningRateController(0.0, 0, 0.1, reference="calibrated", calibration_start=0,
                                           calibration_steps=3, min_ratio=0.5, max_ratio=2.0)
    for value in [0.9, 1.0, 1.1]:
        controller.update(NoiseEstimate(value, 10.0))
    at_reference = controller.factor(8)
    assert at_reference == pytest.approx(snr_lr_factor(1.1, 10.0, 8) / snr_lr_factor(1.0, 10.0, 8))
    controller.update(NoiseEstimate(signal, 10.0))  # β = 0: the factor follows the latest estimate
    factor = controller.factor(8)
    if expected == "larger":
        assert 1.0 < factor < 2.0
    elif expected == "smaller":
        assert 0.5 < factor < 1.0
    elif expected is not None:
        assert factor == expected


def test_calibration_state_round_trips():
    controller = SNRLearningRateController(0.9, 0, 0.1, reference="calibrated", calibration_start=1, calibration_steps=2)
    for value in [1.0, 2.0, 2.1, 1.9]:
        controller.update(NoiseEstimate(value, 3.0))
    restored = SNRLearningRateController(0.9, 0, 0.1, reference="calibrated", calibration_start=1, calibration_steps=2)
    restored.load_state_dict(controller.state_dict())
    assert restored.resolved == controller.resolved and restored.factor(4) == controller.factor(4)
    assert restored.calibration.state_dict() == controller.calibration.state_dict()


def test_two_sided_rule_contracts_when_the_snr_falls_and_never_exceeds_one_before_the_reference_resolves():
    """The two-sided rule (`snr_lr_min_ratio` < 1) is 1 — never above — while the window fills, however clear the
    signal gets meanwhile; once resolved it follows the SNR down, to its floor."""
    controller = SNRLearningRateController(0.0, 0, 0.1, reference="calibrated", calibration_start=3,
                                           calibration_steps=5, min_ratio=0.5, max_ratio=2.0)
    rising = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]  # the bound factor grows at every step before resolution
    for value in rising:
        assert controller.factor(8) == 1.0
        controller.update(NoiseEstimate(value, 10.0))
        if not controller.resolved:
            assert controller.factor(8) == 1.0 and controller.bound_factor(8) >= snr_lr_factor(0.5, 10.0, 8)
    for _ in range(2):
        controller.update(NoiseEstimate(8.0, 10.0))
    assert controller.resolved
    reference = controller.calibration.reference(8)
    falling = []
    for value in [8.0, 2.0, 0.5, 0.1]:  # β = 0: the factor follows the latest estimate
        controller.update(NoiseEstimate(value, 10.0))
        falling.append(controller.factor(8))
    assert falling == sorted(falling, reverse=True) and falling[-1] == 0.5  # contracts, down to the floor
    assert falling[1] == pytest.approx(snr_lr_factor(2.0, 10.0, 8) / reference)


def test_gradient_noise_scale_matches_the_closed_form_on_a_tiny_model(tiny_policy_pools):
    """B_noise = tr Σ/‖μ‖² of exact per-sample REINFORCE gradients of a tiny transformer (the pool's population
    values): the per-sample estimates of 400 steps of 32 completions give it within 3 standard errors (delta method on
    the ratio of the two means); in completions it scales with the completions a sample stands for."""
    from oblr_trl.estimators.snr import gradient_noise_scale

    _, pool = tiny_policy_pools
    rewards = pool.lengths
    per_sample_grads = (rewards - rewards.mean()).unsqueeze(1) * pool.gradients
    true_mean = per_sample_grads.mean(0)
    closed_form = (per_sample_grads - true_mean).pow(2).sum(1).mean().item() / true_mean.pow(2).sum().item()
    gen, n = torch.Generator().manual_seed(5), 32
    traces, signals = [], []
    for _ in range(400):
        x = per_sample_grads[torch.randint(0, len(rewards), (n,), generator=gen)]
        estimate = per_sample_noise_estimate(x.pow(2).sum().item(), x.mean(0).pow(2).sum().item(), n)
        traces.append(estimate.trace_cov)
        signals.append(estimate.grad_sq_norm)
    traces, signals = torch.tensor(traces, dtype=torch.float64), torch.tensor(signals, dtype=torch.float64)
    measured = gradient_noise_scale(traces.mean().item(), signals.mean().item())
    relative_se = math.hypot(traces.std().item() / traces.mean().item(), signals.std().item() / signals.mean().item())
    relative_se /= math.sqrt(len(traces))
    assert abs(measured / closed_form - 1) <= 3 * relative_se
    assert gradient_noise_scale(traces.mean().item(), signals.mean().item(), 8) == pytest.approx(8 * measured)
    assert math.isnan(gradient_noise_scale(1.0, 0.0)) and math.isnan(gradient_noise_scale(1.0, -0.1))
    assert gradient_noise_scale(-1.0, 2.0) == 0.0  # no measured noise


def test_the_logged_noise_scale_is_the_smoothed_estimates_ratio_in_completions(make_trainer):
    """`oblr/noise_scale` = tr Σ/‖μ‖² of the smoothed estimates, times the completions one sample stands for (the
    cross-step estimator's sample is a prompt's group of 4 here), logged beside the completions a step used; NaN while
    the smoothed ‖μ‖² is not positive."""
    completions_per_sample = 4

    def length_reward(completions, **kwargs):  # a clear signal: EOS's logit moves every completion's length
        return [len(c) / 10 for c in completions]

    trainer = make_trainer(max_steps=6, reward_funcs=length_reward)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert all(log["oblr/completions_per_step"] == 8 for log in logs)
    compared = 0
    for log in logs:
        signal, noise = log.get("snr/grad_sq_norm_ema"), log.get("snr/trace_cov_ema")
        if isinstance(signal, float) and isinstance(noise, float) and signal > 0 and noise >= 0:
            assert log["oblr/noise_scale"] == pytest.approx(noise / signal * completions_per_sample, rel=1e-5)
            compared += 1
        else:
            assert log.get("oblr/noise_scale") is None or math.isnan(log["oblr/noise_scale"])
    assert compared > 0


def test_the_calibration_window_opens_when_told_but_not_before_the_factors_warm_up():
    """The trainer opens the window after the learning-rate warm-up once training starts; what it holds stays (a
    resumed run opens it anew), and it never opens before the factor's own warm-up."""
    def make():
        return SNRLearningRateController(0.0, 3, 0.1, reference="calibrated", calibration_start=0,
                                         calibration_steps=2)

    late = make()
    late.open_calibration_after(5)
    for value in [5.0, 5.0, 5.0, 5.0, 5.0, 1.0, 1.0]:  # the first five are before the window opens
        late.update(NoiseEstimate(value, 10.0))
    assert late.resolved and late.calibration.reference(8) == pytest.approx(snr_lr_factor(1.0, 10.0, 8))
    early = make()
    early.open_calibration_after(1)  # not before the factor's warm-up of 3
    for value in [5.0, 5.0, 5.0, 1.0, 1.0]:
        early.update(NoiseEstimate(value, 10.0))
    assert early.calibration.reference(8) == pytest.approx(snr_lr_factor(1.0, 10.0, 8))
    resumed = make()
    resumed.load_state_dict(late.state_dict())
    resumed.open_calibration_after(5)
    assert resumed.calibration.state_dict() == late.calibration.state_dict()
    with pytest.raises(ValueError, match="calibration window"):
        make().calibration.open_after(-1)
