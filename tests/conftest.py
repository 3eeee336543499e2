"""Shared fixtures: tiny local models, datasets, reward functions and a trainer factory. Nothing touches the Hub."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# vLLM's own tests need vLLM (the environment of .ci/constraints-vllm.txt); elsewhere they are not collected
collect_ignore = [] if importlib.util.find_spec("vllm") else ["test_vllm.py"]

# OBLR_TRL_TEST_THREADS=1 runs the suite single-threaded (it must pass with 1 and 2 threads alike)
torch.set_num_threads(int(os.environ.get("OBLR_TRL_TEST_THREADS", min(2, torch.get_num_threads()))))


def digit_fraction_reward(completions, **kwargs):
    """Share of digits in the completion: varies between completions of a random tiny model."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def vowel_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(sum(ch in "aeiou" for ch in t)) for t in texts]


@pytest.fixture(scope="session")
def tokenizer():
    from oblr_trl.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_policy_pools(tokenizer):
    """Two independent pools (512 and 1024 completions) from a tiny policy, with exact per-sample gradients."""
    from tiny_policy import peaked_tiny_policy, sample_pool

    model = peaked_tiny_policy(tokenizer)
    prompt_ids = torch.tensor([tokenizer("7+5=").input_ids])
    return (
        sample_pool(model, tokenizer, prompt_ids, 512, 6, seed=0),
        sample_pool(model, tokenizer, prompt_ids, 1024, 6, seed=1),
    )


@pytest.fixture
def saved_tiny_model(tmp_path, tokenizer):
    """A tiny model and its tokenizer saved to a folder, for code that loads models by path."""
    from oblr_trl.testing import tiny_causal_lm

    path = tmp_path / "tiny-model"
    tiny_causal_lm(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def prompt_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})


@pytest.fixture
def conversational_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"What is {a}+{b}?"}] for a in range(4) for b in range(4)]}
    )


def base_config_kwargs(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        # a random tiny model rarely samples EOS: bias it (+3 on the logit, ~17% per token) so completion lengths vary
        generation_kwargs={"sequence_bias": [[[1], 3.0]]},
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture
def make_trainer(tmp_path, tokenizer, prompt_dataset):
    """Build an OBLRPOTrainer on a fresh tiny model; keyword arguments override the config."""
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.testing import tiny_causal_lm, with_rate_tuning

    def factory(
        reward_funcs=None, dataset=None, model=None, trainer_cls=OBLRPOTrainer, callbacks=None, peft_config=None,
        **overrides,
    ):
        # the rate rule's constants among the overrides (`RateRuleTuning`) go to the trainer, the rest to the config;
        # the SNR factor acts from the first estimates, so that runs of a few steps see it
        trainer_cls, config = with_rate_tuning(trainer_cls, {"snr_warmup_steps": 0,
                                                             **base_config_kwargs(tmp_path, **overrides)})
        args = OBLRPOConfig(**config)
        return trainer_cls(
            model=model if model is not None else tiny_causal_lm(tokenizer),
            reward_funcs=reward_funcs or [digit_fraction_reward],
            args=args,
            train_dataset=dataset if dataset is not None else prompt_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            peft_config=peft_config,
        )

    return factory


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything resolves or loads a model (for errors that must come first)."""
    from transformers import AutoModelForCausalLM

    import oblr_trl.training.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(oblr_trl.training.models, "resolve_model", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


# Option sets every multi-process layout must reproduce (tests/test_fsdp2.py, tests/test_multiprocess.py), each stated
# as what it changes from what ships (the worker's `RUN` fixes only the run's size and what the comparison holds
# still). So every case runs the trust region's peak form per Adam update, its KL on a sample of up to 8 completions
# (all 8 of a step here) measured on the probe, the step after it and then 2, 4, 8, ... steps with a gradient apart up
# to every 16th, and the calibrated SNR factor, which the shipped constants hold at 1 over 4 steps (5 estimates of
# warm-up, then a window of at least 20) while f_t is measured. Clipping at 0.05 acts on every step of these runs
# (their pre-clip norms are larger), so "with clipping" means clipped steps.
CLIP = 0.05
# A named deviation from the shipped constants, so that the calibrated SNR factor acts within 4 steps: no warm-up, the
# smallest window (2 estimates) and the factor free to lower the rate to 0.1 of the schedule (raise-only, it stays 1
# while the SNR falls, as it does over these runs' first steps). The window resolves only where its estimates are told
# apart from noise (t >= 2), which in 4 steps of this data `per_sample` with `num_iterations=2` and tied embeddings do.
SNR_FACTOR_ACTS = {"snr_warmup_steps": 0, "snr_calibration_steps": 2, "snr_lr_min_ratio": 0.1}
# The paper's SNR factor instead (a public option): f_t floored at 0.1, acting from the first estimate.
SNR_ABSOLUTE_FROM_FIRST_ESTIMATE = {"snr_lr_reference": "absolute", "snr_warmup_steps": 0}
BACKEND_MATRIX = [
    {"baseline_weights": weights, "snr_estimator": estimator, "num_iterations": iterations,
     "tie_word_embeddings": tied, "max_grad_norm": clip}
    for weights in ("logit", "exact")
    for estimator in ("cross_step", "per_sample")
    for iterations in (1, 2)
    for tied in (False, True)
    for clip in (0.0, CLIP)
] + [
    # the calibrated SNR factor resolved and acting (`SNR_FACTOR_ACTS`), and the KL measured on 3 of a step's 8
    # completions: the same draw, whichever process holds each row
    {"baseline_weights": "exact", "snr_estimator": "per_sample", "num_iterations": 2, "tie_word_embeddings": True,
     "max_grad_norm": CLIP, "lr_trust_region_sample_size": 3, **SNR_FACTOR_ACTS},
    # exact weights measured only where rewards differ: with 4 completions a prompt each process holds one group, and
    # the one whose group has no spread must still run as many ghost-norm passes as the other under FSDP2; the SNR
    # factor read as 'absolute'
    {"baseline_weights": "exact", "snr_estimator": "cross_step", "num_iterations": 1, "tie_word_embeddings": True,
     "max_grad_norm": 0.0, "num_generations": 4, "reward": "alike_for_even_b", **SNR_ABSOLUTE_FROM_FIRST_ESTIMATE},
    # the ghost-norm passes (weights and the per-sample SNR) under non-reentrant gradient checkpointing, which they
    # keep on: each checkpointed module's input is taken from the backward's recompute, FSDP2 gathering the layer for
    # it
    {"baseline_weights": "exact", "snr_estimator": "per_sample", "num_iterations": 1, "tie_word_embeddings": True,
     "max_grad_norm": 0.0, "gradient_checkpointing": True},
]


def backend_case_id(case: dict) -> str:
    sample = [f"kl_sample{case['lr_trust_region_sample_size']}"] if case.get("lr_trust_region_sample_size") else []
    groups = [f"groups_of_{case['num_generations']}_{case['reward']}"] if case.get("reward") else []
    checkpointing = ["checkpointed"] if case.get("gradient_checkpointing") else []
    snr = ["snr_acts"] if SNR_FACTOR_ACTS.items() <= case.items() else []
    snr += [f"snr_{case['snr_lr_reference']}"] if "snr_lr_reference" in case else []
    return "-".join([case["baseline_weights"], case["snr_estimator"], f"iterations{case['num_iterations']}",
                     "tied" if case["tie_word_embeddings"] else "untied",
                     "clipped" if case["max_grad_norm"] else "unclipped", *snr, *sample, *groups, *checkpointing])


@pytest.fixture(scope="session")
def single_process_matrix(tmp_path_factory):
    """Every case of `BACKEND_MATRIX` on 1 process (4 micro-batches of 2 completions a step): the reference."""
    from test_multiprocess import launch_cases

    return launch_cases(tmp_path_factory.mktemp("single"), 1, 4, BACKEND_MATRIX)
