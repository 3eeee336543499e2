"""Plot what the rate rule did in one committed benchmark run: reward, the rate used against the scheduled one, each
measured step's KL against the KL it aimed at and δ, and the two factors.

The runs of `stability.py` keep their per-step traces (`runs/*.json`); this draws one of them as the picture of a
healthy run that docs/rate_rule.md shows, and writes the PNG beside the run's folder.

    python benchmarks/run_curves.py \
        benchmarks/results/stability/runs/test-oblrpo-trust-peak-update-every16-kl0.005-lr1e-05-seed0.json \
        --output benchmarks/results/stability/healthy_run.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import new_figure, save_figure  # noqa: E402
from learning import used_rates  # noqa: E402


def finite(values: list) -> list[tuple[int, float]]:
    """(step, value) of the logged, finite values; steps count from 1 as the Trainer's do."""
    return [(step, v) for step, v in enumerate(values, start=1) if v is not None and math.isfinite(v)]


def plot(run: dict, output: Path) -> Path:
    traces, delta = run["traces"], run.get("lr_trust_region_kl")
    used = used_rates(traces)
    figure, axes = new_figure(2, (12, 8), rows=2)
    reward = axes[0][0]
    reward.plot(range(1, len(run["reward"]) + 1), run["reward"], marker=".")
    reward.set(title="mean reward of the step's completions", xlabel="optimizer step")
    rates = axes[0][1]
    rates.plot(*zip(*finite(traces["learning_rate"]), strict=True), label="scheduled (learning_rate)", color="gray")
    rates.plot(*zip(*finite(used), strict=True), label="used (oblr/lr)", marker=".")
    rates.set(title=f"learning rate (configured {run['learning_rate']:g})", xlabel="optimizer step", yscale="log")
    rates.legend()
    kl = axes[1][0]
    kl.plot(*zip(*finite(traces["oblr/step_kl"]), strict=True), "o", label="measured (oblr/step_kl)")
    aimed = finite(traces.get("oblr/step_kl_target", []))
    if aimed:
        kl.plot(*zip(*aimed, strict=True), "--", color="gray", label="aimed at (oblr/step_kl_target)")
    if delta:
        kl.axhline(delta, color="red", lw=0.8, label=f"δ = {delta:g}")
    kl.set(title="policy KL of a step, nats a token", xlabel="optimizer step", yscale="log")
    kl.legend()
    factors = axes[1][1]
    factors.plot(*zip(*finite(traces["oblr/trust_region_factor"]), strict=True), label="trust-region factor")
    factors.plot(*zip(*finite(traces["snr/lr_factor"]), strict=True), label="SNR factor")
    factors.set(title="factors on the scheduled rate", xlabel="optimizer step", yscale="log")
    factors.legend()
    for axis in (reward, rates, kl, factors):
        axis.grid(alpha=0.3)
    figure.suptitle(f"{run['method']} · {run['problems']} · seed {run['seed']} · final test accuracy "
                    f"{run['accuracy']:.2f}")
    return save_figure(figure, output.parent, output.stem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run's JSON with its traces (stability.py's runs/)")
    parser.add_argument("--output", type=Path, default=None, help="default: the run's name, .png, beside its folder")
    args = parser.parse_args(argv)
    output = args.output or args.run.parent.parent / f"{args.run.stem}.png"  # runs/ is the folder of the runs
    print(f"wrote {plot(json.loads(args.run.read_text()), output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
