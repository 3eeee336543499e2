"""The stability benchmark's records, each declared once and read-only: the SmolLM2 methods it runs, the problem
sets it runs them on, and the studies (`stability.py --part …`) that choose a problem set's methods, rates, seeds,
steps and config. `stability.py` runs them, `stability_summary.py` reports them. A method whose runs are committed and
which HEAD no longer runs is `Settled`, naming the commit that runs it.

A new task is one `ProblemSet` in `PROBLEM_SETS` (its own results folder, its grid, its δ); a new set of runs one
`Study` in `STUDIES` (its part, seeds, steps and config changes, recorded on every run it makes).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from trl import GRPOConfig

from benchmarks import learning
from oblr_trl.tasks import BOXED_INSTRUCTION

REFERENCE = "grpo"
NOTHING: Mapping[str, Any] = MappingProxyType({})
TRL_SCHEDULE: Mapping[str, Any] = MappingProxyType({"lr_scheduler_type": "linear", "warmup_steps": 0})  # GRPOConfig's
TRL_RATE: float = GRPOConfig.__dataclass_fields__["learning_rate"].default  # what runs where none is set
CPU = learning.CPU


def frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return None if mapping is None else MappingProxyType(dict(mapping))


def by_name(records: Iterable, name: Callable[[Any], str] = lambda record: record.name) -> Mapping[str, Any]:
    """``records`` keyed by name, in their order, read-only; a name given twice is an error."""
    keyed = {}
    for record in records:
        if name(record) in keyed:
            raise ValueError(f"{name(record)!r} is declared twice")
        keyed[name(record)] = record
    return MappingProxyType(keyed)


# --- SmolLM2 methods -------------------------------------------------------------------------------------------------
class Delta(enum.Enum):
    """The δ of a trust-region method that has no number of its own."""

    OF_PROBLEM_SET = "the problem set's δ"  # chosen per problem set on validation seeds (`--part delta`)


@dataclass(frozen=True)
class Method:
    """A SmolLM2 method: OBLRPOConfig fields over the defaults (None: TRL's GRPOTrainer), on TRL's schedule."""

    name: str
    overrides: Mapping[str, Any] | None
    description: str

    def __post_init__(self):
        object.__setattr__(self, "overrides", frozen(self.overrides))

    def config_overrides(self, problems: ProblemSet) -> dict | None:
        """The fields a run on ``problems`` sets: `Delta.OF_PROBLEM_SET` is the problem set's δ."""
        if self.overrides is None:
            return None
        return {key: problems.trust_region_kl if value is Delta.OF_PROBLEM_SET else value
                for key, value in self.overrides.items()}


def trust_region(every: int, delta: float | Delta = Delta.OF_PROBLEM_SET) -> dict:
    """The trust region at δ = ``delta``, measuring every ``every``-th step's KL: the peak form reading the curvature
    per unit of Adam's update, the one OBLR-PO has (the methods of the forms before it are `SETTLED_METHODS`)."""
    return {"lr_trust_region_kl": delta, "lr_trust_region_measure_steps": every}


NO_TRUST_REGION = {"lr_trust_region_kl": None}
# the peak form per update at the median of the validation runs' per-step KL scaled to the schedule's peak (a + b),
# rather than the cap's 90th percentile: what ships
PEAK_DELTA = 0.005
PEAK_DELTA_METHOD = "oblrpo-trust-peak-update-every16-kl0.005"
DEFAULTS_TRUST_REGION = trust_region(16, PEAK_DELTA)
# GRPO's advantage from OBLR-PO's pieces: the whole group's mean with TRL's std scaling, no SNR factor; without a trust
# region TRL's GRPO step for step (docs/rate_rule.md, "Turning it off, and GRPO with the trust region")
GRPO_AS_OBLRPO = {"baseline_weights": "uniform", "baseline_estimator": "weighted", "leave_one_out": False,
                  "use_snr_lr": False}
GRPO_TRUST_REGION = "grpo-trust-region"
# the trust region's factor bounded at 100× the configured rate rather than 10×: where the defaults meet TRL's 1e-6
BOUND_100 = "oblrpo-trust-bound100"

SMOLLM2_METHODS: Mapping[str, Method] = by_name((
    Method(REFERENCE, None, "TRL's GRPOTrainer"),
    Method("oblrpo", {}, "OBLRPOConfig's defaults as they ship when the run is made"),
    Method("oblrpo-no-trust", NO_TRUST_REGION, "the defaults without the trust region"),
    Method("oblrpo-paper", {**NO_TRUST_REGION, "snr_lr_reference": "absolute", "snr_estimator": "per_sample",
                            "snr_warmup_steps": 0},
           "the paper-literal factor (the configured rate is η_max), reacting from the first step"),
    Method("oblrpo-kl", {**NO_TRUST_REGION, "log_step_kl": True},
           "the defaults without the trust region, measuring every step's KL: the runs δ is read off"),
    Method(PEAK_DELTA_METHOD, DEFAULTS_TRUST_REGION,
           f"the peak form per unit of Adam's update at δ = {PEAK_DELTA:g}: the shipped defaults"),
    Method(BOUND_100, {**DEFAULTS_TRUST_REGION, "lr_trust_region_max_ratio": 100.0},
           "the defaults with the trust region's factor bounded at 100×, not 10×: the low side at TRL's 1e-6"),
    Method("oblrpo-trust-peak-update-every16", trust_region(16),
           "the peak form per unit of Adam's update at the problem set's δ (the cap's)"),
    Method(GRPO_TRUST_REGION, {**GRPO_AS_OBLRPO, **DEFAULTS_TRUST_REGION},
           "TRL's GRPO step with the trust region as it ships (peak form, δ = 0.005, every 16th step, short early gaps)"),
))
# what buys the robustness to the rate: GRPO, with the trust region, the paper's two parts alone, all three (defaults)
ATTRIBUTION_ARMS = (REFERENCE, GRPO_TRUST_REGION, "oblrpo-no-trust", PEAK_DELTA_METHOD)


# --- settled methods -------------------------------------------------------------------------------------------------
# the last commit with the trust region's cap and target forms and its curvature read per unit rate (KL/η²): it runs
# the methods that used them
RETIRED_FORMS_COMMIT = "e7f4843"
# the last commit with the methods of the settled SNR and reward-scaling studies (stability/settled.md, a ± b's)
SETTLED_STUDIES_COMMIT = "920ac46"


@dataclass(frozen=True)
class Settled:
    """A method HEAD no longer runs: its runs are committed, the summaries report them, and ``commit`` runs it again
    (`stability.py` refuses it at once, naming the commit)."""

    name: str
    description: str  # what it ran, as its run records' overrides say
    commit: str = RETIRED_FORMS_COMMIT


# each at the problem set's δ and reading the curvature per unit rate unless its description says otherwise; on GRPO's
# advantages: OBLR-PO's pieces with uniform weights, the whole group's mean, std scaling and no SNR factor
SETTLED_METHODS: Mapping[str, Settled] = by_name((
    Settled("oblrpo-trust-cap", "the cap on OBLR-PO's advantages, every step measured"),
    Settled("grpo-trust-cap", "the cap on GRPO's advantages, every step measured"),
    Settled("oblrpo-trust-target", "the target form, every step measured"),
    Settled("grpo-trust-target", "the target form on GRPO's advantages, every step measured"),
    Settled("oblrpo-trust-cap-every4", "the cap measuring every 4th step"),
    Settled("oblrpo-trust-cap-every8", "the cap measuring every 8th step"),
    Settled("oblrpo-trust-target-every8", "the target form measuring every 8th step"),
    Settled("grpo-trust-cap-every8",
            "the cap on GRPO's advantages, every 8th step: what OBLR-PO adds on top of the trust region"),
    Settled("grpo-trust-target-every8", "the target form on GRPO's advantages, every 8th step"),
    Settled("oblrpo-trust-target-every16",
            "the target form measuring every 16th step: half the measuring forwards of every 8th"),
    Settled("oblrpo-trust-peak-every16",
            "the peak form (η̂_max measured, the schedule and the SNR factor shaping every step), every 16th step"),
    Settled("oblrpo-trust-peak-every1",
            "the peak form measuring every step: each step's KL beside its aim, to replay predictors on"),
    Settled("oblrpo-trust-target-update-every16", "the target form per unit of Adam's update, every 16th step"),
    *(Settled(name, description, SETTLED_STUDIES_COMMIT) for name, description in (
        ("oblrpo-unscaled", "the defaults without the trust region and without the group's std scaling"),
        ("oblrpo-two-sided", "the defaults without the trust region, the SNR factor's ratio in [0.5, 2]"),
        ("oblrpo-defaults-no-snr", "the defaults without the SNR factor"),
        ("oblrpo-defaults-snr-two-sided-cal5", "the SNR factor calibrated over 5 steps, its ratio in [0.5, 2]"),
        ("oblrpo-defaults-snr-two-sided-cal5-per-sample", "as cal5, a step's completions the estimate's samples"),
        ("oblrpo-defaults-snr-two-sided-cal2", "as cal5, over a 2-step window"))),
))
# what each part buys, paired by seed at each rate (first minus second): the trust region on GRPO's step, the paper's
# two parts without it, the defaults against GRPO, what each of the two adds on top of the other, and what the 100×
# bound changes on the defaults
PAIRS = ((GRPO_TRUST_REGION, REFERENCE), ("oblrpo-no-trust", REFERENCE), (PEAK_DELTA_METHOD, REFERENCE),
         (PEAK_DELTA_METHOD, GRPO_TRUST_REGION), (PEAK_DELTA_METHOD, "oblrpo-no-trust"),
         (BOUND_100, PEAK_DELTA_METHOD))
# a grid's methods unless its problem set names its own; settled ones among them, so a grid runs with `--methods`
GRID_METHODS = (REFERENCE, "oblrpo", "oblrpo-no-trust", "oblrpo-paper", "grpo-trust-cap", "grpo-trust-target",
                "oblrpo-trust-cap", "oblrpo-trust-cap-every4", "oblrpo-trust-cap-every8", "oblrpo-trust-target",
                "oblrpo-trust-target-every8", "grpo-trust-cap-every8", "grpo-trust-target-every8",
                "oblrpo-trust-target-every16", "oblrpo-trust-peak-every16", "oblrpo-trust-peak-update-every16",
                PEAK_DELTA_METHOD)


# --- problem sets ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProblemSet:
    """The problems a grid trains and tests on, and what is chosen for them on validation seeds."""

    title: str  # what each run records as its ``problems``
    operators: str
    max_operand: int
    data: str  # the folder its splits are written to
    eval_problems: int  # test problems, and as many validation problems
    best_rate: float | None  # GRPO's best rate (None until screened)
    trust_region_kl: float  # δ of the methods that take the problem set's (`Delta.OF_PROBLEM_SET`)
    folder: str | None = None  # its results folder under benchmarks/results
    grid: tuple[float, ...] | None = None  # the grid's configured rates (None: every rate run)
    methods: tuple[str, ...] = GRID_METHODS  # the grid's
    template: str | None = None  # how its questions are asked (None: the answer alone)
    config: Mapping[str, Any] = field(default_factory=lambda: NOTHING)  # config fields beyond the CPU preset's
    eval_max_new_tokens: int = CPU["eval_max_new_tokens"]
    rate_screen: tuple[float, ...] = ()  # GRPO's best rate screened over these on validation seeds
    delta_of: ProblemSet | None = None  # the problem set whose δ it keeps, choosing none of its own

    def __post_init__(self):
        object.__setattr__(self, "config", frozen(self.config))



# products of a + b's operands, cut as its problems are; GRPO's best rate screened on validation seeds (a + b's best
# ÷3, ×1, ×3, and ÷10 once the best was the screen's lowest rate); a + b's δ, unchanged. Also a grid of its own, the
# second task on which the trust region's form was chosen
A_TIMES_B = ProblemSet(title="a × b (0…14)", operators="*", max_operand=14, data="data-products", eval_problems=60,
                       best_rate=3e-6, trust_region_kl=0.01, folder="stability-products",
                       grid=(3e-7, 1e-6, 3e-6, 1e-5, 3e-5))
# sums of operands 0…14, which SmolLM2 learns within the budget under the strict grader (a ± b it barely does); 225
# problems cut into 60 test, 60 validation, 105 training. The grid is symmetric (÷10 … ×10) around the best rate of a
# first screen on test seeds (1e-5); `rate_screen` screened it again on validation seeds (the summary's table): 3e-5,
# which the attribution study's rates follow. δ the 90th percentile of the validation runs' per-step KL at 1e-5,
# rounded (the cap and target forms')
A_PLUS_B = ProblemSet(title="a + b", operators="+", max_operand=14, data="data-sums", eval_problems=60, best_rate=3e-5,
                      trust_region_kl=0.01, folder="stability", grid=(1e-6, 3e-6, 1e-5, 3e-5, 1e-4),
                      rate_screen=(3e-6, 1e-5, 3e-5, 1e-4))
# the learning benchmark's problems; GRPO's best rate is that benchmark's, and its δ, chosen as a + b's, spans the
# per-step KL of runs that barely learn
A_PLUS_MINUS_B = ProblemSet(
    title="a ± b", operators="+-", max_operand=CPU["max_operand"], data="data", eval_problems=200, best_rate=1e-4,
    trust_region_kl=0.4, folder="stability-a-pm-b", grid=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3))
# does δ, a per-token KL chosen on answers of 7–16 tokens, keep its meaning on long ones? a + b's problems (the same
# splits) asked as the math recipes ask them, the reward the graded answer with no term for length; a + b's δ kept.
# Its grid: TRL's default rate, GRPO's best rate (screened on validation seeds) and 10× it, GRPO against the defaults
LONG_COMPLETIONS = 128
A_PLUS_B_REASONED = replace(
    A_PLUS_B, title="a + b, reasoned step by step", folder="stability-long",
    template="What is {question}?\n" + BOXED_INSTRUCTION, config={"max_completion_length": LONG_COMPLETIONS},
    eval_max_new_tokens=LONG_COMPLETIONS, rate_screen=(1e-6, 3e-6, 1e-5, 3e-5, 1e-4), best_rate=3e-5,
    grid=(1e-6, 3e-5, 3e-4), methods=(REFERENCE, PEAK_DELTA_METHOD), delta_of=A_PLUS_B)
PROBLEM_SETS: Mapping[str, ProblemSet] = MappingProxyType(
    {"a+b": A_PLUS_B, "a±b": A_PLUS_MINUS_B, "a×b": A_TIMES_B, "a+b-reasoned": A_PLUS_B_REASONED})


def problems_titled(title: str) -> ProblemSet:
    """The problem set whose runs record ``title`` as their problems."""
    return next(p for p in PROBLEM_SETS.values() if p.title == title)


# --- studies ---------------------------------------------------------------------------------------------------------
def grid_rates(problems: ProblemSet) -> tuple[float, ...]:
    return problems.grid or ()


def best_rate(problems: ProblemSet) -> tuple[float, ...]:
    return (problems.best_rate,) if problems.best_rate else ()


def validation_rates(problems: ProblemSet) -> tuple[float, ...]:
    """GRPO's best rate on ``problems``, or the rates of their screen while none is chosen."""
    return best_rate(problems) or problems.rate_screen


def attribution_rates(problems: ProblemSet) -> tuple[float, ...]:
    """TRL's default rate, GRPO's best rate on ``problems`` and 10× it."""
    return TRL_RATE, problems.best_rate, float(f"{10 * problems.best_rate:g}")


def low_side_rates(problems: ProblemSet) -> tuple[float, ...]:
    """TRL's default rate and the rates of the problem set's grid below it."""
    return tuple(sorted({TRL_RATE, *(rate for rate in grid_rates(problems) if rate < TRL_RATE)}))


@dataclass(frozen=True)
class Study:
    """A set of SmolLM2 runs, made by ``stability.py --part <part>``, each recording ``study``, ``steps`` and
    ``config_changes`` (this study's config and ``--set``'s): what tells it apart from another study's run of the
    same method, rate and seed. The rates are a function of the ``--problems`` problem set."""

    part: str
    name: str  # what its runs record as their study
    description: str
    seeds: tuple[int, ...]
    steps: int
    rates: Callable[[ProblemSet], tuple[float, ...]]
    methods: tuple[str, ...] | None = None  # None: the problem set's grid's
    split: Literal["test", "validation"] = "test"
    config: Mapping[str, Any] = field(default_factory=lambda: NOTHING)  # config fields beyond the problem set's
    folder: str = ""  # its records' folder under runs/: its own where its runs share a method, rate and seed with
    # another study's (the record's file name says only those)

    def __post_init__(self):
        object.__setattr__(self, "config", frozen(self.config))

    def identity(self, steps: int, overrides: Mapping[str, Any]) -> dict:
        """What a run of this study records beside its method, rate and seed."""
        return {"study": self.name, "steps": steps, "config_changes": {**self.config, **overrides}}


DELTA_METHOD = "oblrpo-kl"
VALIDATION_SEEDS = (10, 11)
STUDIES: Mapping[str, Study] = by_name((
    Study("smollm2", "grid", "each method at each rate of the problem set's grid, paired test seeds",
          seeds=(0, 1, 2, 3, 4), steps=40, rates=grid_rates),
    # δ of the trust region is chosen per problem set from the per-step KL of the defaults without one at GRPO's best
    # rate, on validation seeds only
    Study("delta", "validation", "the runs δ is read off", seeds=VALIDATION_SEEDS, steps=40, rates=best_rate,
          methods=(DELTA_METHOD,), split="validation"),
    Study("validation", "validation", "any methods on validation seeds and the validation split (choosing)",
          seeds=VALIDATION_SEEDS, steps=40, rates=validation_rates, methods=(DELTA_METHOD,), split="validation"),
    # what each part buys: the arms paired by seed at each rate; under the grid's name, so that a grid run of an arm
    # at one of these rates is one of its runs
    Study("attribution", "grid", "GRPO, GRPO with the shipped trust region, the defaults without it and the defaults, "
          "at TRL's 1e-6, GRPO's best rate and 10× it, paired test seeds", seeds=(0, 1, 2, 3, 4), steps=40,
          rates=attribution_rates, methods=ATTRIBUTION_ARMS),
    # the low side: where the shipped 10× bound held the trust region's factor (TRL's 1e-6 and the grid's rates below
    # it, and nowhere else in the committed runs), the same rule bounded at 100×; under the grid's name, beside the
    # defaults' runs of those cells
    Study("low-side", "grid", "the defaults with the trust region's factor bounded at 100×, at TRL's 1e-6 and the "
          "grid's rates below it, paired test seeds", seeds=(0, 1, 2, 3, 4), steps=40, rates=low_side_rates,
          methods=(BOUND_100,)),
    # the cells run before runs recorded their code, run again on one seed at GRPO's best rate by today's code: a run
    # that reproduces its committed record step for step shows its cell is today's code
    Study("reproduce", "grid", "committed cells run again on seed 0 at GRPO's best rate", seeds=(0,), steps=40,
          rates=best_rate, methods=(REFERENCE, PEAK_DELTA_METHOD, "oblrpo-no-trust"), folder="reproduce"),
), name=lambda study: study.part)
GRID = STUDIES["smollm2"]
REPRODUCE = STUDIES["reproduce"]

