"""Benchmark `learning`: does OBLR-PO's default learn at least as fast as TRL's GRPO, each at its own best rate?

Protocol (the same for every preset):

1. **Sweep.** Every method trains at each rate of a log-spaced grid (the GRPO rate ×1/3 … ×10) on validation seeds;
   its best rate is the one with the highest mean final accuracy on the *validation* problems (ties: reward AUC).
2. **Test.** Every method trains at its best rate on fresh test seeds, paired across methods (same seed, same model,
   same prompt order); the final greedy accuracy is measured on the *test* problems, which neither the training nor the
   sweep sees.
3. **Control.** `oblrpo-constant`: OBLR-PO's baseline at a constant rate equal to the default's realised mean effective
   rate on the test seeds, so that a difference the SNR factor makes is not just a different mean rate.

The problems are "a + b" and "a − b" with operands 0…`max_operand`, split once into disjoint test, validation and
training sets. Every method uses the same optimizer, gradient clipping (`max_grad_norm`; the clipped fraction of steps
is reported), `loss_type`, KL coefficient and completions per step; only the baseline, the reward scaling and the
learning-rate rule differ:

* `oblrpo`: OBLRPOTrainer with its defaults (pooled-slope gradient-weighted baseline, group std scaling as TRL's,
  calibrated SNR learning rate; the committed results were measured before 2026-11-23, without std scaling);
* `grpo`: TRL's GRPOTrainer with its defaults (group mean, group std scaling);
* `oblrpo-no-snr`, `rloo`, `opo`: for a longer run (`--methods`). The {none, group} × {uniform, weighted} cross that
  separates scaling from baseline runs on the synthetic testbed (`synthetic_learning.py`), which has the seeds for it.

Reported per method: best rate, mean training reward over the steps (the reward's area under the curve, AUC), final
test accuracy, both with 95 % t-intervals over seeds, and their paired differences with `grpo` (95 % t-intervals over
paired seeds; level with `grpo` only where the final accuracy's interval lies inside ±`EQUIVALENCE_MARGIN`); the mean
SNR factor (all steps, and after the calibration window), the fraction of clipped steps; curves of reward, effective
rate, f_t, gradient norm and the noise estimates. Each run is a fresh process and its result is kept under
`<output_dir>/runs/`, so an interrupted benchmark resumes where it stopped.

    python -m benchmarks.learning                      # SmolLM2-135M on CPU, 2 runs at a time (about 100 minutes)
    python -m benchmarks.learning --preset gpu         # SmolLM2-135M, 100 steps × 64 completions, on one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    EQUIVALENCE_MARGIN,
    RESULTS,
    build_trainer,
    code_and_versions,
    child_main,
    equivalence,
    markdown_table,
    new_figure,
    parse_overrides,
    run_in_subprocesses,
    save_figure,
    t_interval,
    write_results,
)

METHODS = {
    "oblrpo": {},
    "grpo": None,
    "oblrpo-no-snr": {"use_snr_lr": False},
    "rloo": {"baseline_weights": "uniform", "baseline_estimator": "weighted", "use_snr_lr": False, "scale_rewards": "none"},
    "opo": {"baseline_weights": "length", "baseline_estimator": "weighted", "leave_one_out": False, "use_snr_lr": False,
            "scale_rewards": "none"},
}
CONTROL = "oblrpo-constant"
REFERENCE = "grpo"
# the curves logged per step, besides the reward
TRACES = ("learning_rate", "grad_norm", "snr/lr_factor", "snr/bound_factor", "snr/grad_sq_norm_ema",
          "snr/trace_cov_ema", "snr/resolved", "snr/calibration_t", "snr/reference_factor", "oblr/step_kl",
          "oblr/trust_region_factor", "frac_reward_zero_std", "oblr/step_kl_target", "completions/mean_length",
          "oblr/lr", "oblr/update_rms", "oblr/trust_region_rate")


# the trust region's form and curvature reading every OBLR-PO run records: OBLR-PO has one of each, the peak form
# read per unit of Adam's update (the runs of the forms before it record theirs: `recorded_trust_region`)
TRUST_REGION_FORM = {"lr_trust_region_mode": "peak", "lr_trust_region_curvature": "per_update"}


def used_rates(traces: dict) -> list[float]:
    """The rate each step used: `oblr/lr` (`snr/effective_lr` in the runs committed before 2026-12-02, the same value
    under its old name), else the scheduled `learning_rate` (GRPOTrainer uses the rate it schedules)."""
    for key in ("oblr/lr", "snr/effective_lr"):
        if any(math.isfinite(v) for v in traces.get(key, [])):
            return traces[key]
    return traces["learning_rate"]


PRESETS = {
    "cpu": {
        "model": "builtin:smollm2-135m-instruct",
        "max_operand": 19,
        # two groups of 4 in one micro-batch: GRPO's per-group std scaling then differs from no scaling (one group
        # per step, rescaled as a whole, would be undone by gradient clipping)
        "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
                       max_completion_length=16, learning_rate=3e-5, lr_scheduler_type="constant_with_warmup",
                       warmup_steps=5, max_grad_norm=1.0, beta=0.0, loss_type="dapo", gradient_checkpointing=False,
                       bf16=False, use_cpu=True),
        "rates": [1e-5, 3e-5, 1e-4, 3e-4],
        "steps": 40, "validation_seeds": [100], "test_seeds": [0, 1, 2, 3, 4], "eval_problems": 200,
        "eval_max_new_tokens": 16, "jobs": 2,
    },
    "gpu": {
        "model": "builtin:smollm2-135m-instruct",
        "max_operand": 19,
        "config": dict(per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8,
                       max_completion_length=16, learning_rate=3e-5, lr_scheduler_type="constant_with_warmup",
                       warmup_steps=5, max_grad_norm=1.0, beta=0.0, loss_type="dapo", gradient_checkpointing=False,
                       bf16=True),
        "rates": [1e-5, 3e-5, 1e-4, 3e-4],
        "steps": 100, "validation_seeds": [100, 101], "test_seeds": [0, 1, 2, 3, 4, 5, 6, 7], "eval_problems": 200,
        "eval_max_new_tokens": 16, "jobs": 4,
    },
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default=None, help="override the preset's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the preset's config for every method, e.g. --set max_steps=60")
    parser.add_argument("--methods", nargs="+", default=["oblrpo", REFERENCE], choices=list(METHODS))
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="the sweep's grid (preset default)")
    parser.add_argument("--validation_seeds", type=int, nargs="+", default=None)
    parser.add_argument("--test_seeds", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (preset default)")
    parser.add_argument("--eval_problems", type=int, default=None, help="problems in each of test and validation")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs at once, each its own process with cpu_count/jobs threads (preset default)")
    parser.add_argument("--output_dir", default=None, help="default: benchmarks/results/learning_<preset>")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def problem_splits(max_operand: int, eval_problems: int, seed: int = 0,
                   operators: str = "+-") -> dict[str, list[dict[str, str]]]:
    """Every "a op b" with operands 0…max_operand and op in ``operators`` (the built-in `arithmetic` task's form),
    shuffled once and cut into disjoint test, validation and train sets."""
    values = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    problems = [
        {"question": f"{a} {op} {b}", "answer": str(values[op](a, b))}
        for a in range(max_operand + 1) for b in range(max_operand + 1) for op in operators
    ]
    random.Random(seed).shuffle(problems)
    if len(problems) < 3 * eval_problems:
        raise ValueError(f"max_operand={max_operand} gives {len(problems)} problems, fewer than 3 × {eval_problems}")
    return {"test": problems[:eval_problems], "validation": problems[eval_problems: 2 * eval_problems],
            "train": problems[2 * eval_problems:]}


def write_splits(splits: dict, folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths[name] = str(path)
    return paths


def load_split(path: str, template: str | None = None):
    """A split written by `write_splits`, its questions asked as ``template`` says (default: the answer alone)."""
    from oblr_trl.tasks import ARITHMETIC_TEMPLATE, TaskOptions, load_task

    return load_task("local", options=TaskOptions(path=path, prompt_template=template or ARITHMETIC_TEMPLATE))


def run_child(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.evaluation import generate_completions, grade
    from oblr_trl.rewards import GRADER_VERSION
    from oblr_trl.training.models import resolve_model

    held_out = load_split(spec["held_out"], spec.get("template"))
    output_dir = Path(spec["scratch"]) / run_key(spec)
    start = time.perf_counter()
    if spec["method"] == "initial":  # the untrained model: the same for every run, measured once per split
        path = resolve_model(spec["model"])
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        torch.set_num_threads(spec["threads"])
    else:
        config = dict(output_dir=str(output_dir), max_steps=spec["steps"], logging_steps=1, save_strategy="no",
                      report_to=[], seed=spec["seed"], data_seed=spec["seed"], disable_tqdm=True,
                      **{**spec["config"], "learning_rate": spec["learning_rate"]})
        trainer = build_trainer(spec["model"], spec["overrides"], config, None,
                                load_split(spec["train"], spec.get("template")))
        torch.set_num_threads(spec["threads"])
        trainer.train()
        model, tokenizer = trainer.model, trainer.processing_class
    model.eval()
    completions = generate_completions(model, tokenizer, list(held_out["prompt"]),
                                       max_new_tokens=spec["eval_max_new_tokens"], progress=False)
    result = {key: spec[key] for key in ("method", "seed", "learning_rate", "split", "problems", "overrides",
                                         "template") if key in spec}
    result.update(spec.get("identity", {}))  # what tells the run apart from another of its method, rate and seed
    samples, accuracy, _ = grade(held_out, completions)
    # a few graded completions with every run, so that what the accuracy rewards can be read, not only its value; each
    # held-out problem's outcome in the split's order, so that intervals can count the problems' noise beside the seeds'
    result.update(accuracy=accuracy, seconds=time.perf_counter() - start, grader=GRADER_VERSION,
                  median_completion_tokens=median_tokens(tokenizer, completions),
                  samples=[{key: s[key] for key in ("question", "answer", "completions", "correct")}
                           for s in samples[:8]],
                  outcomes=[int(s["correct"][0]) for s in samples], code=code_and_versions())
    if spec.get("sample_max_new_tokens"):  # the untrained answers as training samples them (TRL's temperature 1)
        sampled = generate_completions(model, tokenizer, list(held_out["prompt"]), n=4, temperature=1.0,
                                       max_new_tokens=spec["sample_max_new_tokens"], progress=False)
        result["median_sampled_completion_tokens"] = median_tokens(tokenizer, sampled)
    if spec["method"] != "initial":
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result["reward"] = [h["reward"] for h in logs]
        result["traces"] = {key: [math.nan if h.get(key) is None else h[key] for h in logs] for key in TRACES}
        result["config"] = resolved_config(trainer.args)
        result["max_grad_norm"] = trainer.args.max_grad_norm
        result["lr_trust_region_kl"] = getattr(trainer.args, "lr_trust_region_kl", None)
        # how many of a step's completions its KL was measured on (None: all; runs before 2026-11-26 measured all)
        result["lr_trust_region_sample_size"] = getattr(trainer.args, "lr_trust_region_sample_size", None)
        tuning = getattr(trainer, "rate_tuning", None)  # the rate rule's constants the run used (GRPOTrainer: none)
        result["lr_trust_region_measure_steps"] = getattr(tuning, "lr_trust_region_measure_steps", None)
        result.update({field: None if tuning is None else form for field, form in TRUST_REGION_FORM.items()})
    return result


def resolved_config(args) -> dict:
    """The trainer's arguments as the run resolved them, where they differ from their class's defaults (resolved the
    same way): with the method, rate and seed, what reproduces the run. The output directory, a scratch path, is
    left out."""
    defaults = type(args)(output_dir=args.output_dir, use_cpu=args.use_cpu).to_dict()
    return {key: value for key, value in args.to_dict().items() if key != "output_dir" and defaults.get(key) != value}


def median_tokens(tokenizer, completions: list[list[str]]) -> float:
    """The median length of the completions in tokens, the unit a step's KL is averaged over (δ is per token)."""
    return statistics.median(len(tokenizer(text, add_special_tokens=False).input_ids)
                             for texts in completions for text in texts)


def run_key(spec: dict) -> str:
    return f"{spec['split']}-{spec['method']}-lr{spec['learning_rate']:.3g}-seed{spec['seed']}"


def grader_of(run: dict) -> int:
    """The `GRADER_VERSION` that graded a run's accuracy (runs before version 2 carry none)."""
    return run.get("grader", 1)


def graded_now(path: Path) -> bool:
    """A cached run whose accuracy the current grader gave."""
    from oblr_trl.rewards import GRADER_VERSION

    return path.exists() and grader_of(json.loads(path.read_text())) == GRADER_VERSION


def recorded_trust_region(run: dict) -> tuple[float | None, int | None, str | None, str | None]:
    """The δ of the trust region a run used, every how many steps it measured the KL, its form and how it read the
    curvature (None without one). Runs recorded before 2026-11-26 carry no δ: their overrides say, and without one
    they ran without a trust region, the default then; runs recorded before the end of 2026-11-26 carry no cadence:
    their overrides say, else every step; runs recorded before 2026-11-28 carry no form: their overrides say, else the
    cap, the default then; runs recorded before the end of 2026-11-28 carry no curvature: their overrides say, else
    per unit rate, the only one then."""
    overrides = run.get("overrides") or {}
    kl = run.get("lr_trust_region_kl", overrides.get("lr_trust_region_kl"))
    if kl is None:
        return None, None, None, None
    return (kl, run.get("lr_trust_region_measure_steps", overrides.get("lr_trust_region_measure_steps", 1)),
            run.get("lr_trust_region_mode", overrides.get("lr_trust_region_mode", "cap")),
            run.get("lr_trust_region_curvature", overrides.get("lr_trust_region_curvature", "per_rate")))


def requested_trust_region(spec: dict) -> tuple[float | None, int | None, str | None, str | None]:
    """The δ and measuring cadence a spec asks for (its overrides, else OBLRPOConfig's defaults) in OBLR-PO's form and
    curvature reading (`TRUST_REGION_FORM`); GRPO and the untrained model none."""
    if spec.get("overrides") is None:
        return None, None, None, None
    from oblr_trl import OBLRPOConfig
    from oblr_trl.estimators.step_rate import RateRuleTuning

    overrides = spec["overrides"]
    kl = overrides.get("lr_trust_region_kl", OBLRPOConfig.lr_trust_region_kl)
    if kl is None:
        return None, None, None, None
    return (kl, overrides.get("lr_trust_region_measure_steps", RateRuleTuning.lr_trust_region_measure_steps),
            TRUST_REGION_FORM["lr_trust_region_mode"], TRUST_REGION_FORM["lr_trust_region_curvature"])


def current(path: Path, spec: dict) -> bool:
    """A cached run of ``spec`` graded by the current grader, run with the trust region the spec asks for now (a
    method named after the defaults changes when they do) and recording the spec's ``identity`` (its steps, say)."""
    if not graded_now(path):
        return False
    record = json.loads(path.read_text())
    return (recorded_trust_region(record) == requested_trust_region(spec)
            and all(record.get(key) == value for key, value in spec.get("identity", {}).items()))


def run_all(specs: list[dict], folder: Path, description: str, jobs: int) -> list[dict]:
    """Each spec's result, from ``folder`` where an earlier invocation left it, else from a fresh run."""
    folder.mkdir(parents=True, exist_ok=True)
    cached = {run_key(s): folder / f"{run_key(s)}.json" for s in specs}
    todo = [s for s in specs if not current(cached[run_key(s)], s)]
    run_in_subprocesses(__spec__.name, todo, description, jobs=jobs,
                        on_result=lambda spec, result: cached[run_key(spec)].write_text(json.dumps(result)))
    return [json.loads(cached[run_key(s)].read_text()) for s in specs]


def auc(run: dict) -> float:
    """Reward area under the curve: the mean training reward over the run's steps."""
    return statistics.fmean(run["reward"])


def after_calibration(run: dict, skip: int) -> list[float]:
    return [f for f in run["traces"]["snr/lr_factor"][skip:] if not math.isnan(f)] or [1.0]


def summarise(sweep, test, methods, rates, best, skip):
    by_method = {m: sorted((r for r in test if r["method"] == m), key=lambda r: r["seed"]) for m in methods}
    reference = {r["seed"]: r for r in by_method[REFERENCE]} if REFERENCE in by_method else {}
    summary = {}
    for method, runs in by_method.items():
        aucs, finals = [auc(r) for r in runs], [r["accuracy"] for r in runs]
        factors = [f for r in runs for f in r["traces"]["snr/lr_factor"] if not math.isnan(f)] or [1.0]
        calibrated = [f for r in runs for f in after_calibration(r, skip)]
        clipped = [g > r["max_grad_norm"] for r in runs for g in r["traces"]["grad_norm"] if not math.isnan(g)]
        entry = {
            "best_lr": runs[0]["learning_rate"], "seeds": [r["seed"] for r in runs],
            "auc_mean": statistics.fmean(aucs), "auc_ci": t_interval(aucs),
            "final_acc_mean": statistics.fmean(finals), "final_acc_ci": t_interval(finals),
            "final_acc_per_seed": finals, "auc_per_seed": aucs,
            "mean_lr_factor": statistics.fmean(factors), "mean_lr_factor_after_calibration": statistics.fmean(calibrated),
            "lr_factor_range": [min(factors), max(factors)],
            "clipped_fraction": statistics.fmean(clipped) if clipped else 0.0,
            "minutes_per_run": statistics.fmean(r["seconds"] for r in runs) / 60,
        }
        if reference and method != REFERENCE:
            paired = [r for r in runs if r["seed"] in reference]
            auc_diff = [auc(r) - auc(reference[r["seed"]]) for r in paired]
            acc_diff = [r["accuracy"] - reference[r["seed"]]["accuracy"] for r in paired]
            entry.update(auc_diff_vs_grpo=statistics.fmean(auc_diff), auc_diff_vs_grpo_ci=t_interval(auc_diff),
                         final_acc_diff_vs_grpo=statistics.fmean(acc_diff),
                         final_acc_diff_vs_grpo_ci=t_interval(acc_diff))
        if method in best:
            entry["sweep"] = {f"{lr:.3g}": dict(zip(("validation_acc", "validation_auc"), sweep_score(sweep, method, lr)))
                              for lr in rates}
        summary[method] = entry
    return summary


def sweep_score(sweep: list[dict], method: str, rate: float) -> tuple[float, float]:
    """(mean final validation accuracy, mean reward AUC) of ``method`` at ``rate`` over the validation seeds."""
    runs = [r for r in sweep if r["method"] == method and r["learning_rate"] == rate]
    return statistics.fmean(r["accuracy"] for r in runs), statistics.fmean(auc(r) for r in runs)


def choose_rates(sweep: list[dict], methods: list[str], rates: list[float]) -> dict[str, float]:
    """Each method's best rate: highest validation accuracy, ties broken by reward AUC."""
    return {method: max(rates, key=lambda rate: sweep_score(sweep, method, rate)) for method in methods}


def plot(test, methods, output_dir, name):
    panels = [("reward", "training reward (5-step moving average)"), ("oblr/lr", "learning rate used"),
              ("snr/lr_factor", "SNR factor f_t / f_ref (OBLR-PO)"), ("grad_norm", "gradient norm (before clipping)"),
              ("snr/bound_factor", "f_t = N·SNR / (1 + N·SNR)"), ("snr/trace_cov_ema", "noise estimate tr Σ (EMA)")]
    figure, axes = new_figure(len(panels), (5 * len(panels), 4.2))
    for method in methods:
        runs = [r for r in test if r["method"] == method]
        for axis, (key, title) in zip(axes, panels):
            if key == "oblr/lr":
                curves = [used_rates(r["traces"]) for r in runs]
            else:
                curves = [r["reward"] if key == "reward" else r["traces"][key] for r in runs]
            if all(math.isnan(v) for c in curves for v in c):
                continue
            if key == "reward":
                curves = [[statistics.fmean(c[max(0, i - 4): i + 1]) for i in range(len(c))] for c in curves]
            steps = list(range(1, len(curves[0]) + 1))
            mean = [statistics.fmean(v for v in column if not math.isnan(v)) if any(not math.isnan(v) for v in column)
                    else math.nan for column in zip(*curves)]
            axis.plot(steps, mean, label=method)
            axis.set_title(title, fontsize=9)
            axis.set_xlabel("optimizer step")
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize=8)
    return save_figure(figure, output_dir, name)


def ci(values) -> str:
    """An interval; "[one seed]" where one seed gives none (`t_interval`'s NaN)."""
    return "[one seed]" if math.isnan(values[0]) else f"[{values[0]:+.3f}, {values[1]:+.3f}]"


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(run_child, args.child)
    preset = PRESETS[args.preset]
    config = {**preset["config"], **parse_overrides(args.overrides)}
    rates = args.rates or preset["rates"]
    steps = args.steps or preset["steps"]
    eval_problems = args.eval_problems or preset["eval_problems"]
    jobs = args.jobs or preset["jobs"]
    validation_seeds, test_seeds = args.validation_seeds or preset["validation_seeds"], args.test_seeds or preset["test_seeds"]
    output_dir = Path(args.output_dir or RESULTS / f"learning_{args.preset}")
    paths = write_splits(problem_splits(preset["max_operand"], eval_problems), output_dir / "data")
    model = args.model or preset["model"]
    base = {"model": model, "config": config, "steps": steps, "train": paths["train"], "threads": max(1, (os.cpu_count() or 1) // jobs),
            "eval_max_new_tokens": preset["eval_max_new_tokens"]}
    runs_dir = output_dir / "runs"
    base["scratch"] = str(Path(tempfile.gettempdir()) / "oblr-trl-learning")  # the runs save nothing there

    initial = run_all([{**base, "method": "initial", "seed": 0, "learning_rate": 0.0, "split": split,
                        "held_out": paths[split]} for split in ("validation", "test")], runs_dir, "untrained model", jobs)
    sweep = run_all([{**base, "method": m, "overrides": METHODS[m], "seed": s, "learning_rate": lr, "split": "validation",
                      "held_out": paths["validation"]}
                     for s in validation_seeds for lr in rates for m in args.methods], runs_dir, "rate sweep (validation)", jobs)
    best = choose_rates(sweep, args.methods, rates)
    test = run_all([{**base, "method": m, "overrides": METHODS[m], "seed": s, "learning_rate": best[m], "split": "test",
                     "held_out": paths["test"]}
                    for s in test_seeds for m in args.methods], runs_dir, "test seeds", jobs)
    methods = list(args.methods)
    if "oblrpo" in best:
        realised = statistics.fmean(f for r in test if r["method"] == "oblrpo"
                                    for f in r["traces"]["snr/lr_factor"] if not math.isnan(f))
        test += run_all([{**base, "method": CONTROL, "overrides": METHODS["oblrpo-no-snr"], "seed": s,
                          "learning_rate": best["oblrpo"] * realised, "split": "test",
                          "held_out": paths["test"]} for s in test_seeds], runs_dir, "constant-rate control", jobs)
        methods.append(CONTROL)

    from oblr_trl.estimators.step_rate import RateRuleTuning

    skip = config["warmup_steps"] + RateRuleTuning().resolved_snr_calibration_steps
    summary = summarise(sweep, test, methods, rates, best, skip)
    figure = plot(test, methods, output_dir, "summary")
    start = {r["split"]: r["accuracy"] for r in initial}
    markdown = (
        f"# Learning benchmark ({args.preset} preset)\n\n![curves]({figure.name})\n\n"
        f"`{model}` on a ± b, operands 0…{preset['max_operand']}: {eval_problems} test and {eval_problems} validation "
        f"problems, disjoint from each other and from the training problems; untrained accuracy {start['test']:.3f} "
        f"(test), {start['validation']:.3f} (validation). {steps} optimizer steps of "
        f"{config['per_device_train_batch_size'] * config['gradient_accumulation_steps']} completions (groups of "
        f"{config['num_generations']}, ≤ {config['max_completion_length']} tokens), `{config['loss_type']}` loss, β = "
        f"{config['beta']}, AdamW, max_grad_norm {config['max_grad_norm']}, {config['lr_scheduler_type']} with "
        f"{config['warmup_steps']} warm-up steps. Rates {rates} swept on validation seeds {validation_seeds}; test seeds "
        f"{test_seeds}, paired; `{CONTROL}`: OBLR-PO's baseline at the default's realised mean effective rate. "
        f"Intervals: 95 % t-interval over seeds; differences paired with `grpo`, 95 % t-interval over paired seeds. "
        f"Level: the final accuracy's paired difference lies inside ±{EQUIVALENCE_MARGIN:g}, the equivalence margin; "
        "otherwise not shown level. "
        f"The SNR factor after calibration counts steps > {skip} (warm-up + calibration window).\n\n"
        + markdown_table(
            ["method", "best lr", "mean training reward", "mean training reward − grpo [95 % CI]", "final acc.",
             "[95 % CI]", "final − grpo [95 % CI] · level",
             "mean f factor", "after calibration", "clipped steps", "min / run"],
            [[m, s["best_lr"], s["auc_mean"], f"{s['auc_diff_vs_grpo']:+.4f} {ci(s['auc_diff_vs_grpo_ci'])}" if "auc_diff_vs_grpo" in s else "—",
              s["final_acc_mean"], ci(s["final_acc_ci"]),
              f"{s['final_acc_diff_vs_grpo']:+.3f} {ci(s['final_acc_diff_vs_grpo_ci'])} · "
              f"{equivalence(s['final_acc_diff_vs_grpo_ci'])}" if "final_acc_diff_vs_grpo" in s else "—",
              s["mean_lr_factor"], s["mean_lr_factor_after_calibration"], s["clipped_fraction"], s["minutes_per_run"]]
             for m, s in summary.items()],
        )
        + "\n\n### Rate sweep (validation accuracy / mean training reward)\n\n"
        + markdown_table(["method", *[f"{lr:.3g}" for lr in rates]],
                         [[m, *[f"{s['sweep'][f'{lr:.3g}']['validation_acc']:.3f} / {s['sweep'][f'{lr:.3g}']['validation_auc']:.3f}"
                                for lr in rates]] for m, s in summary.items() if "sweep" in s])
    )
    write_results(output_dir, "summary", {"arguments": vars(args), "preset": preset, "initial_accuracy": start,
                                          "methods": summary, "runs": {"sweep": sweep, "test": test}}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
