"""Acceptance 6: the trainer's advantages are the pure functions applied to the gathered rewards and weights, every
weight option matters, and the learning rate seen by the optimizer is the schedule times the logged f_t."""

import math
import warnings
from pathlib import Path

import pytest
import torch
from conftest import digit_fraction_reward, vowel_reward
from tolerances import noise_terms_scale
from transformers import TrainerCallback

from oblr_trl import OBLRPOTrainer, aggregate_rewards, gradient_weighted_advantages
from oblr_trl.estimators.weights import log_sum_sq_probs, logit_proxy_weights
from oblr_trl.training.optim_hooks import innermost_optimizer


def reference_weights(model, output, estimator, temperature):
    """w_i recomputed independently of the trainer: a plain forward with full logits, autograd for `exact`."""
    prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
    mask = output["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([output["prompt_mask"], mask], 1)
    width = completion_ids.size(1)
    if estimator == "uniform":
        return torch.ones(len(input_ids))
    if estimator == "length":
        return mask.sum(1).float()
    if estimator == "logit":
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1] / temperature
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        return logit_proxy_weights(log_probs, log_sum_sq_probs(logits), mask)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(input_ids)):
        logits = model(input_ids=input_ids[i : i + 1], attention_mask=attention_mask[i : i + 1]).logits
        logits = logits[:, -width - 1 : -1].float() / temperature
        log_probs = torch.log_softmax(logits, -1).gather(-1, completion_ids[i : i + 1].unsqueeze(-1)).squeeze(-1)
        grads = torch.autograd.grad((log_probs * mask[i : i + 1]).sum(), params, allow_unused=True)
        norms.append(sum(g.pow(2).sum() for g in grads if g is not None))
    return torch.stack(norms).detach()


class CapturingTrainer(OBLRPOTrainer):
    """Records every generation batch's output together with independently recomputed weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        weights = reference_weights(self.model, output, self.args.baseline_weights, self.temperature)
        self.captured.append(({k: v for k, v in output.items() if torch.is_tensor(v)}, weights))
        return output


def recording(reward_func, sink):
    def recorded(completions, **kwargs):
        rewards = reward_func(completions, **kwargs)
        sink.append(torch.tensor(rewards, dtype=torch.float32))
        return rewards

    recorded.__name__ = reward_func.__name__
    return recorded


def run_capturing(make_trainer, **overrides):
    digits, vowels = [], []
    trainer = make_trainer(
        reward_funcs=[recording(digit_fraction_reward, digits), recording(vowel_reward, vowels)],
        trainer_cls=CapturingTrainer,
        reward_weights=[1.0, 0.5],
        **overrides,
    )
    trainer.train()
    return trainer, [torch.stack([d, v], dim=1) for d, v in zip(digits, vowels)]


CASES = [
    {"baseline_weights": "logit"},
    {"baseline_weights": "logit", "temperature": 0.7, "leave_one_out": False},
    {"baseline_weights": "length", "scale_rewards": "none"},
    {"baseline_weights": "exact"},
    {"baseline_weights": "uniform", "multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"},
    {"baseline_weights": "logit", "baseline_estimator": "weighted"},
    {"baseline_weights": "logit", "baseline_estimator": "pooled_slope"},
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_advantages_equal_pure_functions_of_gathered_inputs(make_trainer, overrides):
    from oblr_trl.estimators.baselines import PooledSlope

    trainer, rewards_per_func = run_capturing(make_trainer, max_steps=2, **overrides)
    assert len(trainer.captured) == 2
    compared = 0.0
    slope = PooledSlope(0.9)  # the pooled slope a batch uses is fitted on the batches before it
    for (output, weights), per_func in zip(trainer.captured, rewards_per_func):
        rewards = aggregate_rewards(
            per_func, torch.tensor([1.0, 0.5]), 4, overrides.get("multi_objective_aggregation", "sum_then_normalize")
        )
        expected = gradient_weighted_advantages(
            rewards, weights, 4, overrides.get("leave_one_out", True), overrides.get("scale_rewards", "group"),
            estimator=overrides.get("baseline_estimator", "pooled_slope"), slope=slope.value,
        )
        slope.update(rewards.view(-1, 4), weights.view(-1, 4))
        assert torch.allclose(output["advantages"], expected.advantages, rtol=1e-4, atol=1e-6)
        compared += expected.advantages.abs().sum().item()
    assert compared > 0  # not a comparison of zeros
    if overrides.get("baseline_estimator") == "pooled_slope":
        assert trainer.pooled_slope.value == pytest.approx(slope.value) and slope.value != 0.0


def test_each_weight_option_changes_advantages(make_trainer):
    """In the weighted baselines the weights enter b_i directly; in the default pooled slope they enter through ρ̂,
    fitted on the batches before (so the second batch differs)."""
    batches = {}
    for estimator in ("uniform", "logit", "length", "exact"):
        weighted, rewards = run_capturing(make_trainer, max_steps=1, baseline_weights=estimator,
                                          baseline_estimator="weighted")
        pooled, _ = run_capturing(make_trainer, max_steps=2, baseline_weights=estimator)
        batches[estimator] = (weighted.captured[0][0]["advantages"], rewards[0], pooled.captured[1][0]["advantages"],
                              pooled.pooled_slope.value)
    uniform_advantages, uniform_rewards, uniform_pooled, uniform_slope = batches.pop("uniform")
    for estimator, (advantages, rewards, pooled, slope) in batches.items():
        assert torch.equal(rewards, uniform_rewards), f"{estimator}: same seed should give the same completions"
        assert not torch.allclose(advantages, uniform_advantages), estimator
        assert slope != uniform_slope and not torch.allclose(pooled, uniform_pooled), estimator


def test_importance_weighted_baseline_squares_the_ratio(make_trainer):
    """Under vLLM IS correction each token's weight is multiplied by ρ_t² (docs/importance_sampling.md); without a
    ratio it is not."""
    output = {
        "completion_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "importance_sampling_ratio": torch.tensor([[2.0], [0.5]]),
    }
    weights = make_trainer(baseline_weights="length").completion_weights
    on = weights.compute(output, None, "train")
    off = weights.compute({k: v for k, v in output.items() if k != "importance_sampling_ratio"}, None, "train")
    assert off.tolist() == [3.0, 2.0]
    assert on.tolist() == [12.0, 0.5]
    uniform = make_trainer(baseline_weights="uniform").completion_weights.compute(output, None, "train")
    assert uniform.tolist() == [1.0, 1.0]


class LearningRateProbe(TrainerCallback):
    """Reads the optimizer's learning rate from inside each optimizer.step() and the schedule's value for it."""

    def __init__(self):
        self.trainer = None
        self.seen = []

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = innermost_optimizer(self.trainer.optimizer)

        def probe(optimizer, *_):
            scheduled = self.trainer.lr_scheduler.get_last_lr()[0]
            self.seen.append((optimizer.param_groups[0]["lr"], scheduled))

        optimizer.register_step_pre_hook(probe)


@pytest.mark.parametrize("use_snr_lr", [False, True])
def test_learning_rate_is_schedule_times_logged_factor(make_trainer, use_snr_lr):
    probe = LearningRateProbe()
    trainer = make_trainer(
        callbacks=[probe], use_snr_lr=use_snr_lr, max_steps=5, snr_warmup_steps=1, snr_lr_floor=0.05,
        gradient_accumulation_steps=4, per_device_train_batch_size=2, snr_lr_reference="absolute",
        lr_trust_region_kl=None,  # the SNR factor alone (the trust region's factor: tests/test_trust_region.py)
    )
    probe.trainer = trainer
    trainer.train()
    assert len(probe.seen) == 5
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len({scheduled for _, scheduled in probe.seen}) > 1  # the schedule really moves
    if not use_snr_lr:
        assert all(lr == scheduled for lr, scheduled in probe.seen)
        assert not any(key.startswith("snr/") for h in logged for key in h)
        return
    factors = [h["snr/lr_factor"] for h in logged]
    for (lr, scheduled), factor, h in zip(probe.seen, factors, logged):
        assert lr == pytest.approx(scheduled * factor, rel=1e-6)
        assert h["oblr/lr"] == pytest.approx(lr, rel=1e-6)
        assert 0.05 <= factor <= 1.0
    assert factors[:2] == [1.0, 1.0]  # step 2 is the first paired with its predecessor, step 3 the first scaled
    assert any(f < 1.0 for f in factors[1:])
    # after the step, the optimizer is back on the schedule (the scheduler never sees the factor)
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.lr_scheduler.get_last_lr()[0]


def test_snr_guards_and_smoothing_are_applied(make_trainer):
    trainer = make_trainer(max_steps=4, snr_warmup_steps=2, snr_lr_floor=0.9, snr_ema_decay=0.5,
                           snr_estimator="two_batch", snr_lr_reference="absolute")
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    factors = [h["snr/lr_factor"] for h in logged]
    assert factors[:2] == [1.0, 1.0]  # warm-up of 2: steps 1 and 2 are measured, step 3 is the first scaled
    assert factors[2] < 1.0
    assert all(0.9 <= f <= 1.0 for f in factors)
    average = 0.0
    for count, h in enumerate(logged, start=1):
        average = 0.5 * average + 0.5 * h["snr/trace_cov"]
        assert h["snr/trace_cov_ema"] == pytest.approx(average / (1 - 0.5**count), rel=1e-5)


def test_per_sample_and_two_batch_coincide_with_one_completion_per_micro_batch(make_trainer):
    """With b = 1 the micro-batch gradients are the per-sample gradients, so the two estimators must agree exactly:
    a check of the hooks, the per-row gradients and the scale conversions between them."""
    trainer = make_trainer(
        snr_estimator="per_sample", per_device_train_batch_size=1, gradient_accumulation_steps=8, max_steps=3
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for h in logged:  # both are differences: compared in the scale of their terms (tests/tolerances.py)
        scale = noise_terms_scale(h)
        assert h["snr/two_batch/trace_cov"] == pytest.approx(h["snr/trace_cov"], abs=1e-4 * 8 * scale)
        assert h["snr/two_batch/grad_sq_norm"] == pytest.approx(h["snr/grad_sq_norm"], abs=1e-4 * scale)


def test_metrics_are_logged_and_finite(make_trainer):
    trainer = make_trainer(max_steps=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]
    for key in (
        "oblr/baseline_mean", "oblr/advantage_mean", "oblr/advantage_std", "oblr/weights/mean",
        "oblr/weights/group_max_min_ratio", "oblr/loo_fallback_frac", "snr/grad_sq_norm", "snr/trace_cov",
        "snr/snr", "snr/lr_factor", "oblr/lr",
    ):
        assert key in logged and math.isfinite(logged[key]), key


def test_model_card_credits_oblr_po(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=1)
    trainer.create_model_card(model_name="tiny-oblr")
    card = (tmp_path / "run" / "README.md").read_text()
    assert "OBLR-PO" in card and "2511.23310" in card and "huang2025oblrpo" in card and "oblr-po" in card


def test_per_sample_batch_size_sets_the_chunks_of_the_norm_pass(make_trainer, monkeypatch):
    """Rows do not interact, so the chunking changes peak memory, never the norms."""
    import oblr_trl.training.completion_weights as trainer_module

    chunks = []
    batched = trainer_module.log_likelihood_grad_sq_norms

    def recording(model, input_ids, *args, **kwargs):
        chunks.append(input_ids.size(0))
        return batched(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "log_likelihood_grad_sq_norms", recording)
    generator = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(8, 60, (6, 5), generator=generator),
        "prompt_mask": torch.ones(6, 5, dtype=torch.long),
        "completion_ids": torch.randint(8, 60, (6, 4), generator=generator),
        "completion_mask": torch.tensor([[1, 1, 1, 1]] * 5 + [[1, 1, 0, 0]]),
    }
    scale = batch["completion_mask"].float()
    norms = {}
    for size in (None, 1, 5):
        chunks.clear()
        trainer = make_trainer(baseline_weights="exact", per_sample_batch_size=size)
        norms[size] = trainer.completion_weights.grad_sq_norms(batch, scale)
        assert chunks == {None: [6], 1: [1] * 6, 5: [5, 1]}[size]  # None: `rows_per_pass`, all 6 on a CPU
    assert torch.allclose(norms[1], norms[None], rtol=1e-5) and torch.allclose(norms[5], norms[None], rtol=1e-5)


def test_without_per_sample_batch_size_the_chunks_come_from_rows_per_pass(make_trainer, monkeypatch):
    import oblr_trl.training.completion_weights as trainer_module

    chunks = []
    batched = trainer_module.log_likelihood_grad_sq_norms
    monkeypatch.setattr(trainer_module, "log_likelihood_grad_sq_norms",
                        lambda model, ids, *a, **k: chunks.append(ids.size(0)) or batched(model, ids, *a, **k))
    trainer = make_trainer(baseline_weights="exact")
    asked = []
    monkeypatch.setattr(trainer.completion_weights, "rows_per_pass",
                        lambda ids, micro_batch, layers: asked.append((ids.size(0), micro_batch, layers)) or 3)
    batch = {"prompt_ids": torch.randint(8, 60, (7, 5)), "prompt_mask": torch.ones(7, 5, dtype=torch.long),
             "completion_ids": torch.randint(8, 60, (7, 4)), "completion_mask": torch.ones(7, 4, dtype=torch.long)}
    trainer.completion_weights.grad_sq_norms(batch, torch.ones(7, 4))
    assert asked == [(7, 4, 0)] and chunks == [3, 3, 1]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize(
    "room, expected",
    [(0, 4), (2**50, 64), (None, None)],  # no room: a micro-batch; room for all; in between: what fits
    ids=["no-room", "room-for-all", "what-fits"],
)
def test_rows_per_pass_fill_the_memory_the_device_has_room_for(make_trainer, monkeypatch, device, room, expected):
    """The pass takes as many rows as fit at `pass_bytes_per_row`, at least a micro-batch, at most every row: on CUDA
    in 80 % of (peak so far − allocated now), on a CPU in half of the available memory; on other devices a
    micro-batch. The CPU twin of what an H100 run decides (no GPU needed: the memory readings are replaced)."""
    from types import SimpleNamespace

    import psutil

    from oblr_trl.estimators.ghost_norms import pass_bytes_per_row

    trainer = make_trainer(baseline_weights="exact")
    weights = trainer.completion_weights
    per_row = pass_bytes_per_row(weights.policy.config, 96, 4, 2)
    share = {"cuda": 0.8, "cpu": 0.5}[device]
    if room is None:  # room for 10 rows
        room, expected = int(10 * per_row / share) + 1, 10
    allocated = 2 * 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated + room)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=room))
    ids = SimpleNamespace(device=torch.device(device), size=lambda dim: (64, 96)[dim])
    assert weights.rows_per_pass(ids, 4, 2) == expected
    elsewhere = SimpleNamespace(device=torch.device("meta"), size=lambda dim: (64, 96)[dim])
    assert weights.rows_per_pass(elsewhere, 4, 2) == 4


def test_exact_weights_train_a_model_with_tied_embeddings(make_trainer, tokenizer):
    """SmolLM2 and Qwen3-0.6B/4B tie the LM head to the embeddings: the tied cross term of the norms must not leak a
    graph into the advantages (the training backward would run into the freed norm pass)."""
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer, tie_word_embeddings=True)
    before = model.get_input_embeddings().weight.detach().clone()
    trainer = make_trainer(model=model, baseline_weights="exact", max_steps=2)
    trainer.train()
    after = trainer.model.get_input_embeddings().weight
    assert after.isfinite().all() and not torch.equal(before, after)


# ----------------------------------------------------------------------------------------------------------------
# The default SNR estimator: cross-step, one micro-batch per step, fp16 loss scale
# ----------------------------------------------------------------------------------------------------------------


class StepGradientRecorder(TrainerCallback):
    """The optimizer's gradient of every step, flattened, as the optimizer sees it (no clipping in these runs)."""

    def __init__(self):
        self.trainer = None
        self.gradients = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.gradients.append(torch.cat([p.grad.detach().reshape(-1).double() for p in params]))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cross_step_estimate_is_the_inner_product_of_consecutive_step_gradients(make_trainer, loss_type, micro_batches):
    """‖μ‖² of step t is ⟨G_t, G_{t−1}⟩ and tr Σ is n(‖G_t‖² − ⟨G_t, G_{t−1}⟩), with G the optimizer's gradient, for
    every loss type and with one or two micro-batches per step (the tiny model's tensors are small enough to be
    sketched exactly, so the match is exact)."""
    recorder = StepGradientRecorder()
    trainer = make_trainer(
        callbacks=[recorder], loss_type=loss_type, max_steps=4, max_grad_norm=0.0, num_generations=4,
        per_device_train_batch_size=8 // micro_batches, gradient_accumulation_steps=micro_batches,
    )
    recorder.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert "snr/grad_sq_norm" not in logged[0]  # step 1 has no predecessor
    groups = 8 / 4
    for step in range(1, 4):
        current, previous = recorder.gradients[step], recorder.gradients[step - 1]
        dot = torch.dot(current, previous).item()
        # float32 round-off of an inner product scales with ‖G_t‖·‖G_{t−1}‖, not with the (possibly cancelling) result
        scale = 1e-4 * (current.norm() * previous.norm()).item()
        assert logged[step]["snr/grad_sq_norm"] == pytest.approx(dot, abs=scale)
        expected_trace = groups * (current.pow(2).sum().item() - dot)
        assert logged[step]["snr/trace_cov"] == pytest.approx(expected_trace, rel=1e-4, abs=groups * scale)


def test_cross_step_does_not_pair_steps_that_share_a_generation_batch(make_trainer):
    """With steps_per_generation = 2 × gradient_accumulation_steps, two optimizer steps train on one generation batch
    (the same prompts): only steps that start a new generation batch are paired with their predecessor."""
    trainer = make_trainer(max_steps=4, steps_per_generation=4, gradient_accumulation_steps=2)
    trainer.train()
    paired = ["snr/grad_sq_norm" in h for h in trainer.state.log_history if "loss" in h]
    assert paired == [False, False, True, False]


def test_default_config_trains_with_one_micro_batch_and_without_args(tmp_path, tokenizer, monkeypatch):
    """`OBLRPOTrainer(model, reward_funcs, train_dataset=...)` with GRPOConfig's defaults (one micro-batch of 8 per
    step), on this CPU as it is: GRPOConfig's bf16 default would be refused here, OBLRPOConfig's resolves to fp32."""
    from datasets import Dataset

    from oblr_trl.testing import tiny_causal_lm

    monkeypatch.chdir(tmp_path)
    trainer = OBLRPOTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=digit_fraction_reward,
        train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3+4="]}),
        processing_class=tokenizer,
    )
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.args.snr_estimator == "cross_step"
    assert trainer.args.bf16 is False and not trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps >= 2
    # every step after the first was paired with its predecessor and measured
    assert trainer.step_rate.snr.grad_sq_norm.count == trainer.state.max_steps - 1
    assert math.isfinite(trainer.step_rate.snr.bound_factor(1))


def test_builtin_model_ids_work_from_python(tmp_path, tokenizer, monkeypatch, prompt_dataset):
    """`OBLRPOTrainer(model="builtin:…")` takes the ids `oblr-trl train` takes (the export is stood in for by a tiny
    model in the cache folder, where the real export would be)."""
    from oblr_trl.testing import tiny_causal_lm
    from oblr_trl.training.models import cache_dir

    monkeypatch.setenv("OBLR_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    exported = cache_dir() / "smollm2-135m-instruct"
    tiny_causal_lm(tokenizer).save_pretrained(exported)
    tokenizer.save_pretrained(exported)
    trainer = OBLRPOTrainer(model="builtin:smollm2-135m-instruct", reward_funcs=digit_fraction_reward,
                            train_dataset=prompt_dataset)
    assert trainer.model.config.vocab_size == tokenizer.vocab_size and Path(trainer.model.name_or_path) == exported
    assert trainer.args.output_dir == "smollm2-135m-instruct-OBLR-PO"  # no "builtin:" in a folder name
    assert trainer.base_model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the model card names
    with pytest.raises(ValueError, match=r"Invalid value for `model`: 'builtin:gpt-5'.*builtin:smollm2-135m-instruct"):
        OBLRPOTrainer(model="builtin:gpt-5", reward_funcs=digit_fraction_reward, train_dataset=prompt_dataset)


def test_a_run_whose_rewards_are_all_none_keeps_its_checkpoints(make_trainer, tmp_path):
    """TRL warns and trains on when every reward is None; writing the model card before each checkpoint must not
    end the run (it did: statistics.fmean of None rewards)."""

    def no_reward(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(reward_funcs=[no_reward], max_steps=2, save_strategy="steps", save_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "model card" in str(w.message)]  # written, not merely survived
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "OBLR-PO" in card and "mean reward" not in card


def test_a_failing_model_card_never_fails_the_save(make_trainer, tmp_path, monkeypatch):
    import oblr_trl.training.run_records

    def broken(facts):
        raise RuntimeError("card template broke")

    monkeypatch.setattr(oblr_trl.training.run_records, "model_card_text", broken)
    trainer = make_trainer(max_steps=1, save_strategy="steps", save_steps=1)
    with pytest.warns(UserWarning, match="model card was not written.*card template broke"):
        trainer.train()
    assert (tmp_path / "run" / "checkpoint-1" / "oblr_state.json").exists()


def test_eval_with_one_generation_per_prompt(make_trainer, prompt_dataset):
    """Evaluation takes no baseline (advantages are not used there), so one completion per prompt is fine, as in TRL."""
    trainer = make_trainer(num_generations_eval=1, per_device_eval_batch_size=4, max_steps=1)
    metrics = trainer.evaluate(eval_dataset=prompt_dataset.select(range(4)))
    assert math.isfinite(metrics["eval_reward"])


def _snr_logs(make_trainer, scaler_scale, estimator):
    trainer = make_trainer(fp16=True, use_cpu=True, max_steps=3, snr_estimator=estimator, snr_lr_reference="absolute",
                           snr_warmup_steps=0)
    if scaler_scale is not None:  # accelerate gives a CPU run no scaler; install the one a GPU run would have
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale, growth_interval=1000)
        trainer.accelerator.native_amp = True
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("estimator", ["two_batch", "cross_step"])
def test_fp16_loss_scale_is_taken_off_the_hooked_gradients(make_trainer, estimator):
    """Under fp16 the hooks (two_batch) and the step-end sketch (cross_step, read before clipping unscales) see
    gradients times the loss scale S while the step norm is unscaled: without dividing by S² (norms) or S (sketches)
    the estimates would be 2^20 or 2^10 times off."""
    plain = _snr_logs(make_trainer, None, estimator)
    scaled = _snr_logs(make_trainer, 1024.0, estimator)
    keys = ["snr/small_batch_grad_sq_norm"] if estimator == "two_batch" else ["snr/grad_sq_norm", "snr/trace_cov"]
    assert all(key in a for a in plain[1:] for key in keys)
    previous = None
    for a, b in zip(plain, scaled, strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        if estimator == "two_batch":  # a sum of squared norms: no cancellation
            assert b["snr/small_batch_grad_sq_norm"] == pytest.approx(a["snr/small_batch_grad_sq_norm"], rel=1e-3)
        elif "snr/grad_sq_norm" in a:
            # ⟨G_t, G_{t−1}⟩ can be far smaller than its products: fp16 rounding of the gradients moves it by a few
            # 1e-5 of ‖G_t‖·‖G_{t−1}‖ (measured), whatever the result; a 1e-3 tolerance in that scale (~2 fp16 ulps)
            scale = noise_terms_scale(a, previous)
            assert b["snr/grad_sq_norm"] == pytest.approx(a["snr/grad_sq_norm"], abs=1e-3 * scale)
            assert b["snr/trace_cov"] == pytest.approx(a["snr/trace_cov"], abs=1e-3 * 8 * scale)  # n ≤ 8 samples
        previous = a


def test_calibrated_factor_moves_the_rate_once_the_reference_is_resolved(make_trainer):
    """The default mode in the loop: factor 1 while the reference is unresolved, then clip(f_t/f_ref) applied to the
    optimizer's rate (the resolution test is relaxed so that a 7-step run resolves it)."""
    probe = LearningRateProbe()
    trainer = make_trainer(callbacks=[probe], max_steps=7, snr_warmup_steps=0, snr_calibration_steps=2,
                           snr_lr_min_ratio=0.5, snr_lr_max_ratio=2.0, snr_ema_decay=0.0, lr_trust_region_kl=None)
    trainer.step_rate.snr.calibration.min_t = -math.inf
    probe.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    resolved = [h["snr/resolved"] for h in logged]
    factors = [h["snr/lr_factor"] for h in logged]
    # estimates from step 2 on; the window of 2 is full after step 3; step 4 is the first with the calibrated factor
    assert resolved == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert factors[:3] == [1.0, 1.0, 1.0]
    assert len(set(factors[3:])) > 1 and all(0.5 <= f <= 2.0 for f in factors)
    for (lr, scheduled), factor in zip(probe.seen, factors, strict=True):
        assert lr == pytest.approx(scheduled * factor, rel=1e-6)
    reference = logged[-1]["snr/reference_factor"]
    for h, factor in zip(logged[3:], factors[4:], strict=False):  # step t's factor comes from step t−1's estimate
        assert factor == pytest.approx(min(2.0, max(0.5, h["snr/bound_factor"] / reference)), rel=1e-5)


def test_a_layer_the_ghost_norms_do_not_know_falls_back_to_exact_per_row_norms(make_trainer, tokenizer):
    """LayerNorm (Cohere-2 and others) has no ghost-norm rule: `exact` weights come from one backward per completion
    instead, with one warning naming the layer, and equal the per-row oracle."""
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)  # a trainable layer without a per-sample rule
    trainer = make_trainer(model=model, trainer_cls=CapturingTrainer, baseline_weights="exact", max_steps=2)
    with pytest.warns(UserWarning, match=r"model.norm` \(LayerNorm\).*one backward per completion"):
        trainer.train()
    assert trainer.completion_weights.ghost_norms_unsupported is not None
    output, _ = trainer.captured[-1]
    used = trainer.completion_weights.grad_sq_norms(output, output["completion_mask"].float())
    reference = reference_weights(trainer.model, output, "exact", trainer.temperature)
    assert torch.allclose(used, reference, rtol=1e-4)


def test_per_sample_norms_and_the_step_kl_read_the_loss_forward(make_trainer, tokenizer):
    """The per-token log-probabilities and entropies that the per-sample norms and the step KL take are the tensors
    TRL's loss forward of the micro-batch computed (no forward of their own), also where the per-sample norms run
    forwards of their own in between (a layer without a ghost-norm rule: one backward per completion)."""
    from oblr_trl.testing import tiny_causal_lm

    class Spying(OBLRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_forwards, self.grad_forwards, self.read = [], [], []
            measure, keep = self.completion_weights.loss_rows_grad_sq, self.kl_recorder.keep
            self.completion_weights.loss_rows_grad_sq = lambda loss, inputs, log_probs, entropies: (
                self.read.append(("per_sample", log_probs, entropies)) or measure(loss, inputs, log_probs, entropies))
            self.kl_recorder.keep = lambda batch, log_probs, mask: (
                self.read.append(("step_kl", log_probs, None)) or keep(batch, log_probs, mask))

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            if torch.is_grad_enabled():
                self.grad_forwards.append(result)
            return result

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            first = len(self.grad_forwards)
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.loss_forwards.append(self.grad_forwards[first])  # TRL's `_compute_loss` forward comes first
            return loss

    model = tiny_causal_lm(tokenizer)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)  # the per-sample norms run forwards of their own
    trainer = make_trainer(model=model, trainer_cls=Spying, snr_estimator="per_sample", max_steps=2)
    assert trainer.kl_recorder is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning naming the layer
        trainer.train()
    assert len(trainer.grad_forwards) > len(trainer.loss_forwards) > 0  # the fallback's forwards happened
    assert [name for name, _, _ in trainer.read] == ["per_sample", "step_kl"] * len(trainer.loss_forwards)
    read = iter(trainer.read)
    for log_probs, entropies, _ in trainer.loss_forwards:
        (_, per_sample_log_probs, per_sample_entropies), (_, step_kl_log_probs, _) = next(read), next(read)
        assert per_sample_log_probs is log_probs and per_sample_entropies is entropies
        assert step_kl_log_probs is log_probs


def test_under_fsdp2_a_layer_the_ghost_norms_do_not_know_is_an_error_naming_it(make_trainer, tokenizer, monkeypatch):
    """The per-row fallback differentiates with respect to the parameters, which FSDP2 keeps as shards outside the
    graph: there it would measure nothing, so the layer is named and the defaults are offered instead."""
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    trainer = make_trainer(model=model, baseline_weights="exact", max_steps=1)
    monkeypatch.setattr(trainer.completion_weights, "sharded", True)  # as the trainer tells it under FSDP2
    with pytest.raises(NotImplementedError, match=r"model.norm` \(LayerNorm\).*Under FSDP2.*baseline_weights='logit'"):
        trainer.train()


@pytest.mark.parametrize(("loss_type", "expected"), [("dapo", [3.0, 2.0]), ("grpo", [1 / 3, 1 / 2]), ("sapo", [1 / 3, 1 / 2])])
def test_weights_take_the_loss_types_per_completion_gain(make_trainer, loss_type, expected):
    """Under a per-completion token mean each token's gradient is divided by L_i, so a token-sum weight by L_i²:
    `length` becomes L_i/L_i² = 1/L_i (the length trend reverses); the exact weights take the same gain."""
    output = {
        "prompt_ids": torch.tensor([[3, 4], [3, 4]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    trainer = make_trainer(baseline_weights="length", loss_type=loss_type)
    assert trainer.completion_weights.compute(output, None, "train").tolist() == pytest.approx(expected)
    exact = make_trainer(baseline_weights="exact", loss_type=loss_type)
    scale = output["completion_mask"].float() * (torch.tensor([[1 / 3], [1 / 2]]) if loss_type != "dapo" else 1.0)
    assert torch.allclose(exact.completion_weights.compute(output, None, "train"), exact.completion_weights.grad_sq_norms(output, scale))


def test_snr_options_reach_the_controller(make_trainer):
    trainer = make_trainer(snr_lr_reference="calibrated", snr_calibration_steps=7, snr_lr_min_ratio=0.3,
                           snr_lr_max_ratio=3.5, snr_warmup_steps=2)
    controller = trainer.step_rate.snr
    assert (controller.reference, controller.calibration.steps) == ("calibrated", 7)
    assert (controller.min_ratio, controller.max_ratio, controller.calibration.start) == (0.3, 3.5, 2)
    assert make_trainer(snr_lr_reference="absolute").step_rate.snr.reference == "absolute"
    assert make_trainer(use_snr_lr=False).step_rate.snr is None
