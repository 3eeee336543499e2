"""One short training run with a real colocated vLLM engine, through Python (not the CLI): what `test_vllm.py` reads.

    python tests/vllm_worker.py OUT.json [--skip_sync] [--lora] [--preempt_at STEP] [--resume CHECKPOINT]
                                         [--set FIELD=VALUE ...]

Writes the run's log history and how it ended (finished, or the checkpoint a preemption saved). `--skip_sync` turns
TRL's weight sync into a no-op (the negative control of the test that the weights reach vLLM); `--lora` trains a LoRA
adapter, which TRL merges before each sync; `--preempt_at` sends this process SIGTERM at the end of that optimizer
step, as a scheduler would; `--resume` continues from a checkpoint. vLLM spawns its engine: the work runs under
`__main__`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import yaml


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--skip_sync", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--preempt_at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    from transformers import TrainerCallback

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer, TrainingPreempted
    from oblr_trl.rewards import accuracy_reward
    from oblr_trl.tasks import TaskOptions, load_task
    from oblr_trl.training.models import resolve_model

    settings = dict(output_dir=args.out + ".run", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    num_generations=8, max_completion_length=24, max_steps=3, learning_rate=3e-5, logging_steps=1,
                    report_to="none", save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False,
                    use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, seed=0,
                    model_init_kwargs={"dtype": "float32"})
    settings.update({key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)})

    class SigtermAt(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step == args.preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = OBLRPOTrainer(model=resolve_model("builtin:smollm2-135m-instruct"), reward_funcs=accuracy_reward,
                            args=OBLRPOConfig(**settings), peft_config=peft_config,
                            callbacks=[SigtermAt()] if args.preempt_at else None,
                            train_dataset=load_task("arithmetic", "train", TaskOptions(num_problems=64, seed=0)))
    if args.skip_sync:
        trainer.vllm_generation.sync_weights = lambda: None
    ended: dict = {"finished": True}
    try:
        trainer.train(resume_from_checkpoint=args.resume)
    except TrainingPreempted as stopped:
        ended = {"finished": False, "checkpoint": str(stopped.checkpoint)}
    with open(args.out, "w") as f:
        json.dump({"log_history": trainer.state.log_history, **ended}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
