"""The rate rule of a step (`estimators.step_rate.StepRateRule`): the factor, the zero-gradient rule, the cadence of
the measurements and the checkpoint, without a model."""

from __future__ import annotations

import copy
import json
import math

import pytest

from oblr_trl.estimators.snr import NoiseEstimate, SNRLearningRateController
from oblr_trl.estimators.step_rate import StepRateRule
from oblr_trl.estimators.trust_region import TrustRegionRate

CURVATURE = 1e3  # KL = CURVATURE · lr² in these runs: a step of 1e-3 moves the policy by 1e-3


def run_steps(rule: StepRateRule, steps, scheduled=1e-3, peak=None) -> tuple[list[bool], list[float]]:
    """Drive ``rule`` as the trainer does, over ``steps`` of (rate multiplier, gradient norm): returns which steps
    were measured and the factor each ran with."""
    measured, factors = [], []
    for multiplier, grad_norm in steps:
        rule.begin_step(scheduled * multiplier, peak if peak is not None else scheduled)
        factor = rule.note_grad_norm(grad_norm)
        lr = scheduled * multiplier * factor
        due = rule.measurements_due(lr, grad_norm)
        kl = CURVATURE * lr**2 if due.kl else None
        rule.observe_step(lr, grad_norm, kl, 0.5 if due.update_size else None)
        measured.append(due.kl)
        factors.append(factor)
    return measured, factors


def test_the_factor_is_the_snr_factor_times_the_trust_region_factor_on_the_rate_it_leaves():
    """f of the next step comes from the noise of the steps before it; g is the trust region's factor on the rate
    scheduled × f (cap form: min(1, η_δ / (scheduled × f)))."""
    snr = SNRLearningRateController(0.0, 0, 0.1, reference="absolute")
    rule = StepRateRule(snr, TrustRegionRate(1e-3, "cap", ema_decay=0.0))
    assert rule.begin_step(1e-3, 1e-3) == pytest.approx(0.01)  # the probe; f = 1 before any estimate
    rule.observe_noise(NoiseEstimate(grad_sq_norm=1.0, trace_cov=1.0), units=1)  # f = 1/(1 + 1) for the next step
    assert rule.snr_part == 1.0  # the current step keeps the factor it began with
    rule.observe_step(1e-5, 1.0, kl=1e-3 * 0.25, update_mean_square=None)  # c = 2.5e6: η_δ = 2e-5
    factor = rule.begin_step(1e-3, 1e-3)
    assert rule.snr_part == pytest.approx(0.5)
    assert rule.trust_part == pytest.approx(2e-5 / (1e-3 * 0.5))
    assert factor == pytest.approx(rule.snr_part * rule.trust_part)
    assert StepRateRule().begin_step(1e-3, 1e-3) == 1.0 and not StepRateRule().scales_rate


def test_a_step_without_a_gradient_is_never_raised_and_never_folded_in():
    """Target form with a δ far above what a step moves: a step with a gradient is raised to the bound, one without
    runs at the scheduled rate (lowering would stay), and its KL does not change the curvature."""
    rule = StepRateRule(None, TrustRegionRate(10.0, "target", ema_decay=0.0, max_ratio=3.0))
    measured, factors = run_steps(rule, [(1.0, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])
    assert measured == [True] * 4 and factors == [0.01, 3.0, 1.0, 3.0]
    assert rule.trust_region.curvature.count == 3  # steps 1, 2 and 4
    low = StepRateRule(None, TrustRegionRate(1e-9, "target", ema_decay=0.0))
    assert run_steps(low, [(1.0, 1.0), (1.0, 0.0)])[1] == [0.01, 0.01]  # lowered with or without a gradient


def test_measuring_every_k_th_step_measures_the_first_and_every_k_th_step_with_a_gradient():
    """k = 3: the first step and every third step with a gradient after the last one measured; a step with a zero
    gradient is neither measured nor counted; the cadence is checkpointed."""
    rule = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=3)
    assert run_steps(rule, [(1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])[0] == [
        True, False, False, True, False, False]
    assert rule.trust_region.curvature.count == 2
    resumed = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=3)
    resumed.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert run_steps(resumed, [(1.0, 1.0)] * 3)[0] == [False, True, False]  # step 5 was counted before the save
    every = StepRateRule(None, TrustRegionRate(1e-3))
    assert run_steps(every, [(1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])[0] == [True, True, True]  # k = 1: zero gradients too
    logging_only = StepRateRule(log_kl=True, measure_every=16)  # no trust region: every step, for the log
    assert logging_only.measures_kl and run_steps(logging_only, [(1.0, 1.0)] * 3)[0] == [True] * 3
    assert not StepRateRule().measures_kl
    with pytest.raises(ValueError, match="measure_every"):
        StepRateRule(None, TrustRegionRate(1e-3), measure_every=0)


def test_measuring_every_k_th_step_measures_every_step_until_one_has_moved_the_policy():
    """A warm-up that starts at rate 0 moves nothing on its first step, so that measurement gives no curvature: the
    next steps with a gradient are measured until one has (the probe's factor would otherwise stay for k steps), and
    the cadence of every k-th step starts from there."""
    rule = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=4)
    measured, factors = run_steps(rule, [(0.0, 1.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0),
                                         (1.0, 1.0), (1.0, 1.0)])
    # rate 0 twice (measured, no curvature), a zero gradient (never measured), the first move, then every 4th
    assert measured == [True, True, False, True, False, False, False, True]
    assert factors[2:4] == [0.01] * 2 and factors[4] != 0.01  # at rate 0 the factor is 1: nothing to scale
    assert rule.trust_region.curvature.count == 2


@pytest.mark.parametrize("short_early_gaps", [True, False])
def test_with_short_early_gaps_the_gaps_between_measurements_double_up_to_every_k_th_step(short_early_gaps):
    """With short early gaps (the per-update curvature) the gaps between measured steps with a gradient are 1, 2,
    4, … after the first reading and then k: the curvature falls fastest early in a run, so the readings come often
    while it does. Without, every k-th (the peak form's provisional probe measures the step after it either way)."""
    cases = (((16, [0, 1, 3, 7, 15, 31, 47]), (4, [0, 1, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]))
             if short_early_gaps else ((16, [0, 1, 17, 33]), (4, [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45])))
    for k, expected in (*cases, (1, list(range(48)))):
        rule = StepRateRule(None, TrustRegionRate(1e-3, "peak"), measure_every=k, short_early_gaps=short_early_gaps)
        measured = run_steps(rule, [(1.0, 1.0)] * 48)[0]
        assert [step for step, due in enumerate(measured) if due] == expected, k


def test_adams_update_size_is_asked_for_per_update_or_beside_a_measurement():
    per_update = StepRateRule(None, TrustRegionRate(1e-3, "peak", per_update=True), measure_every=16)
    per_rate = StepRateRule(None, TrustRegionRate(1e-3, "peak"), measure_every=16)
    for rule in (per_update, per_rate):
        run_steps(rule, [(1.0, 1.0)] * 3)  # the probe and the step after it measured, then not
    assert per_update.measurements_due(1e-3, 1.0).update_size
    assert not per_rate.measurements_due(1e-3, 1.0).update_size
    assert per_update.trust_region.update_mean_square == 0.5  # what `observe_step` handed over


def test_what_a_step_aimed_at_is_known_after_the_probe_only():
    rule = StepRateRule(None, TrustRegionRate(1e-3, "peak", ema_decay=0.0))
    rule.begin_step(1e-3, 1e-3)
    assert rule.measurements_due(1e-5, 1.0).aimed_kl is None  # the probe aims at nothing
    rule.observe_step(1e-5, 1.0, kl=CURVATURE * 1e-10)
    assert rule.measurements_due(1e-3, 1.0).aimed_kl == pytest.approx(CURVATURE * 1e-6)
    assert math.isnan(StepRateRule(None, TrustRegionRate(1e-3)).trust_region_rate)
    assert StepRateRule().trust_region_rate is None


def test_the_rule_resumes_where_it_was_and_the_calibration_opens_when_told():
    def make():
        snr = SNRLearningRateController(0.5, 0, 0.1, reference="calibrated", calibration_start=0, calibration_steps=2)
        return StepRateRule(snr, TrustRegionRate(1e-3, "peak", per_update=True), measure_every=16,
                            short_early_gaps=True)

    rule = make()
    rule.open_calibration_after(7)
    assert rule.snr.calibration.start == 7
    for step in range(5):
        rule.observe_noise(NoiseEstimate(1.0 + step, 2.0), units=2)
        run_steps(rule, [(1.0, 1.0)])
    resumed = make()
    resumed.open_calibration_after(7)  # the trainer opens it anew when training (re)starts
    resumed.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert resumed.state_dict() == rule.state_dict()
    straight, again = copy.deepcopy(rule), resumed
    steps = [(0.5, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)]
    assert run_steps(straight, steps, peak=1e-3) == run_steps(again, steps, peak=1e-3)
