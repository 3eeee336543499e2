"""pytest plugin of `trl_conformance.py`: offline stand-ins for TRL's test models and datasets, and the trainer swap.

Loaded with `-p trl_conformance_plugin` before TRL's test module is imported, so that its `from trl import
GRPOConfig, GRPOTrainer` and `from datasets import load_dataset` pick up what is set here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers.training_args

ORGANISATION = "trl-internal-testing"
REVISION = "0" * 40
# repository name → (model_type, head); sizes are tiny and shared
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "tiny-LlamaForCausalLM-3.2": ("llama", "causal"),
    "tiny-MistralForCausalLM-0.2": ("mistral", "causal"),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal"),
    "tiny-GptOssForCausalLM": ("gpt_oss", "causal"),
    "tiny-Gemma2ForCausalLM": ("gemma2", "causal"),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal"),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal"),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal"),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "classification"),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "classification"),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "classification"),
}
PROMPTS = [
    "The sky is", "The sun is", "Water is", "The moon is", "Fire is", "Grass is", "Snow is", "Night is", "A cat is",
    "The sea is", "Rain is", "Sand is", "A tree is", "The wind is", "Ice is", "A star is", "Stone is", "A bird is",
    "The road is",
]


def build_hub() -> None:
    """Write every buildable model of MODELS, with a tokenizer, into $HF_HUB_CACHE in the Hub cache's layout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from oblr_trl.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    cache = Path(os.environ["HF_HUB_CACHE"])
    for name, (model_type, head) in MODELS.items():
        repo = cache / f"models--{ORGANISATION}--{name}"
        snapshot = repo / "snapshots" / REVISION
        if (snapshot / "config.json").exists():
            continue
        sizes = dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id, num_labels=1,
        )
        try:
            config = AutoConfig.for_model(model_type, **sizes)
            auto = AutoModelForCausalLM if head == "causal" else AutoModelForSequenceClassification
            torch.manual_seed(0)
            model = auto.from_config(config)
            snapshot.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(snapshot)
            tokenizer.save_pretrained(snapshot)
        except Exception as error:  # noqa: BLE001 - an unbuildable stand-in fails its tests for every variant alike
            print(f"conformance: could not build {ORGANISATION}/{name} ({type(error).__name__}: {error})")
            continue
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)


def _zen(config_name: str) -> datasets.DatasetDict:
    def rows(prompts):
        if config_name == "standard_prompt_only":
            return {"prompt": prompts}
        if config_name == "conversational_prompt_only":
            return {"prompt": [[{"role": "user", "content": p}] for p in prompts]}
        raise ValueError(f"conformance: no stand-in for {ORGANISATION}/zen configuration {config_name!r}")

    return datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows(PROMPTS[:17])), "test": datasets.Dataset.from_dict(rows(PROMPTS[17:]))}
    )


_original_load_dataset = datasets.load_dataset


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if path != f"{ORGANISATION}/zen":
        return _original_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    data = _zen(name)
    if streaming:
        data = datasets.IterableDatasetDict({key: value.to_iterable_dataset() for key, value in data.items()})
    return data if split is None else data[split]


datasets.load_dataset = load_dataset


def _missing_availability_check(name: str):
    """TRL's newer test helpers import `is_*_available` functions an older installed TRL lacks: read as False."""
    if name.startswith("is_") and name.endswith("_available"):
        return lambda *args, **kwargs: False
    raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")


import importlib  # noqa: E402

_import_utils = importlib.import_module("trl.import_utils")
if "__getattr__" not in vars(_import_utils):
    _import_utils.__getattr__ = _missing_availability_check
# GRPOConfig defaults to bf16; transformers refuses it without a bf16 GPU. Same for every variant.
transformers.training_args.is_torch_bf16_gpu_available = lambda: True


_variant = os.environ.get("OBLR_CONFORMANCE_VARIANT", "grpo")
if _variant != "grpo":
    import trl

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    # module-level classes: the Trainer pickles its arguments into every checkpoint
    @dataclass
    class ExactWeightsConfig(OBLRPOConfig):
        baseline_weights: str = field(default="exact", metadata={"help": "conformance run: exact weights"})

    @dataclass
    class PerSampleSNRConfig(OBLRPOConfig):
        snr_estimator: str = field(default="per_sample", metadata={"help": "conformance run: per-sample SNR"})

    configs = {"oblrpo": OBLRPOConfig, "exact": ExactWeightsConfig, "per_sample": PerSampleSNRConfig}
    trl.GRPOConfig, trl.GRPOTrainer = configs[_variant], OBLRPOTrainer
