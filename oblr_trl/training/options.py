"""`OBLRPOOptions`: the options OBLR-PO adds to TRL's `GRPOConfig`, and their validation.

Kept apart from `OBLRPOConfig` and free of torch/transformers imports, so that `oblr-trl train --help` and config
checks answer at once; `OBLRPOConfig` (oblr_trl.training.config) combines these fields with every GRPOConfig field and
documents them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..estimators.choices import (
    BASELINE_ESTIMATORS,
    BASELINE_WEIGHTS,
    SNR_ESTIMATORS,
    SNR_LR_REFERENCES,
    TRUST_REGION_CURVATURES,
    TRUST_REGION_MODES,
)

__all__ = ["OBLRPOOptions", "TRAINER_VALUE_RULES", "check_one_of", "invalid_value"]


def invalid_value(name: str, value, allowed: str) -> ValueError:
    return ValueError(f"Invalid value for `{name}`: {value!r}. Allowed values: {allowed}.")


def check_one_of(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise invalid_value(name, value, ", ".join(repr(c) for c in choices))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# (field, allowed values, check): numbers that torch's optimizer, the scheduler or generation would reject later
TRAINER_VALUE_RULES = (
    ("learning_rate", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("weight_decay", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("adam_beta1", "a float in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    ("adam_beta2", "a float in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    ("adam_epsilon", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("warmup_steps", "a number >= 0", lambda v: _number(v) and v >= 0),
    ("max_steps", "-1 (train num_train_epochs) or an integer >= 1", lambda v: isinstance(v, int) and (v == -1 or v >= 1)),
    ("num_train_epochs", "a finite float > 0", lambda v: _number(v) and v > 0),
    ("per_device_train_batch_size", "an integer >= 1", lambda v: isinstance(v, int) and v >= 1),
    ("gradient_accumulation_steps", "an integer >= 1", lambda v: isinstance(v, int) and v >= 1),
    ("max_completion_length", "an integer >= 1", lambda v: isinstance(v, int) and v >= 1),
    ("temperature", "a finite float > 0", lambda v: _number(v) and v > 0),
    ("top_p", "a float in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    ("beta", "a finite float >= 0", lambda v: _number(v) and v >= 0),
)


@dataclass
class OBLRPOOptions:
    """The OBLR-PO fields of `OBLRPOConfig` (documented there)."""

    # Parameters that control the baseline
    baseline_weights: str = field(
        default="logit",
        metadata={
            "help": "Estimator of the per-completion weight w_i ∝ ‖∇_θ log π(o_i|q)‖² used by the baseline: 'logit' "
            "(Σ_t ‖∂ log p_t(y_t)/∂z_t‖², one chunked no-grad forward per generation batch), 'length' (number of "
            "completion tokens, free), 'exact' (true squared gradient norm over the trainable parameters, measured "
            "for the groups whose rewards differ) or "
            "'uniform' (1, i.e. RLOO's baseline).",
            "choices": list(BASELINE_WEIGHTS),
        },
    )
    baseline_estimator: str = field(
        default="pooled_slope",
        metadata={
            "help": "Estimate of b* = E[w r]/E[w] from the group: 'weighted' (Σ w r / Σ w over the others, the "
            "paper's), 'shrunk' (baseline_shrinkage·weighted + (1 − baseline_shrinkage)·uniform mean) or "
            "'pooled_slope' (mean + ρ̂·variance of the others' rewards, ρ̂ fitted on earlier batches).",
            "choices": list(BASELINE_ESTIMATORS),
        },
    )
    baseline_shrinkage: float = field(
        default=0.5,
        metadata={"help": "λ of baseline_estimator='shrunk', in [0, 1]: 1 is 'weighted', 0 the uniform mean (RLOO)."},
    )
    leave_one_out: bool = field(
        default=True,
        metadata={
            "help": "Leave completion i out of its own baseline (b_i = Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j), which keeps the "
            "estimator unbiased. If False, one whole-group baseline Σ_j w_j r_j / Σ_j w_j (verl's OPO/OTB)."
        },
    )
    importance_weighted_baseline: bool = field(
        default=True,
        metadata={
            "help": "Under vLLM importance-sampling correction, weight each token's contribution to w_i by the square "
            "of its IS ratio, so the baseline is optimal for the corrected estimator. No effect otherwise, nor on "
            "'uniform' weights."
        },
    )
    per_sample_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Sequences per forward and backward of the per-sample gradient norms ('exact' weights, "
            "'per_sample' SNR). Without (non-reentrant) gradient checkpointing that pass holds every layer's "
            "activations for its chunk: a smaller value trades speed for memory. None: as many as fit (CUDA: "
            "under the run's peak so far; CPU: half the free memory)."
        },
    )

    # Parameters that control the SNR-driven learning rate
    use_snr_lr: bool = field(
        default=True,
        metadata={
            "help": "Scale the scheduled learning rate of every optimizer step by a factor driven by the measured "
            "gradient SNR = ‖μ‖²/tr Σ through f_t = N·SNR/(1 + N·SNR) (see snr_lr_reference)."
        },
    )
    snr_lr_reference: str = field(
        default="calibrated",
        metadata={
            "help": "What the configured learning rate means. 'calibrated': the rate at the SNR measured early in "
            "training; lr = scheduled · clip(f_t / f_ref, snr_lr_min_ratio, snr_lr_max_ratio), 1 until f_ref is "
            "resolved. 'absolute': the paper's η_max; lr = scheduled · max(f_t, snr_lr_floor).",
            "choices": list(SNR_LR_REFERENCES),
        },
    )
    snr_estimator: str = field(
        default="cross_step",
        metadata={
            "help": "Estimator of ‖μ‖² and tr Σ: 'cross_step' (inner product of consecutive independently generated "
            "step gradients, prompts as samples; works with one micro-batch), 'two_batch' (micro-batch vs full-step "
            "gradient norms; needs gradient_accumulation_steps × processes >= 2) or 'per_sample' (per-completion "
            "gradient norms of the loss, one extra batched forward and backward per micro-batch).",
            "choices": list(SNR_ESTIMATORS),
        },
    )
    snr_ema_decay: float = field(
        default=0.9,
        metadata={"help": "Decay of the bias-corrected moving averages of the ‖μ‖² and tr Σ estimates, in [0, 1)."},
    )
    snr_warmup_steps: int = field(
        default=5,
        metadata={
            "help": "Optimizer steps measured before the estimate is used ('absolute': factor 1 until then; "
            "'calibrated': the calibration window opens after them and after the learning-rate warm-up)."
        },
    )
    snr_calibration_steps: int | None = field(
        default=None,
        metadata={
            "help": "Smallest number of steps in the calibration window of 'calibrated'. None: max(20, "
            "ceil(2/(1 - snr_ema_decay)))."
        },
    )
    snr_lr_min_ratio: float = field(
        default=1.0,
        metadata={
            "help": "Smallest calibrated factor f_t / f_ref, in (0, 1]. The default 1 never takes the rate below the "
            "scheduled one (measured: a floor of 0.5 learned slower than GRPO on the synthetic testbed)."
        },
    )
    snr_lr_max_ratio: float = field(
        default=2.0,
        metadata={"help": "Largest calibrated factor f_t / f_ref, >= 1."},
    )
    snr_lr_floor: float = field(
        default=0.1,
        metadata={"help": "Smallest factor of snr_lr_reference='absolute', in (0, 1]: no signal cannot stall training."},
    )

    # Parameters that control the trust region of the step
    lr_trust_region_kl: float | None = field(
        default=0.005,
        metadata={
            "help": "Target δ of the mean per-token KL(π_t ‖ π_{t+1}) one optimizer step may move the policy by, "
            "measured after a step on its completions (every lr_trust_region_measure_steps-th step); the next step's "
            "rate is the one the smoothed curvature says gives δ (see lr_trust_region_mode and "
            "lr_trust_region_curvature); until a step has moved the policy, the step is a probe at "
            "lr_trust_region_min_ratio × the base rate. With the defaults it sets the peak rate, which your schedule "
            "and the SNR factor shape (docs/rate_rule.md). None: no trust region and no measuring forward."
        },
    )
    lr_trust_region_mode: str = field(
        default="peak",
        metadata={
            "help": "How the trust-region rate η_δ sets the rate used. 'peak': η_δ replaces the schedule's peak (your "
            "learning_rate), within [lr_trust_region_min_ratio, lr_trust_region_max_ratio] × it, and the schedule "
            "and SNR factor shape every step around it; the step after the probe is measured too. 'target': η_δ "
            "within those bounds × scheduled × SNR factor, so inside them the rate is η_δ whatever the schedule and "
            "SNR factor (never raised on a step with a zero gradient). 'cap': min(scheduled × SNR factor, η_δ).",
            "choices": list(TRUST_REGION_MODES),
        },
    )
    lr_trust_region_min_ratio: float = field(
        default=0.01,
        metadata={"help": "Smallest trust-region factor, in (0, 1]: a spike of curvature cannot stall training; "
                  "also the factor of the probe step before any curvature is measured."},
    )
    lr_trust_region_max_ratio: float = field(
        default=10.0,
        metadata={"help": "Largest trust-region factor of 'target' and 'peak', >= 1 ('cap' never exceeds 1)."},
    )
    lr_trust_region_ema_decay: float = field(
        default=0.5,
        metadata={"help": "Decay of the bias-corrected moving average of the measured curvature KL/lr², in [0, 1)."},
    )
    lr_trust_region_curvature: str = field(
        default="per_update",
        metadata={
            "help": "'per_rate': the curvature KL/lr². 'per_update': KL/(lr² · mean u²), u = m̂/(√v̂ + ε) Adam's "
            "update, the next step sized with the last mean u², measured 1, 2, 4, … steps apart before every "
            "lr_trust_region_measure_steps-th (docs/rate_rule.md).",
            "choices": list(TRUST_REGION_CURVATURES),
        },
    )
    lr_trust_region_sample_size: int | None = field(
        default=8,
        metadata={
            "help": "Measure each step's KL on at most this many of the step's completions (over all processes, drawn "
            "uniformly without replacement, the same draw in any layout), so the measuring forward costs a bounded "
            "share of a step however large the batch. Per-completion KLs are heavy-tailed: smaller samples are "
            "noisy (benchmarks/README.md). None: every completion (always, for vision-language models)."
        },
    )
    lr_trust_region_measure_steps: int = field(
        default=16,
        metadata={
            "help": "Measure the step KL on every this-many-th step with a gradient (1: every step), and on every "
            "one until a step has moved the policy; the steps between use the curvature last measured (a jump of "
            "curvature is seen up to k − 1 steps later). log_step_kl without a trust region measures every step."
        },
    )
    log_step_kl: bool = field(
        default=False,
        metadata={
            "help": "Measure and log each step's KL(π_t ‖ π_{t+1}) (`oblr/step_kl`; one no-grad forward of the "
            "step's completions) without a trust region. Always on with lr_trust_region_kl."
        },
    )

    # Parameters that control robustness
    skip_nonfinite_steps: bool = field(
        default=True,
        metadata={
            "help": "Refuse an optimizer step whose loss, gradient norm or learning-rate factor is not finite (skipped "
            "and counted in `oblr/skipped_nonfinite_steps`) instead of writing NaN into the parameters."
        },
    )
    save_on_preemption: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM or SIGINT, finish the current optimizer step, save a resumable checkpoint and stop "
            "(a second SIGINT interrupts at once)."
        },
    )

    def validate_options(self) -> None:
        """Raise ValueError naming the field, its value and the allowed values for the first invalid option."""
        check_one_of("baseline_weights", self.baseline_weights, BASELINE_WEIGHTS)
        check_one_of("snr_estimator", self.snr_estimator, SNR_ESTIMATORS)
        check_one_of("baseline_estimator", self.baseline_estimator, BASELINE_ESTIMATORS)
        if not 0.0 <= self.baseline_shrinkage <= 1.0:
            raise invalid_value("baseline_shrinkage", self.baseline_shrinkage, "a float in [0, 1]")
        if not 0.0 <= self.snr_ema_decay < 1.0:
            raise invalid_value("snr_ema_decay", self.snr_ema_decay, "a float in [0, 1)")
        if isinstance(self.snr_warmup_steps, bool) or not isinstance(self.snr_warmup_steps, int) or self.snr_warmup_steps < 0:
            raise invalid_value("snr_warmup_steps", self.snr_warmup_steps, "an integer >= 0")
        if self.per_sample_batch_size is not None and (
            isinstance(self.per_sample_batch_size, bool)
            or not isinstance(self.per_sample_batch_size, int)
            or self.per_sample_batch_size < 1
        ):
            raise invalid_value("per_sample_batch_size", self.per_sample_batch_size, "None or an integer >= 1")
        if not 0.0 < self.snr_lr_floor <= 1.0:
            raise invalid_value("snr_lr_floor", self.snr_lr_floor, "a float in (0, 1]")
        check_one_of("snr_lr_reference", self.snr_lr_reference, SNR_LR_REFERENCES)
        if self.snr_calibration_steps is not None and (
            isinstance(self.snr_calibration_steps, bool)
            or not isinstance(self.snr_calibration_steps, int)
            or self.snr_calibration_steps < 2
        ):
            raise invalid_value("snr_calibration_steps", self.snr_calibration_steps, "None or an integer >= 2")
        if not 0.0 < self.snr_lr_min_ratio <= 1.0:
            raise invalid_value("snr_lr_min_ratio", self.snr_lr_min_ratio, "a float in (0, 1]")
        if not self.snr_lr_max_ratio >= 1.0 or not math.isfinite(self.snr_lr_max_ratio):
            raise invalid_value("snr_lr_max_ratio", self.snr_lr_max_ratio, "a finite float >= 1")
        if self.lr_trust_region_kl is not None and (
            isinstance(self.lr_trust_region_kl, bool) or not _number(self.lr_trust_region_kl)
            or self.lr_trust_region_kl <= 0
        ):
            raise invalid_value("lr_trust_region_kl", self.lr_trust_region_kl, "None or a finite float > 0")
        check_one_of("lr_trust_region_mode", self.lr_trust_region_mode, TRUST_REGION_MODES)
        if not 0.0 < self.lr_trust_region_min_ratio <= 1.0:
            raise invalid_value("lr_trust_region_min_ratio", self.lr_trust_region_min_ratio, "a float in (0, 1]")
        if not self.lr_trust_region_max_ratio >= 1.0 or not math.isfinite(self.lr_trust_region_max_ratio):
            raise invalid_value("lr_trust_region_max_ratio", self.lr_trust_region_max_ratio, "a finite float >= 1")
        if not 0.0 <= self.lr_trust_region_ema_decay < 1.0:
            raise invalid_value("lr_trust_region_ema_decay", self.lr_trust_region_ema_decay, "a float in [0, 1)")
        check_one_of("lr_trust_region_curvature", self.lr_trust_region_curvature, TRUST_REGION_CURVATURES)
        if self.lr_trust_region_sample_size is not None and (
            isinstance(self.lr_trust_region_sample_size, bool) or not isinstance(self.lr_trust_region_sample_size, int)
            or self.lr_trust_region_sample_size < 1
        ):
            raise invalid_value("lr_trust_region_sample_size", self.lr_trust_region_sample_size, "None or an integer >= 1")
        if isinstance(self.lr_trust_region_measure_steps, bool) or not isinstance(
            self.lr_trust_region_measure_steps, int
        ) or self.lr_trust_region_measure_steps < 1:
            raise invalid_value("lr_trust_region_measure_steps", self.lr_trust_region_measure_steps, "an integer >= 1")

    @property
    def resolved_snr_calibration_steps(self) -> int:
        """`snr_calibration_steps`, or max(20, ⌈2/(1 − β)⌉) when it is None."""
        if self.snr_calibration_steps is not None:
            return self.snr_calibration_steps
        return max(20, math.ceil(round(2.0 / (1.0 - self.snr_ema_decay), 6)))
