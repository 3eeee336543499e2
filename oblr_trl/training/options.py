"""`OBLRPOOptions`: the options OBLR-PO adds to TRL's `GRPOConfig`, and their validation.

Kept apart from `OBLRPOConfig` and free of torch/transformers imports, so that `oblr-trl train --help` and config
checks answer at once; `OBLRPOConfig` (oblr_trl.training.config) combines these fields with every GRPOConfig field and
documents them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..estimators.choices import (
    BASELINE_ESTIMATORS,
    BASELINE_WEIGHTS,
    SNR_ESTIMATORS,
    SNR_LR_REFERENCES,
    check_one_of,
    invalid_value,
)

__all__ = ["OBLRPOOptions", "OPTION_VALUE_RULES", "SECTIONS", "TRAINER_VALUE_RULES", "check_one_of", "invalid_value",
           "parameters_doc"]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _count(value, least: int) -> bool:
    return isinstance(value, int) and value >= least


# (field, allowed values, check) of the GRPOConfig/TrainingArguments numbers that GRPOConfig takes and that torch's
# AdamW, the Trainer's step count or schedule, its data loader or generation refuse, or run wrong, only once the model
# has loaded (tests/test_trl_fields.py shows each late failure and that GRPOConfig takes each value refused here). A
# check TrainingArguments makes itself is left to it: the sign of warmup_steps.
TRAINER_VALUE_RULES = (
    ("learning_rate", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("weight_decay", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("adam_beta1", "a float in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    ("adam_beta2", "a float in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    ("adam_epsilon", "a finite float >= 0", lambda v: _number(v) and v >= 0),
    ("warmup_steps", "a finite number >= 0", _number),
    ("max_steps", "an integer >= 1, or a negative one (train num_train_epochs)",
     lambda v: isinstance(v, int) and v != 0),
    ("num_train_epochs", "a finite float > 0", lambda v: _number(v) and v > 0),
    ("per_device_train_batch_size", "an integer >= 1", lambda v: _count(v, 1)),
    ("gradient_accumulation_steps", "an integer >= 1", lambda v: _count(v, 1)),
    ("max_completion_length", "an integer >= 1", lambda v: _count(v, 1)),
    ("temperature", "a finite float > 0", lambda v: _number(v) and v > 0),
    ("top_p", "a float in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    ("beta", "a finite float >= 0", lambda v: _number(v) and v >= 0),
)


# the headings of `OBLRPOConfig`'s parameters ("> Parameters that control …") and their fields, in order
SECTIONS = {
    "the baseline": ("baseline_weights", "baseline_estimator", "leave_one_out", "per_sample_batch_size"),
    "the SNR-driven learning rate": ("use_snr_lr", "snr_lr_reference", "snr_estimator"),
    "the trust region of the step": ("lr_trust_region_kl", "lr_trust_region_sample_size", "log_step_kl"),
    "robustness": ("skip_nonfinite_steps", "save_on_preemption"),
}


def _option(default, help: str, choices: tuple[str, ...] | None = None):
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    return field(default=default, metadata=metadata)


@dataclass
class OBLRPOOptions:
    """The OBLR-PO fields of `OBLRPOConfig`; each field's `help` is its one text (the docstring of `OBLRPOConfig`,
    `oblr-trl train --help` and docs/configuration.md are written from it)."""

    baseline_weights: str = _option(
        "logit",
        "Estimate of each completion's weight w_i ∝ ‖∇_θ log π(o_i|q)‖² in the baseline: 'logit' (Σ_t ‖∂ log "
        "p_t(y_t)/∂z_t‖², one no-grad forward per generation batch, reused where TRL runs one), 'length' (the token "
        "count, free), 'exact' (the squared gradient norm over the trainable parameters, one extra forward and "
        "backward) or 'uniform' (all equal: with baseline_estimator='weighted', RLOO's baseline).", BASELINE_WEIGHTS)
    baseline_estimator: str = _option(
        "pooled_slope",
        "Estimate of b* = E[w r]/E[w] from the group: 'pooled_slope' (the other rewards' mean + ρ̂ × their variance, "
        "ρ̂ fitted on earlier batches; less noise) or 'weighted' (Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j, the paper's). With "
        "leave_one_out neither reads the completion's own reward; scale_rewards='group' (TRL's default) then divides by "
        "the group's std, which does.", BASELINE_ESTIMATORS)
    leave_one_out: bool = _option(
        True,
        "Leave completion i out of its own baseline, so that the baseline does not read the completion's own reward "
        "(scale_rewards='group' still does, through the group's std). False: one baseline over "
        "the whole group (verl's OPO; with baseline_weights='uniform', GRPO's group mean).")
    per_sample_batch_size: int | None = _option(
        None,
        "Sequences per forward and backward of the per-sample gradient norms ('exact' weights, 'per_sample' SNR): a "
        "smaller value trades speed for memory. None: as many as fit (CUDA: under the run's peak memory so far; CPU: "
        "half the free memory).")

    use_snr_lr: bool = _option(
        True,
        "Scale each optimizer step's rate by a factor of the measured gradient SNR = ‖μ‖²/tr Σ, through f_t = "
        "N·SNR/(1 + N·SNR) (see snr_lr_reference). False: no SNR factor.")
    snr_lr_reference: str = _option(
        "calibrated",
        "'calibrated': lr = scheduled × clip(f_t / f_ref, 1, 2), f_ref measured early in training (factor 1 until "
        "then), so the configured rate is the rate at the early SNR. 'absolute': the paper's rule, lr = scheduled × "
        "max(f_t, 0.1), the configured rate its η_max.", SNR_LR_REFERENCES)
    snr_estimator: str = _option(
        "cross_step",
        "Estimator of ‖μ‖² and tr Σ: 'cross_step' (consecutive steps' independently generated gradients, prompts as "
        "samples; one micro-batch is enough), 'two_batch' (micro-batch vs full-step gradient norms; needs "
        "gradient_accumulation_steps × processes >= 2) or 'per_sample' (per-completion gradient norms, one extra "
        "forward and backward per micro-batch).", SNR_ESTIMATORS)

    lr_trust_region_kl: float | None = _option(
        0.005,
        "δ, the mean per-token KL(π_t ‖ π_{t+1}) a step at the schedule's peak moves the policy by: the peak rate is "
        "measured (within 0.01–10× learning_rate) and your schedule and the SNR factor shape every step around it "
        "(docs/rate_rule.md). Costs a no-grad forward of a few completions every 16th step. None: no trust region.")
    lr_trust_region_sample_size: int | None = _option(
        8,
        "Measure a step's KL on at most this many of its completions (over all processes, the same draw in any "
        "layout), so the measuring forward costs a bounded share of a step however large the batch; fewer is "
        "noisier. None: every completion (always, for vision-language models).")
    log_step_kl: bool = _option(
        False,
        "Measure and log every step's KL(π_t ‖ π_{t+1}) (`oblr/step_kl`, one no-grad forward of the step's "
        "completions) without a trust region, to see how far GRPO's steps move the policy. Always on with "
        "lr_trust_region_kl.")

    skip_nonfinite_steps: bool = _option(
        True,
        "Refuse an optimizer step whose loss, gradient norm or learning-rate factor is not finite (skipped and "
        "counted in `oblr/skipped_nonfinite_steps`) instead of writing NaN into the parameters.")
    save_on_preemption: bool = _option(
        True,
        "On SIGTERM or SIGINT, finish the current optimizer step, save a resumable checkpoint and stop (a second "
        "SIGINT interrupts at once).")

    def validate_options(self) -> None:
        """Raise ValueError naming the field, its value and the allowed values for the first invalid option."""
        for spec in fields(OBLRPOOptions):  # not the GRPOConfig fields of an `OBLRPOConfig`
            if "choices" in spec.metadata:
                check_one_of(spec.name, getattr(self, spec.name), tuple(spec.metadata["choices"]))
        for name, allowed, valid in OPTION_VALUE_RULES:
            value = getattr(self, name)
            if isinstance(value, bool) or not valid(value):
                raise invalid_value(name, value, allowed)


# (field, allowed values, check) of the options that are numbers
OPTION_VALUE_RULES = (
    ("per_sample_batch_size", "None or an integer >= 1", lambda v: v is None or _count(v, 1)),
    ("lr_trust_region_kl", "None or a finite float > 0", lambda v: v is None or (_number(v) and v > 0)),
    ("lr_trust_region_sample_size", "None or an integer >= 1", lambda v: v is None or _count(v, 1)),
)


def _type_name(annotation: str) -> str:
    return " or ".join(f"`{name.strip()}`" for name in annotation.split("|"))


def parameters_doc() -> str:
    """The "Parameters:" section of `OBLRPOConfig`'s docstring, in TRL's format, written from each field's `help`."""
    import textwrap

    lines = ["Parameters:"]
    specs = {spec.name: spec for spec in fields(OBLRPOOptions)}
    for section, names in SECTIONS.items():
        lines += [f"    > Parameters that control {section}", ""]
        for spec in (specs[name] for name in names):
            default = f'"{spec.default}"' if isinstance(spec.default, str) else spec.default
            lines.append(f"    {spec.name} ({_type_name(spec.type)}, *optional*, defaults to `{default}`):")
            lines += textwrap.wrap(spec.metadata["help"], 116, initial_indent="        ", subsequent_indent="        ")
        lines.append("")
    return "\n".join(f"    {line}" if line else "" for line in lines).strip()
