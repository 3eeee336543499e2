"""Benchmark `stability`: does a learning-rate rule keep a run learning when the configured rate is too high?

OBLR-PO's title claim is *stable* RL: the SNR-driven rate "contracts when noise dominates". Users rarely tune the
rate of an RL run, so the question is what each method does over a grid of configured rates, against what GRPO users
really run: TRL's defaults, whose scheduler decays the rate linearly to 0 with no warm-up. On SmolLM2 the grid is
symmetric around GRPO's best rate (best/10 … 10× best), so that a rule which only shrinks the rate loses at the low end
what it saves at the high end; the synthetic grid goes from the best rate up to 30× it.

Per cell (method × configured rate), over paired seeds (same initialisation, prompts and order for every method):
final held-out accuracy with a bootstrap 95 % interval, AUC, the fraction of seeds that **collapsed** (final held-out
accuracy more than `COLLAPSE_MARGIN` below the untrained model's), and the range of the realised SNR factor. Per method, the **regret**: the
best mean final accuracy of any method at any rate minus this method's final accuracy, averaged over the grid's rates
(per seed, so it can be paired), and its paired difference with `grpo`, bootstrapped over seeds. A rule with lower
regret than GRPO loses less when the rate is wrong.

Eight parts, each resumable and each writing into the one summary:

* ``synthetic`` — the testbed of `synthetic_learning.py` (exact gradients, 100 paired seeds, the trainer's own pure
  functions), every method under both schedules (`constant`, and TRL's `linear`), rates 0.1 (GRPO's best) … 3.
* ``smollm2`` — SmolLM2-135M-Instruct on sums a + b of operands 0…14 (the splits and runner of `learning.py`), which
  the model learns within the budget under the fixed grader, TRL's default schedule, the grid symmetric around GRPO's
  best rate 1e-5 (1e-6 … 1e-4), paired seeds 0…4; or, with ``--problems a±b``, on a ± b (rates 1e-5 … 1e-3 around
  1e-4, GRPO's best in the learning benchmark; measured under the grader before 2026-11-25, kept in
  `results/stability-a-pm-b/`). GRPO, the defaults, the defaults without the trust region (`oblrpo-no-trust`, the
  defaults before 2026-11-26), the paper-literal factor, and the trust region of the step (`lr_trust_region_kl`, δ
  chosen by ``delta``) in its forms on GRPO's advantages and on OBLR-PO's. Where a method sets only the defaults
  (a + b: the peak form per update at δ = 0.005), `oblrpo` is not run again: the summary reports that method's runs
  under its name too. At GRPO's best rate the defaults without the SNR factor (`oblrpo-defaults-no-snr`) and with a
  calibration that lets it act on more of a run give the summary's ``snr_ablation``, paired by seed. Each run is a
  fresh process kept under the problems' folder, `results/stability/runs/` for a + b (committed, so the grid can be
  completed across sessions: ``--methods``/``--rates``/``--seeds`` pick a part of it).
* ``snr-long`` — the SNR ablation's per-completion arm and the defaults without the factor over 60 steps, 10 paired
  test seeds at GRPO's best rate (in 40 steps that arm acts on 40 % of the steps), paired in ``snr_ablation``.
* ``delta`` — the per-step KL of the defaults at the best rate on validation seeds and the validation split, from
  which δ is chosen.
* ``validation`` — any ``--methods`` on validation seeds (10, 11) and the validation split: where the rule's
  constants are chosen (issue 56: how the trust region predicts its steps' KL).
* ``transfer`` — the grid's δ, unchanged, on a second task, at GRPO's best rate there and 10× it, 3 paired seeds,
  against GRPO: from a + b products of operands 0…14, with OBLR-PO + cap and + target (`runs/transfer-products/`);
  from a ± b (``--problems a±b``) the built-in `arithmetic` task's products with operands 0…24 (GRPO's best rate
  taken from a ± b; `runs/transfer-multiplication/`).
* ``transfer-rate`` — GRPO's best rate on a + b's second task, screened on validation seeds and the validation split.
* ``resolve`` — one longer SmolLM2 configuration on a ± b with more prompts a step, in which the calibration of the
  SNR factor resolves, so the factor is seen acting on a real model (its trajectory is plotted).

    python benchmarks/stability.py --part synthetic      # 48 cells of 100 seeds (33 min on 2 busy cores)
    python benchmarks/stability.py --part smollm2        # a + b: 25 runs a method (7–15 min each), 2 at a time; resumes
    python benchmarks/stability.py --part delta          # 2 validation runs that choose δ
    python benchmarks/stability.py --part validation --methods M   # M on validation seeds 10, 11 (choosing)
    python benchmarks/stability.py --part snr-long       # the SNR ablation over 60 steps: 20 runs (10-13 min each)
    python benchmarks/stability.py --part transfer-rate  # GRPO's best rate on a × b (0…14), validation seeds
    python benchmarks/stability.py --part transfer       # 9 runs on a × b and the untrained model; resumes
    python benchmarks/stability.py --part smollm2 --problems a±b   # the a ± b grid (results/stability-a-pm-b/)
    python benchmarks/stability.py --part smollm2 --problems a×b   # the products' grid (results/stability-products/)
    python benchmarks/stability.py --part validation --problems a+b-reasoned --methods grpo   # long answers: GRPO's
                                                                 # rate screen (results/stability-long/)
    python benchmarks/stability.py --part resolve        # 3 longer runs on a ± b (16 completions × 60 steps); resumes
    python benchmarks/stability.py --part summary        # rewrite the summary from what has been run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from oblr_trl.estimators.snr import CALIBRATION_MIN_T
from oblr_trl.tasks import BOXED_INSTRUCTION

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402
import synthetic_learning as synthetic  # noqa: E402
from common import (  # noqa: E402
    RESULTS, bootstrap_ci, markdown_table, new_figure, parse_overrides, save_figure, shipped, write_results,
)

REFERENCE = "grpo"
TRL_SCHEDULE = {"lr_scheduler_type": "linear", "warmup_steps": 0}  # GRPOConfig's (TrainingArguments') defaults

# --- the synthetic testbed -------------------------------------------------------------------------------------------
# OBLR-PO's defaults before the trust region (2026-11-26), as this grid ran them; the rules below vary only the rule
DEFAULT = synthetic.METHODS["oblrpo"]
SYNTHETIC_METHODS = {
    "grpo": synthetic.METHODS["grpo"],
    "oblrpo": DEFAULT,
    "oblrpo-unscaled": synthetic.METHODS["oblrpo-unscaled"],
    "oblrpo-no-snr": replace(DEFAULT, rate=synthetic.CONSTANT_RATE,
                             description="OBLR-PO's baseline (group std scaling), no SNR factor"),
    "oblrpo-two-sided": replace(DEFAULT, rate=synthetic.calibrated_snr_rate(0.5, 2.0),
                                description="calibrated factor, ratio in [0.5, 2]"),
    "oblrpo-contract": replace(DEFAULT, rate=synthetic.calibrated_snr_rate(0.25, 1.0),
                               description="calibrated factor, ratio in [0.25, 1]: never raises the rate"),
    "oblrpo-absolute": replace(DEFAULT, rate={"lr_trust_region_kl": None, "snr_lr_reference": "absolute"},
                               description="the paper-literal factor (the rate is η_max)"),
}
SYNTHETIC_RATES = [0.1, 0.3, 1.0, 3.0]

# --- SmolLM2 ---------------------------------------------------------------------------------------------------------
# the defaults before 2026-11-26, when the trust region of the step (the cap, δ = 0.01) became one; the methods below
# that vary one other part of OBLR-PO were run without it and say so
NO_TRUST_REGION = {"lr_trust_region_kl": None}
SMOLLM2_METHODS = {  # name -> (OBLRPOConfig overrides, None for TRL's GRPOTrainer; config changes)
    "grpo": (None, TRL_SCHEDULE),
    "oblrpo": ({}, TRL_SCHEDULE),
    "oblrpo-no-trust": (NO_TRUST_REGION, TRL_SCHEDULE),
    "oblrpo-unscaled": ({**NO_TRUST_REGION, "scale_rewards": "none"}, TRL_SCHEDULE),  # the defaults before 2026-11-23
    "oblrpo-two-sided": ({**NO_TRUST_REGION, "snr_lr_min_ratio": 0.5}, TRL_SCHEDULE),
    "grpo-constant": (None, {"lr_scheduler_type": "constant", "warmup_steps": 0}),
    # the paper-literal factor reacting from the first steps (the issue-26 probe that saved seed 1 at 3e-4)
    "oblrpo-paper": ({**NO_TRUST_REGION, "snr_lr_reference": "absolute", "snr_estimator": "per_sample",
                      "snr_warmup_steps": 0}, TRL_SCHEDULE),
    # the defaults without the trust region, measuring each step's KL (choosing δ)
    "oblrpo-kl": ({**NO_TRUST_REGION, "log_step_kl": True}, TRL_SCHEDULE),
}
# δ of the trust region is chosen per problem set on validation seeds only (--part delta: the defaults at GRPO's best
# rate on seeds 10 and 11 and the validation split): the 90th percentile of their per-step KL, rounded — the largest
# steps the best rate takes while it learns, so that the cap leaves the best rate's learning alone and holds a larger
# rate to it. The trust-region methods below carry a placeholder that `smollm2_specs` replaces with the problems' δ
DELTA = {"method": "oblrpo-kl", "seeds": [10, 11], "steps": 40}
PROBLEMS_DELTA = math.nan  # not a valid δ: a trust-region run that missed the replacement fails validation
# GRPO's advantage from OBLR-PO's pieces: the whole-group mean with std scaling, no SNR factor
GRPO_AS_OBLRPO = {"baseline_weights": "uniform", "baseline_estimator": "weighted", "leave_one_out": False,
                  "use_snr_lr": False}
for _form in ("cap", "target"):  # the KL measured on every step, as these methods' runs were
    SMOLLM2_METHODS[f"oblrpo-trust-{_form}"] = (
        {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": _form, "lr_trust_region_measure_steps": 1},
        TRL_SCHEDULE)
    SMOLLM2_METHODS[f"grpo-trust-{_form}"] = (
        {**GRPO_AS_OBLRPO, "lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": _form,
         "lr_trust_region_measure_steps": 1}, TRL_SCHEDULE)
# the cap measuring every 4th (8th) step's KL instead of every step's (issue 38: a quarter (an eighth) of the
# measuring forwards)
for _every in (4, 8):
    SMOLLM2_METHODS[f"oblrpo-trust-cap-every{_every}"] = (
        {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": "cap", "lr_trust_region_measure_steps": _every},
        TRL_SCHEDULE)
# issue 40 at the cadence that ships (every 8th step since 2026-11-27): the target form on OBLR-PO's advantages (the
# candidate default), and the cap and the target on GRPO's (what OBLR-PO adds on top of the trust region)
for _advantages, _form, _base in (("oblrpo", "target", {}), ("grpo", "cap", GRPO_AS_OBLRPO),
                                  ("grpo", "target", GRPO_AS_OBLRPO)):
    SMOLLM2_METHODS[f"{_advantages}-trust-{_form}-every8"] = (
        {**_base, "lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": _form, "lr_trust_region_measure_steps": 8},
        TRL_SCHEDULE)
# issue 38: the target measuring every 16th step with a gradient (half the measuring forwards of every 8th)
SMOLLM2_METHODS["oblrpo-trust-target-every16"] = (
    {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": "target", "lr_trust_region_measure_steps": 16},
    TRL_SCHEDULE)
# issue 56: the peak form (η̂_max measured by the trust region, the schedule and the SNR factor shaping every step; the
# probe's reading replaced by the next step's) at the shipping cadence
SMOLLM2_METHODS["oblrpo-trust-peak-every16"] = (
    {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": "peak", "lr_trust_region_measure_steps": 16,
     "lr_trust_region_curvature": "per_rate"}, TRL_SCHEDULE)
# issue 56, item 2: the peak form measuring every step (each step's KL beside what it aimed at, to replay predictors),
# and both forms reading the curvature per unit of Adam's update (`lr_trust_region_curvature="per_update"`: also the
# short early gaps between measurements) at the shipping cadence
SMOLLM2_METHODS["oblrpo-trust-peak-every1"] = (
    {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": "peak", "lr_trust_region_measure_steps": 1,
     "lr_trust_region_curvature": "per_rate"}, TRL_SCHEDULE)
# the peak form per update at the δ the validation runs give for it (the median of their per-step KL scaled to the
# schedule's peak, `trust_region_delta` in the summary: 4.9e-3 on a + b, rounded), not the cap's 90th percentile: the
# defaults since 2026-11-29 (`defaults_twin`)
PEAK_DELTA, PEAK_DELTA_METHOD = 0.005, "oblrpo-trust-peak-update-every16-kl0.005"
SMOLLM2_METHODS[PEAK_DELTA_METHOD] = (
    {"lr_trust_region_kl": PEAK_DELTA, "lr_trust_region_mode": "peak", "lr_trust_region_measure_steps": 16,
     "lr_trust_region_curvature": "per_update"}, TRL_SCHEDULE)
# issue 56, item 4: the defaults without the SNR factor (the ablation's other arm), and with a calibrated factor that
# can act on most of a 40-step run: the window of 20 steps resolves on few of them (its mean ‖μ‖² estimate rarely
# reaches t = 2 with 2 prompts a step) and the measured SNR falls through training, which the default ratio floor of 1
# ignores; a window of 5 steps and a floor of 0.5 (replayed on the validation runs' estimates: 41 % of steps acted
# on, against 4 % for the defaults)
SMOLLM2_METHODS["oblrpo-defaults-no-snr"] = (
    {**SMOLLM2_METHODS[PEAK_DELTA_METHOD][0], "use_snr_lr": False}, TRL_SCHEDULE)
SMOLLM2_METHODS["oblrpo-defaults-snr-two-sided-cal5"] = (
    {**SMOLLM2_METHODS[PEAK_DELTA_METHOD][0], "snr_lr_min_ratio": 0.5, "snr_calibration_steps": 5}, TRL_SCHEDULE)
# the cross-step estimate counts a step's 2 prompts as its samples, so its window rarely resolves: the per-completion
# estimator (its 8 completions the samples) or the shortest window, screened on validation seeds 10, 11. Per
# completion the window resolved at steps 14 and 15 and the factor moved 61 % of the steps (final validation accuracy
# 0.750 / 0.783, without the factor 0.733 / 0.817); a 2-step window resolved where the 5-step one did (steps 17, 23,
# 48 %, the same runs), so the per-completion arm is the one run on the test seeds
SMOLLM2_METHODS["oblrpo-defaults-snr-two-sided-cal5-per-sample"] = (
    {**SMOLLM2_METHODS["oblrpo-defaults-snr-two-sided-cal5"][0], "snr_estimator": "per_sample"}, TRL_SCHEDULE)
SMOLLM2_METHODS["oblrpo-defaults-snr-two-sided-cal2"] = (
    {**SMOLLM2_METHODS["oblrpo-defaults-snr-two-sided-cal5"][0], "snr_calibration_steps": 2}, TRL_SCHEDULE)
for _form in ("peak", "target"):
    SMOLLM2_METHODS[f"oblrpo-trust-{_form}-update-every16"] = (
        {"lr_trust_region_kl": PROBLEMS_DELTA, "lr_trust_region_mode": _form, "lr_trust_region_measure_steps": 16,
         "lr_trust_region_curvature": "per_update"}, TRL_SCHEDULE)
# the trust-region methods named before the curvature per unit of Adam's update existed read it per unit rate, the
# only reading then; their names keep meaning what their runs ran now that the defaults read it per update
for _name, (_overrides, _schedule) in SMOLLM2_METHODS.items():
    if (_overrides or {}).get("lr_trust_region_kl") is not None:
        SMOLLM2_METHODS[_name] = ({"lr_trust_region_curvature": "per_rate", **_overrides}, _schedule)
# the grid of each problem set (below) is the symmetric one of issue 26: GRPO's best rate ÷10 … ×10, so that a rule
# which only shrinks the rate loses at the low end what it saves at the high end; runs at other rates are reported
# beside it, outside the regret
SMOLLM2 = {"methods": [REFERENCE, "oblrpo", "oblrpo-no-trust", "oblrpo-paper", "grpo-trust-cap", "grpo-trust-target",
                       "oblrpo-trust-cap", "oblrpo-trust-cap-every4", "oblrpo-trust-cap-every8", "oblrpo-trust-target",
                       "oblrpo-trust-target-every8", "grpo-trust-cap-every8", "grpo-trust-target-every8",
                       "oblrpo-trust-target-every16", "oblrpo-trust-peak-every16",
                       "oblrpo-trust-peak-update-every16", PEAK_DELTA_METHOD],
           "seeds": [0, 1, 2, 3, 4], "steps": 40, "jobs": 2}
# a ± b: GRPO's best rate 1e-4 (the learning benchmark), δ = 0.4 (validation seeds 10, 11: per-step KL spanning 8
# decades, 4.1 nats a token at step 1 and 1e-10 once every group scores alike; 90th percentile 0.42), both measured
# under the grader before 2026-11-25
A_PLUS_MINUS_B = {"operators": "+-", "max_operand": learning.PRESETS["cpu"]["max_operand"], "data": "data",
                  "title": "a ± b", "folder": "stability-a-pm-b", "eval_problems": 200, "best_rate": 1e-4,
                  "trust_region_kl": 0.4, "grid": [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]}
# sums of operands 0…14, which SmolLM2 learns within the grid's budget under the strict grader (on a ± b, 40 steps of
# GRPO moved no rate more than 0.08 above the untrained model); 225 problems: 60 test, 60 validation, 105 training.
# GRPO's best rate 1e-5 (the screen on seeds 0, 1 over 3e-6 … 3e-4: 0.833, against 0.650 at 3e-6 and 0.642 at 3e-5);
# δ = 0.01 (validation seeds 10, 11: per-step KL quartiles 1.5e-4 / 9.2e-4 / 2.5e-3, 90th percentile 0.0086)
A_PLUS_B = {"operators": "+", "max_operand": 14, "data": "data-sums", "title": "a + b", "folder": "stability",
            "eval_problems": 60, "best_rate": 1e-5, "trust_region_kl": 0.01, "grid": [1e-6, 3e-6, 1e-5, 3e-5, 1e-4]}
PROBLEMS = {"a±b": A_PLUS_MINUS_B, "a+b": A_PLUS_B}  # a + b's grid decides (a ± b's cannot: the model barely
# learns it in the budget under the fixed grader), so its folder is the benchmark's `results/stability/`
for _form in ("cap", "target"):  # a + b's δ, unchanged, on the testbed: what it costs where the rate is right
    SYNTHETIC_METHODS[f"oblrpo-trust-{_form}"] = replace(
        DEFAULT, rate={**DEFAULT.rate, "lr_trust_region_kl": A_PLUS_B["trust_region_kl"], "lr_trust_region_mode": _form,
                       "lr_trust_region_curvature": "per_rate", "lr_trust_region_measure_steps": 1},
        description=f"the defaults with the trust region of the step, {_form} form, "
        f"δ = {A_PLUS_B['trust_region_kl']:g} (a + b's)")
# the transfer of each grid's δ, unchanged, to a second task (issue 26, item 4), run at GRPO's best rate there and 10×
# it. From a ± b: the built-in `arithmetic` task's products with operands up to 24 (200 test, 200 validation and 225
# training problems), GRPO's best rate taken from a ± b rather than swept (old grader). From a + b: products of the
# same operands 0…14 (225 problems cut as a + b's), GRPO's best rate screened on validation seeds only
# (--part transfer-rate: seeds 10, 11 and the validation split, a + b's best ÷3, ×1, ×3, and ÷10 once the best was
# the screen's lowest rate): 3e-6 (mean validation accuracy 0.692; 0.558 at 1e-6, 0.608 at 1e-5, 0.475 at 3e-5)
TRANSFERS = {
    "a±b": {"problems": {"operators": "*", "max_operand": 24, "data": "data-multiplication", "title": "a × b",
                         "eval_problems": 200, "best_rate": A_PLUS_MINUS_B["best_rate"],
                         "trust_region_kl": A_PLUS_MINUS_B["trust_region_kl"]},
            "methods": [REFERENCE, "oblrpo-trust-cap", "oblrpo-no-trust"], "runs": "transfer-multiplication"},
    "a+b": {"problems": {"operators": "*", "max_operand": 14, "data": "data-products", "title": "a × b (0…14)",
                         "eval_problems": 60, "best_rate": 3e-6, "trust_region_kl": A_PLUS_B["trust_region_kl"]},
            "methods": [REFERENCE, "oblrpo-trust-cap", "oblrpo-trust-target"], "runs": "transfer-products",
            "rate_screen": [1e-6, 3e-6, 1e-5, 3e-5]},
}
TRANSFER = {"seeds": [0, 1, 2], "steps": 40, "rate_seeds": [10, 11]}
# issue 40's second task for choosing the trust region's form: a + b's transfer problems (products of operands 0…14),
# the whole grid ÷10 … ×10 around GRPO's best rate there (3e-6, screened on validation seeds above), δ unchanged; its
# own folder, with no transfer of its own
A_TIMES_B = {**TRANSFERS["a+b"]["problems"], "folder": "stability-products", "grid": [3e-7, 1e-6, 3e-6, 1e-5, 3e-5]}
PROBLEMS["a×b"] = A_TIMES_B
# issue 56, item 3: does δ, a per-token KL chosen on answers of 7–16 tokens, keep its meaning on long ones? a + b's
# problems (the same splits) asked as the math recipes ask them — reason step by step, box the answer — so that the
# completions run to about a hundred tokens; the reward is the graded answer, with no term for length. GRPO's best rate
# is screened on validation seeds only (--part validation --methods grpo: the rates of `rate_screen`, seeds 10, 11), as
# the products' was: 3e-5 (mean validation accuracy 0.733; 0.450 at 1e-6, 0.508 at 3e-6, 0.633 at 1e-5, 0.100 at
# 1e-4, where both seeds collapsed). Its grid is issue 56's: TRL's 1e-6, GRPO's best rate and 10× it, GRPO and the
# defaults with a + b's δ unchanged
LONG_COMPLETIONS = 128
A_PLUS_B_REASONED = {**A_PLUS_B, "title": "a + b, reasoned step by step", "folder": "stability-long",
                     "template": "What is {question}?\n" + BOXED_INSTRUCTION,
                     "config": {"max_completion_length": LONG_COMPLETIONS}, "eval_max_new_tokens": LONG_COMPLETIONS,
                     "rate_screen": [1e-6, 3e-6, 1e-5, 3e-5, 1e-4], "best_rate": 3e-5, "grid": [1e-6, 3e-5, 3e-4],
                     "methods": [REFERENCE, PEAK_DELTA_METHOD], "delta_of": A_PLUS_B["title"]}
PROBLEMS["a+b-reasoned"] = A_PLUS_B_REASONED
# more prompts a step and a longer run, so that the calibration window resolves
RESOLVE = {"rate": 3e-5, "seed": 0, "steps": 60, "config": {"per_device_train_batch_size": 16, "num_generations": 4},
           "methods": ["oblrpo-no-trust", "grpo", "oblrpo-two-sided"], "problems": "a±b"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["synthetic", "smollm2", "resolve", "delta", "validation", "transfer",
                                           "transfer-rate", "snr-long", "summary"],
                        default="summary")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods of the part (default: all of the synthetic ones; on SmolLM2 GRPO, the "
                        "defaults, the paper-literal factor and both trust-region forms on GRPO and OBLR-PO)")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="the grid (default: the part's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="SmolLM2 seeds (default 0…4)")
    parser.add_argument("--test_seeds", type=int, default=100, help="synthetic: paired seeds")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the part's)")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--problems", choices=list(PROBLEMS), default="a+b",
                        help="the grid's problems (smollm2, delta), or the grid whose δ a transfer carries (transfer, "
                        "transfer-rate); each has its own folder")
    parser.add_argument("--eval_problems", type=int, default=None,
                        help="problems in each of test and validation (default: the problems')")
    parser.add_argument("--jobs", type=int, default=SMOLLM2["jobs"])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field of every SmolLM2 run, e.g. --set use_cpu=false on a GPU (give "
                        "such runs their own --output_dir: cells pair runs of one machine only)")
    parser.add_argument("--bootstrap", type=int, default=10_000)
    parser.add_argument("--output_dir", default=None,
                        help="default: the problems' folder under benchmarks/results (a + b: stability/, a ± b: "
                        "stability-a-pm-b/; resolve runs on a ± b)")
    args = parser.parse_args(argv)
    if args.part in ("transfer", "transfer-rate") and args.problems not in TRANSFERS:
        parser.error(f"--problems {args.problems} has no transfer task (those with one: {', '.join(TRANSFERS)})")
    if args.part == "smollm2" and PROBLEMS[args.problems]["grid"] is None and not args.rates:
        parser.error(f"--problems {args.problems} has no grid until GRPO's best rate is screened (--part validation "
                     "--methods grpo); give --rates")
    if args.output_dir is None:
        problems = RESOLVE["problems"] if args.part == "resolve" else args.problems
        args.output_dir = str(RESULTS / PROBLEMS[problems]["folder"])
    return args


def grid_summary(cells: dict[str, dict[float, list[dict]]], resamples: int) -> dict:
    """Per method: ``by_lr`` cells and the regret over the grid, paired with `grpo`.

    ``cells[method][rate]`` is a list of runs ``{"seed", "final", "auc", "initial", "factor_min", "factor_max"}``.
    Regret of a seed = mean over rates of (best cell mean final of any method − this seed's final); only seeds run at
    every rate of the grid count (and, for the paired difference, also at every rate of `grpo`).
    """
    best = max(statistics.fmean(r["final"] for r in runs)
               for rates in cells.values() for runs in rates.values() if runs)

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
                "final_acc_mean": statistics.fmean(finals), "final_acc_ci": bootstrap_ci(finals, resamples),
                "auc_mean": statistics.fmean(aucs), "auc_ci": bootstrap_ci(aucs, resamples),
                "collapse_fraction": statistics.fmean(collapsed(r) for r in runs),
                "seeds": [r["seed"] for r in runs],
                "factor_range": [min(r["factor_min"] for r in runs), max(r["factor_max"] for r in runs)],
            }
        own = regrets(method)
        if own:
            entry.update(regret_mean=statistics.fmean(own.values()),
                         regret_ci=bootstrap_ci(list(own.values()), resamples), regret_seeds=sorted(own))
        paired = sorted(set(own) & set(reference))
        if method != REFERENCE and paired:
            diff = [own[s] - reference[s] for s in paired]
            entry.update(regret_minus_grpo=statistics.fmean(diff), regret_minus_grpo_ci=bootstrap_ci(diff, resamples))
        if method != REFERENCE and REFERENCE in cells:
            entry.update(against_grpo(rates, cells[REFERENCE], grpo_best_rate, resamples))
        summary[method] = entry
    return {"best_cell_final": best, "methods": summary}


# how far below the untrained model a run must end to count as collapsed: on 60 test problems one run's accuracy has a
# binomial standard error of about 0.065, and a run of GRPO at 3e-6 on a ± b ended 0.010 below the untrained model
# without having moved; the collapses measured end near 0 (0.000–0.070)
COLLAPSE_MARGIN = 0.1


def collapsed(run: dict) -> bool:
    """The run ended more than `COLLAPSE_MARGIN` below the untrained model."""
    return run["final"] < run["initial"] - COLLAPSE_MARGIN


def against_grpo(own: dict[float, list[dict]], reference: dict[float, list[dict]], best_rate: float,
                 resamples: int) -> dict:
    """The other two tests of a default (issue 26, item 5), paired by seed with `grpo`: the final accuracy at GRPO's
    best rate minus GRPO's there (``at_grpo_best_minus_grpo`` and its interval), and the rates at which this method
    collapsed on a seed where GRPO did not (``collapses_where_grpo_does_not``)."""
    def paired(rate: float) -> list[tuple[dict, dict]]:
        theirs = {r["seed"]: r for r in reference.get(rate, [])}
        return [(r, theirs[r["seed"]]) for r in own.get(rate, []) if r["seed"] in theirs]

    at_best = [mine["final"] - grpo["final"] for mine, grpo in paired(best_rate)]
    collapses = [rate for rate in sorted(own)
                 if any(collapsed(mine) and not collapsed(grpo) for mine, grpo in paired(rate))]
    entry: dict = {"grpo_best_rate": best_rate, "collapses_where_grpo_does_not": collapses}
    if at_best:
        entry.update(at_grpo_best_minus_grpo=statistics.fmean(at_best),
                     at_grpo_best_minus_grpo_ci=bootstrap_ci(at_best, resamples), at_grpo_best_seeds=len(at_best))
    return entry


# --- synthetic part --------------------------------------------------------------------------------------------------
def run_synthetic(args) -> dict:
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(2)
    task = synthetic.Task(steps=args.steps or synthetic.Task.steps)
    teacher, held_out, held_out_targets = synthetic.problem(task)
    seeds = list(range(1000, 1000 + args.test_seeds))
    rates = args.rates or SYNTHETIC_RATES
    names = args.methods or list(SYNTHETIC_METHODS)
    cells, curves = {}, {}
    variants = [(name, schedule) for name in names for schedule in ("linear", "constant")]
    with tqdm(total=len(variants) * len(rates), desc="synthetic grid (method × schedule × rate)") as bar:
        for name, schedule in variants:
            label = name if schedule == "linear" else f"{name}-constant"
            cells[label], curves[label] = {}, {}
            for rate in rates:
                result = synthetic.run(SYNTHETIC_METHODS[name], torch.full((len(seeds),), rate), seeds, task, teacher,
                                       held_out, held_out_targets, schedule=schedule)
                factor = result["factor_trace"]
                cells[label][rate] = [
                    {"seed": seed, "final": float(result["final"][i]), "auc": float(result["auc"][i]),
                     "initial": float(result["curve"][i, 0]), "factor_min": float(factor[i].min()),
                     "factor_max": float(factor[i].max())}
                    for i, seed in enumerate(seeds)
                ]
                curves[label][f"{rate:.3g}"] = {"held_out": result["curve"].mean(0).tolist(),
                                                "factor": factor.mean(0).tolist()}
                bar.update()
    return {"task": task.__dict__, "seeds": seeds, "rates": rates, "cells": cells, "curves": curves,
            "descriptions": {name: SYNTHETIC_METHODS[name].description for name in names}}


# --- SmolLM2 parts ---------------------------------------------------------------------------------------------------
def smollm2_specs(args, methods, rates, seeds, steps, *, problems, extra_config=None, tag="", split="test"):
    splits = learning.problem_splits(problems["max_operand"], args.eval_problems or problems["eval_problems"],
                                     operators=problems["operators"])
    paths = learning.write_splits(splits, Path(args.output_dir) / problems["data"])
    base = {"model": args.model, "steps": steps, "train": paths["train"],
            "threads": max(1, (os.cpu_count() or 1) // args.jobs),
            "eval_max_new_tokens": problems.get("eval_max_new_tokens", learning.PRESETS["cpu"]["eval_max_new_tokens"]),
            "split": split, "held_out": paths[split], "scratch": str(Path(tempfile.gettempdir()) / "oblr-trl-stability"),
            **({"template": problems["template"]} if "template" in problems else {})}
    specs = []
    for seed in seeds:  # seed-major, so that an interrupted grid has whole seeds for every cell
        for rate in rates:
            for method in methods:
                overrides, schedule = SMOLLM2_METHODS[method]
                if (overrides or {}).get("lr_trust_region_kl") is PROBLEMS_DELTA:
                    overrides = {**overrides, "lr_trust_region_kl": problems["trust_region_kl"]}
                config = {**learning.PRESETS["cpu"]["config"], **problems.get("config", {}), **schedule,
                          **(extra_config or {}), **parse_overrides(args.overrides)}
                specs.append({**base, "problems": problems["title"], "method": method + tag, "overrides": overrides,
                              "config": config, "seed": seed, "learning_rate": rate})
    initial = {**base, "problems": problems["title"], "method": "initial", "seed": 0, "learning_rate": 0.0,
               "split": "test", "held_out": paths["test"],
               **({"sample_max_new_tokens": problems["config"]["max_completion_length"]} if "config" in problems else {})}
    return specs, initial


def smollm2_cells(runs: list[dict], initial_accuracy: float) -> dict:
    cells: dict[str, dict[float, list[dict]]] = {}
    for r in sorted(runs, key=lambda r: (r["method"], r["learning_rate"], r["seed"])):
        factors = [f for f in r["traces"]["snr/lr_factor"] if not math.isnan(f)] or [1.0]
        cells.setdefault(r["method"], {}).setdefault(r["learning_rate"], []).append(
            {"seed": r["seed"], "final": r["accuracy"], "auc": learning.auc(r), "initial": initial_accuracy,
             "factor_min": min(factors), "factor_max": max(factors)})
    return cells


def validation_rates(problems: dict) -> list[float]:
    """The rates `--part validation` runs by default: GRPO's best rate on ``problems``, or the rates of their screen
    while no best rate is chosen."""
    return [problems["best_rate"]] if problems["best_rate"] else problems["rate_screen"]


def problems_of(runs: list[dict]) -> dict:
    """The problem set the runs trained on (runs before 2026-11-25 name none: they are a ± b)."""
    title = runs[0].get("problems", A_PLUS_MINUS_B["title"])
    return next(p for p in [*PROBLEMS.values(), *(t["problems"] for t in TRANSFERS.values())] if p["title"] == title)


def cached_runs(folder: Path) -> list[dict]:
    """A folder's test runs of one grader, never a mix: the current grader's where it has any, else the older ones
    (which `grader_warning` then marks in the summary)."""
    from oblr_trl.rewards import GRADER_VERSION

    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("test-*.json"))]
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


def smollm2_grid(runs: list[dict], resamples: int, problems: dict | None = None) -> tuple[dict, dict] | None:
    """The grid's summary (`grid_summary`) and what it was measured on, from one folder's test runs; None before the
    untrained model and a first grid run are there. ``problems``: the problem set, where its title does not say which
    (a transfer's problems may have a grid of their own elsewhere: a + b's products)."""
    initial = next((r for r in runs if r["method"] == "initial"), None)
    if initial is None:
        return None
    problems = problems or problems_of([initial])
    rates = problems.get("grid")  # the transfer has no grid: its two rates are all there is
    grid, beyond = [], []
    for r in runs:
        if r["method"] in SMOLLM2_METHODS:
            (grid if rates is None or r["learning_rate"] in rates else beyond).append(r)
    if not grid:
        return None
    details = {"initial_accuracy": initial["accuracy"], "rates": sorted({r["learning_rate"] for r in grid}),
               "beyond_grid": {f"{m} @ {rate:g}": {r["seed"]: r["accuracy"] for r in beyond
                                                    if (r["method"], r["learning_rate"]) == (m, rate)}
                               for m, rate in sorted({(r["method"], r["learning_rate"]) for r in beyond})},
               "steps": len(grid[0]["reward"]), "schedule": TRL_SCHEDULE,
               "problems": problems["title"]}
    cells = smollm2_cells(grid, initial["accuracy"])
    summary = grid_summary(cells, resamples)
    summary["forms"] = form_comparison(cells, resamples)
    summary["form_regrets"] = form_regret_differences(cells, details["rates"], resamples)
    summary["rate_rule"] = rate_rule_traces(grid + beyond)
    twin = defaults_twin(problems)
    if "oblrpo" not in summary["methods"] and twin in summary["methods"]:  # the defaults' runs, under their own name
        summary["methods"]["oblrpo"] = {**summary["methods"][twin], "same_runs_as": twin}
        details["defaults_range"] = rate_range(grid + beyond, twin, summary["best_cell_final"])
    return summary, details


def rate_rule_traces(runs: list[dict]) -> dict:
    """What the trust region did, per method, from its runs' traces (issue 56's checks of the default):

    * ``moving_fraction``: of the steps with a gradient whose trust-region factor sits strictly inside its bounds and
      whose previous step had a gradient and was not measured (so the curvature did not change between them), the
      share whose rate used differs by more than 1 % from the previous step's — the schedule and the SNR factor acting
      on the step;
    * ``aim_ratio_*``: the measured ÷ aimed KL (`oblr/step_kl` ÷ `oblr/step_kl_target`) over the measured steps after
      each run's first, pooled (median, quartiles) and each run's median (runs that log the aimed KL only)."""
    by_method: dict[str, dict] = {}
    for r in runs:
        traces = r.get("traces", {})
        factors = traces.get("oblr/trust_region_factor")
        if not factors or r.get("lr_trust_region_kl") is None:
            continue
        low, high = 0.01, (1.0 if r.get("lr_trust_region_mode") == "cap" else 10.0)  # the benchmark's bounds
        used = learning.used_rates(traces)
        measured = [isinstance(v, float) and math.isfinite(v) for v in traces["oblr/step_kl"]]
        entry = by_method.setdefault(r["method"], {"pairs": 0, "moving": 0, "ratios": [], "run_medians": []})
        gradient = [g != 0 for g in traces["grad_norm"]]
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
                           "runs": sum(r["method"] == method for r in runs)}
        if entry["ratios"]:
            ratios = entry["ratios"]
            summary[method].update(aim_ratio_median=statistics.median(ratios),
                                   aim_ratio_quartiles=(statistics.quantiles(ratios, n=4) if len(ratios) > 1
                                                        else ratios * 3),
                                   aim_ratio_run_medians=entry["run_medians"], aim_ratio_steps=len(ratios))
    return summary


def rate_rule_table(summary: dict) -> str:
    rows = []
    for method, entry in summary.items():
        aim = "not logged" if "aim_ratio_median" not in entry else (
            f"{entry['aim_ratio_median']:.2f} [{entry['aim_ratio_quartiles'][0]:.2f}, "
            f"{entry['aim_ratio_quartiles'][2]:.2f}] ({entry['aim_ratio_steps']} steps)")
        moving = "—" if entry["moving_fraction"] is None else f"{entry['moving_fraction']:.2f}"
        rows.append([method, entry["runs"], f"{moving} of {entry['inside_bounds_pairs']}", aim])
    return markdown_table(["method", "runs", "rate moved > 1 % between measurements, inside the bounds",
                           "measured ÷ aimed KL after the first measurement: median [quartiles]"], rows)


def rate_range(runs: list[dict], method: str, best_cell: float) -> dict:
    """Every configured rate ``method`` ran at, in the grid and beside it: its mean final test accuracy and that ÷ the
    grid's best cell (issue 40: how wide a range of configured rates the defaults turn into good runs; None where no
    cell learned anything)."""
    finals: dict[float, list[float]] = {}
    for r in runs:
        if r["method"] == method:
            finals.setdefault(r["learning_rate"], []).append(r["accuracy"])
    return {f"{rate:g}": {"final_mean": statistics.fmean(values), "seeds": len(values),
                          "of_best_cell": statistics.fmean(values) / best_cell if best_cell > 0 else None}
            for rate, values in sorted(finals.items())}


# issue 40's decision between the trust region's two forms at the shipping cadence, and each against GRPO; then what
# OBLR-PO's baseline and SNR factor add on top of the default trust region (the same trust region on GRPO's advantages);
# then issue 38's cheaper cadence against the one it replaces, against GRPO and against the cap; then issue 56's peak
# forms, and the defaults since 2026-11-29 against the previous ones and GRPO
FORM_PAIRS = [("oblrpo-trust-target-every8", "oblrpo-trust-cap-every8"), ("oblrpo-trust-target-every8", REFERENCE),
              ("oblrpo-trust-cap-every8", REFERENCE), ("oblrpo-trust-target-every8", "grpo-trust-target-every8"),
              ("grpo-trust-target-every8", REFERENCE),
              ("oblrpo-trust-target-every16", "oblrpo-trust-target-every8"), ("oblrpo-trust-target-every16", REFERENCE),
              ("oblrpo-trust-target-every16", "oblrpo-trust-cap-every8"),
              ("oblrpo-trust-peak-every16", "oblrpo-trust-target-every16"),
              ("oblrpo-trust-peak-update-every16", "oblrpo-trust-target-every16"),
              ("oblrpo-trust-peak-update-every16", "oblrpo-trust-peak-every16"),
              (PEAK_DELTA_METHOD, "oblrpo-trust-target-every16"), (PEAK_DELTA_METHOD, REFERENCE)]


def form_comparison(cells: dict[str, dict[float, list[dict]]], resamples: int) -> dict:
    """Per pair of `FORM_PAIRS` and per rate both ran: the final accuracy of the first minus the second, paired by
    seed (mean, bootstrap interval, seeds), so that a cell with more seeds than the grid (10 at 1e-6 and 1e-5) is
    compared on all of them."""
    comparison = {}
    for first, second in FORM_PAIRS:
        if first not in cells or second not in cells:
            continue
        by_rate = {}
        for rate in sorted(set(cells[first]) & set(cells[second])):
            theirs = {r["seed"]: r["final"] for r in cells[second][rate]}
            diffs = {r["seed"]: r["final"] - theirs[r["seed"]] for r in cells[first][rate] if r["seed"] in theirs}
            if diffs:
                by_rate[f"{rate:.3g}"] = {"mean": statistics.fmean(diffs.values()),
                                          "ci": bootstrap_ci(list(diffs.values()), resamples), "seeds": sorted(diffs)}
        comparison[f"{first} - {second}"] = by_rate
    return comparison


def form_regret_differences(cells: dict[str, dict[float, list[dict]]], rates: list[float], resamples: int) -> dict:
    """Per pair of `FORM_PAIRS`: the first's regret minus the second's, paired by seed over the seeds both ran at every
    rate of the grid (issue 40's criterion: the target's regret below the cap's). The best cell cancels from a paired
    difference of regrets, so it is minus the mean over the rates of (first's final − second's final)."""
    differences = {}
    for first, second in FORM_PAIRS:
        if first not in cells or second not in cells or not all(r in cells[first] and r in cells[second] for r in rates):
            continue
        finals = {m: {rate: {r["seed"]: r["final"] for r in cells[m][rate]} for rate in rates} for m in (first, second)}
        seeds = sorted(set.intersection(*(set(finals[m][rate]) for m in (first, second) for rate in rates)))
        if seeds:
            values = [-statistics.fmean(finals[first][rate][seed] - finals[second][rate][seed] for rate in rates)
                      for seed in seeds]
            differences[f"{first} - {second}"] = {"mean": statistics.fmean(values),
                                                  "ci": bootstrap_ci(values, resamples), "seeds": seeds}
    return differences


def form_table(comparison: dict) -> str:
    rates = sorted({rate for by_rate in comparison.values() for rate in by_rate}, key=float)
    rows = [[pair, *(f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] (n={len(c['seeds'])})"
                     if (c := by_rate.get(rate)) else "—" for rate in rates)]
            for pair, by_rate in comparison.items()]
    return markdown_table(["final accuracy, paired by seed", *rates], rows)


def grid_methods(methods: list[str], problems: dict) -> list[str]:
    """``methods`` without `oblrpo` where its twin (`defaults_twin`) is among them: the same configuration is run once
    and reported under both names."""
    return [m for m in methods if m != "oblrpo"] if defaults_twin(problems) in methods else methods


def defaults_twin(problems: dict) -> str | None:
    """The trust-region method that runs OBLRPOConfig's defaults on ``problems`` (every field it sets, its δ once the
    problems' δ replaces the placeholder, is the default), so that the grid reports `oblrpo` without running the same
    configuration twice; None where no method does."""

    def resolved(overrides: dict) -> dict:
        if overrides.get("lr_trust_region_kl") is PROBLEMS_DELTA:
            return {**overrides, "lr_trust_region_kl": problems["trust_region_kl"]}
        return overrides

    return next((name for name, (overrides, schedule) in SMOLLM2_METHODS.items()
                 if overrides and overrides.get("lr_trust_region_kl") is not None and schedule is TRL_SCHEDULE
                 and all(shipped(field) == value for field, value in resolved(overrides).items())),
                None)


# issue 56, item 4: the SNR factor on and off at GRPO's best rate, the rest of the defaults unchanged. The defaults are
# the first arm; the others calibrate the factor so that it can act on more of a 40-step run
SNR_ABLATION_WITHOUT = "oblrpo-defaults-no-snr"
SNR_ABLATION_ARMS = ["oblrpo-defaults-snr-two-sided-cal5", "oblrpo-defaults-snr-two-sided-cal5-per-sample",
                     "oblrpo-defaults-snr-two-sided-cal2"]
# the per-completion arm resolves at a median step 23 of 40 and then acts on nearly every step, so in 40-step runs it
# acts on 40 %: `--part snr-long` runs it and the arm without the factor for 60 steps (the same linear schedule
# stretched over them), 10 paired test seeds, named with the tag `snr_long_tag()` so that the grid leaves them out
SNR_LONG = {"steps": 60, "seeds": list(range(10)),
            "arms": ["oblrpo-defaults-snr-two-sided-cal5-per-sample", SNR_ABLATION_WITHOUT]}


def snr_long_tag(steps: int = SNR_LONG["steps"]) -> str:
    return f"@{steps}steps"


def snr_factor_acting_fraction(runs: list[dict]) -> float | None:
    """Of the runs' steps that logged an SNR factor, the share whose factor moved the rate by more than 1 %."""
    factors = [f for r in runs for f in r["traces"]["snr/lr_factor"] if isinstance(f, float) and math.isfinite(f)]
    return sum(abs(f - 1.0) > 0.01 for f in factors) / len(factors) if factors else None


def snr_ablation(runs: list[dict], validation: list[dict], twin: str | None, rate: float, resamples: int) -> dict:
    """Each arm with the SNR factor (the defaults, `twin`, first; then `SNR_ABLATION_ARMS`) minus the defaults without
    it (`SNR_ABLATION_WITHOUT`): final test accuracy at ``rate``, paired by seed, with the share of the arm's steps the
    factor acted on (the longer `SNR_LONG` runs against the longer runs without it). The defaults' comparison is the
    top level, the other arms under ``variants``; the validation runs that chose among the arms (seeds 10, 11,
    validation split) under ``validation``. Empty before a pair has run."""
    def by_seed(pool: list[dict], method: str) -> dict[int, dict]:
        return {r["seed"]: r for r in pool if r["method"] == method and r["learning_rate"] == rate}

    tag = snr_long_tag()
    pairs = [(arm, SNR_ABLATION_WITHOUT) for arm in [twin, *SNR_ABLATION_ARMS]]
    pairs += [(arm + tag, SNR_ABLATION_WITHOUT + tag) for arm in SNR_LONG["arms"] if arm != SNR_ABLATION_WITHOUT]
    arms = {}
    for arm, reference in pairs:
        mine, without = by_seed(runs, arm), by_seed(runs, reference)
        seeds = sorted(set(mine) & set(without))
        if arm is None or not seeds:
            continue
        differences = [mine[s]["accuracy"] - without[s]["accuracy"] for s in seeds]
        arms[arm] = {"with": arm, "without": reference, "rate": rate,
                     "steps": len(mine[seeds[0]]["traces"]["snr/lr_factor"]),
                     "difference_mean": statistics.fmean(differences),
                     "difference_ci": bootstrap_ci(differences, resamples), "seeds": seeds,
                     "with_final_mean": statistics.fmean(mine[s]["accuracy"] for s in seeds),
                     "without_final_mean": statistics.fmean(without[s]["accuracy"] for s in seeds),
                     "acting_fraction": snr_factor_acting_fraction([mine[s] for s in seeds])}
    screen = {}
    for method in [twin, SNR_ABLATION_WITHOUT, *SNR_ABLATION_ARMS]:
        chosen_on = by_seed(validation, method)
        if chosen_on:
            screen[method] = {"final_by_seed": {seed: r["accuracy"] for seed, r in sorted(chosen_on.items())},
                              "acting_fraction": snr_factor_acting_fraction(list(chosen_on.values()))}
    if not arms and not screen:
        return {}
    return {"rate": rate, **arms.pop(twin, {}), "variants": arms, "validation": screen}


def snr_ablation_lines(ablation: dict) -> list[str]:
    rows = [[entry["with"], entry["steps"], f"{entry['with_final_mean']:.3f}", f"{entry['without_final_mean']:.3f}",
             f"{entry['difference_mean']:+.3f} [{entry['difference_ci'][0]:+.3f}, {entry['difference_ci'][1]:+.3f}]",
             len(entry["seeds"]), "—" if entry["acting_fraction"] is None else f"{entry['acting_fraction']:.2f}"]
            for entry in ([ablation] if "with" in ablation else []) + list(ablation["variants"].values())]
    lines = [f"The SNR factor on and off, the rest of the defaults unchanged (final test accuracy at {ablation['rate']:g}, "
             f"paired by seed against `{SNR_ABLATION_WITHOUT}` over as many steps; acted: the share of the arm's steps "
             "whose rate the factor moved by more than 1 %):\n"]
    if rows:
        lines += [markdown_table(["with the factor", "steps", "final", "without", "difference [95 % CI]", "seeds",
                                  "acted"],
                                 rows), ""]
    if ablation["validation"]:
        lines += ["Validation runs that chose the arms (validation seeds and split):\n",
                  markdown_table(["method", "seed: final validation acc.", "acted"],
                                 [[method, ", ".join(f"{seed}: {acc:.3f}" for seed, acc in v["final_by_seed"].items()),
                                   "—" if v["acting_fraction"] is None else f"{v['acting_fraction']:.2f}"]
                                  for method, v in ablation["validation"].items()]), ""]
    return lines


# --- report ----------------------------------------------------------------------------------------------------------
def cell_table(summary: dict, rates: list[float]) -> str:
    rows = []
    for method, entry in summary["methods"].items():
        regret = (f"{entry['regret_mean']:.3f} [{entry['regret_ci'][0]:.3f}, {entry['regret_ci'][1]:.3f}]"
                  if "regret_mean" in entry else "—")
        vs = (f"{entry['regret_minus_grpo']:+.3f} [{entry['regret_minus_grpo_ci'][0]:+.3f}, "
              f"{entry['regret_minus_grpo_ci'][1]:+.3f}]" if "regret_minus_grpo" in entry else "—")
        cells = []
        for rate in rates:
            cell = entry["by_lr"].get(f"{rate:.3g}")
            cells.append("—" if cell is None else
                         f"{cell['final_acc_mean']:.3f} [{cell['final_acc_ci'][0]:.3f}, {cell['final_acc_ci'][1]:.3f}]"
                         f" · {cell['collapse_fraction']:.0%}"
                         f" · f {cell['factor_range'][0]:.2f}–{cell['factor_range'][1]:.2f}"
                         f" (n={len(cell['seeds'])})")
        at_best = (f"{entry['at_grpo_best_minus_grpo']:+.3f} [{entry['at_grpo_best_minus_grpo_ci'][0]:+.3f}, "
                   f"{entry['at_grpo_best_minus_grpo_ci'][1]:+.3f}]" if "at_grpo_best_minus_grpo" in entry else "—")
        extra = (", ".join(f"{r:.3g}" for r in entry["collapses_where_grpo_does_not"]) or "none"
                 if "collapses_where_grpo_does_not" in entry else "—")
        name = f"{method} (= {entry['same_runs_as']}'s runs)" if "same_runs_as" in entry else method
        rows.append([name, *cells, regret, vs, at_best, extra])
    return markdown_table(["method", *[f"lr {r:.3g}: final [CI] · collapsed · factor" for r in rates],
                           "regret [CI]", "regret − grpo [CI]", "at GRPO's best rate − grpo [CI]",
                           "collapsed where GRPO did not"], rows)


def grid_and_legend(*axes) -> None:
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)


def plot(summary_sets: list[tuple[str, dict, list[float]]], resolve_runs: list[dict], output_dir: Path,
         screen_runs: list[dict] = ()) -> Path:
    # a row each: (final, collapse), (rate used, t) or the rate screen's (validation accuracy, completion length)
    rows = len(summary_sets) + (1 if resolve_runs else 0) + (1 if screen_runs else 0)
    figure, axes = new_figure(2, (13, 4.6 * rows), rows=rows)
    axes = list(axes.flat)
    for index, (title, summary, rates) in enumerate(summary_sets):
        final_axis, collapse_axis = axes[2 * index], axes[2 * index + 1]
        for method, entry in summary["methods"].items():
            present = [r for r in rates if f"{r:.3g}" in entry["by_lr"]]
            if not present:
                continue
            cells = [entry["by_lr"][f"{r:.3g}"] for r in present]
            style = "--" if method.endswith("-constant") else "-"
            final_axis.errorbar(present, [c["final_acc_mean"] for c in cells], linestyle=style, marker="o", capsize=3,
                                yerr=[[max(0.0, c["final_acc_mean"] - c["final_acc_ci"][0]) for c in cells],
                                      [max(0.0, c["final_acc_ci"][1] - c["final_acc_mean"]) for c in cells]],
                                label=method)
            collapse_axis.plot(present, [c["collapse_fraction"] for c in cells], linestyle=style, marker="o",
                               label=method)
        final_axis.set(xscale="log", xlabel="configured learning rate", ylabel="final held-out accuracy (95 % CI)",
                       title=title)
        collapse_axis.set(xscale="log", xlabel="configured learning rate", ylabel="collapsed fraction of seeds",
                          title=f"{title}: collapse (final < untrained − {COLLAPSE_MARGIN:g})")
        grid_and_legend(final_axis, collapse_axis)
    if resolve_runs:
        rate_axis, t_axis = axes[-2], axes[-1]
        for index, r in enumerate(resolve_runs):
            traces, label = r["traces"], f"{r['method']} lr {r['learning_rate']:g} (final acc {r['accuracy']:.2f})"
            steps = range(1, len(traces["learning_rate"]) + 1)
            measured = "snr/calibration_t" in traces and any(math.isfinite(v) for v in traces["snr/calibration_t"])
            rate_axis.plot(steps, learning.used_rates(traces), label=label,
                           color=f"C{index}")  # one colour per run in both panels
            if measured:
                t_axis.plot(steps, traces["snr/calibration_t"], label=label, color=f"C{index}")
        t_axis.axhline(CALIBRATION_MIN_T, color="black", linestyle=":",
                       label=f"resolves at t ≥ {CALIBRATION_MIN_T:g}")
        completions = RESOLVE["config"]["per_device_train_batch_size"]
        rate_axis.set(xlabel="optimizer step", ylabel="learning rate used", yscale="log",
                      title=f"SmolLM2, {completions} completions a step: rate used")
        t_axis.set(xlabel="optimizer step", ylabel="t-statistic of the window's mean ‖μ‖²",
                   title="calibration window: does the signal resolve?")
        grid_and_legend(rate_axis, t_axis)
    if screen_runs:
        accuracy_axis, length_axis = axes[-4:-2] if resolve_runs else axes[-2:]
        rates = sorted({r["learning_rate"] for r in screen_runs})
        for index, seed in enumerate(sorted({r["seed"] for r in screen_runs})):
            mine = sorted((r for r in screen_runs if r["seed"] == seed), key=lambda r: r["learning_rate"])
            style = ["-", "--", ":", "-."][index % 4]  # one per seed in both panels, a colour per rate on the right
            accuracy_axis.plot([r["learning_rate"] for r in mine], [r["accuracy"] for r in mine], marker="o",
                               color="black", linestyle=style, label=f"seed {seed}")
            for r in mine:  # each run's mean sampled length per step: do the answers shorten as it learns?
                lengths = r["traces"]["completions/mean_length"]
                length_axis.plot(range(1, len(lengths) + 1), lengths, color=f"C{rates.index(r['learning_rate'])}",
                                 linestyle=style, label=f"seed {seed}, lr {r['learning_rate']:g}")
        accuracy_axis.set(xscale="log", xlabel="configured learning rate", ylabel="final validation accuracy",
                          title=f"{REFERENCE}'s rate screen (validation seeds and split)")
        length_axis.set(xlabel="optimizer step", ylabel="mean sampled completion length (tokens)",
                        title="how long the answers are while training")
        grid_and_legend(accuracy_axis, length_axis)
    return save_figure(figure, output_dir, "summary")


# a seed and rate on which GRPO collapsed: on a ± b GRPO and the defaults both collapsed there (seed 1, 3× the best
# rate); on a + b GRPO held at 10× it and collapsed on both screened seeds at 30× (3e-4)
COLLAPSE = {"seed": 1, "times_best": {"a ± b": 3, "a + b": 30}}


def plot_collapse(runs: list[dict], output_dir: Path) -> Path | None:
    """Reward, rate used and step KL per step of every method run on the `COLLAPSE` seed and rate."""
    problems = problems_of(runs)
    rate = problems["best_rate"] * COLLAPSE["times_best"][problems["title"]]
    chosen = sorted((r for r in runs if r["seed"] == COLLAPSE["seed"] and math.isclose(r["learning_rate"], rate)
                     and r["method"] in SMOLLM2_METHODS), key=lambda r: r["method"])
    if not any(r["method"] in RATE_FOLLOWERS for r in chosen):
        return None
    figure, axes = new_figure(3, (16, 4.4))
    for index, r in enumerate(chosen):
        traces, steps = r["traces"], range(1, len(r["reward"]) + 1)
        used = learning.used_rates(traces)
        label = f"{r['method']} (final acc {r['accuracy']:.2f})"
        axes[0].plot(steps, r["reward"], label=label, color=f"C{index}")
        axes[1].plot(steps, used, label=label, color=f"C{index}")
        if any(math.isfinite(v) for v in traces.get("oblr/step_kl", [])):
            axes[2].plot(steps, traces["oblr/step_kl"], label=label, color=f"C{index}")
    axes[2].axhline(problems["trust_region_kl"], color="black", linestyle=":",
                    label=f"δ = {problems['trust_region_kl']:g}")
    for axis, (ylabel, scale) in zip(axes, [("training reward", "linear"), ("learning rate used", "log"),
                                            ("KL(π_t ‖ π_t+1) per token", "log")], strict=True):
        axis.set(xlabel="optimizer step", ylabel=ylabel, yscale=scale,
                 title=f"SmolLM2 ({problems['title']}) seed {COLLAPSE['seed']}, configured rate {rate:g}")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    return save_figure(figure, output_dir, "collapse_seed")


SUPERSEDED = "trust-region-v1"  # the first trust-region screen, before steps with a zero gradient were left out
RATE_FOLLOWERS = ["oblrpo-trust-cap", "oblrpo-trust-target", "grpo-trust-cap", "grpo-trust-target"]


def plot_rates_used(runs: list[dict], output_dir: Path) -> Path | None:
    """Per trust-region method, the rate each step used on the `COLLAPSE` seed, one line per configured rate: if the
    configured rate stopped mattering, the lines meet after the first steps."""
    methods = [m for m in RATE_FOLLOWERS if any(r["method"] == m and r["seed"] == COLLAPSE["seed"] for r in runs)]
    if not methods:
        return None
    figure, axes = new_figure(len(methods), (5.2 * len(methods), 4.4))
    for axis, method in zip([axes] if len(methods) == 1 else axes, methods, strict=True):
        chosen = sorted((r for r in runs if r["method"] == method and r["seed"] == COLLAPSE["seed"]),
                        key=lambda r: r["learning_rate"])
        for index, r in enumerate(chosen):
            used = learning.used_rates(r["traces"])
            axis.plot(range(1, len(used) + 1), used, color=f"C{index}",
                      label=f"configured {r['learning_rate']:g} (final acc {r['accuracy']:.2f})")
            axis.axhline(r["learning_rate"], color=f"C{index}", linestyle=":", linewidth=0.8)
        axis.set(xlabel="optimizer step", ylabel="learning rate used (dotted: configured)", yscale="log",
                 title=f"{method}, seed {COLLAPSE['seed']}")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    return save_figure(figure, output_dir, "rates_used")


def write_summary(args) -> None:
    output_dir = Path(args.output_dir)
    runs_dir = output_dir / "runs"
    synthetic_path = output_dir / "synthetic_cells.json"
    results, sets, markdown = {}, [], ["# Stability over the configured learning rate\n", "![summary](summary.png)\n"]
    runs = cached_runs(runs_dir)  # none where the folder is not
    resolve_runs = sorted((r for r in runs if r["method"].endswith(resolve_tag())),
                          key=lambda r: (r["learning_rate"], r["method"]))
    problems = problems_of(runs) if runs else PROBLEMS[args.problems]  # the folder's, before any grid too
    grid = smollm2_grid(runs, args.bootstrap)
    if grid is not None:
        summary, details = grid
        results.update(summary, smollm2={**details, "grader": learning.grader_of(runs[0])})
        sets.append((f"SmolLM2-135M, {details['problems']}", summary, details["rates"]))
        markdown += [f"## SmolLM2-135M-Instruct ({details['problems']}, {details['steps']} steps of 8 completions, "
                     f"TRL's linear schedule; untrained test accuracy {details['initial_accuracy']:.3f})\n",
                     grader_warning(runs),
                     f"Cell: final test accuracy [95 % CI] · collapsed fraction (final < untrained − "
                     f"{COLLAPSE_MARGIN:g}) · realised SNR factor range (n = seeds). Regret: best cell mean final minus "
                     "this method's final, averaged over the rates, per seed; difference paired with `grpo` (bootstrap "
                     "over seeds).\n",
                     cell_table(summary, details["rates"]), ""]
        if summary["forms"]:
            markdown += ["The trust region's forms (cap, target, peak), measuring cadences (every 8th, every 16th step) "
                         "and curvature readings (per unit rate, per unit of Adam's update), on OBLR-PO's and on "
                         "GRPO's advantages, paired by seed at each rate both ran:\n",
                         form_table(summary["forms"]), ""]
        if summary.get("form_regrets"):
            markdown += ["Regret difference over the grid, paired by seed (the seeds both ran at every rate):\n",
                         markdown_table(["pair", "regret difference [95 % CI]", "seeds"],
                                        [[pair, f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]",
                                          " ".join(map(str, d["seeds"]))]
                                         for pair, d in summary["form_regrets"].items()]), ""]
        if summary.get("rate_rule"):
            markdown += ["What the trust region did in each method's runs (grid and beside it): how often the rate "
                         "used moved between measurements while the factor sat inside its bounds, and where the "
                         "measured steps landed against the KL the rule aimed them at:\n",
                         rate_rule_table(summary["rate_rule"]), ""]
        if details.get("defaults_range"):
            markdown += [f"The defaults (`{summary['methods']['oblrpo']['same_runs_as']}`) at every configured rate, "
                         "grid and beside it, against the grid's best cell:\n",
                         markdown_table(["configured rate", "mean final", "seeds", "÷ best cell"],
                                        [[rate, f"{cell['final_mean']:.3f}", cell["seeds"],
                                          "—" if cell["of_best_cell"] is None else f"{cell['of_best_cell']:.2f}"]
                                         for rate, cell in details["defaults_range"].items()]), ""]
        validation = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("validation-*.json"))]
        ablation = snr_ablation(runs, validation, defaults_twin(problems), problems["best_rate"], args.bootstrap)
        if ablation:
            results["snr_ablation"] = ablation
            markdown += snr_ablation_lines(ablation)
        if details["beyond_grid"]:
            markdown += ["Runs outside the grid (not in the regret): final test accuracy per seed\n",
                         markdown_table(["method @ rate", "seed: final"],
                                        [[cell, ", ".join(f"{seed}: {acc:.3f}" for seed, acc in finals.items())]
                                         for cell, finals in details["beyond_grid"].items()]), ""]
    # a long-completion task: how long its answers are, and the screen that chooses GRPO's best rate, before any grid
    if "template" in problems and runs:
        results.update(completion_lengths(runs))
        markdown += completion_length_lines(results)
    screen_runs = ([json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"validation-{REFERENCE}-*.json"))]
                   if "rate_screen" in problems else [])
    if screen_runs:
        results["rate_screen"], lines = rate_screen(screen_runs, problems)
        markdown += lines
    # the transfer of this folder's grid (each grid has its own folder); --problems where no grid has run yet
    source = next((key for key, p in PROBLEMS.items() if grid is not None and p["title"] == grid[1]["problems"]),
                  args.problems)
    transfer = TRANSFERS.get(source)  # a grid with a transfer of its own
    if transfer is not None:
        task, delta = transfer["problems"], PROBLEMS[source]["trust_region_kl"]
        screen = [json.loads(p.read_text()) for p in (runs_dir / transfer["runs"]).glob("validation-*.json")]
        if screen:
            results["transfer_rate_screen"], lines = rate_screen(screen, task)
            markdown += lines
        transfer_runs = cached_runs(runs_dir / transfer["runs"])
        transfer_grid = smollm2_grid(transfer_runs, args.bootstrap, problems=task)
        if transfer_grid is not None:
            summary, details = transfer_grid
            rate_origin = "screened above" if "rate_screen" in transfer else f"taken from {PROBLEMS[source]['title']}"
            results["transfer"] = {**summary, **details, "task": task, "trust_region_kl": delta,
                                   "grader": learning.grader_of(transfer_runs[0])}
            sets.append((f"SmolLM2-135M, {task['title']}: δ = {delta:g} carried over", summary, details["rates"]))
            markdown += [f"## Transfer: δ = {delta:g}, chosen on {PROBLEMS[source]['title']}, unchanged on "
                         f"{task['title']} (operands 0…{task['max_operand']}, {details['steps']} steps, untrained "
                         f"test accuracy {details['initial_accuracy']:.3f}; runs in `runs/{transfer['runs']}/`)\n",
                         grader_warning(transfer_runs),
                         f"GRPO's best rate ({rate_origin}) and 10× it; cells and regret as above, the regret over "
                         "these rates only.\n",
                         cell_table(summary, details["rates"]), ""]
    if resolve_runs:
        results["resolve"] = [{key: r[key] for key in ("method", "seed", "learning_rate", "accuracy")}
                              | {"auc": learning.auc(r), "lr_factor": r["traces"]["snr/lr_factor"],
                                 "resolved": r["traces"]["snr/resolved"],
                                 "effective_lr": learning.used_rates(r["traces"])}
                              for r in resolve_runs]
        rows = []
        for r in resolve_runs:
            factors = [f for f in r["traces"]["snr/lr_factor"] if not math.isnan(f)]
            resolved = next((i + 1 for i, v in enumerate(r["traces"]["snr/resolved"]) if v == 1), None)
            factor_range = f"{min(factors):.2f}–{max(factors):.2f}" if factors else "—"
            t_values = [t for t in r["traces"]["snr/calibration_t"] if math.isfinite(t)]
            ratios = [f / ref for f, ref in zip(r["traces"]["snr/bound_factor"], r["traces"]["snr/reference_factor"])
                      if math.isfinite(f / ref)]  # what an unclamped calibrated factor would have been
            rows.append([r["method"], r["learning_rate"], r["accuracy"], learning.auc(r),
                         resolved or ("never" if factors else "— (no SNR factor)"),
                         f"{max(t_values):.2f} / {t_values[-1]:.2f}" if t_values else "—",
                         f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "—", factor_range,
                         statistics.fmean(factors) if factors else "—"])
        markdown += [f"## SmolLM2 with more prompts a step, so that the calibration can resolve ({RESOLVE['config']}, "
                     f"{RESOLVE['steps']} steps, seed {RESOLVE['seed']}; the rates tried)\n",
                     "The window resolves once it holds `snr_calibration_steps` estimates (20 by default) whose mean "
                     f"‖μ‖² has a t-statistic ≥ {CALIBRATION_MIN_T:g}; until then the factor is 1.\n",
                     markdown_table(["run", "lr", "final acc.", "AUC", "resolved at step", "t: largest / last",
                                     "f_t/f_ref once resolved", "factor range", "mean factor"], rows), ""]
    delta_runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"validation-{DELTA['method']}-*.json"))]
    if delta_runs:
        kls = [kl for r in delta_runs for kl in r["traces"]["oblr/step_kl"] if math.isfinite(kl)]
        quartiles, deciles = statistics.quantiles(kls, n=4), statistics.quantiles(kls, n=10)
        problems = problems_of(delta_runs)
        at_peak = [kl for kl, _ in steps_at_peak(delta_runs)]
        peak_quartiles = (statistics.quantiles(at_peak, n=4) if len(at_peak) > 1 else at_peak * 3) or [math.nan] * 3
        # the KL of a whole completion, per token × the step's mean completion length (runs that logged it)
        per_sequence = [kl * length for r in delta_runs
                        for kl, length in zip(r["traces"]["oblr/step_kl"],
                                              r["traces"].get("completions/mean_length", []), strict=False)
                        if math.isfinite(kl)]
        kept = problems.get("delta_of")  # a task that tests another's δ chooses none of its own
        units, unit_lines = delta_units(problems, delta_runs, runs) if kept else (None, [])
        results["trust_region_delta"] = {"seeds": [r["seed"] for r in delta_runs],
                                         "rate": delta_runs[0]["learning_rate"], "split": "validation",
                                         "step_kl_quartiles": quartiles, "step_kl_90th_percentile": deciles[-1],
                                         "chosen": None if kept else problems["trust_region_kl"],
                                         "step_kl_at_peak_quartiles": peak_quartiles}
        if kept:
            results["trust_region_delta"].update(delta_of=kept, units=units)
        if len(per_sequence) > 1:
            results["trust_region_delta"]["step_kl_per_sequence_quartiles"] = statistics.quantiles(per_sequence, n=4)
        chosen = (f"δ is not chosen here: the task keeps {kept}'s (the defaults' {PEAK_DELTA:g} at the peak), and "
                  "these figures say what the same rule would read off its steps" if kept else
                  f"The cap and target forms' δ = {problems['trust_region_kl']:g} (the 90th percentile, rounded: the "
                  "largest steps the best rate takes while it learns); the defaults' peak form reads its δ off the "
                  "steps scaled to the peak, below")
        sequence_line = ("" if len(per_sequence) < 2 else
                         "Per completion (KL per token × the step's mean completion length): quartiles " +
                         " / ".join(f"{q:.2e}" for q in results["trust_region_delta"]["step_kl_per_sequence_quartiles"])
                         + ". ")
        markdown += [f"## Choosing δ of the trust region (validation seeds {[r['seed'] for r in delta_runs]}, the "
                     f"defaults at GRPO's best rate {delta_runs[0]['learning_rate']:g}, validation split)\n",
                     f"Per-step KL(π_t ‖ π_t+1) per token over {len(kls)} steps: quartiles {quartiles[0]:.2e} / "
                     f"{quartiles[1]:.2e} / {quartiles[2]:.2e}, 90th percentile {deciles[-1]:.2e}. {sequence_line}"
                     f"{chosen}.\n",
                     f"Scaled to the schedule's peak, KL·(η_peak/η)² over the {len(at_peak)} steps with a gradient: "
                     f"quartiles {peak_quartiles[0]:.2e} / {peak_quartiles[1]:.2e} / {peak_quartiles[2]:.2e} — the "
                     "median is the δ a peak form whose steps land on their aim reads off these runs "
                     f"(`{PEAK_DELTA_METHOD}`).\n", "", *unit_lines]
        trust_runs = [r for r in runs if r["method"] in [*RATE_FOLLOWERS, "oblrpo-paper"]]
        if trust_runs:
            rows = [[r["method"], r["learning_rate"], r["seed"], r["accuracy"], learning.auc(r),
                     statistics.median(k for k in r["traces"]["oblr/step_kl"] if math.isfinite(k))
                     if any(math.isfinite(k) for k in r["traces"]["oblr/step_kl"]) else "—"]
                    for r in sorted(trust_runs, key=lambda r: (r["learning_rate"], r["seed"], r["method"]))]
            markdown += ["Trust-region runs so far (the grid is not complete: see the table above for the cells):\n",
                         markdown_table(["method", "lr", "seed", "final acc.", "AUC", "median step KL"], rows), ""]
            collapse = plot_collapse(runs, output_dir)
            if collapse is not None:
                markdown += [f"![one collapsing seed with and without the trust region]({collapse.name})\n"]
            rates_used = plot_rates_used(runs, output_dir)
            if rates_used is not None:
                markdown += [f"![the rate each step used, per configured rate]({rates_used.name})\n"]
        superseded = cached_runs(runs_dir / SUPERSEDED)  # none where the folder is not
        if superseded:
            results["trust_region_v1"] = [{key: r[key] for key in ("method", "seed", "learning_rate", "accuracy")}
                                          for r in superseded]
            markdown += [f"Rule v1, superseded (`runs/{SUPERSEDED}/`: it also folded the KL of steps with a zero "
                         "gradient, which move by Adam's momentum only, into the curvature):\n",
                         markdown_table(["method", "lr", "seed", "final acc."],
                                        [[r["method"], r["learning_rate"], r["seed"], r["accuracy"]]
                                         for r in sorted(superseded, key=lambda r: (r["method"], r["learning_rate"]))]),
                         ""]
    if synthetic_path.exists():
        data = json.loads(synthetic_path.read_text())
        cells = {m: {float(rate): runs for rate, runs in by_rate.items()} for m, by_rate in data["cells"].items()}
        summary = grid_summary(cells, args.bootstrap)
        results["synthetic"] = {**summary, "task": data["task"], "rates": data["rates"], "seeds": len(data["seeds"]),
                                "descriptions": data["descriptions"], "curves": data["curves"]}
        sets.append(("synthetic testbed", summary, data["rates"]))
        markdown += [f"## Synthetic testbed ({len(data['seeds'])} paired seeds, {data['task']['steps']} steps; "
                     "methods without a suffix use TRL's linear schedule, `-constant` a constant rate)\n",
                     synthetic_defaults_line(), cell_table(summary, data["rates"]), ""]
    if not sets and not resolve_runs and not results:
        raise SystemExit("nothing has been run yet: run --part synthetic, smollm2 or resolve first")
    figure = plot(sets, resolve_runs, output_dir, screen_runs) if sets or resolve_runs or screen_runs else None
    write_results(output_dir, "summary", results, "\n".join(markdown))
    print("\n".join(markdown))
    print(f"wrote {output_dir / 'summary.json'}" + (f" and {figure}" if figure else " (nothing to plot yet)"))


def synthetic_defaults_line() -> str:
    """Which testbed method of this grid runs OBLR-PO's rate rule as it ships, where `oblrpo` there does not (the
    testbed's `oblrpo` is the defaults before the trust region became one: its cells were measured then and kept
    under that name)."""
    if DEFAULT.runs_shipped_rate:
        return ""
    twin = next((name for name, m in SYNTHETIC_METHODS.items() if m.runs_shipped_rate), None)
    return (f"Here `oblrpo` is OBLR-PO's defaults without the trust region (before 2026-11-26); today's defaults "
            f"(δ = {shipped('lr_trust_region_kl'):g}, {shipped('lr_trust_region_mode')}) are "
            + (f"`{twin}`" if twin else "none of this grid's methods (the testbed's `defaults` arm runs them: "
               "`synthetic_learning.py`)") + ".\n")


def steps_at_peak(delta_runs: list[dict]) -> list[tuple[float, float]]:
    """Each gradient step of runs without a trust region (`DELTA`): its KL per token scaled to the schedule's peak,
    KL·(η_peak/η)², and the step's mean completion length (NaN where the run did not log it). The peak form aims δ
    at the peak and (per update) lands there, so the first is what a δ for it reads off the runs."""
    steps = []
    for r in delta_runs:
        traces = r["traces"]
        lengths = traces.get("completions/mean_length") or [math.nan] * len(traces["oblr/step_kl"])
        steps += [(kl * (r["learning_rate"] / lr) ** 2, length)
                  for kl, lr, grad, length in zip(traces["oblr/step_kl"], traces["learning_rate"], traces["grad_norm"],
                                                  lengths, strict=True)
                  if math.isfinite(kl) and lr > 0 and grad != 0]
    return steps


def median_completion_length(runs: list[dict]) -> float:
    """The median over the runs' steps of the step's mean completion length (runs that log it)."""
    return statistics.median(length for r in runs for length in r["traces"].get("completions/mean_length", []))


def measured_peak_multiple(runs: list[dict], rate: float) -> dict | None:
    """Where the defaults (`PEAK_DELTA_METHOD`, δ per token) put the peak rate in their own test runs at ``rate``
    (GRPO's best): each run's median `oblr/trust_region_rate` ÷ ``rate`` over the steps that have an estimate (every
    step after the first measurement: the estimate is held between measurements), and the median of those. None
    before such a run has finished."""
    multiples = [statistics.median(v for v in r["traces"]["oblr/trust_region_rate"] if math.isfinite(v)) / rate
                 for r in runs if r["method"] == PEAK_DELTA_METHOD and r["learning_rate"] == rate]
    return {"median": statistics.median(multiples), "run_medians": multiples} if multiples else None


def delta_units(problems: dict, delta_runs: list[dict], runs: list[dict]) -> tuple[dict, list[str]]:
    """Where each unit of δ puts the peak form's rate on ``problems`` and on the task whose δ they keep
    (``problems["delta_of"]``), as a multiple of GRPO's best rate there, from each task's `DELTA` runs at that rate:
    per token, η̂/η_best = √(δ / m) with m the median KL per token at the peak (`steps_at_peak`); per completion,
    δ·L_src for the source's median answer length L_src, against the median of KL·L (L: the step's mean length). The
    unit whose multiple stays put across tasks keeps its meaning; δ is the defaults' peak δ, chosen on the source.
    Beside them, where the defaults' per-token δ put the peak in their test runs at that rate (``runs``: this task's
    test runs; the source's are its committed ones), `measured_peak_multiple`."""
    source = next(p for p in PROBLEMS.values() if p["title"] == problems["delta_of"])
    source_runs = [json.loads(p.read_text()) for p in
                   sorted((RESULTS / source["folder"] / "runs").glob(f"validation-{DELTA['method']}-*.json"))]
    # the source's δ runs may predate the length trace: its answers' length is then read off its validation runs
    # at the same rate that log it
    rate_runs = [json.loads(p.read_text()) for p in sorted((RESULTS / source["folder"] / "runs").glob(
        f"validation-*-lr{source['best_rate']:g}-seed*.json"))]
    source_length = median_completion_length([r for r in rate_runs if "completions/mean_length" in r["traces"]])
    units, rows = {}, []
    for task, task_delta_runs, test_runs in ((source, source_runs, cached_runs(RESULTS / source["folder"] / "runs")),
                                              (problems, delta_runs, runs)):
        steps = steps_at_peak(task_delta_runs)
        lengths = [length if math.isfinite(length) else source_length for _, length in steps]
        token_median = statistics.median(kl for kl, _ in steps)
        sequence_median = statistics.median(kl * length for (kl, _), length in zip(steps, lengths, strict=True))
        best_rate = task_delta_runs[0]["learning_rate"]
        measured = measured_peak_multiple(test_runs, best_rate)
        units[task["title"]] = {
            "best_rate": best_rate, "median_completion_length": statistics.median(lengths),
            "step_kl_at_peak_median": token_median, "per_token": math.sqrt(PEAK_DELTA / token_median),
            "per_completion": math.sqrt(PEAK_DELTA * source_length / sequence_median), "steps": len(steps),
            "defaults_measured_peak": measured}
        unit = units[task["title"]]
        rows.append([task["title"], f"{best_rate:g}", f"{unit['median_completion_length']:.1f}",
                     f"{token_median:.2e}", f"{unit['per_token']:.2f}×", f"{unit['per_completion']:.2f}×",
                     "not run" if measured is None else
                     f"{measured['median']:.2f}× ({len(measured['run_medians'])} runs, "
                     f"{min(measured['run_medians']):.2f}–{max(measured['run_medians']):.2f})"])
    lines = [f"Where each unit of δ puts the peak form's rate, as a multiple of GRPO's best rate on each task (δ = "
             f"{PEAK_DELTA:g} per token, or {PEAK_DELTA:g} × {source_length:.1f} = {PEAK_DELTA * source_length:.3g} "
             f"per completion, {source['title']}'s median answer length; from each task's runs without a trust "
             "region at GRPO's best rate, validation seeds):\n",
             markdown_table(["task", "GRPO's best rate", "median length", "median KL per token at the peak",
                             "η̂ ÷ best, δ per token", "η̂ ÷ best, δ per completion",
                             "the defaults' measured η̂ ÷ best (test runs at the best rate; run medians' range)"],
                            rows), ""]
    return units, lines


def rate_screen(screen: list[dict], problems: dict) -> tuple[dict, list[str]]:
    """GRPO's final validation accuracy per rate and seed (the runs that choose ``problems``' best rate), and the
    summary's lines for it."""
    by_rate: dict[float, list[dict]] = {}
    for r in sorted(screen, key=lambda r: (r["learning_rate"], r["seed"])):
        by_rate.setdefault(r["learning_rate"], []).append(r)
    seeds = sorted({r["seed"] for r in screen})
    chosen = f"chosen: {problems['best_rate']:g}" if problems.get("best_rate") else "none chosen yet"
    lines = [f"## GRPO's best rate on {problems['title']} (validation seeds {seeds}, validation split; {chosen})\n",
             markdown_table(["lr", "seed: final validation acc.", "mean"],
                            [[rate, ", ".join(f"{r['seed']}: {r['accuracy']:.3f}" for r in runs),
                              statistics.fmean(r["accuracy"] for r in runs)] for rate, runs in by_rate.items()]), ""]
    return {f"{rate:g}": {r["seed"]: r["accuracy"] for r in runs} for rate, runs in by_rate.items()}, lines


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


def completion_length_lines(lengths: dict) -> list[str]:
    rows = [[method, rate, f"{c['sampled_mean']:.1f}", f"{c['greedy_median']:.1f}", c["runs"]]
            for method, by_rate in lengths["completion_tokens_at_end"].items() for rate, c in by_rate.items()]
    untrained = (f"Completion length in tokens (δ is per token): the untrained model's median "
                 f"{lengths['median_completion_tokens']} sampled as training samples (temperature 1, at most "
                 f"{LONG_COMPLETIONS}), {lengths['median_completion_tokens_greedy']} greedy on the test problems")
    if not rows:
        return [untrained + "; no test run has trained yet.\n"]
    return [untrained + "; after training:\n",
            markdown_table(["method", "lr", "last step's mean sampled length", "greedy median (test)", "runs"], rows),
            ""]


def resolve_tag() -> str:
    return f"@{RESOLVE['config']['per_device_train_batch_size']}x{RESOLVE['steps']}"


def main(argv=None) -> int:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    runs_dir = output_dir / "runs"
    if args.part == "synthetic":
        data = run_synthetic(args)
        path = output_dir / "synthetic_cells.json"
        if path.exists():  # methods run earlier on the same task, seeds and rates stay in the summary
            earlier = json.loads(path.read_text())
            if all(earlier[key] == data[key] for key in ("task", "seeds", "rates")):
                for key in ("cells", "curves", "descriptions"):
                    data[key] = {**earlier[key], **data[key]}
        output_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    elif args.part in ("smollm2", "resolve", "delta", "validation", "transfer", "transfer-rate", "snr-long"):
        folder = runs_dir
        if args.part == "smollm2":
            methods = grid_methods(args.methods or PROBLEMS[args.problems].get("methods", SMOLLM2["methods"]),
                                   PROBLEMS[args.problems])
            specs, initial = smollm2_specs(args, methods,
                                           args.rates or PROBLEMS[args.problems]["grid"],
                                           args.seeds or SMOLLM2["seeds"], args.steps or SMOLLM2["steps"],
                                           problems=PROBLEMS[args.problems])
        elif args.part == "delta":
            specs, initial = smollm2_specs(args, [DELTA["method"]], args.rates or [PROBLEMS[args.problems]["best_rate"]],
                                           args.seeds or DELTA["seeds"], args.steps or DELTA["steps"], split="validation",
                                           problems=PROBLEMS[args.problems])
        elif args.part == "validation":  # any methods, on validation seeds and the validation split (choosing)
            specs, initial = smollm2_specs(args, args.methods or [DELTA["method"]],
                                           args.rates or validation_rates(PROBLEMS[args.problems]),
                                           args.seeds or DELTA["seeds"], args.steps or DELTA["steps"], split="validation",
                                           problems=PROBLEMS[args.problems])
        elif args.part == "snr-long":  # the SNR ablation's per-completion arm long enough to act on most steps
            specs, initial = smollm2_specs(args, args.methods or SNR_LONG["arms"],
                                           args.rates or [PROBLEMS[args.problems]["best_rate"]],
                                           args.seeds or SNR_LONG["seeds"], args.steps or SNR_LONG["steps"],
                                           problems=PROBLEMS[args.problems],
                                           tag=snr_long_tag(args.steps or SNR_LONG["steps"]))
        elif args.part == "transfer":  # its own folder: the untrained model and the cells are another task's
            transfer = TRANSFERS[args.problems]
            best = transfer["problems"]["best_rate"]
            rates = args.rates or [best, float(f"{10 * best:g}")]
            specs, initial = smollm2_specs(args, args.methods or transfer["methods"], rates,
                                           args.seeds or TRANSFER["seeds"], args.steps or TRANSFER["steps"],
                                           problems=transfer["problems"])
            folder = runs_dir / transfer["runs"]
        elif args.part == "transfer-rate":  # GRPO's best rate on the second task, from validation seeds only
            transfer = TRANSFERS[args.problems]
            specs, initial = smollm2_specs(args, [REFERENCE], args.rates or transfer["rate_screen"],
                                           args.seeds or TRANSFER["rate_seeds"], args.steps or TRANSFER["steps"],
                                           split="validation", problems=transfer["problems"])
            folder = runs_dir / transfer["runs"]
        else:
            specs, initial = smollm2_specs(args, args.methods or RESOLVE["methods"], args.rates or [RESOLVE["rate"]],
                                           args.seeds or [RESOLVE["seed"]], args.steps or RESOLVE["steps"],
                                           problems=PROBLEMS[RESOLVE["problems"]], extra_config=RESOLVE["config"],
                                           tag=resolve_tag())
        # each run is a `learning.py --child`; the untrained model's accuracy beside the first runs
        learning.run_all([initial, *specs], folder, f"{args.part} runs", args.jobs)
    write_summary(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
