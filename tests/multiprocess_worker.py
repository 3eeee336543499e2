"""One training run for the multi-process equivalence test: `torchrun --nproc_per_node W multiprocess_worker.py ...`.

Completions are a deterministic function of (prompt, position in its group, generation round), and TRL's shuffle of
the generation batch is turned off, so a 1-process and a 2-process run see the same completions and the same
micro-batches; only the process layout differs. Rank 0 writes what the trainer computed to a JSON file.
"""

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

torch.set_num_threads(1)

import trl.trainer.grpo_trainer as grpo_trainer  # noqa: E402
from datasets import Dataset  # noqa: E402

from oblr_trl import OBLRPOConfig, OBLRPOTrainer  # noqa: E402
from oblr_trl.testing import tiny_causal_lm, tiny_tokenizer  # noqa: E402

grpo_trainer.shuffle_sequence_dict = lambda batch: batch  # micro-batches follow the order of the generation batch


class DeterministicTrainer(OBLRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation_round = 0
        self.gathered = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        offset = self.accelerator.process_index * len(prompt_ids)
        completions = []
        for i, prompt in enumerate(prompt_ids):
            position = (offset + i) % num_generations
            rng = random.Random(f"{prompt}-{position}-{self.generation_round}")
            length = rng.randint(1, self.max_completion_length)
            completions.append([rng.randint(8, 100) for _ in range(length)])
        self.generation_round += 1
        return completions, None

    def _replace_advantages(self, output, local_weights, mode):
        super()._replace_advantages(output, local_weights, mode)
        gather = self.accelerator.gather
        self.gathered.append(
            {
                "weights": gather(local_weights.float().contiguous()).tolist(),
                "advantages": gather(output["advantages"].contiguous()).tolist(),
            }
        )


def reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, required=True)
    parser.add_argument("--gradient_accumulation_steps", type=int, required=True)
    parser.add_argument("--num_iterations", type=int, default=1)
    parser.add_argument("--baseline_weights", default="logit")
    parser.add_argument("--snr_estimator", default="two_batch")
    parser.add_argument("--snr_lr_reference", default="absolute")
    args = parser.parse_args()

    tokenizer = tiny_tokenizer()
    config = OBLRPOConfig(
        output_dir=os.path.dirname(args.output),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_iterations=args.num_iterations,
        num_generations=8,
        max_completion_length=6,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        snr_warmup_steps=1,
        baseline_weights=args.baseline_weights,
        snr_estimator=args.snr_estimator,
        snr_lr_reference=args.snr_lr_reference,
        shuffle_dataset=False,
        seed=0,
    )
    trainer = DeterministicTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"{a}*{b}=" for a in range(6) for b in range(6)]}),
        processing_class=tokenizer,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        keys = ("snr/grad_sq_norm", "snr/trace_cov", "snr/lr_factor", "snr/effective_lr", "grad_norm", "loss")
        steps = [{k: h.get(k) for k in keys} for h in trainer.state.log_history if "loss" in h]
        with open(args.output, "w") as f:
            json.dump({"processes": trainer.accelerator.num_processes, "batches": trainer.gathered, "steps": steps}, f)


if __name__ == "__main__":
    sys.exit(main())
