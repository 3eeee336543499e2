"""One short training run with a real colocated vLLM engine, through Python (not the CLI): what `test_vllm.py` reads.

    python tests/vllm_worker.py OUT.json [--skip_sync] [--set FIELD=VALUE ...]

Writes the run's log history and the exit it reached; `--skip_sync` turns TRL's weight sync into a no-op (the
negative control of the test that the weights reach vLLM). vLLM spawns its engine: the work runs under `__main__`.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--skip_sync", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.rewards import accuracy_reward
    from oblr_trl.tasks import TaskOptions, load_task
    from oblr_trl.training.models import resolve_model

    settings = dict(output_dir=args.out + ".run", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    num_generations=8, max_completion_length=24, max_steps=3, learning_rate=3e-5, logging_steps=1,
                    report_to="none", save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False,
                    use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, seed=0,
                    model_init_kwargs={"dtype": "float32"})
    settings.update({key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)})
    trainer = OBLRPOTrainer(model=resolve_model("builtin:smollm2-135m-instruct"), reward_funcs=accuracy_reward,
                            args=OBLRPOConfig(**settings),
                            train_dataset=load_task("arithmetic", "train", TaskOptions(num_problems=64, seed=0)))
    if args.skip_sync:
        trainer.vllm_generation.sync_weights = lambda: None
    trainer.train()
    with open(args.out, "w") as f:
        json.dump({"log_history": trainer.state.log_history, "finished": True}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
