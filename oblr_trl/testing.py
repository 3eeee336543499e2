"""Tiny, locally built models and tokenizers for tests, examples and smoke benchmarks (no Hub access).

The tokenizer works on characters, so any text round-trips; the models are randomly initialised Llama-, Qwen2- or
Qwen3-style causal LMs small enough for exact per-sample gradients on a CPU. `allow_fsdp_on_cpu` lets accelerate run
FSDP2 over CPU processes, for tests and benchmarks of the sharded path on a machine without GPUs.
`with_rate_tuning` runs a trainer with other constants of its rate rule, for tests and the benchmarks' ablations.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

__all__ = ["CHAT_TEMPLATE", "allow_fsdp_on_cpu", "tiny_causal_lm", "tiny_tokenizer", "with_rate_tuning"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_ARCHITECTURES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with a chat template and pad/eos/bos tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast | None = None,
    architecture: str = "llama",
    hidden_size: int = 32,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A randomly initialised causal LM of the given family ('llama', 'qwen2' or 'qwen3') for ``tokenizer``."""
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"Invalid value for `architecture`: {architecture!r}. Allowed values: {sorted(_ARCHITECTURES)}.")
    tokenizer = tokenizer or tiny_tokenizer()
    config = _ARCHITECTURES[architecture](
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def allow_fsdp_on_cpu() -> None:
    """Let accelerate set up the FSDP plugin it is given on a multi-process CPU run (gloo).

    accelerate builds FSDP only for GPU-like devices and silently keeps DDP on CPU processes. This lifts that one
    refusal (call it before the Trainer is created); everything after it — `fsdp2_prepare_model`'s wrapping,
    gradient accumulation without sync, clipping of DTensor gradients, the optimizer on shards — is accelerate's and
    torch's real FSDP2 path. For tests and benchmarks only.
    """
    import accelerate.state as state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # the process state is shared: later AcceleratorState() calls copy their distributed type from it
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = init


def with_rate_tuning(trainer_cls: type, settings: dict) -> tuple[type, dict]:
    """``settings`` (config fields and constants of the rate rule, `RateRuleTuning`'s fields, mixed) as the trainer
    class whose `rate_tuning` holds those constants and the config fields left: ``(trainer_cls, config fields)``."""
    from .estimators.step_rate import RateRuleTuning

    tuning, config = RateRuleTuning.split(settings)
    if tuning == trainer_cls.rate_tuning:
        return trainer_cls, config
    return type(trainer_cls.__name__, (trainer_cls,), {"rate_tuning": tuning}), config
