"""One SmolLM2 run of the stability benchmark, in a process of its own.

`stability.py` turns each run of a study into a spec and hands the specs to `run_all`, which keeps each run's record
under the results folder's ``runs/``, reuses a record that still answers its spec (`current`) and runs `run_child` for
each of the others in a fresh process (`common.run_in_subprocesses`). `run_child` trains OBLRPOTrainer with the
spec's overrides (TRL's GRPOTrainer where it has none) on a split of arithmetic problems (`problem_splits`: every
"a op b" with operands 0…max_operand, cut once into disjoint test, validation and training sets), answers the held-out
split greedily and returns the record the summaries read: the accuracy and each problem's outcome, the reward and
`TRACES` per step, the resolved config, the trust region it ran with and the code it ran. `CPU` is the configuration
every run starts from.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import build_trainer, code_and_versions, compact_json, run_in_subprocesses

# the curves a run records per step besides the reward: those the summaries read (the others: docs/metrics.md)
TRACES = ("learning_rate", "oblr/lr", "grad_norm", "snr/lr_factor", "oblr/step_kl", "oblr/step_kl_target",
          "oblr/trust_region_factor", "oblr/trust_region_rate", "completions/mean_length")


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


# two groups of 4 in one micro-batch: GRPO's per-group std scaling then differs from no scaling (one group per step,
# rescaled as a whole, would be undone by gradient clipping); a problem set and a method override what they set
CPU = {
    "max_operand": 19,
    "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
                   max_completion_length=16, learning_rate=3e-5, lr_scheduler_type="constant_with_warmup",
                   warmup_steps=5, max_grad_norm=1.0, beta=0.0, loss_type="dapo", gradient_checkpointing=False,
                   bf16=False, use_cpu=True),
    "eval_max_new_tokens": 16,
}


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
    """Each split as ``<folder>/<name>.jsonl``; their paths by name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: str(folder / f"{name}.jsonl") for name in splits}


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
    # the code as the run starts: what trains it (a commit made while it trains is not its code)
    start, code = time.perf_counter(), code_and_versions()
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
                  outcomes=[int(s["correct"][0]) for s in samples], code=code)
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
        result["lr_trust_region_max_ratio"] = getattr(tuning, "lr_trust_region_max_ratio", None)
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


def recorded_trust_region(run: dict) -> tuple[float | None, int | None, str | None, str | None]:
    """The δ of the trust region a run used, its measuring cadence, form and curvature reading (None without one). A
    record that predates a field has its overrides say, else what ran then: no trust region, every step, the cap, per
    unit rate."""
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
    from oblr_trl.rewards import GRADER_VERSION

    if not path.exists():
        return False
    record = json.loads(path.read_text())
    return (grader_of(record) == GRADER_VERSION and recorded_trust_region(record) == requested_trust_region(spec)
            and all(record.get(key) == value for key, value in spec.get("identity", {}).items()))


def run_all(specs: list[dict], folder: Path, description: str, jobs: int) -> list[dict]:
    """Each spec's result, from ``folder`` where an earlier invocation left it, else from a fresh run."""
    folder.mkdir(parents=True, exist_ok=True)
    cached = {run_key(s): folder / f"{run_key(s)}.json" for s in specs}
    todo = [s for s in specs if not current(cached[run_key(s)], s)]
    run_in_subprocesses(__spec__.name, todo, description, jobs=jobs,
                        on_result=lambda spec, result: cached[run_key(spec)].write_text(compact_json(result)))
    return [json.loads(cached[run_key(s)].read_text()) for s in specs]
