"""A randomly initialised causal LM with the shape of a Hub model, for timing on machines that cannot reach the Hub.

Step time and memory depend on a model's shape and on the sequence lengths, not on its weights; the `overhead`
benchmark fixes completion lengths, so a random model with the right shape times like the real one. The shapes are
copied from the models' published `config.json`; the vocabulary is the given tokenizer's (state it with the results).

    python -m benchmarks.random_model --shape qwen3-4b --tokenizer PATH --output /tmp/qwen3-4b-shape
    python -m benchmarks.random_model --shape smollm2-1.7b --output /tmp/smollm2-1.7b-shape   # SmolLM2's tokenizer
"""

from __future__ import annotations

import argparse
from pathlib import Path

QWEN3 = dict(max_position_embeddings=40960, rope_theta=1_000_000.0)
LLAMA_SMOLLM2 = dict(max_position_embeddings=8192, rope_theta=130_000.0, rms_norm_eps=1e-5)
SHAPES = {  # (architecture, shape)
    "qwen3-4b": ("qwen3", dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "smollm2-1.7b": ("llama", dict(LLAMA_SMOLLM2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                   num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True)),
    # the 135M model's shape: the same code path at a size a CPU test can build
    "smollm2-135m": ("llama", dict(LLAMA_SMOLLM2, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
}


def build_model(shape: str, tokenizer_path: str, output: str, seed: int = 0) -> str:
    """Save a randomly initialised bf16 model of ``shape`` with the tokenizer at ``tokenizer_path`` to ``output``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    architecture, dims = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[architecture]
    config = config_cls(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **dims)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {output}")
    return output


def resolve(model: str, output_dir: Path, build: bool = True) -> str:
    """``random:<shape>`` as a folder holding a randomly initialised model of that shape with the built-in SmolLM2
    tokenizer (built once, under ``output_dir/runs``, unless ``build`` is false; ``--output`` can put one there with
    another tokenizer); anything else as it is."""
    if not model.startswith("random:"):
        return model
    from oblr_trl.training.models import resolve_model

    shape = model[len("random:"):]
    folder = Path(output_dir) / "runs" / f"random-{shape}"
    if build and not (folder / "config.json").exists():
        build_model(shape, resolve_model("builtin:smollm2-135m-instruct"), str(folder))
    return str(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct",
                        help="folder or id of the tokenizer (its vocabulary is used); default: the built-in SmolLM2's")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from oblr_trl.training.models import resolve_model

    build_model(args.shape, resolve_model(args.tokenizer, option="--tokenizer"), args.output, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
