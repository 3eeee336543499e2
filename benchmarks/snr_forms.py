"""Benchmark `snr_forms`: which form of the SNR factor, if any, earns its place at our users' batch sizes.

On the synthetic testbed (`synthetic_learning.py`: the trainer's rate rule, `StepRateRule`, on a policy small enough
for 100 paired seeds), the shipped rule — the trust region measuring the schedule's peak — runs with each form of the
SNR factor f_t on top, at 8, 32 and 128 prompts a step (8 completions each, as the trainer's default group):

* `none`: no SNR factor (`use_snr_lr=False`), the trust region alone;
* `raise-only`: the calibrated factor clip(f_t / f_ref, 1, 2) — raises the rate above the measured peak, never lowers;
* `lower-only`: clip(f_t / f_ref, 0.5, 1) — lowers the rate when the SNR falls below its early level, never raises;
* `two-sided`: clip(f_t / f_ref, 0.5, 2);
* `paper`: the paper's η_t = η_max · max(f_t, 0.1), f_t = N·SNR/(1 + N·SNR) ≤ 1, with η_max the measured peak
  (`snr_lr_reference="absolute"`).

Each form is compared with `none`, paired (same seeds: initial parameters, prompts), under a constant schedule and
TRL's default (linear decay to 0), at two configured rates per batch size and schedule: GRPO's best (the highest validation AUC of a constant rate on validation seeds 0–19, from a log grid)
and 30× below it (TRL's default 1e-6 is about that far below GRPO's best on SmolLM2 a + b). The differences in
area under the held-out curve (AUC) and final score come with bootstrap 95 % intervals over 100 test seeds; "acts"
is the share of steps whose factor is not 1.

    python benchmarks/snr_forms.py   # 2 schedules × 3 batch sizes × 5 forms × 2 rates × 100 seeds: ~25 min, 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic_learning as synthetic  # noqa: E402
from common import RESULTS, bootstrap_ci, markdown_table, new_figure, save_figure, write_results  # noqa: E402

DEFAULTS = synthetic.METHODS["defaults"]  # the shipped baseline and rule; a form replaces the rule's SNR part
FORMS = {
    "none": {"use_snr_lr": False},
    "raise-only": {"snr_lr_min_ratio": 1.0, "snr_lr_max_ratio": 2.0},
    "lower-only": {"snr_lr_min_ratio": 0.5, "snr_lr_max_ratio": 1.0},
    "two-sided": {"snr_lr_min_ratio": 0.5, "snr_lr_max_ratio": 2.0},
    "paper": {"snr_lr_reference": "absolute"},
}
GRPO_RATES = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # the constant-rate grid GRPO's best is chosen from
LOW_RATE_DIVISOR = 30.0


def form(name: str) -> synthetic.Method:
    return synthetic.Method(DEFAULTS.weights, DEFAULTS.leave_one_out, DEFAULTS.scale_rewards, dict(FORMS[name]),
                            DEFAULTS.estimator, f"the shipped rule, SNR factor: {name}")


def interval(values: torch.Tensor) -> dict:
    return {"mean": float(values.mean()), "ci": bootstrap_ci(values)}


def cell(entry: dict) -> str:
    return f"{entry['mean']:+.4f} [{entry['ci'][0]:+.4f}, {entry['ci'][1]:+.4f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--validation_seeds", type=int, default=20)
    parser.add_argument("--test_seeds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--schedules", nargs="+", default=list(synthetic.SCHEDULES), choices=synthetic.SCHEDULES)
    parser.add_argument("--output_dir", default=str(RESULTS / "learning_synthetic"))
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    torch.set_num_threads(2)
    forms = ["none", *[name for name in args.forms if name != "none"]]
    validation = list(range(args.validation_seeds))
    test = list(range(1000, 1000 + args.test_seeds))
    summary = {"forms": {name: FORMS[name] for name in forms}, "validation_seeds": validation, "test_seeds": test,
               "steps": args.steps, "grpo_rates": list(GRPO_RATES), "schedules": {}}
    rows = []
    bar = tqdm(total=len(args.schedules) * len(args.prompts) * (1 + 2 * len(forms)),
               desc="schedules × batch sizes × (GRPO screen + forms × rates)")
    for schedule in args.schedules:
        summary["schedules"][schedule] = {}
        for prompts in args.prompts:
            task = synthetic.Task(prompts_per_step=prompts, steps=args.steps)
            teacher, held_out, targets = synthetic.problem(task)

            def run(method: synthetic.Method, rates: torch.Tensor, seeds: list[int]) -> dict:
                return synthetic.run(method, rates, seeds, task, teacher, held_out, targets, schedule)  # noqa: B023

            # GRPO's screen in one batch: every grid rate on every validation seed side by side
            grid = torch.tensor(GRPO_RATES).repeat_interleave(len(validation))
            screen = run(synthetic.METHODS["grpo"], grid, validation * len(GRPO_RATES))["auc"]
            screen = screen.view(len(GRPO_RATES), -1).mean(1)
            best = GRPO_RATES[int(screen.argmax())]
            bar.update()
            rates = {"GRPO's best": best, f"GRPO's best ÷ {LOW_RATE_DIVISOR:g}": best / LOW_RATE_DIVISOR}
            entry = {"grpo_screen_auc": {str(r): float(a) for r, a in zip(GRPO_RATES, screen, strict=True)},
                     "grpo_best_rate": best, "rates": {}}
            for label, rate in rates.items():
                runs = {}
                for name in forms:
                    runs[name] = run(form(name), torch.full((len(test),), rate), test)
                    bar.update()
                reference = runs["none"]
                cells = {}
                for name, result in runs.items():
                    factors = result["factor_trace"]
                    cells[name] = {
                        "auc": interval(result["auc"]), "final": interval(result["final"]),
                        "auc_minus_none": interval(result["auc"] - reference["auc"]),
                        "final_minus_none": interval(result["final"] - reference["final"]),
                        "acts": float(((factors - 1.0).abs() > 1e-6).float().mean()),
                        "mean_factor": float(factors.mean()),
                        "factor_range": [float(factors.min()), float(factors.max())],
                        "mean_rate_over_configured": float(result["mean_lr"].mean()) / rate,
                        "mean_factor_curve": factors.mean(0).tolist(),
                    }
                    rows.append([schedule, prompts, f"{label} ({rate:.3g})", name, cells[name]["auc"]["mean"],
                                 "—" if name == "none" else cell(cells[name]["auc_minus_none"]),
                                 "—" if name == "none" else cell(cells[name]["final_minus_none"]),
                                 f"{cells[name]['acts']:.0%}", cells[name]["mean_factor"],
                                 f"{cells[name]['factor_range'][0]:.2f}–{cells[name]['factor_range'][1]:.2f}",
                                 cells[name]["mean_rate_over_configured"]])
                entry["rates"][label] = {"rate": rate, "forms": cells}
            summary["schedules"][schedule][str(prompts)] = entry
    bar.close()

    markdown = (
        f"## The SNR factor's forms at 8–128 prompts a step ({len(test)} paired test seeds, {args.steps} steps, "
        f"{synthetic.Task.group_size} completions a prompt)\n\n"
        "The shipped rate rule (the trust region measuring the peak) with each form of the SNR factor on top; paired "
        "differences against `none` (the trust region alone) with bootstrap 95 % intervals. Configured rates: GRPO's "
        f"best on validation seeds {validation[0]}–{validation[-1]} at that batch size and schedule, and "
        f"{LOW_RATE_DIVISOR:g}× below it. *acts*: share of steps whose SNR factor is not 1. Schedules: constant, and "
        "TRL's default linear decay to 0 (no warm-up).\n\n"
        + markdown_table(["schedule", "prompts/step", "configured rate", "form", "AUC", "AUC − none [95 % CI]",
                          "final − none [95 % CI]", "acts", "mean factor", "factor range", "mean rate ÷ configured"],
                         rows)
    )
    write_results(args.output_dir, "snr_forms", summary, markdown)

    schedules = list(summary["schedules"])
    labels = list(next(iter(summary["schedules"][schedules[0]].values()))["rates"])
    figure, axes = new_figure(len(labels), (6 * len(labels), 4.2 * len(schedules)), rows=len(schedules))
    axes = numpy.asarray(axes).reshape(len(schedules), len(labels))  # one row per schedule, however few
    for row, schedule in zip(axes, schedules, strict=True):
        sizes = list(summary["schedules"][schedule])
        for axis, label in zip(row, labels, strict=True):
            for offset, name in enumerate(forms[1:]):
                diffs = [summary["schedules"][schedule][size]["rates"][label]["forms"][name]["auc_minus_none"]
                         for size in sizes]
                positions = [i + (offset - (len(forms) - 2) / 2) * 0.15 for i in range(len(sizes))]
                axis.errorbar(positions, [d["mean"] for d in diffs], capsize=3, fmt="o", label=name,
                              yerr=[[d["mean"] - d["ci"][0] for d in diffs], [d["ci"][1] - d["mean"] for d in diffs]])
            axis.axhline(0.0, color="grey", linewidth=0.8)
            axis.set_xticks(range(len(sizes)), sizes)
            axis.set(xlabel="prompts a step", ylabel="AUC − none (95 % CI)",
                     title=f"{schedule} schedule, configured rate: {label}")
            axis.legend(fontsize=8)
    save_figure(figure, args.output_dir, "snr_forms")
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
