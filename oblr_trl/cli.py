"""Command line: ``oblr-trl`` / ``python -m oblr_trl``."""

from __future__ import annotations

import argparse
import os


def demo(args: argparse.Namespace) -> int:
    """A few OBLR-PO steps on a tiny, locally built model: checks an installation in seconds, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset

    from . import OBLRPOConfig, OBLRPOTrainer
    from .testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})

    def digit_reward(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    config = OBLRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        snr_warmup_steps=1,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
    )
    trainer = OBLRPOTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=digit_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print(
        f"demo finished: {args.steps} steps, reward {last['reward']:.3f}, "
        f"SNR factor {last['snr/lr_factor']:.3f}, LOO fallbacks {last['oblr/loo_fallback_frac']:.2f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oblr-trl", description="OBLR-PO for TRL")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="a few OBLR-PO steps on a tiny local model (seconds, offline)")
    demo_parser.add_argument("--steps", type=int, default=5)
    demo_parser.add_argument("--output_dir", default="runs/demo")
    demo_parser.set_defaults(handler=demo)
    args = parser.parse_args(argv)
    return args.handler(args)
