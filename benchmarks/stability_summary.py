"""The stability summary of one results folder (``summary.{json,md,png}``): a list of sections, each a function of
the folder's run records that returns its part of the JSON, its markdown and the rows it adds to ``summary.png``.

A section returns None where the folder holds nothing it reports; the numbers are `stability_measures.py`'s."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from benchmarks import learning
from benchmarks.common import EQUIVALENCE_MARGIN, equivalence, markdown_table, t_interval, write_results
from benchmarks.stability_figures import Row, cells_row, plot_summary, screen_row
from benchmarks.stability_measures import (
    COLLAPSE_MARGIN, code_of_runs, collapsed, completion_lengths, rate_rule_traces, reproduction, screen_by_rate,
    smollm2_grid, step_kl_spread,
)
from benchmarks.stability_registry import (
    DELTA_METHOD, GRID, LONG_COMPLETIONS, PEAK_DELTA, PEAK_DELTA_METHOD, REFERENCE, REPRODUCE, STUDIES, ProblemSet,
    Study, problems_titled,
)

# --- the folder's records --------------------------------------------------------------------------------------------
def read_runs(folder: Path, split: str) -> list[dict]:
    """The run records of ``split`` in ``folder`` (none where it is not), in the order of their file names."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{split}-*.json"))]


def cached_runs(folder: Path) -> list[dict]:
    """A folder's test runs of one grader, never a mix: the current grader's where it has any, else the older ones
    (which `grader_warning` then marks in the summary)."""
    from oblr_trl.rewards import GRADER_VERSION

    runs = read_runs(folder, "test")
    return [r for r in runs if learning.grader_of(r) == GRADER_VERSION] or runs


def grader_warning(runs: list[dict]) -> str:
    """A line for the summary where the runs (of one grader: `cached_runs`) were graded by an older grader."""
    from oblr_trl.rewards import GRADER_VERSION

    if not runs or learning.grader_of(runs[0]) == GRADER_VERSION:
        return ""
    return ("**Graded by math-verify alone (before 2026-11-25), which credited an unevaluated expression: policies "
            "trained on a × b restated the question (\"19 * 20 is a legendary and iconic Japanese martial arts film "
            "franchise\", graded correct), so these accuracies do not measure arithmetic. Re-run to grade them as "
            "now.**\n")


@dataclass
class Folder:
    """One results folder's records, read once: its test runs (`cached_runs`, the untrained model's among them) and
    validation runs under ``runs/``, and the problem set they trained on (``--problems``' before any run)."""

    output_dir: Path
    problems: ProblemSet
    tests: list[dict]
    validation: list[dict]

    @classmethod
    def read(cls, output_dir: Path, problems: ProblemSet) -> Folder:
        tests, validation = cached_runs(output_dir / "runs"), read_runs(output_dir / "runs", "validation")
        recorded = [*tests, *validation]
        return cls(output_dir, problems_titled(recorded[0]["problems"]) if recorded else problems, tests, validation)

    def runs_of(self, study: Study) -> list[dict]:
        """The study's test runs, from its folder under runs/ (`cached_runs`; runs/ itself, read once, for "")."""
        tests = cached_runs(self.output_dir / "runs" / study.folder) if study.folder else self.tests
        return [r for r in tests if r["method"] != "initial" and r["study"] == study.name]

    @cached_property
    def initial(self) -> dict | None:
        return next((r for r in self.tests if r["method"] == "initial"), None)

    @cached_property
    def grid(self) -> tuple[dict, dict] | None:
        """`smollm2_grid` of the folder's grid runs; None before the untrained model and a grid run are there."""
        if self.initial is None:
            return None
        return smollm2_grid(self.initial, self.runs_of(GRID), self.problems, self.problems.grid)


@dataclass
class Section:
    markdown: list[str]
    results: dict = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)  # rows of summary.png


def interval(mean: float, ci: list[float], sign: str = "+") -> str:
    """The mean and its interval; "[one seed]" where a single seed gives no interval (`t_interval`'s NaN)."""
    if math.isnan(ci[0]):
        return f"{mean:{sign}.3f} [one seed]"
    return f"{mean:{sign}.3f} [{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]"


# what a summary's "level" means, where it writes one
LEVEL = (f"Level: the 95 % t-interval of a paired difference in final accuracy lies inside ±{EQUIVALENCE_MARGIN:g}, "
         "the equivalence margin; otherwise not shown level.")


def fraction(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


# --- the grid --------------------------------------------------------------------------------------------------------
def cell_table(summary: dict, rates: list[float]) -> str:
    rows = []
    for method, entry in summary["methods"].items():
        regret = interval(entry["regret_mean"], entry["regret_ci"], sign="") if "regret_mean" in entry else "—"
        vs = (interval(entry["regret_minus_grpo"], entry["regret_minus_grpo_ci"]) if "regret_minus_grpo" in entry
              else "—")
        cells = []
        for rate in rates:
            cell = entry["by_lr"].get(f"{rate:.3g}")
            cells.append("—" if cell is None else
                         interval(cell["final_acc_mean"], cell["final_acc_ci"], sign="")
                         + f" · {cell['collapse_fraction']:.0%}"
                         f" · f {cell['factor_range'][0]:.2f}–{cell['factor_range'][1]:.2f}"
                         f" (n={len(cell['seeds'])})")
        at_best = ("—" if "at_grpo_best_minus_grpo" not in entry else
                   f"{interval(entry['at_grpo_best_minus_grpo'], entry['at_grpo_best_minus_grpo_ci'])} · "
                   f"{equivalence(entry['at_grpo_best_minus_grpo_ci'])}")
        extra = (", ".join(f"{r:.3g}" for r in entry["collapses_where_grpo_does_not"]) or "none"
                 if "collapses_where_grpo_does_not" in entry else "—")
        name = f"{method} (= {entry['same_runs_as']}'s runs)" if "same_runs_as" in entry else method
        rows.append([name, *cells, regret, vs, at_best, extra])
    return markdown_table(["method", *[f"lr {r:.3g}: final [CI] · collapsed · factor" for r in rates],
                           "regret [CI]", "regret − grpo [CI]", "at GRPO's best rate − grpo [CI] · level",
                           "collapsed where GRPO did not"], rows)


def grid_section(folder: Folder) -> Section | None:
    """Per method and configured rate of the problem set's grid: final test accuracy, collapses, the SNR factor's
    range, and the regret paired with GRPO (`grid_summary`)."""
    if folder.grid is None:
        return None
    summary, details = folder.grid
    return Section(
        [f"## SmolLM2-135M-Instruct ({details['problems']}, {details['steps']} steps of 8 completions, TRL's linear "
         f"schedule; untrained test accuracy {details['initial_accuracy']:.3f})\n",
         grader_warning(folder.tests),
         f"Cell: final test accuracy [95 % t-interval over seeds] · collapsed fraction (final < untrained − "
         f"{COLLAPSE_MARGIN:g}) · realised SNR factor range (n = seeds). Regret: best cell mean final minus this "
         "method's final, averaged over the rates, per seed; differences paired with `grpo` (95 % t-interval over "
         f"paired seeds). {LEVEL}\n",
         cell_table(summary, details["rates"]), ""],
        {**summary, "smollm2": {**details, "grader": learning.grader_of(folder.tests[0])}},
        [cells_row(f"SmolLM2-135M, {details['problems']}", summary, details["rates"])])


def code_section(folder: Folder) -> Section | None:
    """The commits the folder's runs were made by, per method (`code_of_runs`): a cell is today's code only where its
    runs name a commit whose trajectory-changing code is HEAD's, or where `--part reproduce` shows it."""
    runs = [r for r in [*folder.tests, *folder.validation] if r["method"] != "initial"]
    if not runs:
        return None
    code = code_of_runs(runs)
    return Section(["The code each method's runs (test and validation, every study) were made by: the commit their "
                    "records name and how many runs each made (\"not recorded\": made before run records named their "
                    "code; `--part reproduce` runs such cells again):\n",
                    markdown_table(["method", "runs", "commits (runs)"],
                                   [[method, sum(counts.values()),
                                     ", ".join(f"{label} ({n})" for label, n in counts.items())]
                                    for method, counts in code.items()]), ""],
                   {"code": code})


def pairs_section(folder: Folder) -> Section | None:
    """The registry's `PAIRS`, paired by seed at each rate both ran (`pair_comparison`)."""
    if folder.grid is None or not folder.grid[0]["pairs"]:
        return None
    comparison = folder.grid[0]["pairs"]
    rates = sorted({rate for by_rate in comparison.values() for rate in by_rate}, key=float)
    rows = [[pair, *(f"{interval(c['mean'], c['ci'])} (n={len(c['seeds'])}) · {equivalence(c['ci'])}"
                     + (" · with problems [{:+.3f}, {:+.3f}]".format(*c["ci_with_problems"])
                        if "ci_with_problems" in c else "") if (c := by_rate.get(rate)) else "—" for rate in rates)]
            for pair, by_rate in comparison.items()]
    return Section(["What each part buys: the arms paired by seed at each rate both ran, the grid's and beyond it, "
                    "first minus second (95 % t-interval over paired seeds; \"with problems\": where every run recorded "
                    "each test problem's outcome, the interval counting the problems' noise too, seeds and problems "
                    "crossed; the trust region's earlier forms, paired alike, are in [settled.md](settled.md)). "
                    f"{LEVEL}\n",
                    markdown_table(["final accuracy, paired by seed", *rates], rows), ""])


def arms_section(folder: Folder) -> Section | None:
    """The attribution study's arms at each of its rates, on the seeds every arm ran there: mean final test accuracy
    [95 % t-interval over those seeds] and how many of them collapsed (`COLLAPSE_MARGIN`), so that the arms' levels
    and the pairs' differences come from the same seeds."""
    study = STUDIES["attribution"]
    if folder.initial is None or folder.problems.best_rate is None:
        return None
    finals: dict[float, dict[str, dict[int, float]]] = {}
    for r in folder.runs_of(study):
        if r["method"] in study.methods:
            finals.setdefault(r["learning_rate"], {}).setdefault(r["method"], {})[r["seed"]] = r["accuracy"]
    untrained, results, columns = folder.initial["accuracy"], {}, []
    for rate in study.rates(folder.problems):
        by_arm = finals.get(rate, {})
        seeds = sorted(set.intersection(*(set(by_arm.get(m, {})) for m in study.methods)))
        if not seeds:
            continue
        results[f"{rate:.3g}"] = {"seeds": seeds, **{m: {
            "mean": statistics.fmean(by_arm[m][s] for s in seeds), "ci": t_interval([by_arm[m][s] for s in seeds]),
            "collapsed": sum(collapsed({"final": by_arm[m][s], "initial": untrained}) for s in seeds)}
            for m in study.methods}}
        columns.append(rate)
    if not results:
        return None
    rows = [[method, *(f"{interval(c['mean'], c['ci'], sign='')} · collapsed {c['collapsed']}"
                       for c in (results[f"{rate:.3g}"][method] for rate in columns))] for method in study.methods]
    headers = [f"lr {rate:.3g} (seeds {' '.join(map(str, results[f'{rate:.3g}']['seeds']))})" for rate in columns]
    return Section([f"The attribution study's arms on the seeds all of them ran at each rate: final test accuracy, mean "
                    f"[95 % t-interval over those seeds] · how many collapsed (untrained {untrained:.3f}):\n",
                    markdown_table(["arm", *headers], rows), ""],
                   {"attribution_arms": results})


def pair_regrets_section(folder: Folder) -> Section | None:
    """The pairs' regret differences over the grid (`pair_regret_differences`)."""
    if folder.grid is None or not folder.grid[0]["pair_regrets"]:
        return None
    return Section(["Regret difference over the grid, paired by seed (the seeds both ran at every rate; 95 % "
                    "t-interval over paired seeds):\n",
                    markdown_table(["pair", "regret difference [95 % CI]", "seeds"],
                                   [[pair, interval(d["mean"], d["ci"]), " ".join(map(str, d["seeds"]))]
                                    for pair, d in folder.grid[0]["pair_regrets"].items()]), ""])


def rate_rule_section(folder: Folder) -> Section | None:
    """What the trust region did in each method's runs (`rate_rule_traces`)."""
    if folder.grid is None or not folder.grid[0]["rate_rule"]:
        return None
    rows = []
    for method, entry in folder.grid[0]["rate_rule"].items():
        aim = "not logged" if "aim_ratio_median" not in entry else (
            f"{entry['aim_ratio_median']:.2f} [{entry['aim_ratio_quartiles'][0]:.2f}, "
            f"{entry['aim_ratio_quartiles'][2]:.2f}] ({entry['aim_ratio_steps']} steps)")
        rows.append([method, entry["runs"], f"{fraction(entry['moving_fraction'])} of {entry['inside_bounds_pairs']}",
                     aim])
    return Section(["What the trust region did in each method's runs (grid and beside it): how often the rate used "
                    "moved between measurements while the factor sat inside its bounds, and where the measured steps "
                    "landed against the KL the rule aimed them at:\n",
                    markdown_table(["method", "runs", "rate moved > 1 % between measurements, inside the bounds",
                                    "measured ÷ aimed KL after the first measurement: median [quartiles]"], rows), "",
                    "Where a bound set the rate, per configured rate (steps with a gradient; the bounds are 0.01× and "
                    "10× the scheduled rate or a method's own, 1× for the `cap` form): the share at each bound, the "
                    "rate the trust region asked for ÷ the scheduled rate (median; runs that log it), the rate "
                    "used ÷ the configured rate (mean over steps and runs) and the share of a run's summed rate used "
                    "that fell on its steps without a gradient (Adam's momentum alone, never raised by the trust "
                    "region; mean over runs):\n",
                    markdown_table(["method", "lr", "runs", "steps with a gradient", "at the upper bound",
                                    "at the lower bound", "asked ÷ scheduled (median)", "used ÷ configured",
                                    "on steps without a gradient"],
                                   [[method, rate, cell["runs"], cell["gradient_steps"], fraction(cell["at_upper_bound"]),
                                     fraction(cell["at_lower_bound"]),
                                     "—" if cell["asked_over_scheduled_median"] is None
                                     else f"{cell['asked_over_scheduled_median']:.3g}",
                                     f"{cell['used_over_configured_mean']:.3g}",
                                     fraction(cell["without_gradient_share_mean"])]
                                    for method, entry in folder.grid[0]["rate_rule"].items()
                                    for rate, cell in entry["by_rate"].items()]), ""])


def defaults_range_section(folder: Folder) -> Section | None:
    """The defaults' twin at every configured rate it ran, and the low side study's variants of it, against the
    grid's best cell (`rate_range`)."""
    if folder.grid is None or not folder.grid[1].get("defaults_range"):
        return None
    summary, details = folder.grid
    twin = summary["methods"]["oblrpo"]["same_runs_as"]
    ranges = {f"the defaults (`{twin}`)": details["defaults_range"],
              **{f"`{method}`": by_rate for method, by_rate in details["low_side_range"].items()}}
    return Section(["The defaults at every configured rate, grid and beside it, and the low side study's variants of "
                    "them (`--part low-side`), against the grid's best cell:\n",
                    markdown_table(["method", "configured rate", "mean final", "seeds", "÷ best cell"],
                                   [[name, rate, f"{cell['final_mean']:.3f}", cell["seeds"],
                                     fraction(cell["of_best_cell"])]
                                    for name, by_rate in ranges.items() for rate, cell in by_rate.items()]), ""])


def beyond_grid_section(folder: Folder) -> Section | None:
    """The grid study's runs at rates outside the grid, per seed (not in the regret)."""
    if folder.grid is None or not folder.grid[1]["beyond_grid"]:
        return None
    return Section(["Runs outside the grid (not in the regret): final test accuracy per seed\n",
                    markdown_table(["method @ rate", "seed: final"],
                                   [[cell, ", ".join(f"{seed}: {acc:.3f}" for seed, acc in finals.items())]
                                    for cell, finals in folder.grid[1]["beyond_grid"].items()]), ""])


# --- long completions and rate screens -------------------------------------------------------------------------------
def completion_lengths_section(folder: Folder) -> Section | None:
    """On a task with a prompt template (long answers): how long its answers are, untrained and after training
    (`completion_lengths`)."""
    if folder.problems.template is None or not folder.tests:
        return None
    lengths = completion_lengths(folder.tests)
    rows = [[method, rate, f"{c['sampled_mean']:.1f}", f"{c['greedy_median']:.1f}", c["runs"]]
            for method, by_rate in lengths["completion_tokens_at_end"].items() for rate, c in by_rate.items()]
    untrained = (f"Completion length in tokens (δ is per token): the untrained model's median "
                 f"{lengths['median_completion_tokens']} sampled as training samples (temperature 1, at most "
                 f"{LONG_COMPLETIONS}), {lengths['median_completion_tokens_greedy']} greedy on the test problems")
    if not rows:
        return Section([untrained + "; no test run has trained yet.\n"], lengths)
    return Section([untrained + "; after training:\n",
                    markdown_table(["method", "lr", "last step's mean sampled length", "greedy median (test)", "runs"],
                                   rows), ""], lengths)


def screen_lines(runs: list[dict], problems: ProblemSet) -> tuple[dict, list[str]]:
    """Final validation accuracy per method, rate and seed: GRPO's (the runs that choose ``problems``' best rate) and
    any other method's (`--part validation --methods …`, the low side is chosen there), each cell ÷ GRPO's best cell
    on the same seeds, with the share of its gradient steps at the trust region's upper bound (`rate_rule_traces`);
    the results and the lines for them."""
    screen = screen_by_rate([r for r in runs if r["method"] == REFERENCE])
    best = max(screen, key=lambda rate: statistics.fmean(r["accuracy"] for r in screen[rate]), default=None)
    bounds, results, rows = rate_rule_traces(runs), {}, []
    for method in sorted({r["method"] for r in runs}, key=lambda m: (m != REFERENCE, m)):
        for rate, cell in screen_by_rate([r for r in runs if r["method"] == method]).items():
            seeds = {r["seed"]: r["accuracy"] for r in cell}
            best_here = [a["accuracy"] for a in screen.get(best, []) if a["seed"] in seeds]
            of_best = (statistics.fmean(seeds.values()) / statistics.fmean(best_here)
                       if best_here and statistics.fmean(best_here) > 0 else None)
            upper = bounds.get(method, {}).get("by_rate", {}).get(rate, {}).get("at_upper_bound")
            results.setdefault(method, {})[f"{rate:g}"] = seeds | ({"of_best": of_best, "at_upper_bound": upper}
                                                                   if method != REFERENCE else {})
            rows.append([method, rate, ", ".join(f"{seed}: {acc:.3f}" for seed, acc in seeds.items()),
                         statistics.fmean(seeds.values()), fraction(of_best), fraction(upper)])
    chosen = f"chosen: {problems.best_rate:g}" if problems.best_rate else "none chosen yet"
    lines = [f"## GRPO's best rate on {problems.title} (validation seeds {sorted({r['seed'] for r in runs})}, "
             f"validation split; {chosen}), and other methods on the same seeds\n",
             markdown_table(["method", "lr", "seed: final validation acc.", "mean", "÷ GRPO's best cell",
                             "at the trust region's upper bound"], rows), ""]
    return results, lines


def rate_screen_section(folder: Folder) -> Section | None:
    """GRPO's rate screen on validation seeds, where the problem set has one (its best rate is chosen there), and the
    other methods run on them (`screen_lines`)."""
    runs = [r for r in folder.validation if r["method"] != DELTA_METHOD] if folder.problems.rate_screen else []
    if not runs:
        return None
    results, lines = screen_lines(runs, folder.problems)
    return Section(lines, {"rate_screen": results.pop(REFERENCE, {}), "validation_methods": results},
                   [screen_row(runs)])


# --- δ and the trust region's runs -----------------------------------------------------------------------------------
def delta_section(folder: Folder) -> Section | None:
    """The per-step KL of the runs δ is read off (the defaults without a trust region at GRPO's best rate, validation
    seeds: `step_kl_spread`) and the δ chosen from it, none on a task that keeps another's δ (where each unit of δ
    puts the peak rate on both tasks is settled: stability-long/settled.md)."""
    delta_runs = [r for r in folder.validation if r["method"] == DELTA_METHOD]
    if not delta_runs:
        return None
    problems, spread = folder.problems, step_kl_spread(delta_runs)
    quartiles, peak_quartiles = spread["step_kl_quartiles"], spread["step_kl_at_peak_quartiles"]
    results = {"seeds": [r["seed"] for r in delta_runs], "rate": delta_runs[0]["learning_rate"], "split": "validation",
               "step_kl_quartiles": quartiles, "step_kl_90th_percentile": spread["step_kl_90th_percentile"],
               "chosen": None if problems.delta_of else problems.trust_region_kl,
               "step_kl_at_peak_quartiles": peak_quartiles}
    if problems.delta_of:
        results["delta_of"] = problems.delta_of.title
    if "step_kl_per_sequence_quartiles" in spread:
        results["step_kl_per_sequence_quartiles"] = spread["step_kl_per_sequence_quartiles"]
    chosen = (f"δ is not chosen here: the task keeps {problems.delta_of.title}'s (the defaults' {PEAK_DELTA:g} at the "
              "peak), and these figures say what the same rule would read off its steps" if problems.delta_of else
              f"The cap and target forms' δ = {problems.trust_region_kl:g} (the 90th percentile, rounded: the largest "
              "steps the best rate takes while it learns); the defaults' peak form reads its δ off the steps scaled "
              "to the peak, below")
    sequence_line = ("" if "step_kl_per_sequence_quartiles" not in spread else
                     "Per completion (KL per token × the step's mean completion length): quartiles "
                     + " / ".join(f"{q:.2e}" for q in spread["step_kl_per_sequence_quartiles"]) + ". ")
    return Section(
        [f"## Choosing δ of the trust region (validation seeds {results['seeds']}, the defaults at GRPO's best rate "
         f"{results['rate']:g}, validation split)\n",
         f"Per-step KL(π_t ‖ π_t+1) per token over {spread['steps']} steps: quartiles {quartiles[0]:.2e} / "
         f"{quartiles[1]:.2e} / {quartiles[2]:.2e}, 90th percentile {spread['step_kl_90th_percentile']:.2e}. "
         f"{sequence_line}{chosen}.\n",
         f"Scaled to the schedule's peak, KL·(η_peak/η)² over the {spread['steps_at_peak']} steps with a gradient: "
         f"quartiles {peak_quartiles[0]:.2e} / {peak_quartiles[1]:.2e} / {peak_quartiles[2]:.2e} — the median is the "
         f"δ a peak form whose steps land on their aim reads off these runs (`{PEAK_DELTA_METHOD}`).\n", ""],
        {"trust_region_delta": results})


def reproduce_section(folder: Folder) -> Section | None:
    """The committed cells run again by today's code (`--part reproduce`), each beside its committed record."""
    committed = {(r["method"], r["learning_rate"], r["seed"]): r for r in folder.runs_of(GRID)}
    pairs = [(r, committed[key]) for r in folder.runs_of(REPRODUCE)
             if (key := (r["method"], r["learning_rate"], r["seed"])) in committed]
    if not pairs:
        return None
    rows = [reproduction(fresh, record) for fresh, record in pairs]
    return Section(
        ["## Committed cells run again (`--part reproduce`)\n",
         "Each run made again by the code its record names, beside the committed run of the same method, rate and "
         "seed: the largest difference of a step's rate used (relative) and of a step's mean reward over the 40 "
         "steps. A run that reproduces step for step shows its cell is that code's; one whose rate differs in the "
         "last digits (a small KL measured as the difference of large log-probabilities) while every step's reward "
         "and the final accuracy are equal reproduces the cell to the precision its summary reports.\n",
         markdown_table(["method", "lr", "seed", "code", "rate used, max rel. difference", "reward, max difference",
                         "final acc. (committed)", "step for step"],
                        [[r["method"], r["learning_rate"], r["seed"], r["code"] or "—", r["rate_difference"],
                          r["reward_difference"], f"{r['accuracy']:.3f} ({r['committed_accuracy']:.3f})",
                          "yes" if r["step_for_step"] else "rewards and final accuracy" if r["rewards_reproduce"]
                          else "no"] for r in rows]), ""],
        {"reproduce": rows})


SECTIONS: tuple[Callable[[Folder], Section | None], ...] = (
    grid_section, code_section, arms_section, pairs_section, pair_regrets_section, rate_rule_section,
    defaults_range_section, beyond_grid_section, completion_lengths_section, rate_screen_section, delta_section,
    reproduce_section)


def write_summary(output_dir: Path, problems: ProblemSet) -> None:
    """``summary.{json,md,png}`` in ``output_dir``: every section of `SECTIONS` with something to report, in order.
    ``problems``: the folder's problem set before any run says which."""
    folder = Folder.read(output_dir, problems)
    sections = [section for section in (write(folder) for write in SECTIONS) if section is not None]
    if not sections:
        raise SystemExit("nothing has been run yet: run --part smollm2 or validation first")
    rows = [row for section in sections for row in section.rows]
    figure = plot_summary(rows, output_dir) if rows else None
    markdown = ["# Stability over the configured learning rate\n", *(["![summary](summary.png)\n"] if figure else []),
                *(line for section in sections for line in section.markdown)]
    results = {key: value for section in sections for key, value in section.results.items()}
    write_results(output_dir, "summary", results, "\n".join(markdown))
    print("\n".join(markdown))
    print(f"wrote {output_dir / 'summary.json'}" + (f" and {figure}" if figure else " (nothing to plot yet)"))
