"""The rate rule of a step (`estimators.step_rate`): the factor, the zero-gradient rule, the cadence of the
measurements, the record of a step, the checkpoint and the rule built from the options, without a model."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest

from oblr_trl.estimators.snr import NoiseEstimate, SNRLearningRateController
from oblr_trl.estimators.step_rate import (
    RATE_RULE_OPTIONS,
    RateRuleTuning,
    StepRateRule,
    StepRecord,
    step_rate_rule,
)
from oblr_trl.estimators.trust_region import TrustRegionRate

CURVATURE = 1e3  # KL = CURVATURE · lr² in these runs: a step of 1e-3 moves the policy by 1e-3


def run_steps(rule: StepRateRule, steps, scheduled=1e-3, peak=None, varied=False) -> tuple[list[bool], list[float]]:
    """Drive ``rule`` as the trainer does, over ``steps`` of (rate multiplier, gradient norm), each moving the policy
    by CURVATURE · lr² with Adam's update of mean square 0.5; ``varied``: the i-th step also hands over the noise
    estimate (1 + i, 2) over 2 samples, moves the policy by (1 + 0.1 i) · CURVATURE · lr² and updates by 0.9^i.
    Returns which steps were measured and the factor each ran with. Every step is measured exactly where the rule
    said before it began (`kl_planned`) that it would be, save a step whose gradient turned out zero (k > 1)."""
    measured, factors = [], []
    for i, (multiplier, grad_norm) in enumerate(steps):
        rule.begin_step(scheduled * multiplier, peak if peak is not None else scheduled)
        planned = rule.kl_planned
        factor = rule.note_grad_norm(grad_norm)
        if varied:
            rule.observe_noise(NoiseEstimate(1.0 + i, 2.0), units=2)
        lr = scheduled * multiplier * factor
        kl = CURVATURE * lr**2 * (1 + 0.1 * i if varied else 1.0)
        record = rule.end_step(lr, step_kl=lambda measure, kl=kl: kl if measure else None,
                               update_mean_square=lambda i=i: 0.9**i if varied else 0.5)
        measured.append(record.kl is not None)
        assert measured[-1] == (planned and not (grad_norm == 0.0 and rule.measure_every > 1)), i
        factors.append(factor)
    return measured, factors


def test_the_factor_is_the_snr_factor_times_the_trust_region_factor_and_the_record_says_which_ran():
    """f of the next step comes from the noise of the steps before it; g is the trust region's factor on the rate
    scheduled × f and the schedule's peak: clip(η_δ / peak). The record of a step gives the f and g it ran with."""
    snr = SNRLearningRateController(0.0, 0, 0.1, reference="absolute")
    rule = StepRateRule(snr, TrustRegionRate(1e-3, ema_decay=0.0))
    assert rule.begin_step(1e-3, 1e-3) == pytest.approx(0.01)  # the probe; f = 1 before any estimate
    reading = rule.observe_noise(NoiseEstimate(grad_sq_norm=1.0, trace_cov=1.0), units=1)  # f = 1/(1 + 1) next
    assert reading.bound_factor == pytest.approx(0.5) and reading.resolved
    # KL/(lr²·ū²) = 2.5e6: η_δ = 2e-5
    record = rule.end_step(1e-5, step_kl=lambda measure: 1e-3 * 0.25, update_mean_square=lambda: 1.0)
    assert (record.snr_factor, record.trust_region_factor, record.lr) == (1.0, 0.01, 1e-5)  # f of the step it began
    assert record.aimed_kl is None and record.kl == 1e-3 * 0.25 and record.update_rms == 1.0  # the probe aims at none
    assert record.trust_region_rate == pytest.approx(2e-5)
    factor = rule.begin_step(5e-4, 1e-3)  # half the peak: the schedule shapes the rate around the measured peak
    assert factor == pytest.approx(0.5 * 2e-5 / 1e-3)
    record = rule.end_step(5e-4 * factor, step_kl=lambda measure: None, update_mean_square=lambda: 1.0)
    assert record.snr_factor == pytest.approx(0.5) and record.trust_region_factor == pytest.approx(0.02)
    assert record.aimed_kl == pytest.approx(1e-3 * (5e-6 / 2e-5) ** 2)  # δ·(η/η̂_max)²
    plain = StepRateRule()
    assert plain.begin_step(1e-3, 1e-3) == 1.0 and not plain.scales_rate and not plain.measures_kl
    assert plain.observe_noise(NoiseEstimate(1.0, 1.0), units=1) is None
    assert plain.end_step(1e-3) == StepRecord(lr=1e-3, snr_factor=None, trust_region_factor=None)


def test_a_step_without_a_gradient_is_never_raised_and_never_folded_in():
    """δ far above what a step moves: a step with a gradient is raised to the bound, one without runs at the scheduled
    rate (lowering would stay), and its KL does not change the curvature (the probe's reading is replaced by the
    next one, so steps 2 and 4 make the average)."""
    rule = StepRateRule(None, TrustRegionRate(10.0, ema_decay=0.0, max_ratio=3.0))
    measured, factors = run_steps(rule, [(1.0, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])
    assert measured == [True] * 4 and factors == [0.01, 3.0, 1.0, 3.0]
    assert rule.trust_region.curvature.count == 2
    low = StepRateRule(None, TrustRegionRate(1e-9, ema_decay=0.0))
    assert run_steps(low, [(1.0, 1.0), (1.0, 0.0)])[1] == [0.01, 0.01]  # lowered with or without a gradient


def test_a_gradient_norm_known_only_after_the_step_leaves_its_factor_and_still_keeps_it_out_of_the_curvature():
    """Under DeepSpeed the norm comes after the optimizer stepped: the factor the step ran with stands (and is what
    the record says), and a zero gradient is still neither measured (k > 1) nor folded in."""
    rule = StepRateRule(None, TrustRegionRate(10.0, ema_decay=0.0, max_ratio=3.0), measure_every=4)
    run_steps(rule, [(1.0, 1.0)] * 2)  # the probe and the step after it: g = 3 from now on
    assert rule.begin_step(1e-3, 1e-3) == 3.0
    assert rule.note_grad_norm(0.0, stepped=True) == 3.0
    calls = []
    record = rule.end_step(3e-3, step_kl=lambda measure: calls.append(measure), update_mean_square=lambda: 0.5)
    assert record.trust_region_factor == 3.0 and calls == [False] and rule.unmeasured_steps == 0
    assert rule.trust_region.curvature.count == 1


def test_measuring_every_k_th_step_measures_the_first_and_every_k_th_step_with_a_gradient():
    """k = 3: the probe, the step after it (the probe's reading is provisional), then every third step with a gradient
    after the last one measured; a step with a zero gradient is neither measured nor counted; the cadence is
    checkpointed."""
    rule = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=3)
    assert run_steps(rule, [(1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])[0] == [
        True, True, False, False, False, True]
    assert rule.trust_region.curvature.count == 2  # the probe's reading replaced by step 2's, then step 6's
    saved = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=3)
    assert run_steps(saved, [(1.0, 1.0)] * 4 + [(1.0, 0.0)])[0] == [True, True, False, False, False]
    resumed = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=3)
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    assert run_steps(resumed, [(1.0, 1.0)] * 3)[0] == [True, False, False]  # two steps counted before the save
    every = StepRateRule(None, TrustRegionRate(1e-3))
    assert run_steps(every, [(1.0, 1.0), (1.0, 0.0), (1.0, 1.0)])[0] == [True, True, True]  # k = 1: zero gradients too
    logging_only = StepRateRule(log_kl=True, measure_every=16)  # no trust region: every step, for the log
    assert logging_only.measures_kl and run_steps(logging_only, [(1.0, 1.0)] * 3)[0] == [True] * 3
    assert not StepRateRule().measures_kl
    with pytest.raises(ValueError, match="measure_every"):
        StepRateRule(None, TrustRegionRate(1e-3), measure_every=0)


def test_measuring_every_k_th_step_measures_every_step_until_one_has_moved_the_policy():
    """A warm-up that starts at rate 0 moves nothing on its first step, so that measurement gives no curvature: the
    next steps with a gradient are measured until one has (the probe's factor would otherwise stay for k steps), the
    step after it too (its reading replaces the probe's), and the cadence of every k-th step starts from there."""
    rule = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.5), measure_every=4)
    measured, factors = run_steps(rule, [(0.0, 1.0), (0.0, 1.0), (1.0, 0.0), *[(1.0, 1.0)] * 6])
    # rate 0 twice (measured, no curvature), a zero gradient (never measured), the first move and the step after it,
    # then every 4th
    assert measured == [True, True, False, True, True, False, False, False, True]
    assert factors[2:4] == [0.01] * 2 and factors[4] != 0.01  # at rate 0 the factor is 1: nothing to scale
    assert rule.trust_region.curvature.count == 2


@pytest.mark.parametrize("short_early_gaps", [True, False])
def test_with_short_early_gaps_the_gaps_between_measurements_double_up_to_every_k_th_step(short_early_gaps):
    """With short early gaps the gaps between measured steps with a gradient are 1, 2, 4, … after the first reading
    and then k: the curvature falls fastest early in a run, so the readings come often while it does. Without, every
    k-th (the probe's provisional reading measures the step after it either way)."""
    cases = (((16, [0, 1, 3, 7, 15, 31, 47]), (4, [0, 1, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]))
             if short_early_gaps else ((16, [0, 1, 17, 33]), (4, [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45])))
    for k, expected in (*cases, (1, list(range(48)))):
        rule = StepRateRule(None, TrustRegionRate(1e-3), measure_every=k, short_early_gaps=short_early_gaps)
        measured = run_steps(rule, [(1.0, 1.0)] * 48)[0]
        assert [step for step, due in enumerate(measured) if due] == expected, k


def test_adams_update_size_is_read_after_every_step_with_a_trust_region_and_beside_every_kl_measured():
    """The curvature is per unit of Adam's update: with a trust region its size is read after every step (a step
    without a gradient is not noted), and before the KL; without one, only beside a measured KL."""
    rule = StepRateRule(None, TrustRegionRate(1e-3), measure_every=16)
    calls, records = [], []
    for grad_norm, mean_square in ((1.0, 0.9), (1.0, 0.7), (1.0, 0.5), (0.0, 0.1)):
        rule.begin_step(1e-3, 1e-3)
        rule.note_grad_norm(grad_norm)
        records.append(rule.end_step(
            1e-5, step_kl=lambda measure: calls.append("kl") or (1e-6 if measure else None),
            update_mean_square=lambda mean_square=mean_square: calls.append("update") or mean_square))
    assert calls == ["update", "kl"] * 4  # the probe and the step after it measured, then not: read every step
    assert [r.kl is not None for r in records] == [True, True, False, False]
    assert [r.update_rms for r in records] == pytest.approx([0.9**0.5, 0.7**0.5, 0.5**0.5, 0.1**0.5])
    assert rule.trust_region.update_mean_square == 0.5  # the last gradient step's, not the zero gradient's
    calls.clear()
    logging_only = StepRateRule(log_kl=True)
    logging_only.begin_step(1e-3, 1e-3)
    logging_only.end_step(1e-3, step_kl=lambda measure: calls.append("kl") or 1e-6,
                          update_mean_square=lambda: calls.append("update") or 0.5)
    StepRateRule(SNRLearningRateController(0.9, 0, 0.1)).end_step(1e-3)  # measures nothing, needs nothing
    assert calls == ["update", "kl"]
    with pytest.raises(ValueError, match="step_kl"):
        StepRateRule(log_kl=True).end_step(1e-3)


def test_a_refused_step_is_measured_by_nobody_and_counts_for_nothing():
    """A step refused on every process moved nothing: `step_kl` is told so (what was kept for it goes), Adam's update
    is not read, and the step neither counts towards the cadence nor changes the curvature."""
    rule = StepRateRule(None, TrustRegionRate(1e-3), measure_every=4)
    run_steps(rule, [(1.0, 1.0)] * 3)
    state = rule.state_dict()
    calls = []
    rule.begin_step(1e-3, 1e-3)
    record = rule.end_step(None, step_kl=lambda measure: calls.append(measure),
                           update_mean_square=lambda: calls.append("update"))
    assert calls == [False] and rule.state_dict() == state
    assert record.lr is None and record.kl is None and record.update_rms is None and record.trust_region_rate is None
    assert record.trust_region_factor == rule.begin_step(1e-3, 1e-3)  # the factor it would have run with


def test_what_a_step_aimed_at_is_known_after_the_probe_only():
    rule = StepRateRule(None, TrustRegionRate(1e-3, ema_decay=0.0))
    rule.begin_step(1e-3, 1e-3)
    record = rule.end_step(1e-5, step_kl=lambda measure: CURVATURE * 1e-10, update_mean_square=lambda: 1.0)
    assert record.aimed_kl is None  # the probe aims at nothing
    rule.begin_step(1e-3, 1e-3)
    record = rule.end_step(1e-3, step_kl=lambda measure: None, update_mean_square=lambda: 1.0)
    assert record.aimed_kl == pytest.approx(CURVATURE * 1e-6)
    assert math.isnan(StepRateRule(None, TrustRegionRate(1e-3)).trust_region_rate)
    assert StepRateRule().trust_region_rate is None


def test_the_rule_resumes_where_it_was_and_the_calibration_opens_when_told():
    def make():
        snr = SNRLearningRateController(0.5, 0, 0.1, reference="calibrated", calibration_start=0, calibration_steps=2)
        return StepRateRule(snr, TrustRegionRate(1e-3), measure_every=16, short_early_gaps=True)

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


# A rule's state saved by the code before the rule was driven through `end_step` (the calibrated SNR factor and the
# peak form per unit of Adam's update, 16 steps a measurement with short early gaps), after the 6 steps of
# `test_a_checkpoint_of_the_previous_code_resumes_as_that_code_went_on`, and how that code went on from it.
PREVIOUS_STATE = {
    "next_snr_factor": 1.3932291666666667, "unmeasured_steps": 1, "readings": 3,
    "snr": {"grad_sq_norm": {"decay": 0.5, "average": 5.015625, "count": 6},
            "trace_cov": {"decay": 0.5, "average": 1.96875, "count": 6},
            "calibration": {"seen": 6, "count": 2, "signal_sum": 3.0, "signal_sq_sum": 5.0, "noise_sum": 4.0,
                            "resolved": True},
            "skipped": 0},
    "trust_region": {"curvature": {"decay": 0.5, "average": 1197.18792866941, "count": 2}, "provisional": False,
                     "update_mean_square": 0.6561},
}
PREVIOUS_FACTORS_BEFORE = [0.01, 1.0, 0.9931901971308252, 1.1865029763476806, 1.1829068823924556, 1.3130550233037614]
PREVIOUS_FACTORS_AFTER = [1.3614039485804503, 0.9919481807589099, 0.9947798548866, 1.0204382432393695,
                          1.1542084785348612, 1.2728844704281435]


def test_a_checkpoint_of_the_previous_code_resumes_as_that_code_went_on():
    """The state's keys are those the previous code saved: its checkpoint loads, and the rule goes on from it with the
    factors (to the last bit) and the measurements that code had; run from the start, the rule saves that state."""
    def make():
        snr = SNRLearningRateController(0.5, 0, 0.1, reference="calibrated", calibration_start=0, calibration_steps=2)
        return StepRateRule(snr, TrustRegionRate(1e-3), measure_every=16, short_early_gaps=True)

    straight = make()
    measured, factors = run_steps(straight, [(1.0, 1.0)] * 5 + [(1.0, 0.0)], varied=True)
    assert factors == PREVIOUS_FACTORS_BEFORE and measured == [True, True, False, True, False, False]
    assert json.loads(json.dumps(straight.state_dict())) == PREVIOUS_STATE
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(PREVIOUS_STATE))
    measured, factors = run_steps(resumed, [(0.5, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)],
                                  varied=True)
    assert factors == PREVIOUS_FACTORS_AFTER and measured == [False, False, False, True, False, False]


# The rule the options configure ---------------------------------------------------------------------------------


def options(**values):
    shipped = {"use_snr_lr": True, "snr_lr_reference": "calibrated", "lr_trust_region_kl": 0.005, "log_step_kl": False}
    return SimpleNamespace(**{**shipped, **values})


def test_the_rule_is_built_from_the_options_and_the_constants():
    assert set(RATE_RULE_OPTIONS) == {"use_snr_lr", "snr_lr_reference", "lr_trust_region_kl", "log_step_kl"}
    rule = step_rate_rule(options())
    assert rule.snr.reference == "calibrated" and rule.trust_region.target_kl == 0.005
    assert (rule.measure_every, rule.short_early_gaps, rule.measures_kl) == (16, True, True)
    assert rule.snr.calibration.start == 5 and rule.snr.calibration.steps == 20
    assert step_rate_rule(options(use_snr_lr=False)).snr is None
    assert step_rate_rule(options(snr_lr_reference="absolute")).snr.reference == "absolute"
    off = step_rate_rule(options(lr_trust_region_kl=None))
    assert off.trust_region is None and not off.measures_kl
    assert step_rate_rule(options(lr_trust_region_kl=None, log_step_kl=True)).measures_kl
    tuning = RateRuleTuning(lr_trust_region_measure_steps=4, lr_trust_region_short_early_gaps=False,
                            lr_trust_region_min_ratio=0.1, lr_trust_region_max_ratio=3.0, lr_trust_region_ema_decay=0.9,
                            snr_warmup_steps=2, snr_calibration_steps=6, snr_lr_min_ratio=0.5, snr_lr_max_ratio=4.0,
                            snr_ema_decay=0.8, snr_lr_floor=0.2)
    tuned = step_rate_rule(options(), tuning)
    assert (tuned.measure_every, tuned.short_early_gaps) == (4, False)
    trust, snr = tuned.trust_region, tuned.snr
    assert (trust.min_ratio, trust.max_ratio, trust.curvature.decay) == (0.1, 3.0, 0.9)
    assert (snr.warmup_steps, snr.calibration.start, snr.calibration.steps) == (2, 2, 6)
    assert (snr.min_ratio, snr.max_ratio, snr.grad_sq_norm.decay, snr.floor) == (0.5, 4.0, 0.8, 0.2)


@pytest.mark.parametrize(("field", "value"), [("snr_lr_reference", "relative"), ("lr_trust_region_kl", 0.0),
                                              ("lr_trust_region_kl", float("inf")), ("lr_trust_region_kl", True)])
def test_an_option_the_rule_cannot_take_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"`{field}`: {value!r}. Allowed values"):
        step_rate_rule(options(**{field: value}))


def test_the_constants_split_from_the_config_and_retired_forms_are_refused_by_name():
    tuning, rest = RateRuleTuning.split({"snr_warmup_steps": 0, "lr_trust_region_kl": None})
    assert tuning == RateRuleTuning(snr_warmup_steps=0) and rest == {"lr_trust_region_kl": None}
    assert RateRuleTuning().resolved_snr_calibration_steps == 20
    assert RateRuleTuning(snr_ema_decay=0.95).resolved_snr_calibration_steps == 40
    for retired in ("lr_trust_region_mode", "lr_trust_region_curvature"):
        assert retired not in RateRuleTuning.__dataclass_fields__
        with pytest.raises(TypeError, match=retired):
            RateRuleTuning(**{retired: "peak"})


def test_the_trainers_options_are_accepted_as_they_are():
    from oblr_trl.training.options import OBLRPOOptions

    defaults = OBLRPOOptions()
    assert {name: getattr(defaults, name) for name in RATE_RULE_OPTIONS} == vars(options())
    assert step_rate_rule(defaults).state_dict() == step_rate_rule(options()).state_dict()
