"""How well each way of reading the curvature predicts a step's KL, replayed on runs that measured every step.

The trust region sizes a step with the KL its smoothed curvature predicts, ĉ·η² (`oblr/step_kl_target`). This replays
that prediction over runs that measured the KL of every step (`stability.py --part validation --methods
oblrpo-trust-peak-every1`, validation seeds and split only: a settled method, which commit e7f4843 runs; its runs are
committed), for each predictor and measuring cadence, and reports the measured ÷ predicted KL of every step with a
gradient after the predictor's first reading — 1 is a step that lands where it aims — and of the steps the cadence
itself would measure (what a run at that cadence can report). The predictors:

* ``per-rate``: ĉ = EMA of KL/η² (the reading the runs replayed here ran with, no longer OBLR-PO's);
* ``per-update``: ĉ = EMA of KL/(η²·ū²), the next step predicted with the last gradient step's ū² (ū² the mean square
  of Adam's update per unit rate, `oblr/update_rms`²; the trust region's reading, with the doubling cadence);
* ``per-update (this step's ū²)``: the same with the step's own ū² — what a rule that read Adam's update before the
  step could reach, the bound of the last-step approximation.

The probe's reading is replaced by the next one (the peak form's provisional probe), and the curvature is the
bias-corrected moving average of the readings (decay 0.5, the default, or 0: the last reading alone). The readings are
those the cadence would take (the probe, the step after it, then every k-th step with a gradient, or gaps doubling
from 1 to 16); the rates are the runs' own, so a predictor is scored on the steps the runs took, not on
the steps it would have chosen.

    python benchmarks/kl_prediction.py      # reads results/stability/runs/validation-*-every1-*.json (seconds)

Writes ``results/stability/kl_prediction.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "stability"
CADENCES = (1, 4, 16, "doubling")  # "doubling": gaps of 1, 2, 4, 8 gradient steps after the probe, then 16
DECAYS = (0.5, 0.0)  # lr_trust_region_ema_decay's default, and the last reading alone
PREDICTORS = ("per-rate", "per-update", "per-update (this step's ū²)")


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def gap(cadence: int | str, readings: int) -> int:
    """Gradient steps from one reading to the next, after ``readings`` readings."""
    return min(16, 2 ** max(readings - 1, 0)) if cadence == "doubling" else cadence


def replay(traces: dict, predictor: str, cadence: int | str, decay: float,
           replace_probe: bool = True) -> list[tuple[float, bool]]:
    """(measured ÷ predicted KL, whether the cadence measures the step) of every step with a gradient after the first
    reading, for one run."""
    kl, lr, rms, grad = (traces[key] for key in ("oblr/step_kl", "oblr/lr", "oblr/update_rms", "grad_norm"))
    weighted = weight = 0.0  # the bias-corrected EMA of the readings: Σ d^k·x / Σ d^k
    readings, since, last_ms, provisional = 0, 0, None, False
    ratios = []
    for t in range(len(kl)):
        if not (finite(kl[t]) and finite(lr[t]) and lr[t] > 0 and finite(rms[t])):
            continue
        ms = rms[t] ** 2
        gradient = grad[t] != 0
        scale = {"per-rate": 1.0, "per-update": last_ms, "per-update (this step's ū²)": ms}[predictor]
        if not gradient:
            continue
        since += 1
        due = readings == 0 or provisional or since >= gap(cadence, readings)
        if readings and scale:
            ratios.append((kl[t] / (weighted / weight * lr[t] ** 2 * scale), due))
        last_ms = ms
        if not due:
            continue
        since = 0
        reading = kl[t] / (lr[t] ** 2 * (1.0 if predictor == "per-rate" else ms))
        if reading <= 0:
            continue
        if provisional:
            weighted = weight = 0.0
        weighted, weight = decay * weighted + reading, decay * weight + 1.0
        provisional = replace_probe and readings == 0
        readings += 1
    return ratios


def summarise(runs: list[dict]) -> dict:
    rows = {}
    for predictor in PREDICTORS:
        for cadence in CADENCES:
            for decay in DECAYS:
                replayed = [replay(r["traces"], predictor, cadence, decay) for r in runs]
                per_run = [[ratio for ratio, _ in steps] for steps in replayed]
                pooled = [ratio for ratios in per_run for ratio in ratios]
                measured = [ratio for steps in replayed for ratio, due in steps if due]
                logs = [math.log(ratio) for ratio in pooled if ratio > 0]
                rows[f"{predictor} | every {cadence} | decay {decay}"] = {
                    "predictor": predictor, "cadence": cadence, "ema_decay": decay,
                    "steps": len(pooled), "median": statistics.median(pooled),
                    "measured_steps": len(measured), "measured_median": statistics.median(measured),
                    "quartiles": statistics.quantiles(pooled, n=4),
                    "within_half_to_double": sum(0.5 <= x <= 2 for x in pooled) / len(pooled),
                    "log_ratio_sd": statistics.pstdev(logs),
                    "run_medians": [statistics.median(ratios) for ratios in per_run if ratios]}
    return rows


def table(rows: dict) -> str:
    lines = [("| predictor | measured every | EMA decay | steps | measured ÷ predicted: median [quartiles] | "
              "share in [0.5, 2] | sd of log ratio | run medians | the measured steps: median (steps) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        q = row["quartiles"]
        lines.append(f"| {row['predictor']} | {row['cadence']} | {row['ema_decay']} | "
                     f"{row['steps']} | {row['median']:.2f} [{q[0]:.2f}, {q[2]:.2f}] | "
                     f"{row['within_half_to_double']:.2f} | {row['log_ratio_sd']:.2f} | "
                     f"{', '.join(f'{m:.2f}' for m in row['run_medians'])} | "
                     f"{row['measured_median']:.2f} ({row['measured_steps']}) |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        t = r["traces"]
        steps = [s for s in range(len(t["oblr/step_kl"])) if finite(t["oblr/step_kl"][s]) and t["grad_norm"][s] != 0]
        label = f"seed {r['seed']}, {r['learning_rate']:g}"
        axes[0].semilogy(steps, [t["oblr/step_kl"][s] / t["oblr/lr"][s] ** 2 for s in steps], label=label)
        axes[1].semilogy(steps, [t["oblr/step_kl"][s] / (t["oblr/lr"][s] * t["oblr/update_rms"][s]) ** 2
                                 for s in steps], label=label)
    axes[0].set(title="KL / η² (per unit rate)", xlabel="step")
    axes[1].set(title="KL / (η² · ū²) (per unit of Adam's update)", xlabel="step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(RESULTS / "runs"))
    parser.add_argument("--pattern", default="validation-*-every1-*.json")
    parser.add_argument("--output_dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    output = Path(args.output_dir)
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob(args.pattern))]
    runs = [r for r in runs if "oblr/update_rms" in r.get("traces", {})]
    if not runs:
        raise SystemExit(f"no run that logs oblr/update_rms matches {args.pattern} in {args.runs}")
    rows = summarise(runs)
    output.mkdir(parents=True, exist_ok=True)
    (output / "kl_prediction.json").write_text(json.dumps(
        {"runs": [{"method": r["method"], "seed": r["seed"], "learning_rate": r["learning_rate"]} for r in runs],
         "predictors": rows}, indent=1))
    (output / "kl_prediction.md").write_text(
        "# Measured ÷ predicted KL of each step, replayed (validation seeds)\n\n"
        f"{len(runs)} runs that measured every step: "
        + ", ".join(f"{r['method']} seed {r['seed']} at {r['learning_rate']:g}" for r in runs)
        + ". Every step with a gradient after the predictor's first reading; 1 is a step that lands where it aims.\n\n"
        + table(rows) + "\n![curvature per unit rate and per unit update](kl_prediction.png)\n")
    plot(runs, output / "kl_prediction.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
