"""`OBLRPOConfig`: TRL's `GRPOConfig` plus the OBLR-PO baseline and learning-rate options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from .baselines import BASELINE_ESTIMATORS

__all__ = ["OBLRPOConfig"]

BASELINE_WEIGHTS = ("logit", "length", "exact", "uniform")
SNR_ESTIMATORS = ("cross_step", "two_batch", "per_sample")
SNR_LR_REFERENCES = ("calibrated", "absolute")
SCALE_REWARDS = ("none", "group", "batch")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _invalid(name: str, value, allowed: str) -> ValueError:
    return ValueError(f"Invalid value for `{name}`: {value!r}. Allowed values: {allowed}.")


def _one_of(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _invalid(name, value, ", ".join(repr(c) for c in choices))


@dataclass
class OBLRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`OBLRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the ones below.

    OBLR-PO (Huang, Sheng, Zheng, [arXiv 2511.23310](https://huggingface.co/papers/2511.23310)) changes two things in
    GRPO: the advantage baseline is the variance-optimal, gradient-weighted one, and the learning rate of each
    optimizer step is scaled by a factor driven by the measured gradient signal-to-noise ratio.

    Parameters:
        > Parameters that control the baseline

        baseline_weights (`str`, *optional*, defaults to `"logit"`):
            How the weight w_i ∝ ‖∇_θ log π(o_i|q)‖² of each completion is estimated:

            - `"logit"`: Σ_t ‖∂ log p_t(y_t)/∂z_t‖² = Σ_t (1 − 2 p_t(y_t) + Σ_v p_t(v)²), the squared gradient w.r.t.
              the logits, from one chunked no-grad forward per generation batch (reused when TRL already runs one).
            - `"length"`: the number of completion tokens (verl OPO's proxy). Free.
            - `"exact"`: the true squared gradient norm over the trainable parameters (LoRA parameters under PEFT).
            - `"uniform"`: 1 for every completion, which reduces the baseline to RLOO's (for ablations).

            The weight is that of completion i's actual contribution to the loss gradient: under a per-completion
            token mean (`loss_type` `"grpo"`, `"sapo"`) each token's term is divided by the completion's length L_i,
            so `logit` and `length` weights are divided by L_i² and `exact` ones measure Σ_t log p_t / L_i.
        baseline_estimator (`str`, *optional*, defaults to `"pooled_slope"`):
            How b* = E[w r]/E[w] is estimated from the group (leave-one-out keeps every one of them unbiased):

            - `"weighted"`: Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j, the paper's estimator (the default before measurement:
              on SmolLM2 after 30 steps its noise ÷ signal was 1.037 [1.006, 1.060] × RLOO's, worse than RLOO).
            - `"shrunk"`: λ·(the weighted mean) + (1 − λ)·(the uniform mean) of the others, λ = `baseline_shrinkage`;
              less noise when the weights spread widely.
            - `"pooled_slope"`: p̂₋ᵢ + ρ̂·v̂₋ᵢ, the mean and variance of the other rewards and a slope ρ̂ fitted on earlier
              batches (weighted least squares, moving average; saved in checkpoints; logged as
              `oblr/baseline_slope`). ρ̂ = 0 is RLOO. The default: the lowest noise ÷ signal of every unbiased estimate
              on SmolLM2-135M (benchmarks/results/variance: 0.943 [0.875, 0.997] × RLOO's on the base model, 0.993
              [0.973, 1.015] after 30 steps), where the weights enter through ρ̂ only.
        baseline_shrinkage (`float`, *optional*, defaults to `0.5`):
            λ of `"shrunk"`, in [0, 1]: 1 is `"weighted"`, 0 the uniform mean (RLOO).
        leave_one_out (`bool`, *optional*, defaults to `True`):
            Leave completion i out of its own baseline, b_i = Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j, which keeps the gradient
            estimator unbiased. With `False`, one baseline per group, Σ_j w_j r_j / Σ_j w_j (verl's OPO/OTB form).
        importance_weighted_baseline (`bool`, *optional*, defaults to `True`):
            Under vLLM importance-sampling correction, weight each token's contribution to w_i by ρ_t², the square of
            the IS ratio that multiplies its loss term, so that the baseline is optimal for the corrected estimator.
            Has no effect without vLLM IS correction, nor on `"uniform"` weights.
        per_sample_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Sequences per forward and backward of the per-sample gradient norms (`"exact"` weights, `"per_sample"`
            SNR). That pass runs without gradient checkpointing and holds every layer's activations for its chunk, so
            a smaller value trades speed for peak memory. `None` uses `per_device_train_batch_size`.

        > Parameters that control the SNR-driven learning rate

        use_snr_lr (`bool`, *optional*, defaults to `True`):
            Scale the scheduled learning rate of every optimizer step by a factor driven by the measured gradient
            signal-to-noise ratio SNR = ‖μ‖²/tr Σ, through the paper's bound-optimal f_t = N·SNR/(1 + N·SNR) (N the
            prompts per step). How f_t is used: `snr_lr_reference`.
        snr_lr_reference (`str`, *optional*, defaults to `"calibrated"`):
            What the configured learning rate means:

            - `"calibrated"`: the rate at the SNR measured early in training. The paper's rule η_t = η_max · f_t with
              η_max calibrated so that the scheduled rate is the rate at the reference f_ref:
              η_t = η_sched(t) · clip(f_{t−1} / f_ref, snr_lr_min_ratio, snr_lr_max_ratio). f_ref is measured over
              `snr_calibration_steps` steps after the learning-rate warm-up (and `snr_warmup_steps`), and the factor
              is 1 until it is resolved (mean ‖μ‖² estimate at least 2 standard errors above 0; logged as
              `snr/resolved`). A rate tuned for GRPO stays the rate used while the SNR stays where it was; the step
              grows when the signal gets clearer and shrinks when it fades.
            - `"absolute"`: the paper's literal reading, the configured rate is η_max: η_t = η_sched(t) · max(f_{t−1},
              snr_lr_floor). Since f_t < 1 always and a tuned rate already reflects typical noise, this cuts a GRPO
              rate by 1/f (measured: 10× on SmolLM2 with 8 completions a step); raise the rate to match.
        snr_estimator (`str`, *optional*, defaults to `"cross_step"`):
            How ‖μ‖² and tr Σ are measured each step:

            - `"cross_step"`: from the inner product of two consecutive, independently generated step gradients,
              ‖μ‖² ≈ ⟨G_t, G_{t−1}⟩ and tr Σ ≈ n(‖G_t‖² − ⟨G_t, G_{t−1}⟩) with the prompt (group) as the sample unit,
              so between-prompt variance counts as noise. The previous gradient is kept as a random-projection sketch
              (`oblr_trl.sketch`; a few MB). Works with one micro-batch per step; steps that reuse the previous
              step's generation batch (`num_iterations > 1`, `steps_per_generation` > `gradient_accumulation_steps`)
              are not paired.
            - `"two_batch"`: from the squared norms of the micro-batch gradients and of the full-step gradient
              (McCandlish et al.'s estimator; completions as samples). Needs at least two micro-batches per optimizer
              step across processes (`gradient_accumulation_steps` × number of processes ≥ 2).
            - `"per_sample"`: from per-completion gradient norms of the loss (one extra batched forward and backward
              per micro-batch, `oblr_trl.ghost_norms`; one backward per completion with an entropy bonus).
        snr_ema_decay (`float`, *optional*, defaults to `0.9`):
            Decay β of the bias-corrected moving averages that smooth the ‖μ‖² and tr Σ estimates, in [0, 1).
        snr_warmup_steps (`int`, *optional*, defaults to `5`):
            Optimizer steps measured before the estimate is used: the factor is 1 until then (`"absolute"`), the
            calibration window opens after it and after the learning-rate warm-up (`"calibrated"`).
        snr_calibration_steps (`int` or `None`, *optional*, defaults to `None`):
            Smallest number of steps in the calibration window of `"calibrated"`; `None` uses max(20, ⌈2/(1 − β)⌉).
        snr_lr_min_ratio (`float`, *optional*, defaults to `1.0`):
            Smallest calibrated factor f_t / f_ref, in (0, 1]. The default never takes the rate below the scheduled
            one: on the synthetic testbed (benchmarks/results/learning_synthetic, 100 paired seeds, every method at
            its best rate) letting it fall to 0.5 cost 0.006 [0.003, 0.009] of area under the held-out curve against
            GRPO, while [1, 2] was level with it.
        snr_lr_max_ratio (`float`, *optional*, defaults to `2.0`):
            Largest calibrated factor f_t / f_ref, ≥ 1.
        snr_lr_floor (`float`, *optional*, defaults to `0.1`):
            Smallest factor of `"absolute"`, in (0, 1]: a flat reward landscape (no signal) cannot stall training.

        > Parameters that control robustness

        skip_nonfinite_steps (`bool`, *optional*, defaults to `True`):
            Refuse an optimizer step whose loss, gradient norm or learning-rate factor is not finite (the step is
            skipped, the optimizer state untouched, and `oblr/skipped_nonfinite_steps` counts it) instead of writing
            NaN into the parameters.
        save_on_preemption (`bool`, *optional*, defaults to `True`):
            On SIGTERM or SIGINT, finish the current optimizer step, save a resumable checkpoint and stop (a second
            SIGINT interrupts at once).

    > [!NOTE]
    > Defaults that differ from [`~trl.GRPOConfig`], because the theory says so:
    > - `scale_rewards`: `"none"` instead of `"group"`. The variance-optimal baseline has no std scaling, and dividing
    >   by a std that depends on r_i biases the estimator.
    """

    # Defaults that follow the theory where TRL's differ
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Scaling of the advantages: 'none' (default here: the variance-optimal baseline of the theory has "
            "no std scaling, and a std that depends on r_i biases the estimator), 'group' (TRL's default: divide by "
            "the group's reward std) or 'batch' (divide by the batch's reward std).",
            "choices": list(SCALE_REWARDS),
        },
    )

    # Parameters that control the baseline
    baseline_weights: str = field(
        default="logit",
        metadata={
            "help": "Estimator of the per-completion weight w_i ∝ ‖∇_θ log π(o_i|q)‖² used by the baseline: 'logit' "
            "(Σ_t ‖∂ log p_t(y_t)/∂z_t‖², one chunked no-grad forward per generation batch), 'length' (number of "
            "completion tokens, free), 'exact' (true squared gradient norm over the trainable parameters) or "
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
            "'per_sample' SNR). That pass runs without gradient checkpointing and holds every layer's activations "
            "for its chunk, so a smaller value trades speed for peak memory. None: per_device_train_batch_size."
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

    def __post_init__(self):
        self._validate_oblr_fields()
        super().__post_init__()
        self._validate_batch_layout()

    def _validate_oblr_fields(self) -> None:
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        _one_of("scale_rewards", scale, SCALE_REWARDS)
        _one_of("multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
        _one_of("baseline_weights", self.baseline_weights, BASELINE_WEIGHTS)
        _one_of("snr_estimator", self.snr_estimator, SNR_ESTIMATORS)
        _one_of("baseline_estimator", self.baseline_estimator, BASELINE_ESTIMATORS)
        if not 0.0 <= self.baseline_shrinkage <= 1.0:
            raise _invalid("baseline_shrinkage", self.baseline_shrinkage, "a float in [0, 1]")
        if not 0.0 <= self.snr_ema_decay < 1.0:
            raise _invalid("snr_ema_decay", self.snr_ema_decay, "a float in [0, 1)")
        if isinstance(self.snr_warmup_steps, bool) or not isinstance(self.snr_warmup_steps, int) or self.snr_warmup_steps < 0:
            raise _invalid("snr_warmup_steps", self.snr_warmup_steps, "an integer >= 0")
        if self.per_sample_batch_size is not None and (
            isinstance(self.per_sample_batch_size, bool)
            or not isinstance(self.per_sample_batch_size, int)
            or self.per_sample_batch_size < 1
        ):
            raise _invalid("per_sample_batch_size", self.per_sample_batch_size, "None or an integer >= 1")
        if not 0.0 < self.snr_lr_floor <= 1.0:
            raise _invalid("snr_lr_floor", self.snr_lr_floor, "a float in (0, 1]")
        _one_of("snr_lr_reference", self.snr_lr_reference, SNR_LR_REFERENCES)
        if self.snr_calibration_steps is not None and (
            isinstance(self.snr_calibration_steps, bool)
            or not isinstance(self.snr_calibration_steps, int)
            or self.snr_calibration_steps < 2
        ):
            raise _invalid("snr_calibration_steps", self.snr_calibration_steps, "None or an integer >= 2")
        if not 0.0 < self.snr_lr_min_ratio <= 1.0:
            raise _invalid("snr_lr_min_ratio", self.snr_lr_min_ratio, "a float in (0, 1]")
        if not self.snr_lr_max_ratio >= 1.0 or not math.isfinite(self.snr_lr_max_ratio):
            raise _invalid("snr_lr_max_ratio", self.snr_lr_max_ratio, "a finite float >= 1")

    @property
    def resolved_snr_calibration_steps(self) -> int:
        """`snr_calibration_steps`, or max(20, ⌈2/(1 − β)⌉) when it is None."""
        if self.snr_calibration_steps is not None:
            return self.snr_calibration_steps
        return max(20, math.ceil(round(2.0 / (1.0 - self.snr_ema_decay), 6)))

    def _validate_batch_layout(self) -> None:
        if not self.use_snr_lr:
            return
        micro_batches = self.gradient_accumulation_steps * self.world_size
        samples = micro_batches * self.per_device_train_batch_size
        if self.snr_estimator == "two_batch" and micro_batches < 2:
            raise ValueError(
                "Invalid value for `snr_estimator`: 'two_batch' needs at least two micro-batches per optimizer step "
                f"(gradient_accumulation_steps × processes >= 2), got {self.gradient_accumulation_steps} × "
                f"{self.world_size}. With one, only one batch size is observable and the SNR cannot be measured. "
                "Allowed: set gradient_accumulation_steps >= 2 (halve per_device_train_batch_size to keep the "
                "step size), snr_estimator='per_sample', or use_snr_lr=False."
            )
        if self.snr_estimator == "per_sample" and samples < 2:
            raise ValueError(
                "Invalid value for `snr_estimator`: 'per_sample' needs at least two completions per optimizer step, "
                f"got {samples}. Allowed: a larger per_device_train_batch_size or gradient_accumulation_steps, or "
                "use_snr_lr=False."
            )
