"""The stability summary's numbers, as pure functions of run records (`stability_summary.py` lays them out).

A run record is the JSON `learning.run_child` returns: ``method``, ``seed``, ``learning_rate``, ``accuracy``,
``reward`` (per step), ``traces`` (per step) and the study's ``study``, ``steps`` and ``config_changes``. A cell run
(``cells[method][rate]``) is ``{"seed", "final", "auc", "initial", "factor_min", "factor_max"}``.
"""

from __future__ import annotations

import math
import statistics

from benchmarks import learning
from benchmarks.common import seeds_and_problems_interval, shipped, t_interval
from benchmarks.stability_registry import (
    PAIRS, REFERENCE, SMOLLM2_METHODS, STUDIES, TRL_SCHEDULE, ProblemSet,
)

Cells = dict[str, dict[float, list[dict]]]

# how far below the untrained model a run must end to count as collapsed: on 60 test problems one run's accuracy has a
# binomial standard error of about 0.065, and a run that did not move can end 0.01 below it; collapses end near 0
COLLAPSE_MARGIN = 0.1


def collapsed(run: dict) -> bool:
    """The run ended more than `COLLAPSE_MARGIN` below the untrained model."""
    return run["final"] < run["initial"] - COLLAPSE_MARGIN


def paired_difference(mine: dict[int, float], theirs: dict[int, float]) -> dict | None:
    """``mine`` minus ``theirs`` on the seeds both have, in seed order: mean, 95 % t-interval over the paired seeds
    (`t_interval`) and the seeds; None where they share none."""
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return None
    differences = [mine[s] - theirs[s] for s in seeds]
    return {"mean": statistics.fmean(differences), "ci": t_interval(differences), "seeds": seeds}


# --- the grid --------------------------------------------------------------------------------------------------------
def grid_summary(cells: Cells) -> dict:
    """Per method: ``by_lr`` cells and the regret over the grid, paired with `grpo`.

    Regret of a seed = mean over rates of (best cell mean final of any method − this seed's final); only seeds run at
    every rate of the grid count (and, for the paired difference, also at every rate of `grpo`). The best cell is one
    of more than one seed where any has more (a single seed's final is no cell's mean: the attribution's arms start
    with one).
    """
    means = [(len(runs), statistics.fmean(r["final"] for r in runs))
             for rates in cells.values() for runs in rates.values() if runs]
    best = max(mean for n, mean in means if n > 1 or all(m == 1 for m, _ in means))

    grid = {rate for rates in cells.values() for rate, runs in rates.items() if runs}

    def regrets(method: str) -> dict[int, float]:
        """Per seed, over every rate of the grid (a seed not yet run at some rate has no regret yet)."""
        by_seed: dict[int, list[float]] = {}
        for runs in cells[method].values():
            for r in runs:
                by_seed.setdefault(r["seed"], []).append(best - r["final"])
        return {seed: statistics.fmean(v) for seed, v in by_seed.items() if len(v) == len(grid)}

    reference = regrets(REFERENCE) if REFERENCE in cells else {}
    if REFERENCE in cells:  # on the seeds GRPO ran at every rate: a cell must not win or lose by extra seeds
        grpo_best_rate = max(cells[REFERENCE], key=lambda rate: statistics.fmean(
            r["final"] for r in cells[REFERENCE][rate] if r["seed"] in reference or not reference))
    summary = {}
    for method, rates in cells.items():
        entry = {"by_lr": {}}
        for rate, runs in rates.items():
            if not runs:
                continue
            finals, aucs = [r["final"] for r in runs], [r["auc"] for r in runs]
            entry["by_lr"][f"{rate:.3g}"] = {
                "final_acc_mean": statistics.fmean(finals), "final_acc_ci": t_interval(finals),
                "auc_mean": statistics.fmean(aucs), "auc_ci": t_interval(aucs),
                "collapse_fraction": statistics.fmean(collapsed(r) for r in runs),
                "seeds": [r["seed"] for r in runs],
                "factor_range": [min(r["factor_min"] for r in runs), max(r["factor_max"] for r in runs)],
            }
        own = regrets(method)
        if own:
            entry.update(regret_mean=statistics.fmean(own.values()),
                         regret_ci=t_interval(list(own.values())), regret_seeds=sorted(own))
        if method != REFERENCE and (vs := paired_difference(own, reference)):
            entry.update(regret_minus_grpo=vs["mean"], regret_minus_grpo_ci=vs["ci"])
        if method != REFERENCE and REFERENCE in cells:
            entry.update(against_grpo(rates, cells[REFERENCE], grpo_best_rate))
        summary[method] = entry
    return {"best_cell_final": best, "methods": summary}


def against_grpo(own: dict[float, list[dict]], reference: dict[float, list[dict]], best_rate: float) -> dict:
    """The other two tests of a default, paired by seed with `grpo`: the final accuracy at GRPO's best rate minus
    GRPO's there (``at_grpo_best_minus_grpo`` and its interval), and the rates at which this method collapsed on a
    seed where GRPO did not (``collapses_where_grpo_does_not``)."""
    def paired(rate: float) -> list[tuple[dict, dict]]:
        theirs = {r["seed"]: r for r in reference.get(rate, [])}
        return [(r, theirs[r["seed"]]) for r in own.get(rate, []) if r["seed"] in theirs]

    at_best = [mine["final"] - grpo["final"] for mine, grpo in paired(best_rate)]
    collapses = [rate for rate in sorted(own)
                 if any(collapsed(mine) and not collapsed(grpo) for mine, grpo in paired(rate))]
    entry: dict = {"grpo_best_rate": best_rate, "collapses_where_grpo_does_not": collapses}
    if at_best:
        entry.update(at_grpo_best_minus_grpo=statistics.fmean(at_best),
                     at_grpo_best_minus_grpo_ci=t_interval(at_best), at_grpo_best_seeds=len(at_best))
    return entry


def smollm2_cells(runs: list[dict], initial_accuracy: float) -> Cells:
    """The runs as cells (``auc``: the mean training reward), each run's realised SNR factor range (1 where it logged
    none) and its test problems' outcomes (None where it did not record them)."""
    cells: Cells = {}
    for r in sorted(runs, key=lambda r: (r["method"], r["learning_rate"], r["seed"])):
        factors = [f for f in r["traces"]["snr/lr_factor"] if not math.isnan(f)] or [1.0]
        cells.setdefault(r["method"], {}).setdefault(r["learning_rate"], []).append(
            {"seed": r["seed"], "final": r["accuracy"], "auc": statistics.fmean(r["reward"]),
             "initial": initial_accuracy, "outcomes": r.get("outcomes"), "factor_min": min(factors),
             "factor_max": max(factors)})
    return cells


def smollm2_grid(initial: dict, trained: list[dict], problems: ProblemSet,
                 rates: tuple[float, ...] | None) -> tuple[dict, dict] | None:
    """The grid's summary (`grid_summary`, the forms' comparisons, the rate rule's traces) and what it was measured
    on, from the untrained model's run and a grid's runs on ``problems``; runs at a rate outside ``rates`` (None: no
    rate is) are reported beside the grid. None before a grid run is there."""
    grid = [r for r in trained if rates is None or r["learning_rate"] in rates]
    beyond = [r for r in trained if rates is not None and r["learning_rate"] not in rates]
    if not grid:
        return None
    details = {"initial_accuracy": initial["accuracy"], "rates": sorted({r["learning_rate"] for r in grid}),
               "beyond_grid": {f"{m} @ {rate:g}": {r["seed"]: r["accuracy"] for r in beyond
                                                    if (r["method"], r["learning_rate"]) == (m, rate)}
                               for m, rate in sorted({(r["method"], r["learning_rate"]) for r in beyond})},
               "steps": grid[0]["steps"], "schedule": dict(TRL_SCHEDULE), "problems": problems.title}
    cells = smollm2_cells(grid, initial["accuracy"])
    summary = grid_summary(cells)
    # the pairs at every rate both arms ran, beyond the grid too (the attribution study's 10× GRPO's best rate)
    summary["pairs"] = pair_comparison(smollm2_cells(trained, initial["accuracy"]))
    summary["pair_regrets"] = pair_regret_differences(cells, details["rates"])
    summary["rate_rule"] = rate_rule_traces(grid + beyond)
    twin = defaults_twin(problems)
    if "oblrpo" not in summary["methods"] and twin in summary["methods"]:  # the defaults' runs, under their own name
        summary["methods"]["oblrpo"] = {**summary["methods"][twin], "same_runs_as": twin}
        details["defaults_range"] = rate_range(grid + beyond, twin, summary["best_cell_final"])
    # a variant of the defaults is a candidate default: it is judged by the bar the defaults are, the grid's best cell
    details["low_side_range"] = {method: rate_range(grid + beyond, method, summary["best_cell_final"])
                                 for method in STUDIES["low-side"].methods if method in summary["methods"]}
    return summary, details


def rate_rule_traces(runs: list[dict]) -> dict:
    """What the trust region did, per method, from its runs' traces:

    * ``moving_fraction``: of the gradient steps whose factor sits inside its bounds, after an unmeasured gradient
      step, the share whose rate used moved by more than 1 % (the schedule and the SNR factor acting on the step);
    * ``aim_ratio_*``: measured ÷ aimed KL over the measured steps after each run's first (median, quartiles, each
      run's median; runs that log the aim);
    * ``by_rate``: per configured rate, the shares of gradient steps at the upper and the lower bound, the median rate
      asked ÷ scheduled, the mean rate used ÷ configured, and the share of a run's summed rate used that fell on its
      steps without a gradient (Adam's momentum alone, never raised by the trust region): where a bound, not the
      measured KL, set the rate."""
    by_method: dict[str, dict] = {}
    for r in runs:
        traces = r.get("traces", {})
        factors = traces.get("oblr/trust_region_factor")
        if not factors or r.get("lr_trust_region_kl") is None:
            continue
        # runs before 2026-12-06 recorded no upper bound: theirs was an override's or the 10 of that time
        high = (1.0 if r.get("lr_trust_region_mode") == "cap" else r.get("lr_trust_region_max_ratio")
                or (r.get("overrides") or {}).get("lr_trust_region_max_ratio", 10.0))
        low = 0.01
        used = learning.used_rates(traces)
        measured = [isinstance(v, float) and math.isfinite(v) for v in traces["oblr/step_kl"]]
        entry = by_method.setdefault(r["method"], {"pairs": 0, "moving": 0, "ratios": [], "run_medians": []})
        gradient = [g != 0 for g in traces["grad_norm"]]
        cell = entry.setdefault("by_rate", {}).setdefault(r["learning_rate"], {
            "steps": 0, "upper": 0, "lower": 0, "asked": [], "used": [], "without_gradient_share": []})
        asked = traces.get("oblr/trust_region_rate") or [math.nan] * len(used)
        for t, has_gradient in enumerate(gradient):
            if not has_gradient:
                continue
            cell["steps"] += 1
            cell["upper"] += factors[t] >= high * 0.9999
            cell["lower"] += factors[t] <= low * 1.0001
            if math.isfinite(asked[t]) and traces["learning_rate"][t] > 0:
                cell["asked"].append(asked[t] / traces["learning_rate"][t])
        cell["used"].append(statistics.fmean(used) / r["learning_rate"])
        if (moved := sum(used)) > 0:
            cell["without_gradient_share"].append(sum(u for u, g in zip(used, gradient) if not g) / moved)
        for t in range(1, len(used)):
            inside = low * 1.0001 < factors[t] < high * 0.9999
            if measured[t - 1] or not (gradient[t] and gradient[t - 1] and inside):
                continue  # a zero-gradient step runs at the scheduled rate by rule: not the rule's rate moving
            entry["pairs"] += 1
            entry["moving"] += abs(used[t] / used[t - 1] - 1.0) > 0.01
        aimed = traces.get("oblr/step_kl_target")
        if aimed:
            first = measured.index(True) if any(measured) else len(measured)
            ratios = [traces["oblr/step_kl"][t] / aimed[t] for t in range(first + 1, len(measured))
                      if measured[t] and isinstance(aimed[t], float) and aimed[t] > 0]
            entry["ratios"] += ratios
            if ratios:
                entry["run_medians"].append(statistics.median(ratios))
    summary = {}
    for method, entry in sorted(by_method.items()):
        summary[method] = {"inside_bounds_pairs": entry["pairs"],
                           "moving_fraction": entry["moving"] / entry["pairs"] if entry["pairs"] else None,
                           "runs": sum(r["method"] == method for r in runs),
                           "by_rate": {rate: {"gradient_steps": cell["steps"],
                                              "at_upper_bound": cell["upper"] / cell["steps"] if cell["steps"] else None,
                                              "at_lower_bound": cell["lower"] / cell["steps"] if cell["steps"] else None,
                                              "asked_over_scheduled_median": (statistics.median(cell["asked"])
                                                                              if cell["asked"] else None),
                                              "used_over_configured_mean": statistics.fmean(cell["used"]),
                                              "without_gradient_share_mean": (
                                                  statistics.fmean(cell["without_gradient_share"])
                                                  if cell["without_gradient_share"] else None),
                                              "runs": len(cell["used"])}
                                       for rate, cell in sorted(entry["by_rate"].items())}}
        if entry["ratios"]:
            ratios = entry["ratios"]
            summary[method].update(aim_ratio_median=statistics.median(ratios),
                                   aim_ratio_quartiles=(statistics.quantiles(ratios, n=4) if len(ratios) > 1
                                                        else ratios * 3),
                                   aim_ratio_run_medians=entry["run_medians"], aim_ratio_steps=len(ratios))
    return summary


def code_of_runs(runs: list[dict]) -> dict[str, dict[str, int]]:
    """Per method, how many of its runs each commit made (``<commit>+dirty`` where tracked files outside the results
    differed from it; "not recorded" for runs made before records named their code)."""
    by_method: dict[str, dict[str, int]] = {}
    for r in runs:
        code = r.get("code") or {}
        label = (code["git_commit"] + ("+dirty" if code.get("git_dirty") else "")) if code.get("git_commit") \
            else "not recorded"
        counts = by_method.setdefault(r["method"], {})
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(by_method.items()))


def rate_range(runs: list[dict], method: str, best_cell: float) -> dict:
    """Every configured rate ``method`` ran at, in the grid and beside it: its mean final test accuracy and that ÷ the
    grid's best cell (how wide a range of configured rates the defaults turn into good runs; None where no cell
    learned anything)."""
    finals: dict[float, list[float]] = {}
    for r in runs:
        if r["method"] == method:
            finals.setdefault(r["learning_rate"], []).append(r["accuracy"])
    return {f"{rate:g}": {"final_mean": statistics.fmean(values), "seeds": len(values),
                          "of_best_cell": statistics.fmean(values) / best_cell if best_cell > 0 else None}
            for rate, values in sorted(finals.items())}


def pair_comparison(cells: Cells) -> dict:
    """Per pair of `PAIRS` and per rate both ran: the final accuracy of the first minus the second, paired by
    seed (mean, t-interval, seeds), so that a cell with more seeds than the grid is compared on all of
    them; where every paired run recorded each test problem's outcome, ``ci_with_problems`` counts the problems'
    noise too (`seeds_and_problems_interval`)."""
    comparison = {}
    for first, second in PAIRS:
        if first not in cells or second not in cells:
            continue
        by_rate = {}
        for rate in sorted(set(cells[first]) & set(cells[second])):
            finals = [{r["seed"]: r["final"] for r in cells[method][rate]} for method in (first, second)]
            if difference := paired_difference(*finals):
                outcomes = [{r["seed"]: r.get("outcomes") for r in cells[method][rate]} for method in (first, second)]
                if all(outcomes[0][s] and outcomes[1][s] for s in difference["seeds"]):
                    difference["ci_with_problems"] = seeds_and_problems_interval(
                        [[a - b for a, b in zip(outcomes[0][s], outcomes[1][s], strict=True)]
                         for s in difference["seeds"]])
                by_rate[f"{rate:.3g}"] = difference
        comparison[f"{first} - {second}"] = by_rate
    return comparison


def pair_regret_differences(cells: Cells, rates: list[float]) -> dict:
    """Per pair of `PAIRS`: the first's regret minus the second's, paired by seed over the seeds both ran at every
    rate of the grid. The best cell cancels from a paired
    difference of regrets, so it is minus the mean over the rates of (first's final − second's final)."""
    differences = {}
    for first, second in PAIRS:
        if not all(m in cells and all(rate in cells[m] for rate in rates) for m in (first, second)):
            continue
        finals = {m: {rate: {r["seed"]: r["final"] for r in cells[m][rate]} for rate in rates}
                  for m in (first, second)}
        seeds = sorted(set.intersection(*(set(finals[m][rate]) for m in (first, second) for rate in rates)))
        if seeds:
            values = [-statistics.fmean(finals[first][rate][seed] - finals[second][rate][seed] for rate in rates)
                      for seed in seeds]
            differences[f"{first} - {second}"] = {"mean": statistics.fmean(values),
                                                  "ci": t_interval(values), "seeds": seeds}
    return differences


def grid_methods(methods: list[str], problems: ProblemSet) -> list[str]:
    """``methods`` without `oblrpo` where its twin (`defaults_twin`) is among them: the same configuration is run once
    and reported under both names."""
    return [m for m in methods if m != "oblrpo"] if defaults_twin(problems) in methods else methods


def defaults_twin(problems: ProblemSet) -> str | None:
    """The trust-region method that runs OBLRPOConfig's defaults on ``problems`` (every field it sets, its δ the
    problem set's where it takes that, is the default), so that the grid reports `oblrpo` without running the same
    configuration twice; None where no method does."""
    return next((method.name for method in SMOLLM2_METHODS.values()
                 if method.overrides and method.overrides.get("lr_trust_region_kl") is not None
                 and all(shipped(key) == value for key, value in method.config_overrides(problems).items())),
                None)


# --- δ ---------------------------------------------------------------------------------------------------------------
def steps_at_peak(delta_runs: list[dict]) -> list[float]:
    """Each gradient step of runs without a trust region: its KL per token scaled to the schedule's peak,
    KL·(η_peak/η)². The peak form aims δ at the peak and (per update) lands there, so this is what a δ for it reads
    off the runs."""
    return [kl * (r["learning_rate"] / lr) ** 2 for r in delta_runs
            for kl, lr, grad in zip(r["traces"]["oblr/step_kl"], r["traces"]["learning_rate"], r["traces"]["grad_norm"],
                                    strict=True)
            if math.isfinite(kl) and lr > 0 and grad != 0]


def step_kl_spread(delta_runs: list[dict]) -> dict:
    """The per-step KL per token of the runs δ is read off: quartiles and 90th percentile over the steps that measured
    one; scaled to the schedule's peak (`steps_at_peak`), quartiles over the steps with a gradient; and, where the
    runs logged their completions' length, the quartiles of the KL of a whole completion (per token × the step's mean
    length)."""
    kls = [kl for r in delta_runs for kl in r["traces"]["oblr/step_kl"] if math.isfinite(kl)]
    at_peak = steps_at_peak(delta_runs)
    per_sequence = [kl * length for r in delta_runs
                    for kl, length in zip(r["traces"]["oblr/step_kl"], r["traces"].get("completions/mean_length", []),
                                          strict=False)
                    if math.isfinite(kl)]
    spread = {"steps": len(kls), "step_kl_quartiles": statistics.quantiles(kls, n=4),
              "step_kl_90th_percentile": statistics.quantiles(kls, n=10)[-1], "steps_at_peak": len(at_peak),
              "step_kl_at_peak_quartiles": ((statistics.quantiles(at_peak, n=4) if len(at_peak) > 1 else at_peak * 3)
                                            or [math.nan] * 3)}
    if len(per_sequence) > 1:
        spread["step_kl_per_sequence_quartiles"] = statistics.quantiles(per_sequence, n=4)
    return spread


# --- screens and lengths ---------------------------------------------------------------------------------------------
def screen_by_rate(screen: list[dict]) -> dict[float, list[dict]]:
    """A rate screen's runs per rate, rates and then seeds in order."""
    by_rate: dict[float, list[dict]] = {}
    for r in sorted(screen, key=lambda r: (r["learning_rate"], r["seed"])):
        by_rate.setdefault(r["learning_rate"], []).append(r)
    return by_rate


def completion_lengths(runs: list[dict]) -> dict:
    """How long the answers of a long-completion task are, in tokens: the untrained model's (sampled as training
    samples them, the answers a step's KL averages over, and greedy, as evaluated), and per method and rate the mean
    over runs of the last step's mean sampled length and of the trained model's greedy median."""
    initial = next(r for r in runs if r["method"] == "initial")
    trained = [r for r in runs if r["method"] != "initial" and "median_completion_tokens" in r]
    end: dict[str, dict[str, dict]] = {}
    for r in trained:
        cell = end.setdefault(r["method"], {}).setdefault(f"{r['learning_rate']:g}", {"sampled": [], "greedy": []})
        cell["sampled"].append(r["traces"]["completions/mean_length"][-1])
        cell["greedy"].append(r["median_completion_tokens"])
    return {"median_completion_tokens": initial.get("median_sampled_completion_tokens"),
            "median_completion_tokens_greedy": initial.get("median_completion_tokens"),
            "completion_tokens_at_end": {method: {rate: {"sampled_mean": statistics.fmean(c["sampled"]),
                                                         "greedy_median": statistics.fmean(c["greedy"]),
                                                         "runs": len(c["sampled"])}
                                                  for rate, c in by_rate.items()}
                                         for method, by_rate in end.items()}}


def reproduction(fresh: dict, committed: dict) -> dict:
    """How far a run made again (``fresh``) lands from the committed record of the same method, rate and seed: the
    largest difference of each step's rate used (relative to the committed rate) and of each step's mean reward, and
    the final accuracies. Step for step means both differences are 0: the committed cell is then today's code; the
    rewards alone reproducing (every step's and the final accuracy equal, the rate off in its last digits) means the
    cell is today's to the precision a summary reports."""
    mine, theirs = learning.used_rates(fresh["traces"]), learning.used_rates(committed["traces"])
    rate = max((abs(a - b) / abs(b) if b else abs(a) for a, b in zip(mine, theirs, strict=True)), default=0.0)
    reward = max((abs(a - b) for a, b in zip(fresh["reward"], committed["reward"], strict=True)), default=0.0)
    return {"method": fresh["method"], "learning_rate": fresh["learning_rate"], "seed": fresh["seed"],
            "rate_difference": rate, "reward_difference": reward, "accuracy": fresh["accuracy"],
            "committed_accuracy": committed["accuracy"], "step_for_step": rate == 0.0 and reward == 0.0,
            "rewards_reproduce": reward == 0.0 and fresh["accuracy"] == committed["accuracy"],
            "code": fresh.get("code", {}).get("git_commit")}
