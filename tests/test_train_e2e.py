"""Acceptance 7: `train()` works end to end on a tiny local model across the GRPO features users rely on, and the
trainable parameters change."""

import math

import pytest
import torch
from conftest import digit_fraction_reward, vowel_reward

from oblr_trl import OBLRPOTrainer
from oblr_trl.training.completion_weights import CompletionWeights

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def train_and_check(trainer):
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)]
    assert changed, "no trainable parameter changed"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(math.isfinite(h["loss"]) for h in logged)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return logged


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type(make_trainer, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    train_and_check(make_trainer(loss_type=loss_type, **extra))


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_iterations": 2},
        {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 2},
        {"baseline_weights": "exact", "gradient_checkpointing": True},
        {"baseline_weights": "length", "leave_one_out": False},
        {"baseline_weights": "uniform", "use_snr_lr": False},
        {"snr_estimator": "per_sample", "gradient_checkpointing": True},
        {"scale_rewards": "group", "mask_truncated_completions": True},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_training_features(make_trainer, overrides):
    train_and_check(make_trainer(**overrides))


def test_reference_model_with_beta(make_trainer, tokenizer, tmp_path):
    """beta > 0 without PEFT: TRL loads the reference model from the policy's path."""
    from oblr_trl.testing import tiny_causal_lm

    path = tmp_path / "tiny-model"
    tiny_causal_lm(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    logged = train_and_check(make_trainer(model=str(path), beta=0.04))
    assert all(math.isfinite(h["kl"]) for h in logged)


class WeightsWithoutGenerationLogits(CompletionWeights):
    def captures_generation_logits(self):
        return False


class NoGenerationCapture(OBLRPOTrainer):
    """As under vLLM: the generation logits are not available to the trainer."""

    weights_class = WeightsWithoutGenerationLogits


@pytest.mark.parametrize(
    ("trainer_cls", "steps_per_generation", "extra_forward"),
    [(OBLRPOTrainer, None, 0.0), (NoGenerationCapture, 4, 0.0), (NoGenerationCapture, None, 1.0)],
    ids=["from-generation", "reuses-trl-forward", "own-forward"],
)
def test_logit_weights_cost_no_extra_forward_when_avoidable(make_trainer, trainer_cls, steps_per_generation, extra_forward):
    """transformers' generation: the weights come from the logits it computed. Otherwise, with
    steps_per_generation > gradient_accumulation_steps TRL runs a no-grad forward (old log-probs) and the weights reuse
    it; only when neither exists does the trainer run one forward of its own."""
    logged = train_and_check(
        make_trainer(trainer_cls=trainer_cls, steps_per_generation=steps_per_generation, max_steps=3)
    )
    values = [h["oblr/weights/extra_forward"] for h in logged if "oblr/weights/extra_forward" in h]
    assert values and all(value == extra_forward for value in values)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("baseline_weights", ["logit", "exact"])
def test_peft_lora(make_trainer, beta, baseline_weights):
    from peft import LoraConfig

    trainer = make_trainer(
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        beta=beta,
        baseline_weights=baseline_weights,
        learning_rate=5e-2,
    )
    assert all("lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    train_and_check(trainer)


def test_conversational_dataset_and_two_reward_functions(make_trainer, conversational_dataset):
    logged = train_and_check(
        make_trainer(dataset=conversational_dataset, reward_funcs=[digit_fraction_reward, vowel_reward])
    )
    assert "rewards/vowel_reward/mean" in logged[0] and "rewards/digit_fraction_reward/mean" in logged[0]
