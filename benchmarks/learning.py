"""Benchmark `learning`: reward and held-out accuracy against step for OBLR-PO and the baselines it refines.

Methods (same model, data order, schedule and seeds; only the baseline and the learning-rate factor differ):

* `oblrpo`: OBLR-PO defaults (logit weights, leave-one-out, no std scaling, SNR learning rate);
* `oblrpo-no-snr`: the same baseline, the scheduled learning rate as is;
* `grpo`: TRL's GRPOTrainer with its defaults (group mean, group std scaling);
* `rloo`: uniform leave-one-out, no std scaling (RLOO), no SNR factor;
* `opo`: length weights, whole-group baseline (verl's OPO), no SNR factor.

Each (method, seed) runs in its own process; the held-out accuracy is greedy pass@1 on problems the training never
sees, measured every `--eval_every` steps. The default size fits in about 90 minutes on 2 CPU cores:

    python benchmarks/learning.py                          # SmolLM2-135M-Instruct, one-digit + and −, 3 seeds
    python benchmarks/learning.py --preset gpu             # Qwen3-4B-Base on GSM8K (recipes/Qwen3-4B-Base)
    python benchmarks/learning.py --set use_cpu=false --jobs 10    # the cpu preset on one GPU, 10 runs at once

How the cpu preset's size was chosen: one-digit + and − starts SmolLM2-135M-Instruct at about half right (0.55
held-out), so groups of 4 often have mixed rewards and there is room to improve; 24 tokens hold an answer with a
short working; 8 completions per step (two groups of 4, so that GRPO's per-group std scaling differs from RLOO's,
which one group per step and gradient clipping make identical) at about 15 s a step give 24 steps × 5 methods ×
3 seeds in the time budget. Rewards rise from step ~12 (learning rate 3e-5 after 5 warm-up steps); on an H100 with
4 seeds the methods without the SNR factor separated from OBLR-PO's defaults by 24–40 steps, while the seed spread
stayed larger than the gaps among GRPO, RLOO and OBLR-PO's baseline (benchmarks/results/gpu_h100/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    build_trainer,
    child_main,
    markdown_table,
    new_figure,
    parse_overrides,
    run_in_subprocesses,
    save_figure,
    write_results,
)

METHODS = {
    "oblrpo": {},
    "oblrpo-no-snr": {"use_snr_lr": False},
    "grpo": None,
    "rloo": {"baseline_weights": "uniform", "use_snr_lr": False, "scale_rewards": "none"},
    "opo": {"baseline_weights": "length", "leave_one_out": False, "use_snr_lr": False, "scale_rewards": "none"},
}
PRESETS = {
    "cpu": {
        "model": "builtin:smollm2-135m-instruct",
        "task": "arithmetic",
        "task_options": {"digits": 1, "operators": "+-", "num_problems": 1000},
        # two groups of 4 per step: with one group per step, GRPO's std scaling is one factor for the whole step
        # that gradient clipping (max_grad_norm=1) removes, so GRPO and RLOO took identical steps (module docstring)
        "config": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                       max_completion_length=24, learning_rate=3e-5, lr_scheduler_type="constant_with_warmup",
                       warmup_steps=5, gradient_checkpointing=False, bf16=False, use_cpu=True),
        "peft": None,
        "steps": 24, "eval_every": 8, "eval_problems": 30, "eval_max_new_tokens": 24, "target_reward": 0.6,
    },
    "gpu": {
        "model": "Qwen/Qwen3-4B-Base",
        "task": "gsm8k",
        "task_options": {},
        "config": dict(per_device_train_batch_size=16, gradient_accumulation_steps=8, num_generations=8,
                       max_completion_length=1024, learning_rate=1e-5, lr_scheduler_type="constant_with_warmup",
                       warmup_steps=10, gradient_checkpointing=True, bf16=True, use_vllm=True, vllm_mode="colocate",
                       vllm_gpu_memory_utilization=0.4),
        "peft": {"r": 32, "lora_alpha": 64, "target_modules": "all-linear", "task_type": "CAUSAL_LM"},
        "steps": 100, "eval_every": 25, "eval_problems": 200, "eval_max_new_tokens": 1024, "target_reward": 0.7,
    },
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default=None, help="override the preset's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the preset's config (YAML value), e.g. --set use_cpu=false to run "
                             "the cpu preset on a GPU")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (preset default)")
    parser.add_argument("--eval_every", type=int, default=None)
    parser.add_argument("--eval_problems", type=int, default=None)
    parser.add_argument("--target_reward", type=float, default=None,
                        help="for 'steps to reach' (5-step moving average; preset default)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each its own process (a GPU with room for several small models); "
                             "the 'min / run' column then counts time shared with the other runs")
    parser.add_argument("--output_dir", default=str(RESULTS / "learning"))
    parser.add_argument("--name", default="learning")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_child(spec: dict) -> dict:
    from transformers import TrainerCallback

    from oblr_trl.evaluation import generate_completions, grade
    from oblr_trl.tasks import TaskOptions, load_task

    preset = PRESETS[spec["preset"]]
    options = TaskOptions(**preset["task_options"])
    train = load_task(preset["task"], "train", options)
    held_out = load_task(preset["task"], "test", TaskOptions(**{**preset["task_options"], "limit": spec["eval_problems"]}))
    common = dict(output_dir=spec["output_dir"], max_steps=spec["steps"], logging_steps=1, save_strategy="no",
                  report_to=[], seed=spec["seed"], data_seed=spec["seed"], **spec["config"])
    accuracy = []

    class HeldOut(TrainerCallback):
        def evaluate(self, model, tokenizer, step):
            was_training = model.training
            model.eval()
            completions = generate_completions(model, tokenizer, list(held_out["prompt"]),
                                               max_new_tokens=preset["eval_max_new_tokens"], progress=False)
            accuracy.append({"step": step, "accuracy": grade(held_out, completions)[1]})
            model.train(was_training)

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.evaluate(model, processing_class, 0)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step % spec["eval_every"] == 0 or state.global_step == spec["steps"]:
                self.evaluate(model, processing_class, state.global_step)

    start, started_at = time.perf_counter(), time.time()
    trainer = build_trainer(spec["model"], METHODS[spec["method"]], common, preset["peft"], train, callbacks=[HeldOut()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"method": spec["method"], "seed": spec["seed"], "seconds": time.perf_counter() - start,
            "started_at": started_at, "finished_at": time.time(), "learning_rate": trainer.args.learning_rate,
            "reward": [h["reward"] for h in logs], "lr_factor": [h.get("snr/lr_factor", 1.0) for h in logs],
            "accuracy": accuracy}


def moving_average(values, window=5):
    return [statistics.mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def summarise(runs, methods, target):
    rows = []
    for method in methods:
        results = [r for r in runs if r["method"] == method]
        final = [r["accuracy"][-1]["accuracy"] for r in results]
        initial = [r["accuracy"][0]["accuracy"] for r in results]
        last_rewards = [statistics.mean(r["reward"][-5:]) for r in results]
        reach = []
        for r in results:
            smoothed = moving_average(r["reward"])
            reach.append(next((i + 1 for i, v in enumerate(smoothed) if v >= target), None))
        reached = [s for s in reach if s is not None]
        rows.append({
            "method": method,
            "held_out_accuracy_start": statistics.mean(initial),
            "held_out_accuracy_final": statistics.mean(final),
            "final_accuracy_seed_std": statistics.stdev(final) if len(final) > 1 else 0.0,
            "final_accuracy_per_seed": final,
            "reward_last5_mean": statistics.mean(last_rewards),
            "reward_last5_seed_std": statistics.stdev(last_rewards) if len(last_rewards) > 1 else 0.0,
            "steps_to_target": statistics.median(reached) if reached else None,
            "seeds_reaching_target": f"{len(reached)}/{len(reach)}",
            "mean_lr_factor": statistics.mean(f for r in results for f in r["lr_factor"]),
            "minutes_per_run": statistics.mean(r["seconds"] for r in results) / 60,
        })
    return rows


def plot(runs, methods, output_dir, name):
    figure, axes = new_figure(2, (14, 5))
    for method in methods:
        results = [r for r in runs if r["method"] == method]
        curves = [moving_average(r["reward"]) for r in results]
        length = min(len(c) for c in curves)
        mean = [statistics.mean(c[i] for c in curves) for i in range(length)]
        low = [min(c[i] for c in curves) for i in range(length)]
        high = [max(c[i] for c in curves) for i in range(length)]
        steps = list(range(1, length + 1))
        (line,) = axes[0].plot(steps, mean, label=method)
        axes[0].fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
        eval_steps = [p["step"] for p in results[0]["accuracy"]]
        acc = [[r["accuracy"][k]["accuracy"] for r in results] for k in range(len(eval_steps))]
        axes[1].errorbar(eval_steps, [statistics.mean(a) for a in acc],
                         yerr=[[statistics.mean(a) - min(a) for a in acc], [max(a) - statistics.mean(a) for a in acc]],
                         label=method, capsize=3, marker="o", color=line.get_color())
    axes[0].set_title("training reward (5-step moving average; mean, band = min–max over seeds)")
    axes[1].set_title("held-out greedy accuracy (mean, bars = min–max over seeds)")
    for axis in axes:
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        axis.legend()
    return save_figure(figure, output_dir, name)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(run_child, args.child)
    preset = PRESETS[args.preset]
    overrides = parse_overrides(args.overrides)
    config = {**preset["config"], **overrides}
    steps = args.steps or preset["steps"]
    eval_every = args.eval_every or preset["eval_every"]
    eval_problems = args.eval_problems or preset["eval_problems"]
    target_reward = args.target_reward if args.target_reward is not None else preset["target_reward"]
    output_dir = Path(args.output_dir)
    specs = [
        {"preset": args.preset, "model": args.model or preset["model"], "config": config, "method": method, "seed": seed,
         "steps": steps, "eval_every": eval_every, "eval_problems": eval_problems,
         "output_dir": str(output_dir / "runs" / f"{method}-{seed}")}
        for seed in args.seeds for method in args.methods
    ]
    runs = run_in_subprocesses(__file__, specs, "learning runs", jobs=args.jobs)
    rows = summarise(runs, args.methods, target_reward)
    figure = plot(runs, args.methods, output_dir, args.name)
    markdown = (
        f"# Learning curves ({args.preset} preset)\n\n![learning]({figure.name})\n\n"
        f"`{args.model or preset['model']}` on {preset['task']} {preset['task_options'] or ''}; {steps} optimizer steps "
        f"of {config['per_device_train_batch_size'] * config['gradient_accumulation_steps']} "
        f"completions (groups of {config['num_generations']}, at most {config['max_completion_length']} tokens); "
        f"scheduled learning rate {config['learning_rate']} for every method; seeds {args.seeds}; held-out greedy "
        f"accuracy on {eval_problems} unseen problems every {eval_every} steps; target reward {target_reward} "
        "(5-step moving average)"
        + (f"; preset overrides `{overrides}`" if overrides else "")
        + (f"; {args.jobs} runs at a time" if args.jobs > 1 else "") + ".\n\n"
        + markdown_table(
            ["method", "held-out acc. start", "held-out acc. final", "± seed std", "per seed", "reward (last 5)",
             "± seed std", "steps to target", "seeds reaching", "mean f_t", "min / run"],
            [[r["method"], r["held_out_accuracy_start"], r["held_out_accuracy_final"], r["final_accuracy_seed_std"],
              ", ".join(f"{a:.2f}" for a in r["final_accuracy_per_seed"]), r["reward_last5_mean"],
              r["reward_last5_seed_std"], r["steps_to_target"] if r["steps_to_target"] is not None else "—",
              r["seeds_reaching_target"], r["mean_lr_factor"], r["minutes_per_run"]] for r in rows],
        )
    )
    write_results(output_dir, args.name, {"arguments": vars(args), "target_reward": target_reward, "summary": rows,
                                          "runs": runs}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
