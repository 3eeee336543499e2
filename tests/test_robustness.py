"""Bad input never yields a NaN parameter or a silent skip: either correct finite advantages and learning rates, or a
clear error naming the cause. docs/robustness.md lists every case with the test below that covers it."""

import math

import pytest
import torch
from conftest import base_config_kwargs, digit_fraction_reward
from datasets import Dataset

from oblr_trl import OBLRPOConfig, OBLRPOTrainer

NAN, INF = float("nan"), float("inf")


class RecordingTrainer(OBLRPOTrainer):
    """Keeps the advantages of every generation batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.advantages = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.advantages.append(output["advantages"].clone())
        return output


def train_safely(trainer):
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters()), "a parameter became non-finite"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for entry in logged:
        for key in ("snr/lr_factor", "oblr/lr"):
            if key in entry:
                assert math.isfinite(entry[key]), (key, entry[key])
    for advantages in getattr(trainer, "advantages", []):
        assert torch.isfinite(advantages).all()
    return before, logged


def cycling(values):
    """A reward function returning `values` over and over (None, NaN and inf included)."""

    def reward(completions, **kwargs):
        return [values[i % len(values)] for i in range(len(completions))]

    reward.__name__ = "cycling_reward"
    return reward


@pytest.mark.parametrize(
    ("name", "funcs"),
    [
        ("nan_from_some", [cycling([1.0, NAN, 0.0, 2.0])]),
        ("none_from_some", [cycling([1.0, None, 0.0, None])]),
        ("inf_from_some", [cycling([INF, 0.0, -INF, 1.0])]),
        ("none_from_all_functions", [cycling([None]), cycling([None])]),
        ("nan_everywhere", [cycling([NAN])]),
        ("none_in_one_function_only", [cycling([None, 1.0]), digit_fraction_reward]),
    ],
)
def test_bad_rewards_give_finite_advantages(make_trainer, name, funcs):
    trainer = make_trainer(reward_funcs=funcs, trainer_cls=RecordingTrainer)
    _, logged = train_safely(trainer)
    assert "oblr/unscorable_frac" in logged[0]
    if name in ("none_from_all_functions", "nan_everywhere"):
        assert all(a.abs().sum() == 0 for a in trainer.advantages)  # nothing to learn from: no signal, no NaN


def test_all_equal_rewards_give_zero_advantages_and_no_update(make_trainer):
    trainer = make_trainer(reward_funcs=[cycling([0.3])], trainer_cls=RecordingTrainer, max_steps=2)
    before, logged = train_safely(trainer)
    assert all(torch.equal(a, torch.zeros_like(a)) for a in trainer.advantages)
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    assert all(entry["snr/lr_factor"] == 1.0 for entry in logged)  # zero gradient: the factor has nothing to scale


@pytest.mark.parametrize("baseline_weights", ["logit", "exact", "length"])
def test_empty_completions(make_trainer, monkeypatch, baseline_weights):
    """Every other completion comes back from the generator with no token at all (which TRL alone cannot score)."""
    from trl import GRPOTrainer

    generate = GRPOTrainer._generate_single_turn

    def generate_with_empties(self, *args, **kwargs):
        completion_ids, logprobs = generate(self, *args, **kwargs)
        return [[] if i % 2 else ids for i, ids in enumerate(completion_ids)], logprobs

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate_with_empties)
    trainer = make_trainer(trainer_cls=RecordingTrainer, baseline_weights=baseline_weights)
    with pytest.warns(UserWarning, match="empty completion"):
        _, logged = train_safely(trainer)
    assert all(entry["oblr/empty_completions"] == 4.0 for entry in logged)


class BadWeights(RecordingTrainer):
    def __init__(self, *args, weights=(), **kwargs):
        super().__init__(*args, **kwargs)
        forced = torch.tensor(weights)
        self.completion_weights.compute = lambda output, record, mode, measure=None: forced.repeat(8)[: output["completion_ids"].size(0)]


@pytest.mark.parametrize(
    "weights", [[0.0] * 8, [NAN] * 8, [INF, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 5.0]], ids=["zero", "nan", "inf", "mostly-zero"]
)
@pytest.mark.parametrize("estimator", ["weighted", "pooled_slope"])
def test_zero_or_non_finite_weights_fall_back(make_trainer, tokenizer, prompt_dataset, tmp_path, weights, estimator):
    """The weighted baseline falls back to the uniform mean (counted); the pooled slope leaves such weights out of its
    fit (it uses no weights in the baseline itself): both train with finite advantages and a finite slope."""
    import math

    from oblr_trl.testing import tiny_causal_lm

    trainer = BadWeights(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=[digit_fraction_reward],
        args=OBLRPOConfig(**base_config_kwargs(tmp_path, baseline_estimator=estimator)),
        train_dataset=prompt_dataset,
        processing_class=tokenizer,
        weights=weights,
    )
    _, logged = train_safely(trainer)
    if estimator == "weighted":
        assert any(entry["oblr/loo_fallback_frac"] > 0 for entry in logged)
    else:
        assert math.isfinite(trainer.pooled_slope.value)


def test_two_completions_per_group(make_trainer):
    train_safely(make_trainer(num_generations=2, per_device_train_batch_size=2, trainer_cls=RecordingTrainer))


def test_group_size_not_dividing_the_batch_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"generation_batch_size \(6\) must be divisible by num_generations \(4\)"):
        OBLRPOConfig(**base_config_kwargs(tmp_path, per_device_train_batch_size=3, num_generations=4))


def test_prompt_longer_than_the_context_is_refused(make_trainer, tokenizer):
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    model.config.max_position_embeddings = 24
    dataset = Dataset.from_dict({"prompt": ["1+1=" * 10] * 8})
    with pytest.raises(ValueError, match="A prompt of 40 tokens exceeds the model's context of 24 tokens"):
        make_trainer(model=model, dataset=dataset).train()


def test_prompt_plus_completion_past_the_context_warns_like_trl_generates(make_trainer, tokenizer):
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    model.config.max_position_embeddings = 12
    dataset = Dataset.from_dict({"prompt": ["1+1=" * 2] * 8})
    with pytest.warns(UserWarning, match="plus max_completion_length=8 exceeds the model's context of 12"):
        make_trainer(model=model, dataset=dataset, max_steps=1).train()


def test_empty_dataset_is_refused_before_the_model_loads(make_trainer, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset`: it is empty"):
        make_trainer(model=str(tmp_path / "not-loaded"), dataset=Dataset.from_dict({"prompt": []}))


def test_wrong_columns_are_refused_before_the_model_loads(make_trainer, tmp_path):
    with pytest.raises(ValueError, match="no 'prompt' column.*'question'"):
        make_trainer(model=str(tmp_path / "not-loaded"), dataset=Dataset.from_dict({"question": ["1+1="]}))

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"Reward function 'needs_answer' needs the argument\(s\) \['answer'\]"):
        make_trainer(model=str(tmp_path / "not-loaded"), reward_funcs=[needs_answer])


def test_a_failing_reward_function_is_named(make_trainer):
    def flaky_reward(completions, **kwargs):
        raise ZeroDivisionError("division by zero")

    with pytest.raises(RuntimeError, match="Reward function 'flaky_reward' raised ZeroDivisionError: division by zero"):
        make_trainer(reward_funcs=[flaky_reward]).train()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"gradient_accumulation_steps": 1, "per_device_train_batch_size": 8, "snr_estimator": "two_batch"},
         "`snr_estimator`: 'two_batch' needs"),
        ({"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_clip_max": 2.0}, "must be less than"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "can not be both configured"),
        ({"lr_trust_region_sample_size": 0}, "`lr_trust_region_sample_size`"),
    ],
)
def test_contradictory_configuration_is_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        OBLRPOConfig(**base_config_kwargs(tmp_path, **overrides))


class PoisonedStep(OBLRPOTrainer):
    """Makes the loss (or one gradient) of optimizer step 2 non-finite."""

    poison = "loss"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step == 1:
            if self.poison == "loss":
                return loss * float("nan")
            next(p for p in model.parameters() if p.requires_grad).register_hook(
                lambda grad: torch.full_like(grad, float("inf")) if self.state.global_step == 1 else grad
            )
        return loss


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_non_finite_steps_are_refused_and_counted(make_trainer, poison):
    PoisonedStep.poison = poison
    trainer = make_trainer(trainer_cls=PoisonedStep, max_steps=3)
    _, logged = train_safely(trainer)
    assert trainer.skipped_nonfinite_steps == 1
    assert logged[1]["oblr/skipped_nonfinite_steps"] == 1.0
    assert "snr/lr_factor" not in logged[1]  # the refused step never reached the learning-rate hooks
    assert all(math.isfinite(entry["snr/lr_factor"]) for entry in (logged[0], logged[2]))


def test_skip_nonfinite_steps_off_lets_nan_through(make_trainer):
    """The guard is what keeps the parameters finite: without it the poisoned step writes NaN."""
    PoisonedStep.poison = "loss"
    trainer = make_trainer(trainer_cls=PoisonedStep, max_steps=2, skip_nonfinite_steps=False, use_snr_lr=False)
    trainer.train()
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_environment_owned_prompts_are_not_refused():
    """With an `environment_factory` or `rollout_func` the environment owns the prompts: TRL accepts rows without a
    'prompt' column, and so do we."""
    from oblr_trl.training.guards import validate_training_data

    rows = Dataset.from_dict({"task_id": [0, 1]})
    with pytest.raises(ValueError, match="no 'prompt' column"):
        validate_training_data(rows, [], [])
    validate_training_data(rows, [], [], requires_prompt=False)
