"""A randomly initialised causal LM with the shape of a Hub model, for timing on machines that cannot reach the Hub.

Step time and memory depend on a model's shape and on the sequence lengths, not on its weights; the `overhead`
benchmark fixes completion lengths, so a random model with the right shape times like the real one. The shapes are
copied from the models' published `config.json`; the vocabulary is the given tokenizer's (state it with the results).

    python benchmarks/random_model.py --shape qwen3-4b --tokenizer PATH --output /tmp/qwen3-4b-shape
"""

from __future__ import annotations

import argparse

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer", required=True, help="folder or id of the tokenizer (its vocabulary is used)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=40960, rope_theta=1_000_000.0,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **SHAPES[args.shape])
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
