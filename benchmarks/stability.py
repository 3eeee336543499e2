"""Benchmark `stability`: does a learning-rate rule keep a run learning when the configured rate is too high?

Users rarely tune the rate of an RL run, so each method runs over a grid of configured rates around GRPO's best
(best/10 … 10× best, TRL's linear schedule without warm-up), paired seeds (same initialisation, prompts and order).
Per cell: final held-out accuracy with a 95 % t-interval over seeds, the mean training reward, the share of seeds that
collapsed (ended more than `COLLAPSE_MARGIN` below the untrained model) and the realised SNR factor's range. Per
method, the regret (best cell's mean final minus this method's final, averaged over the rates, per seed) paired with
`grpo`. Two arms are level only where their paired difference's interval lies inside ±`EQUIVALENCE_MARGIN`.

What runs is declared in `stability_registry.py` (methods, problem sets, studies); the summary's sections are
`stability_summary.py`'s. Each run is a fresh process whose record under the folder's `runs/` names its method, rate,
seed, problems, study, steps, config changes and code; a part resumes from the records it finds and ends by
rewriting the folder's summary. A settled method (`SETTLED_METHODS`) is refused before anything runs, naming the
commit that runs it; settled studies left the code, and each folder's ``settled.md`` or summary names their commit.

    python -m benchmarks.stability --part smollm2 --methods grpo oblrpo   # a + b's grid, 2 runs at a time
    python -m benchmarks.stability --part delta          # 2 validation runs that choose δ
    python -m benchmarks.stability --part validation --methods grpo --rates 3e-6 1e-5 3e-5 1e-4   # GRPO's best
    python -m benchmarks.stability --part attribution    # the four arms at 1e-6, GRPO's best and 10× it
    python -m benchmarks.stability --part reproduce      # 3 committed cells run again, compared step for step
    python -m benchmarks.stability --part smollm2 --problems a±b --methods M   # another problem set's grid
    python -m benchmarks.stability --part summary --problems a+b-reasoned   # rewrite a folder's summary
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from benchmarks import learning
from benchmarks.common import RESULTS, parse_overrides
from benchmarks.stability_measures import grid_methods
from benchmarks.stability_registry import (
    CPU, PROBLEM_SETS, SETTLED_METHODS, SMOLLM2_METHODS, STUDIES, TRL_SCHEDULE, ProblemSet, Settled, Study,
)
from benchmarks.stability_summary import write_summary

JOBS = 2  # runs at a time on the 2 CPU cores the grids were measured on


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=[*STUDIES, "summary"], default="summary",
                        help="; ".join(f"{part}: {study.description}" for part, study in STUDIES.items()))
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods of the part (default: the part's; for a grid GRPO, the defaults, the "
                        "paper-literal factor and the trust region's forms, settled)")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="the grid (default: the part's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the part's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the part's)")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--problems", choices=list(PROBLEM_SETS), default="a+b",
                        help="the problems a part trains and tests on; each has its own folder")
    parser.add_argument("--eval_problems", type=int, default=None,
                        help="problems in each of test and validation (default: the problems')")
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field of every run, e.g. --set use_cpu=false on a GPU (give "
                        "such runs their own --output_dir: cells pair runs of one machine only)")
    parser.add_argument("--output_dir", default=None,
                        help="default: the problems' folder under benchmarks/results (a + b stability/, a ± b "
                        "stability-a-pm-b/, …)")
    args = parser.parse_args(argv)
    problems = PROBLEM_SETS[args.problems]
    study = STUDIES.get(args.part)
    if study is not None and not args.rates and not study.rates(problems):
        parser.error(f"--part {args.part} has no rates on --problems {args.problems} (a grid needs GRPO's best rate "
                     "screened first: --part validation --methods grpo); give --rates")
    if args.output_dir is None:
        args.output_dir = str(RESULTS / problems.folder)
    return args


def refuse_settled(names: Iterable[str], settled: Mapping[str, Settled]) -> None:
    """Stop before anything runs where ``names`` holds a settled method, in one line naming the commit that runs it."""
    found = [settled[name] for name in names if name in settled]
    if found:
        raise SystemExit(f"{', '.join(m.name for m in found)}: settled, their runs committed and reported; HEAD no "
                         f"longer runs them, commit {', '.join(sorted({m.commit for m in found}))} does (give "
                         "--methods without them to run the others)")


# --- SmolLM2 parts ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one invocation of a study's part runs, and where its records go."""

    study: Study
    problems: ProblemSet
    methods: tuple[str, ...]
    rates: tuple[float, ...]
    seeds: tuple[int, ...]
    steps: int
    folder: Path  # where its records go


def plan(study: Study, args) -> Plan:
    """The study on ``--problems``, narrowed by the options; a settled method among its methods stops it
    (`refuse_settled`)."""
    problems = PROBLEM_SETS[args.problems]
    folder = Path(args.output_dir) / "runs" / study.folder
    methods = args.methods or study.methods or problems.methods
    refuse_settled(methods, SETTLED_METHODS)
    return Plan(study, problems, tuple(grid_methods(list(methods), problems)),
                tuple(args.rates or study.rates(problems)), tuple(args.seeds or study.seeds), args.steps or study.steps,
                folder)


def smollm2_specs(args, plan: Plan) -> tuple[list[dict], dict]:
    """Each run of ``plan`` as a `learning.run_child` spec, seed-major (an interrupted grid has whole seeds for every
    cell), and the untrained model's spec."""
    problems, study = plan.problems, plan.study
    splits = learning.problem_splits(problems.max_operand, args.eval_problems or problems.eval_problems,
                                     operators=problems.operators)
    paths = learning.write_splits(splits, Path(args.output_dir) / problems.data)
    base = {"model": args.model, "steps": plan.steps, "train": paths["train"],
            "threads": max(1, (os.cpu_count() or 1) // args.jobs), "eval_max_new_tokens": problems.eval_max_new_tokens,
            "split": study.split, "held_out": paths[study.split], "problems": problems.title,
            "scratch": str(Path(tempfile.gettempdir()) / "oblr-trl-stability"),
            **({"template": problems.template} if problems.template else {})}
    changes = parse_overrides(args.overrides)
    identity = study.identity(plan.steps, changes)
    specs = []
    for seed in plan.seeds:
        for rate in plan.rates:
            for name in plan.methods:
                method = SMOLLM2_METHODS[name]
                config = {**CPU["config"], **problems.config, **TRL_SCHEDULE, **study.config, **changes}
                specs.append({**base, "method": name, "overrides": method.config_overrides(problems), "config": config,
                              "seed": seed, "learning_rate": rate, "identity": identity})
    initial = {**base, "method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test",
               "held_out": paths["test"], **({"sample_max_new_tokens": problems.config["max_completion_length"]}
                  if "max_completion_length" in problems.config else {})}
    return specs, initial


def run_study(study: Study, args) -> None:
    """The study's runs that its folder does not hold yet, each a `learning.run_child`, with the untrained model's
    evaluation beside them; a study in a folder of its own shares the problem set's, in runs/."""
    planned = plan(study, args)
    specs, initial = smollm2_specs(args, planned)
    learning.run_all(([] if study.folder else [initial]) + specs, planned.folder, f"{study.part} runs", args.jobs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part in STUDIES:
        run_study(STUDIES[args.part], args)
    write_summary(Path(args.output_dir), PROBLEM_SETS[args.problems])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
