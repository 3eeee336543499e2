"""The stability summary's figure, ``summary.png``: a row of two panels per section that draws one."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import new_figure, save_figure
from benchmarks.stability_measures import COLLAPSE_MARGIN
from benchmarks.stability_registry import REFERENCE

Row = Callable[..., None]  # draws one row of ``summary.png`` on its (left, right) axes
SEED_STYLES = ("-", "--", ":", "-.")  # one line style per seed, where the colour says something else


def grid_and_legend(*axes) -> None:
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)


def plot_summary(rows: list[Row], output_dir: Path) -> Path:
    figure, axes = new_figure(2, (13, 4.6 * len(rows)), rows=len(rows))
    axes = list(axes.flat)
    for index, draw in enumerate(rows):
        draw(axes[2 * index], axes[2 * index + 1])
    return save_figure(figure, output_dir, "summary")


def error_bar(cell: dict) -> tuple[float, float]:
    """How far a cell's interval reaches below and above its mean final accuracy, cut at the accuracies a run can end
    with (0 and 1: the t-interval of 2 or 3 seeds reaches past them); none for one seed (no interval)."""
    low, high = cell["final_acc_ci"]
    if math.isnan(low):
        return 0.0, 0.0
    mean = cell["final_acc_mean"]
    return max(0.0, mean - max(low, 0.0)), max(0.0, min(high, 1.0) - mean)


def cells_row(title: str, summary: dict, rates: list[float]) -> Row:
    """Final accuracy (95 % t-interval over seeds, `error_bar`) and the collapsed fraction per configured rate, a line
    per method."""
    def draw(final_axis, collapse_axis) -> None:
        for method, entry in summary["methods"].items():
            present = [r for r in rates if f"{r:.3g}" in entry["by_lr"]]
            if not present:
                continue
            cells = [entry["by_lr"][f"{r:.3g}"] for r in present]
            final_axis.errorbar(present, [c["final_acc_mean"] for c in cells], marker="o", capsize=3,
                                yerr=list(zip(*(error_bar(c) for c in cells), strict=True)), label=method)
            collapse_axis.plot(present, [c["collapse_fraction"] for c in cells], marker="o", label=method)
        final_axis.set(xscale="log", xlabel="configured learning rate", ylabel="final held-out accuracy (95 % t-interval)",
                       title=title)
        collapse_axis.set(xscale="log", xlabel="configured learning rate", ylabel="collapsed fraction of seeds",
                          title=f"{title}: collapse (final < untrained − {COLLAPSE_MARGIN:g})")
        grid_and_legend(final_axis, collapse_axis)
    return draw


def screen_row(runs: list[dict]) -> Row:
    """GRPO's final validation accuracy per screened rate (a line per seed) with the other methods' validation runs
    (a marker per run), and each of GRPO's runs' mean sampled length per step."""
    others = [r for r in runs if r["method"] != REFERENCE]
    runs = [r for r in runs if r["method"] == REFERENCE]

    def draw(accuracy_axis, length_axis) -> None:
        for index, method in enumerate(sorted({r["method"] for r in others})):
            mine = [r for r in others if r["method"] == method]
            accuracy_axis.scatter([r["learning_rate"] for r in mine], [r["accuracy"] for r in mine],
                                  marker="sDv^<>"[index % 6], color=f"C{index}", label=method, zorder=3)
        rates = sorted({r["learning_rate"] for r in runs})
        for index, seed in enumerate(sorted({r["seed"] for r in runs})):
            mine = sorted((r for r in runs if r["seed"] == seed), key=lambda r: r["learning_rate"])
            style = SEED_STYLES[index % len(SEED_STYLES)]  # a colour per rate on the right
            accuracy_axis.plot([r["learning_rate"] for r in mine], [r["accuracy"] for r in mine], marker="o",
                               color="black", linestyle=style, label=f"seed {seed}")
            for r in mine:  # each run's mean sampled length per step: do the answers shorten as it learns?
                lengths = r["traces"]["completions/mean_length"]
                length_axis.plot(range(1, len(lengths) + 1), lengths, color=f"C{rates.index(r['learning_rate'])}",
                                 linestyle=style, label=f"seed {seed}, lr {r['learning_rate']:g}")
        accuracy_axis.set(xscale="log", xlabel="configured learning rate", ylabel="final validation accuracy",
                          title=f"{REFERENCE}'s rate screen and other methods (validation seeds and split)")
        length_axis.set(xlabel="optimizer step", ylabel="mean sampled completion length (tokens)",
                        title="how long the answers are while training")
        grid_and_legend(accuracy_axis, length_axis)
    return draw

