"""The trust region of the step (docs/rate_rule.md): the rule, the KL it measures, and the trainer."""

import copy
import dataclasses
import json
import math

import pytest
import torch
from transformers import TrainerCallback

from oblr_trl.estimators.trust_region import TrustRegionRate, adam_update_square_sum, sampled_token_kl

# ----------------------------------------------------------------------------------------------------------------
# The rule (pure)
# ----------------------------------------------------------------------------------------------------------------


def test_until_a_step_moves_the_policy_the_step_is_a_probe_at_the_floor():
    rule = TrustRegionRate(1e-3, ema_decay=0.0, min_ratio=0.02)
    assert rule.factor(1e-4, 1e-4) == 0.02
    rule.update(kl=0.0, lr=2e-6)  # a probe that did not move the policy (no gradient): still no curvature
    assert rule.factor(1e-4, 1e-4) == 0.02
    rule.update(kl=1e-3 / 100, lr=1e-5)  # δ/100 at 1e-5: δ is reached at 1e-4
    assert rule.factor(1e-4, 1e-4) == pytest.approx(1.0)


def test_a_step_above_the_target_kl_lowers_the_rate():
    rule = TrustRegionRate(1e-3, ema_decay=0.0)
    rule.update(kl=4e-3, lr=1e-4)  # 4δ at 1e-4: δ is reached at 1e-4 · sqrt(1/4)
    assert rule.rate == pytest.approx(5e-5)
    assert rule.factor(1e-4, 1e-4) == pytest.approx(0.5)


def test_a_rate_whose_steps_stay_below_the_target_is_raised_within_its_bound():
    rule = TrustRegionRate(1e-3, ema_decay=0.0, max_ratio=10.0)
    rule.update(kl=1e-3 / 16, lr=1e-4)
    assert rule.factor(1e-4, 1e-4) == pytest.approx(4.0)
    rule.update(kl=1e-3 / 10_000, lr=1e-4)  # would be 100×: bounded
    assert rule.factor(1e-4, 1e-4) == 10.0


def test_the_factor_stays_within_its_bounds():
    rule = TrustRegionRate(1e-3, ema_decay=0.0, min_ratio=0.05, max_ratio=4.0)
    for kl in (1e-9, 1e-6, 1e-3, 1e-1, 10.0):
        rule.update(kl=kl, lr=1e-3)
        for base in (1e-6, 1e-4, 1e-2):
            for peak in (base, 10 * base, 1e-2):
                assert 0.05 <= rule.factor(base, peak) <= 4.0
    rule.update(kl=10.0, lr=1e-3)
    assert rule.factor(1e-3, 1e-3) == 0.05
    assert rule.factor(0.0, 1e-3) == 1.0  # a rate of 0: nothing to scale


def test_the_curvature_is_smoothed_and_non_measurements_are_ignored():
    rule = TrustRegionRate(1e-3, ema_decay=0.5)
    rule.update(kl=1e-2, lr=1e-2)  # the probe: replaced by the next reading
    rule.update(kl=1e-3, lr=1e-2)  # curvature 10
    rule.update(kl=4e-3, lr=1e-2)  # curvature 40
    average = (0.5 * 0.5 * 10 + 0.5 * 40) / (1 - 0.25)
    assert rule.rate == pytest.approx(math.sqrt(1e-3 / average))
    assert not rule.update(kl=float("nan"), lr=1e-2) and not rule.update(kl=1e-3, lr=0.0)
    assert rule.rate == pytest.approx(math.sqrt(1e-3 / average))
    copied = TrustRegionRate(1e-3, ema_decay=0.5)
    copied.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert copied.rate == rule.rate


def test_the_rule_measures_the_peak_and_leaves_the_schedule_and_snr_factor_to_shape_each_step():
    """η = η_s · clip(η_δ/η_peak): the factor is set by the schedule's peak, not by the step's own rate, so the rate
    used falls with the schedule and moves with the SNR factor around the measured peak η̂_max = η_δ."""
    rule = TrustRegionRate(1e-3, ema_decay=0.0)
    rule.update(kl=1e-3 / 16, lr=1e-4)  # η_δ = 4e-4
    used = [base * rule.factor(base, 1e-4) for base in (1e-4, 5e-5, 8e-5, 5e-5)]
    assert used == pytest.approx([4e-4, 2e-4, 3.2e-4, 2e-4])  # η̂_max × scheduled/peak × f
    assert rule.factor(1e-4, 1e-6) == 10.0 and rule.factor(1e-4, 1.0) == 0.01  # bounded
    assert rule.factor(5e-5) == rule.factor(5e-5, 5e-5) == 8.0  # without a peak: the step's own rate


def test_the_probes_reading_is_replaced_by_the_next_one():
    """Adam's first step (the probe) overstates the curvature: its reading is provisional, the next reading replaces
    it and the step after the probe must be measured."""
    rule = TrustRegionRate(1e-3, ema_decay=0.5)
    assert rule.needs_measurement and not rule.provisional
    rule.update(kl=0.0, lr=1e-5)  # did not move the policy: still probing, nothing provisional
    assert rule.probing and not rule.provisional
    rule.update(kl=1e-3, lr=1e-5)  # the probe: curvature 1e7
    assert rule.provisional and rule.needs_measurement
    resumed = TrustRegionRate(1e-3, ema_decay=0.5)
    resumed.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert resumed.provisional and resumed.rate == rule.rate
    rule.update(kl=1e-3, lr=1e-4)  # curvature 1e5
    assert rule.curvature.value == pytest.approx(1e5) and not rule.needs_measurement
    rule.update(kl=4e-3, lr=1e-4)  # then averaged as usual
    assert rule.curvature.count == 2


def test_the_aimed_kl_is_delta_at_the_rules_rate_and_scales_with_the_square_of_the_rate():
    rule = TrustRegionRate(1e-2, ema_decay=0.0)
    assert math.isnan(rule.aimed_kl(1e-5))  # probing: nothing aimed at
    rule.update(kl=1e-2 / 4, lr=1e-5)  # η_δ = 2e-5
    assert rule.aimed_kl(2e-5) == pytest.approx(1e-2)
    assert rule.aimed_kl(1e-5) == pytest.approx(1e-2 / 4)


def assert_update_read_from_the_state(device: str, **adam) -> None:
    """u = m̂/(√v̂ + ε) is the move of a step of rate 1: the parameters moved by lr·u (no weight decay), the first
    step's u is sign(g) (mean square 1), and it shrinks as v̂ accumulates gradients whose signs disagree. Also run by
    `test_gpu.py` with the step count on the device (fused AdamW), where it is read in float32 as the optimizer does."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(30, 4, device=device))
    bias = torch.nn.Parameter(torch.randn(7, device=device))
    optimizer = torch.optim.AdamW([weight, bias], lr=1e-3, eps=1e-8, weight_decay=0.0, **adam)
    assert adam_update_square_sum(optimizer) is None  # no step yet: no state
    means = []
    for _ in range(6):
        before = [weight.detach().clone(), bias.detach().clone()]
        for param in (weight, bias):
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()
        total, count = adam_update_square_sum(optimizer).tolist()
        moved = sum(float((param.detach() - old).square().sum()) for param, old in zip((weight, bias), before))
        assert count == 30 * 4 + 7
        assert total == pytest.approx(moved / 1e-3**2, rel=1e-4)
        means.append(total / count)
    assert means[0] == pytest.approx(1.0, rel=1e-4)
    assert means[-1] < 0.5 * means[0]


@pytest.mark.parametrize("adam", [{}, {"amsgrad": True}, {"fused": True}], ids=["adam", "amsgrad", "fused"])
def test_adams_update_per_unit_rate_is_read_from_its_state(adam):
    assert_update_read_from_the_state("cpu", **adam)
    weight = torch.nn.Parameter(torch.zeros(3))
    assert adam_update_square_sum(torch.optim.SGD([weight], lr=1e-3)) is None  # not Adam's state


def test_the_curvature_is_read_per_unit_of_the_update_and_predicts_with_the_last_one():
    """KL = c·lr²·ū²: a step whose update shrank 4-fold (ū² 1 → 0.25) at the same rate and a quarter of the KL reads
    the same curvature, and the next step, predicted with ū² = 0.25, may run at twice the rate of the first; without
    Adam's state (no ū² noted) a reading is per unit rate."""
    rule = TrustRegionRate(1e-3, ema_decay=0.5)
    rule.note_update(1.0)
    rule.update(kl=1e-3, lr=1e-4)  # the probe, c = 1e5 per unit update: replaced by the next reading
    for _ in range(2):
        rule.note_update(0.25)
        rule.update(kl=1e-3 / 4, lr=1e-4)
    assert rule.curvature.value == pytest.approx(1e5)
    assert rule.rate == pytest.approx(math.sqrt(1e-3 / (1e5 * 0.25)))  # 2e-4
    assert rule.aimed_kl(2e-4) == pytest.approx(1e-3)
    resumed = TrustRegionRate(1e-3, ema_decay=0.5)
    resumed.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert resumed.rate == rule.rate
    for nothing in (None, 0.0, float("nan")):
        rule.note_update(nothing)
    assert rule.update_mean_square == 0.25
    per_rate = TrustRegionRate(1e-3, ema_decay=0.0)
    per_rate.update(kl=1e-3 / 4, lr=1e-4)
    assert per_rate.rate == pytest.approx(2e-4)


def test_options_are_checked():
    for target in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="target_kl"):
            TrustRegionRate(target)


def test_sampled_token_kl_is_unbiased_for_the_kl_of_two_categoricals():
    generator = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(50, generator=generator), -1)
    new = torch.log_softmax(old + 0.3 * torch.randn(50, generator=generator), -1)
    exact = (old.exp() * (old - new)).sum()
    tokens = torch.multinomial(old.exp(), 200_000, replacement=True, generator=generator)
    total, count = sampled_token_kl(new[tokens][None], old[tokens][None], torch.ones(1, len(tokens)))
    k3 = torch.expm1(new[tokens] - old[tokens]) - (new[tokens] - old[tokens])
    assert count == len(tokens)
    assert (total / count).item() == pytest.approx(exact.item(), abs=4 * k3.std().item() / math.sqrt(len(tokens)))  # 4 s.e.


# ----------------------------------------------------------------------------------------------------------------
# The measurement on a sample of the step's completions (`StepKLRecorder`, lr_trust_region_sample_size)
# ----------------------------------------------------------------------------------------------------------------


def _micro_batch(rows, width=3, seed=0):
    """A micro-batch whose "policy after the step" is stored in it: log-probabilities before and after, a mask."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=generator) - 0.1
    new = old + 0.5 * torch.randn(rows, width, generator=generator)
    mask = torch.ones(rows, width)
    mask[:, -1] = (torch.arange(rows) % 2).float()  # completions of 2 and 3 tokens
    return {"new": new, "row_id": torch.arange(rows) + 100 * seed, "scalar": torch.tensor(1.0)}, old, mask


def _record(sample_size, batches, counts=None, process_index=0, seed=0):
    """One step measured by a recorder on ``batches``; ``counts`` stands in for the other processes' row counts."""
    from oblr_trl.training.step_kl import StepKLRecorder

    forwarded, local = [], {}

    def token_log_probs(batch):
        forwarded.extend(batch["row_id"].tolist())
        return batch["new"]

    def reduce_sum(stats):
        local["sums"] = stats.clone()
        return stats

    # gather: every process's [row count, widths agree]; the others' stand-in counts, this process's flag for all
    gather = (lambda t: torch.tensor([[c, t[1]] for c in counts]).flatten()) if counts is not None else (lambda t: t)
    recorder = StepKLRecorder(token_log_probs, reduce_sum, sample_size, gather, process_index, seed)
    for batch, old, mask in batches:
        recorder.keep(batch, old, mask)
    kl = recorder.after_step(True)
    return kl, forwarded, local["sums"], recorder


def _k3(batch, old, mask, rows):
    delta = batch["new"][rows] - old[rows]
    return ((torch.expm1(delta) - delta) * mask[rows]).sum().item(), mask[rows].sum().item()


def test_a_sample_of_the_step_measures_only_the_drawn_completions_and_their_tokens():
    batches = [_micro_batch(4, seed=0), _micro_batch(4, seed=1)]
    full, forwarded_all, _, _ = _record(None, batches)
    assert sorted(forwarded_all) == [0, 1, 2, 3, 100, 101, 102, 103]
    kl, forwarded, sums, _ = _record(3, batches)
    assert _record(3, batches)[0] == kl  # the same step draws the same rows
    assert len(forwarded) == 3  # the drawn rows of both micro-batches, in one forward
    drawn = {0: [], 1: []}
    for row_id in forwarded:
        drawn[row_id // 100].append(row_id % 100)
    total, tokens = 0.0, 0.0
    for index, (batch, old, mask) in enumerate(batches):
        if drawn[index]:
            k, n = _k3(batch, old, mask, drawn[index])
            total, tokens = total + k, tokens + n
    assert sum(len(rows) for rows in drawn.values()) == 3
    assert sums[1].item() == tokens < 8 * 3  # the drawn completions' tokens only
    assert kl == pytest.approx(total / tokens, rel=1e-6) and kl != pytest.approx(full, rel=1e-3)
    assert _record(8, batches)[0] == full and _record(100, batches)[0] == full  # a sample of all: the full measure


def test_micro_batches_of_other_widths_are_measured_one_forward_each():
    """Where a process's micro-batches differ in width (several generation batches in one step), each is measured in
    a forward of its own: its drawn rows, or one row counted with weight 0 where none was drawn."""
    batches = [_micro_batch(4, width=3, seed=0), _micro_batch(4, width=4, seed=1)]
    _, forwarded, sums, recorder = _record(1, batches)
    assert len(forwarded) == 2 and sums[1].item() in (2.0, 3.0, 4.0)  # one completion's tokens counted
    drawn, largest = recorder._drawn_rows(batches)
    assert largest == 0 and sum(int(d.sum()) for d in drawn) == 1


def test_every_process_forwards_as_many_rows_as_the_one_that_drew_most():
    """A sharded model needs every process in every forward (and chunk): a process that drew fewer of the step's rows
    pads its one forward with rows counted with weight 0."""
    from oblr_trl.training.step_kl import StepKLRecorder

    one = [_micro_batch(4, seed=0), _micro_batch(4, seed=1)]
    for seed in range(6):
        drawn = StepKLRecorder(lambda b: b["new"], lambda s: s, 5, lambda t: t, 0, seed)._drawn_rows(one)[0]
        per_process = [int(drawn[0].sum()), int(drawn[1].sum())]
        for rank in (0, 1):
            _, forwarded, sums, _ = _record(5, [one[rank]], counts=[4, 4], process_index=rank, seed=seed)
            assert len(forwarded) == max(per_process)
            assert sums[1].item() == one[rank][2][drawn[rank]].sum().item()  # the drawn rows' tokens only


def test_the_sample_is_the_same_in_any_process_layout_and_resumes_with_the_run():
    """Rows 0–7 of a step on 1 process (2 micro-batches of 4) or on 2 (one micro-batch of 4 each): the same rows are
    drawn and the per-process sums add up to the one-process measurement. The step count that seeds the draws is
    checkpointed."""
    from oblr_trl.training.step_kl import StepKLRecorder

    one = [_micro_batch(4, seed=0), _micro_batch(4, seed=1)]
    single_kl, _, single_sums, recorder = _record(3, one)
    total = sum(_record(3, [one[rank]], counts=[4, 4], process_index=rank)[2] for rank in (0, 1))
    assert total[1].item() == single_sums[1].item()
    assert (total[0] / total[1]).item() == pytest.approx(single_kl, rel=1e-6)
    resumed = StepKLRecorder(lambda b: b["new"], lambda s: s, 3, lambda t: t)
    resumed.load_state_dict(json.loads(json.dumps(recorder.state_dict())))
    assert resumed.measured_steps == recorder.measured_steps == 1


def test_a_step_is_measured_only_when_asked_and_its_micro_batches_are_forgotten_either_way():
    from oblr_trl.training.step_kl import StepKLRecorder

    forwards = []
    recorder = StepKLRecorder(lambda batch: forwards.append(1) or batch["new"], lambda s: s)
    recorder.keep(*_micro_batch(4, seed=0))
    assert recorder.after_step(False) is None and not forwards
    assert recorder.after_step(True) is None and not forwards  # nothing kept since: nothing to measure
    recorder.keep(*_micro_batch(4, seed=1))
    assert recorder.after_step(True) > 0 and forwards == [1] and recorder.measured_steps == 1


def test_the_draw_of_each_step_is_uniform_over_the_steps_completions():
    from oblr_trl.training.step_kl import StepKLRecorder

    batches = [_micro_batch(4, seed=0), _micro_batch(4, seed=1)]
    counts = torch.zeros(8)
    recorder = StepKLRecorder(lambda b: b["new"], lambda s: s, 2, lambda t: t, 0, seed=3)
    for _ in range(2000):
        drawn, _ = recorder._drawn_rows(batches)
        counts += torch.cat(drawn).float()
        recorder.measured_steps += 1
    assert counts.sum() == 2 * 2000
    assert (counts / 2000).tolist() == pytest.approx([2 / 8] * 8, abs=0.04)  # 4 s.e. of a 2000-draw frequency


# ----------------------------------------------------------------------------------------------------------------
# In the trainer
# ----------------------------------------------------------------------------------------------------------------


def plain_copy(model):
    """A copy of the policy's weights in a plain model of the same config (TRL patches the policy's `forward` with a
    fused LM head that a deepcopy would still route to the original)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(copy.deepcopy(model.state_dict()))
    return plain.eval()


class PolicySnapshots(TrainerCallback):
    """The policy before each step and the micro-batches the KL is measured on."""

    def __init__(self):
        self.trainer, self.before, self.batches = None, {}, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.before[state.global_step + 1] = plain_copy(self.trainer.model)
        keep = self.trainer.kl_recorder.keep
        if not getattr(keep, "recording", False):
            def recording(batch, log_probs, mask):
                self.batches.setdefault(self.trainer.state.global_step + 1, []).append((batch, mask))
                keep(batch, log_probs, mask)

            recording.recording = True
            self.trainer.kl_recorder.keep = recording


def _log_probs(model, batch, temperature):
    """log π(y_t) of the completion tokens, by a plain forward of the model (not TRL's fused head)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, -width - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_the_logged_step_kl_is_the_kl_between_the_policies_before_and_after_the_step(make_trainer):
    snapshots = PolicySnapshots()
    trainer = make_trainer(log_step_kl=True, lr_trust_region_kl=None, max_steps=3, callbacks=[snapshots],
                           temperature=0.9)
    snapshots.trainer = trainer
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    after = {step: snapshots.before[step + 1] for step in (1, 2)}
    after[3] = plain_copy(trainer.model)
    for step in (1, 2, 3):
        total, tokens, deltas = 0.0, 0.0, []
        for batch, mask in snapshots.batches[step]:
            old, new = _log_probs(snapshots.before[step], batch, 0.9), _log_probs(after[step], batch, 0.9)
            delta = (new - old)[mask.bool()]
            total += (torch.expm1(delta) - delta).sum().item()
            tokens += mask.sum().item()
            deltas.append(delta.abs())
        assert len(snapshots.batches[step]) == 2  # both micro-batches of the step, not a sample
        # each k3 is formed from a Δ of size mean|Δ|: float32 log-probabilities move it by ~1e-6 of that
        scale = torch.cat(deltas).mean().item()
        assert logged[step]["oblr/step_kl"] == pytest.approx(total / tokens, abs=1e-4 * scale) and total > 0
    assert "oblr/trust_region_factor" not in logged[3]  # measured, not acted on


def _factors(trainer):
    return [h.get("oblr/trust_region_factor") for h in trainer.state.log_history if "loss" in h]


class RatesUsed(TrainerCallback):
    def __init__(self):
        self.trainer, self.seen, self.hooked = None, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        from oblr_trl.training.optim_hooks import innermost_optimizer

        optimizer = innermost_optimizer(self.trainer.optimizer)
        if self.hooked is not optimizer:  # registered after the trainer's: sees the scaled rate
            optimizer.register_step_pre_hook(lambda opt, a, k: self.seen.append(float(opt.param_groups[0]["lr"])))
            self.hooked = optimizer


def test_the_trust_region_sets_the_rate_the_optimizer_uses(make_trainer):
    """A δ far below what a 1e-2 step moves the tiny policy: from step 2 on the optimizer's rate is the scheduled
    rate × the SNR factor × the trust-region factor, and that factor is below 1 (the curvature's rate)."""
    probe = RatesUsed()
    trainer = make_trainer(lr_trust_region_kl=1e-6, max_steps=4, callbacks=[probe], lr_scheduler_type="constant")
    probe.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    factors = _factors(trainer)
    assert factors[0] == 0.01 and all(0.01 <= f < 1.0 for f in factors[1:])  # step 1: the probe, at the floor
    for h, used, factor in zip(logged, probe.seen, factors, strict=True):
        assert used == pytest.approx(1e-2 * h["snr/lr_factor"] * factor, rel=1e-6)
        assert h["oblr/lr"] == pytest.approx(used, rel=1e-6)


def test_the_rule_follows_the_schedule_and_logs_what_each_step_aimed_at(make_trainer):
    """Linear decay, measured every 4th step after the short early gaps: the probe and the step after it are measured
    (the probe's reading is replaced), then the steps 2 apart; the rate used falls with the schedule, and every step
    after the probe logs the KL it aimed at, δ·(η/η̂_max)² with η̂_max the rate the step before it left."""
    probe = RatesUsed()
    trainer = make_trainer(lr_trust_region_kl=1e-3, lr_trust_region_measure_steps=4, max_steps=6,
                           lr_scheduler_type="linear", use_snr_lr=False, callbacks=[probe])
    probe.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["grad_norm"] > 0 for h in logged)
    assert ["oblr/step_kl" in h for h in logged] == [True, True, False, True, False, False]
    factors = _factors(trainer)
    assert factors[0] == 0.01
    for h, used, factor in zip(logged, probe.seen, factors, strict=True):
        assert used == pytest.approx(h["learning_rate"] * factor, rel=1e-6)
        assert h["oblr/lr"] == pytest.approx(used, rel=1e-6) and "snr/effective_lr" not in h
    assert "oblr/step_kl_target" not in logged[0]  # the probe aims at nothing
    for t in range(1, 6):
        rate = logged[t - 1]["oblr/trust_region_rate"]
        assert logged[t]["oblr/step_kl_target"] == pytest.approx(1e-3 * (probe.seen[t] / rate) ** 2, rel=1e-6)


def test_each_step_logs_adams_update_and_the_rule_reads_the_curvature_per_unit_of_it(make_trainer):
    """`oblr/update_rms` is the root mean square of the step's Adam update per unit rate (about 1 for the first); the
    rate the rule leaves is sqrt(δ/(ĉ·ū²)) with ū² the step's, and what a step aimed at is the curvature times its
    rate² times the ū² before it."""
    trainer = make_trainer(lr_trust_region_kl=1e-3, lr_trust_region_measure_steps=1, lr_trust_region_ema_decay=0.0,
                           max_steps=4, use_snr_lr=False, lr_scheduler_type="constant")
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["grad_norm"] > 0 for h in logged)
    rms = [h["oblr/update_rms"] for h in logged]
    assert 0.5 < rms[0] <= 1.0 and rms[-1] < rms[0]  # sign(g), but for coordinates no token reached (g = 0)
    used = [h["oblr/lr"] for h in logged]
    for before, after in zip(logged[1:], logged[2:]):  # every step measured, ema_decay 0: the last reading alone
        curvature = before["oblr/step_kl"] / (before["oblr/lr"] ** 2 * before["oblr/update_rms"] ** 2)
        assert after["oblr/step_kl_target"] == pytest.approx(
            curvature * after["oblr/lr"] ** 2 * before["oblr/update_rms"] ** 2, rel=1e-4)
        assert before["oblr/trust_region_rate"] == pytest.approx(
            math.sqrt(1e-3 / (curvature * before["oblr/update_rms"] ** 2)), rel=1e-4)
    assert len(set(used)) == 4


def test_a_step_without_a_gradient_is_logged_but_does_not_change_the_curvature(make_trainer):
    """From step 2 on every group scores alike, so the gradient is zero: Adam's momentum still moves the policy (its
    KL is logged, every step measured) but by far less than a gradient step of the same rate, so the curvature, and
    with it the rate the rule allows, stays what step 1 measured."""
    from conftest import digit_fraction_reward

    trainer = None

    def rewards_vary_on_step_one_only(completions, **kwargs):
        if trainer.state.global_step == 0:
            return digit_fraction_reward(completions, **kwargs)
        return [1.0] * len(completions)

    trainer = make_trainer(reward_funcs=[rewards_vary_on_step_one_only], lr_trust_region_kl=1e-3, max_steps=4,
                           use_snr_lr=False, lr_scheduler_type="constant", lr_trust_region_measure_steps=1)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["grad_norm"] > 0 and all(h["grad_norm"] == 0 for h in logged[1:])
    assert all(h["oblr/step_kl"] > 0 for h in logged)  # the momentum-only steps did move the policy
    rates = [h["oblr/trust_region_rate"] for h in logged]
    assert math.isfinite(rates[0]) and rates[1:] == [rates[0]] * 3


def test_a_step_without_a_gradient_is_not_raised(make_trainer):
    """δ far above what any step moves the tiny policy: the rule raises every step with a gradient to its bound
    (`test_each_trust_region_option_changes_the_factor`), but from step 2 on every group scores alike, and a step that
    Adam's momentum alone drives runs at the scheduled rate, as the optimizer sees it."""
    from conftest import digit_fraction_reward

    trainer = None

    def rewards_vary_on_step_one_only(completions, **kwargs):
        if trainer.state.global_step == 0:
            return digit_fraction_reward(completions, **kwargs)
        return [1.0] * len(completions)

    probe = RatesUsed()
    trainer = make_trainer(reward_funcs=[rewards_vary_on_step_one_only], lr_trust_region_kl=10.0,
                           lr_trust_region_max_ratio=3.0, max_steps=3,
                           use_snr_lr=False, lr_scheduler_type="constant", callbacks=[probe])
    probe.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["grad_norm"] > 0 and all(h["grad_norm"] == 0 for h in logged[1:])
    assert math.isfinite(logged[1]["oblr/trust_region_rate"])  # the rule would raise: its rate is far above 1e-2
    assert logged[1]["oblr/trust_region_rate"] > 3e-2
    assert _factors(trainer) == [0.01, 1.0, 1.0]
    assert probe.seen == pytest.approx([1e-4, 1e-2, 1e-2], rel=1e-6)


def test_each_trust_region_option_changes_the_factor(make_trainer):
    common = dict(max_steps=3, lr_scheduler_type="constant", use_snr_lr=False)
    off = make_trainer(lr_trust_region_kl=None, **common)
    off.train()
    assert off.kl_recorder is None and _factors(off) == [None] * 3
    default = make_trainer(**common)  # the peak with δ = 0.005 per update: the probe, then the measured KL's factor
    rule = default.step_rate
    assert (rule.trust_region.target_kl, rule.measure_every, rule.short_early_gaps) == (0.005, 16, True)
    default.train()
    assert _factors(default)[0] == 0.01 and all(0.01 <= g <= 10.0 for g in _factors(default))
    floor = make_trainer(lr_trust_region_kl=1e-12, lr_trust_region_min_ratio=0.2, **common)
    floor.train()
    assert _factors(floor) == [0.2, 0.2, 0.2]  # the probe, then the floor
    raised = make_trainer(lr_trust_region_kl=10.0, lr_trust_region_max_ratio=3.0, **common)  # a δ no step reaches
    raised.train()
    assert _factors(raised)[1:] == [3.0, 3.0]  # the too-low rate is raised, to its bound
    smoothed = make_trainer(lr_trust_region_kl=1e-6, lr_trust_region_ema_decay=0.9, **common)
    assert smoothed.step_rate.trust_region.curvature.decay == 0.9
    measured = make_trainer(log_step_kl=True, lr_trust_region_kl=None, **common)
    measured.train()
    assert all(h["oblr/step_kl"] > 0 for h in measured.state.log_history if "loss" in h)


def test_a_sample_size_measures_the_step_on_that_many_completions(make_trainer):
    """8 completions a step in 2 micro-batches of 4: with a sample of 1 the measuring forward sees the drawn row (one
    forward for the step), against all 8 with the default sample of 8 or none; 16 completions a step: the default
    measures 8."""
    rows = []

    def counting(trainer):
        recorder = trainer.kl_recorder
        token_log_probs, after_step = recorder.token_log_probs, recorder.after_step

        def count(batch):
            rows[-1] += batch["completion_ids"].size(0)
            return token_log_probs(batch)

        def measured_step(*args, **kwargs):
            rows.append(0)
            return after_step(*args, **kwargs)

        recorder.token_log_probs = count
        trainer.step_control.step_kl = lambda measure: measured_step(measure) if measure else after_step(measure)
        return trainer

    common = dict(max_steps=3, lr_scheduler_type="constant", use_snr_lr=False, lr_trust_region_measure_steps=1)
    default = counting(make_trainer(**common))
    assert default.args.lr_trust_region_sample_size == 8
    default.train()
    assert rows == [8, 8, 8]  # no more completions than the default sample: measured whole
    rows.clear()
    counting(make_trainer(lr_trust_region_sample_size=None, **common)).train()
    assert rows == [8, 8, 8]
    rows.clear()
    # 16 completions a step in 2 micro-batches of 8: the default measures 8 of them
    counting(make_trainer(per_device_train_batch_size=8, **common)).train()
    assert rows == [8, 8, 8]
    rows.clear()
    sampled = counting(make_trainer(lr_trust_region_sample_size=1, **common))
    sampled.train()
    assert rows == [1, 1, 1]
    assert sampled.kl_recorder.measured_steps == 3
    assert all(h["oblr/step_kl"] >= 0 for h in sampled.state.log_history if "loss" in h)


def test_measure_steps_measures_every_k_th_step_of_training(make_trainer):
    """`lr_trust_region_measure_steps=2` without the short early gaps: the probe, the step after it (whose reading
    replaces the probe's) and then every 2nd step run the measuring forward and log their KL, steps 1, 2 and 4 of 5;
    only those steps keep their micro-batches for it (the cadence is known before a step begins); the card says what
    the run's rule measured."""
    trainer = make_trainer(lr_trust_region_measure_steps=2, lr_trust_region_short_early_gaps=False, max_steps=5,
                           lr_scheduler_type="constant", use_snr_lr=False)
    assert (trainer.step_rate.measure_every, trainer.step_rate.short_early_gaps) == (2, False)
    kept_on, keep = [], trainer.kl_recorder.keep
    trainer.kl_recorder.keep = lambda *args: (kept_on.append(trainer.state.global_step), keep(*args))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["grad_norm"] > 0 for h in logged)  # every step has a gradient: the cadence is 1, 2, 4
    assert ["oblr/step_kl" in h for h in logged] == [True, True, False, True, False]
    assert sorted(set(kept_on)) == [0, 1, 3]  # steps 1, 2 and 4 (global_step counts the steps done before)
    assert trainer.kl_recorder.measured_steps == 3
    from oblr_trl.estimators.step_rate import RateRuleTuning, step_rate_rule
    from oblr_trl.training.run_records import card_settings

    settings = card_settings(trainer.args, trainer.step_rate, 5, trainer.num_generations, trainer.reward_func_names)
    assert ("δ = 0.005 per token at the schedule's peak (factor in [0.01, 10], curvature per unit of Adam's update, "
            "measured every 2 steps)") in settings["learning-rate factor"]
    # the card reads the rule the run used, not the config: another rule, another sentence
    shipped = step_rate_rule(trainer.args, dataclasses.replace(trainer.rate_tuning, lr_trust_region_max_ratio=3.0,
                                                               lr_trust_region_short_early_gaps=True))
    assert "factor in [0.01, 3], curvature per unit of Adam's update, measured every 2 steps after gaps of 1, 2, 4" in (
        card_settings(trainer.args, shipped, 5, trainer.num_generations, trainer.reward_func_names)[
            "learning-rate factor"])
    assert "measured every" not in card_settings(trainer.args, step_rate_rule(trainer.args, RateRuleTuning(
        lr_trust_region_measure_steps=1)), 5, trainer.num_generations, trainer.reward_func_names)["learning-rate factor"]


def test_resume_restores_the_trust_region(make_trainer, tmp_path):
    from test_scaling import StopAt

    common = dict(max_steps=5, save_strategy="steps", save_steps=2, lr_trust_region_kl=1e-3, use_snr_lr=False,
                  lr_scheduler_type="constant", lr_trust_region_measure_steps=1)  # k > 1: the recorder's own test
    straight = make_trainer(output_dir=str(tmp_path / "straight"), **common)
    straight.train()
    first = make_trainer(output_dir=str(tmp_path / "split"), callbacks=[StopAt(2)], **common)
    first.train()
    state = json.loads((tmp_path / "split" / "checkpoint-2" / "oblr_state.json").read_text())
    # the defaults' peak form: the probe's reading is replaced by step 2's, which is the one reading folded in
    assert state["step_rate"]["trust_region"]["curvature"]["count"] == 1
    second = make_trainer(output_dir=str(tmp_path / "split"), **common)
    second.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-2"))
    resumed = _factors(second)  # the log history of steps 1-2 comes back with the checkpoint
    assert len(resumed) == 5 and resumed[:2] == _factors(first)
    assert resumed[2] != 0.01  # step 3's factor comes from the restored curvature, not a new probe
    assert resumed == pytest.approx(_factors(straight), rel=1e-5)


def test_a_checkpoint_without_the_rules_state_resumes_with_a_warning_and_a_new_probe(make_trainer, tmp_path):
    """A checkpoint of an older version carries no `step_rate`: the resume says so and the rule probes again."""
    from test_scaling import StopAt

    common = dict(max_steps=3, save_strategy="steps", save_steps=2, use_snr_lr=False, lr_scheduler_type="constant",
                  lr_trust_region_measure_steps=1, output_dir=str(tmp_path))
    make_trainer(callbacks=[StopAt(2)], **common).train()
    path = tmp_path / "checkpoint-2" / "oblr_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({key: value for key, value in state.items() if key != "step_rate"}))
    resumed = make_trainer(**common)
    with pytest.warns(UserWarning, match="no `step_rate`.*new probe"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert _factors(resumed)[2] == 0.01  # step 3 probes again
