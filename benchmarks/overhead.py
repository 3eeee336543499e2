"""Benchmark `overhead`: wall time per optimizer step and peak memory of OBLRPOTrainer against TRL's GRPOTrainer.

Every variant trains the same model on the same data with the same seeds. Completion lengths are fixed (EOS is held
back until `max_completion_length`) so that every step of every variant processes the same number of tokens and a
difference in time is the trainer's own. Each (variant, repeat) runs in a fresh process, interleaved
(A B C … A B C …); per run, the median of the timed steps (after warm-up steps); per variant, the median over runs
with min–max, and the ratio to GRPO per repeat. Peak memory: resident set size (CPU) or peak allocated (GPU).

    python benchmarks/overhead.py                       # quickstart size on CPU
    python benchmarks/overhead.py --max_completion_length 128 --name overhead_long
    python benchmarks/overhead.py --preset gpu          # Qwen3-4B-Base, LoRA, one GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
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

VARIANTS = {
    "grpo": None,  # TRL's GRPOTrainer with GRPOConfig defaults
    "oblrpo": {},  # OBLR-PO defaults: logit weights + SNR learning rate
    "oblrpo-no-snr": {"use_snr_lr": False},
    "length": {"baseline_weights": "length"},
    "uniform-no-snr": {"baseline_weights": "uniform", "use_snr_lr": False},
    "exact": {"baseline_weights": "exact"},
    "exact-naive": {"baseline_weights": "exact"},  # the same weights by one backward per completion (NaiveExact)
}
PRESETS = {
    "cpu": {
        "model": "builtin:smollm2-135m-instruct",
        "config": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8,
                       learning_rate=3e-5, gradient_checkpointing=False, bf16=False, use_cpu=True),
        "peft": None,
    },
    "gpu": {
        "model": "Qwen/Qwen3-4B-Base",
        "config": dict(per_device_train_batch_size=16, gradient_accumulation_steps=8, num_generations=8,
                       learning_rate=1e-5, gradient_checkpointing=True, bf16=True, use_vllm=True,
                       vllm_mode="colocate", vllm_gpu_memory_utilization=0.4),
        "peft": {"r": 32, "lora_alpha": 64, "target_modules": "all-linear", "task_type": "CAUSAL_LM"},
    },
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default=None, help="override the preset's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the preset's config (YAML value), e.g. --set use_vllm=false")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    parser.add_argument("--warmup_steps", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--max_completion_length", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="overhead", help="results file name")
    parser.add_argument("--output_dir", default=str(RESULTS / "overhead"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class PeakMemory:
    """Peak resident memory of this process while active (sampled), or peak CUDA allocation."""

    def __init__(self):
        import psutil
        import torch

        self.cuda = torch.cuda.is_available()
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.process.memory_info().rss)


def naive_exact_trainer():
    """OBLRPOTrainer whose `exact` weights come from one forward and backward per completion (the trainer's own
    fallback for layers without a ghost-norm rule, one completion at a time), as the only public implementation of the
    exact baseline does: the reference the batched version is measured against."""
    from oblr_trl import OBLRPOTrainer

    class NaiveExact(OBLRPOTrainer):
        def _per_sample_grad_sq_norms(self, batch, token_scale):
            return self._looped_grad_sq_norms(batch, token_scale, 1)

    return NaiveExact


def run_child(spec: dict) -> dict:
    """One training run of one variant; returns per-step times and peak memory."""
    from transformers import TrainerCallback

    from oblr_trl.tasks import TaskOptions, load_task

    preset = PRESETS[spec["preset"]]
    config = {**preset["config"], **spec["overrides"]}
    task = load_task("arithmetic", "train", TaskOptions(num_problems=200, seed=spec["seed"]))
    length = spec["max_completion_length"]
    min_tokens = "min_tokens" if config.get("use_vllm") else "min_new_tokens"  # vLLM's name / transformers'
    common = dict(
        output_dir=spec["output_dir"], max_steps=spec["warmup_steps"] + spec["steps"], max_completion_length=length,
        generation_kwargs={min_tokens: length}, logging_steps=1, save_strategy="no", report_to=[],
        seed=spec["seed"], **config,
    )
    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    trainer = build_trainer(spec["model"] or preset["model"], VARIANTS[spec["variant"]], common, preset["peft"], task,
                            callbacks=[StepTimer()],
                            trainer_cls=naive_exact_trainer() if spec["variant"] == "exact-naive" else None)
    with PeakMemory() as memory:
        trainer.train()
    timed = times[spec["warmup_steps"]:]
    return {"variant": spec["variant"], "repeat": spec["repeat"], "num_generations": trainer.args.num_generations,
            "step_seconds": timed,
            "median_step_seconds": statistics.median(timed), "peak_memory_bytes": memory.peak}


def summarise(runs: list[dict], variants: list[str]) -> list[dict]:
    by_variant = {v: sorted((r for r in runs if r["variant"] == v), key=lambda r: r["repeat"]) for v in variants}
    reference = by_variant.get("grpo")
    rows = []
    for variant, results in by_variant.items():
        medians = [r["median_step_seconds"] for r in results]
        memory = [r["peak_memory_bytes"] for r in results]
        row = {"variant": variant, "median_step_seconds": statistics.median(medians), "min": min(medians),
               "max": max(medians), "peak_memory_mib": statistics.median(memory) / 2**20}
        if reference:
            time_ratios = [r["median_step_seconds"] / g["median_step_seconds"] for r, g in zip(results, reference)]
            memory_ratios = [r["peak_memory_bytes"] / g["peak_memory_bytes"] for r, g in zip(results, reference)]
            row |= {"time_ratio": statistics.median(time_ratios), "time_ratio_min": min(time_ratios),
                    "time_ratio_max": max(time_ratios), "memory_ratio": statistics.median(memory_ratios),
                    "memory_ratio_min": min(memory_ratios), "memory_ratio_max": max(memory_ratios)}
        rows.append(row)
    return rows


def plot(rows, output_dir, name):
    figure, axes = new_figure(2, (13, 4.5))
    labels = [r["variant"] for r in rows]
    for axis, key, title in ((axes[0], "time", "time per optimizer step"), (axes[1], "memory", "peak memory")):
        values = [r.get(f"{key}_ratio", float("nan")) for r in rows]
        errors = [[v - r.get(f"{key}_ratio_min", v) for v, r in zip(values, rows)],
                  [r.get(f"{key}_ratio_max", v) - v for v, r in zip(values, rows)]]
        axis.bar(labels, values, yerr=errors, capsize=4)
        axis.axhline(1.0, color="black", lw=0.8)
        axis.axhline(1.05, color="red", lw=0.8, ls="--", label="1.05× bar (default mode)")
        axis.set_ylabel("÷ GRPOTrainer (median, min–max over repeats)")
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=30)
        axis.legend()
    return save_figure(figure, output_dir, name)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(run_child, args.child)
    overrides = parse_overrides(args.overrides)
    output_dir = Path(args.output_dir)
    specs = [  # interleaved: A B C ... A B C ...
        {"preset": args.preset, "model": args.model, "overrides": overrides, "variant": variant, "repeat": repeat,
         "seed": args.seed + repeat,
         "steps": args.steps, "warmup_steps": args.warmup_steps, "max_completion_length": args.max_completion_length,
         "output_dir": str(output_dir / "runs" / f"{variant}-{repeat}")}
        for repeat in range(args.repeats) for variant in args.variants
    ]
    runs = run_in_subprocesses(__file__, specs, "overhead runs")
    rows = summarise(runs, args.variants)
    figure = plot(rows, output_dir, args.name)
    preset = PRESETS[args.preset]
    config = {**preset["config"], **overrides}
    markdown = (
        f"# Overhead against GRPOTrainer ({args.preset} preset)\n\n![overhead]({figure.name})\n\n"
        f"Model `{args.model or preset['model']}`, {config['num_generations']} completions per prompt, "
        f"{config['per_device_train_batch_size']} × {config['gradient_accumulation_steps']} "
        f"completions per step, completions fixed at {args.max_completion_length} tokens; {args.repeats} interleaved "
        f"repeats × {args.steps} timed steps (after {args.warmup_steps} warm-up)"
        + (f"; preset overrides `{overrides}`" if overrides else "") + ".\n\n"
        + markdown_table(
            ["variant", "s / step (median)", "min", "max", "÷ GRPO time", "time ratio min–max", "peak MiB",
             "÷ GRPO memory", "memory ratio min–max"],
            [[r["variant"], r["median_step_seconds"], r["min"], r["max"], r.get("time_ratio", "—"),
              f"{r.get('time_ratio_min', float('nan')):.3f}–{r.get('time_ratio_max', float('nan')):.3f}",
              r["peak_memory_mib"], r.get("memory_ratio", "—"),
              f"{r.get('memory_ratio_min', float('nan')):.3f}–{r.get('memory_ratio_max', float('nan')):.3f}"]
             for r in rows],
        )
    )
    write_results(output_dir, args.name, {"arguments": vars(args), "summary": rows, "runs": runs}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
