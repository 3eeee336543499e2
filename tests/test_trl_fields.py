"""The early checks `OBLRPOConfig` makes of fields it takes from TRL, compared with the installed TRL, transformers and
torch: each value refused early either fails late there (after the model has loaded) or is refused early by TRL itself,
and each value allowed runs through their code. A TRL or transformers upgrade that adds, drops or starts to refuse a
value fails here rather than in a user's run."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from conftest import base_config_kwargs, digit_fraction_reward, vowel_reward
from transformers import Trainer
from trl import GRPOConfig, GRPOTrainer

from oblr_trl import OBLRPOConfig
from oblr_trl.training.config import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from oblr_trl.training.options import TRAINER_VALUE_RULES

# A value each rule of TRAINER_VALUE_RULES refuses, and one at each edge of what it allows
REFUSED = {
    "learning_rate": [-1.0, math.nan, math.inf],
    "weight_decay": [-0.1, math.nan, math.inf],
    "adam_beta1": [1.0, -0.5, math.nan],
    "adam_beta2": [1.0, -0.5, math.nan],
    "adam_epsilon": [-1e-8, math.nan, math.inf],
    "warmup_steps": [math.nan, math.inf],
    "max_steps": [0],
    "num_train_epochs": [0.0, -1.0, math.nan],
    "per_device_train_batch_size": [0],
    "gradient_accumulation_steps": [0],
    "max_completion_length": [0, None],
    "temperature": [0.0, -1.0, math.nan, math.inf],
    "top_p": [0.0, -0.5, 1.5],
    "beta": [-0.01, math.nan],
}
ALLOWED = {
    "learning_rate": [0.0, 1e-6],
    "weight_decay": [0.0, 0.1],
    "adam_beta1": [0.0, 0.999999],
    "adam_beta2": [0.0, 0.999999],
    "adam_epsilon": [0.0, 1e-8],
    "warmup_steps": [0, 0.5, 5],
    "max_steps": [-5, -1, 1],
    "num_train_epochs": [0.01, 3.0],
    "per_device_train_batch_size": [1],
    "gradient_accumulation_steps": [1],
    "max_completion_length": [1],
    "temperature": [1e-3, 1.0],
    "top_p": [1e-3, 1.0],
    "beta": [0.0, 0.04],
}
RULES = {name: (allowed, valid) for name, allowed, valid in TRAINER_VALUE_RULES}


def grpo_config(tmp_path, **values) -> GRPOConfig:
    """TRL's own config (no OBLR-PO checks), in the tests' small batch layout."""
    return GRPOConfig(**base_config_kwargs(tmp_path, **values))


def grpo_trainer(tmp_path, tokenizer, prompt_dataset, model=None, **values) -> GRPOTrainer:
    """TRL's trainer on a tiny model (``model``: a path to load it from, as GRPOTrainer needs to build a reference)."""
    from oblr_trl.testing import tiny_causal_lm

    return GRPOTrainer(
        model=str(model) if model is not None else tiny_causal_lm(tokenizer),
        reward_funcs=[digit_fraction_reward, vowel_reward], args=grpo_config(tmp_path, **values),
        train_dataset=prompt_dataset, processing_class=tokenizer,
    )


def one_generation_batch(trainer) -> list[dict]:
    """A generation batch as TRL's sampler yields it: each prompt `num_generations` times in a row."""
    prompts = ["1+2=", "3+4="][: trainer.args.generation_batch_size // trainer.num_generations]
    return [{"prompt": prompt} for prompt in prompts for _ in range(trainer.num_generations)]


# ------------------------------------------------------------------------------------------------------------------
# The rules and TRL's own checks
# ------------------------------------------------------------------------------------------------------------------


def test_each_rule_has_its_refused_and_allowed_values_here():
    assert set(REFUSED) == set(ALLOWED) == set(RULES)
    for name, (allowed, valid) in RULES.items():
        assert not any(valid(value) for value in REFUSED[name]), name
        assert all(valid(value) for value in ALLOWED[name]), name


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in REFUSED.items() for v in values])
def test_grpo_config_takes_each_value_a_rule_refuses(tmp_path, field, value):
    """No rule repeats a check of GRPOConfig/TrainingArguments: were one added there, this fails and ours goes."""
    assert getattr(grpo_config(tmp_path, **{field: value}), field) == value or value != value  # NaN


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in ALLOWED.items() for v in values])
def test_oblrpo_config_takes_each_value_a_rule_allows(tmp_path, field, value):
    layout = {"num_generations": 2} if field == "per_device_train_batch_size" else {}  # whole groups in a batch
    assert getattr(OBLRPOConfig(**base_config_kwargs(tmp_path, **layout, **{field: value})), field) == value


def test_a_negative_warmup_steps_is_left_to_training_arguments_which_refuses_it_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError) as trls:
        grpo_config(tmp_path, warmup_steps=-5)
    with pytest.raises(ValueError) as ours:
        OBLRPOConfig(**base_config_kwargs(tmp_path, warmup_steps=-5))
    assert str(ours.value) == str(trls.value)
    assert "warmup_steps" in str(ours.value) and "-5" in str(ours.value)


# ------------------------------------------------------------------------------------------------------------------
# The late failures each rule prevents
# ------------------------------------------------------------------------------------------------------------------


def optimizer_step(config) -> torch.Tensor:
    """One step of the optimizer `Trainer.create_optimizer` builds from ``config`` (its class, keyword arguments and
    weight-decay group), on a parameter of ones with gradient 0.5; the parameter after it."""
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(config)
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = optimizer_cls([{"params": [parameter], "weight_decay": config.weight_decay}], **kwargs)
    parameter.grad = torch.full_like(parameter, 0.5)
    optimizer.step()
    return parameter.detach()


@pytest.mark.parametrize(("field", "value", "late"), [
    ("learning_rate", -1.0, "refused"),
    ("learning_rate", math.nan, "refused"),
    ("learning_rate", math.inf, "non-finite"),
    ("weight_decay", -0.1, "grows"),  # AdamW checks only its default; each step scales by 1 + lr × 0.1
    ("weight_decay", math.nan, "non-finite"),
    ("weight_decay", math.inf, "non-finite"),
    ("adam_beta1", 1.0, "refused"),
    ("adam_beta1", -0.5, "refused"),
    ("adam_beta1", math.nan, "refused"),
    ("adam_beta2", 1.0, "refused"),
    ("adam_beta2", -0.5, "refused"),
    ("adam_beta2", math.nan, "refused"),
    ("adam_epsilon", -1e-8, "refused"),
    ("adam_epsilon", math.nan, "refused"),
    ("adam_epsilon", math.inf, "frozen"),  # every update divided by an infinite denominator
])
def test_the_optimizer_the_trainer_builds_refuses_or_breaks_on_what_the_rules_refuse(tmp_path, field, value, late):
    assert not RULES[field][1](value)
    config = grpo_config(tmp_path, **{field: value})
    if late == "refused":
        with pytest.raises(ValueError):
            optimizer_step(config)
    elif late == "non-finite":
        assert not torch.isfinite(optimizer_step(config)).all()
    elif late == "grows":  # decay away from 0: without a gradient the parameters grow exponentially
        assert (optimizer_step(config) > optimizer_step(grpo_config(tmp_path, **{field: 0.0}))).all()
    else:
        assert torch.equal(optimizer_step(config), torch.ones(3))


@pytest.mark.parametrize("field", ["learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"])
def test_the_optimizer_the_trainer_builds_takes_the_edges_the_rules_allow(tmp_path, field):
    for value in ALLOWED[field]:
        assert torch.isfinite(optimizer_step(grpo_config(tmp_path, **{field: value}))).all()


def test_a_non_finite_warmup_steps_fails_where_the_trainer_builds_its_schedule(tmp_path):
    """`Trainer.create_scheduler` asks `get_warmup_steps`, once the model is loaded and training starts."""
    with pytest.raises(ValueError):
        grpo_config(tmp_path, warmup_steps=math.nan).get_warmup_steps(100)
    with pytest.raises(OverflowError):
        grpo_config(tmp_path, warmup_steps=math.inf).get_warmup_steps(100)
    assert [grpo_config(tmp_path, warmup_steps=v).get_warmup_steps(100) for v in ALLOWED["warmup_steps"]] == [0, 50, 5]


def planned_steps(config) -> int:
    """The optimizer steps `Trainer.train` plans for ``config`` over a data loader of 8 batches."""
    trainer = SimpleNamespace(get_total_train_batch_size=lambda args: 8, get_sp_size=lambda: 1,
                              num_examples=lambda dataloader: 8 * len(dataloader))
    return Trainer.set_initial_training_values(trainer, config, list(range(8)))[-1]


def test_the_step_count_the_trainer_plans_from_max_steps_and_num_train_epochs(tmp_path):
    """Any negative max_steps means "train num_train_epochs" (allowed); 0 steps, or 0 or fewer epochs, plan no step
    (the Trainer still takes one, on a schedule built for none); a NaN epoch count fails when training starts."""
    plan = {v: planned_steps(grpo_config(tmp_path, max_steps=v, num_train_epochs=3.0)) for v in (-5, -1, 1, 0)}
    assert plan == {-5: 12, -1: 12, 1: 1, 0: 0}  # 8 batches / 2 accumulated = 4 steps an epoch
    assert planned_steps(grpo_config(tmp_path, max_steps=-1, num_train_epochs=0.01)) == 1
    for epochs in (0.0, -1.0):
        assert planned_steps(grpo_config(tmp_path, max_steps=-1, num_train_epochs=epochs)) <= 0
    with pytest.raises(ValueError):
        planned_steps(grpo_config(tmp_path, max_steps=-1, num_train_epochs=math.nan))


@pytest.mark.parametrize("field", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_a_zero_batch_size_fails_in_the_trainers_data_loader(tmp_path, tokenizer, prompt_dataset, field):
    """GRPOConfig and GRPOTrainer take it; torch refuses the batch size of 0 it yields when training starts, without
    naming the field."""
    trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, **{field: 0})
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        trainer.get_train_dataloader()
    layout = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_generations": 2, field: 1}
    assert len(grpo_trainer(tmp_path, tokenizer, prompt_dataset, **layout).get_train_dataloader()) > 0


def test_max_completion_length_0_fails_once_the_model_is_loaded_and_none_at_the_first_batch(
    tmp_path, tokenizer, prompt_dataset
):
    from oblr_trl.training.guards import check_prompt_lengths

    with pytest.raises(ValueError, match="max_new_tokens"):  # GRPOTrainer's generation config
        grpo_trainer(tmp_path, tokenizer, prompt_dataset, max_completion_length=0)
    with pytest.raises(TypeError):  # OBLRPOTrainer's check of every batch's prompts against the context
        check_prompt_lengths([[5, 6, 7]], 16, None, warn=True)
    trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, max_completion_length=1)
    assert trainer.generation_config.max_new_tokens == 1


def generate(trainer) -> torch.Tensor:
    """Sample one token per prompt with the generation config GRPOTrainer built (its path without vLLM)."""
    prompt = torch.tensor([[2, 10, 11]])
    return trainer.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  generation_config=trainer.generation_config)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.nan), ("top_p", -0.5),
])
def test_sampling_values_fail_at_the_first_generation(tmp_path, tokenizer, prompt_dataset, field, value):
    trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, max_completion_length=1, **{field: value})
    with pytest.raises(ValueError, match=field):
        generate(trainer)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_sampling_takes_the_edges_the_rules_allow(tmp_path, tokenizer, prompt_dataset, field):
    for value in ALLOWED[field]:
        trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, max_completion_length=1, **{field: value})
        assert generate(trainer).shape == (1, 4)


def test_an_infinite_temperature_makes_every_token_equally_likely():
    """TRL divides the logits by the temperature (generation and the loss's log-probabilities): all become 0."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    assert torch.equal(TemperatureLogitsWarper(math.inf)(None, torch.tensor([[3.0, -1.0]])), torch.zeros(1, 2))


def test_top_p_is_refused_outside_the_interval_grpo_config_states():
    """GRPOConfig states (0, 1], which vLLM enforces; transformers' generation ignores a top_p above 1 and keeps
    the most likely token at 0, so the rule follows TRL's statement."""
    help_text = next(f.metadata["help"] for f in fields(GRPOConfig) if f.name == "top_p")
    assert "Must be in (0, 1]." in help_text and RULES["top_p"][0].endswith("(0, 1]")


def test_a_negative_beta_makes_trls_loss_reward_moving_away_from_the_reference(
    tmp_path, tokenizer, prompt_dataset, saved_tiny_model
):
    """TRL adds beta × KL(π ‖ π_ref) to the loss: with beta < 0 the loss falls the farther the policy is from the
    reference, without bound; a NaN beta makes every loss NaN."""
    def loss(beta: float, reference_logp: float) -> float:
        trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, saved_tiny_model, beta=beta, loss_type="bnpo")
        trainer.model.eval()  # no accumulation normaliser to take from a training loop
        completion = torch.tensor([[12, 13, 14]])
        inputs = {
            "prompt_ids": torch.tensor([[2, 10, 11]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
            "completion_ids": completion, "completion_mask": torch.ones_like(completion),
            "advantages": torch.zeros(1),  # the policy term is 0: the loss is the KL term alone
            "ref_per_token_logps": torch.full(completion.shape, reference_logp),
        }
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, inputs).item()

    # a tiny model's log-probabilities are near -log(vocabulary) > -10: a lower reference log-probability is farther
    assert loss(-0.1, -100.0) < loss(-0.1, -50.0) < 0 < loss(0.1, -50.0) < loss(0.1, -100.0)
    assert math.isnan(loss(math.nan, -50.0))


# ------------------------------------------------------------------------------------------------------------------
# scale_rewards and multi_objective_aggregation: the values GRPOTrainer branches on
# ------------------------------------------------------------------------------------------------------------------


def compared_literals(function, attribute: str) -> set[str]:
    """The strings ``function``'s source compares ``self.<attribute>`` with (==, !=, in, not in)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    literals = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == attribute:
            for comparator in node.comparators:
                items = comparator.elts if isinstance(comparator, (ast.List, ast.Tuple, ast.Set)) else [comparator]
                literals |= {item.value for item in items if isinstance(item, ast.Constant)}
    return literals


@pytest.mark.parametrize(("field", "ours"), [
    ("scale_rewards", SCALE_REWARDS), ("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS),
])
def test_the_values_allowed_are_those_grpo_trainer_branches_on(field, ours):
    assert compared_literals(GRPOTrainer._generate_and_score_completions, field) == set(ours)


def test_the_extraction_finds_each_form_of_comparison():
    class Branches:
        def method(self):
            if self.mode == "a" or self.mode in ["b", "c"] or self.mode != "d" or self.other == "e":
                return self.mode not in ("f",)

    assert compared_literals(Branches.method, "mode") == {"a", "b", "c", "d", "f"}


def test_scale_rewards_true_and_false_are_resolved_by_trl(tmp_path):
    for value, resolved in [(True, "group"), (False, "none")]:
        assert GRPOConfig(**base_config_kwargs(tmp_path, scale_rewards=value)).scale_rewards == resolved
        assert OBLRPOConfig(**base_config_kwargs(tmp_path, scale_rewards=value)).scale_rewards == resolved


@pytest.mark.parametrize(("scale_rewards", "aggregation"), [
    ("none", "sum_then_normalize"), ("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
    ("group", "normalize_then_sum"),
])
def test_each_value_allowed_runs_through_trls_advantages_and_ours(make_trainer, scale_rewards, aggregation):
    """OBLRPOTrainer runs GRPOTrainer's advantages (which raise on a value they do not branch on), then its own."""
    trainer = make_trainer(reward_funcs=[digit_fraction_reward, vowel_reward], max_completion_length=2,
                           scale_rewards=scale_rewards, multi_objective_aggregation=aggregation)
    output = trainer._generate_and_score_completions(one_generation_batch(trainer))
    assert torch.isfinite(output["advantages"]).all()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("scale_rewards", "std", "Invalid value for scale_rewards"),
    ("multi_objective_aggregation", "max", "Invalid multi_objective_aggregation"),
])
def test_trl_refuses_another_value_only_after_generating(tmp_path, tokenizer, prompt_dataset, field, value, message):
    trainer = grpo_trainer(tmp_path, tokenizer, prompt_dataset, max_completion_length=2, **{field: value})
    with pytest.raises(ValueError, match=message):
        trainer._generate_and_score_completions(one_generation_batch(trainer))
    with pytest.raises(ValueError, match=f"Invalid value for `{field}`: '{value}'"):
        OBLRPOConfig(**base_config_kwargs(tmp_path, **{field: value}))
