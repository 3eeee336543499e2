"""`OBLRPOConfig`: TRL's `GRPOConfig` plus the OBLR-PO baseline and learning-rate options."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

__all__ = ["OBLRPOConfig"]

BASELINE_WEIGHTS = ("logit", "length", "exact", "uniform")
SNR_ESTIMATORS = ("two_batch", "per_sample")
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
            Multiply the scheduled learning rate of every optimizer step by f_t = N·SNR/(1 + N·SNR) ∈ [floor, 1],
            with SNR = ‖μ‖²/tr Σ the measured gradient signal-to-noise ratio and N the completions per step.
        snr_estimator (`str`, *optional*, defaults to `"two_batch"`):
            How ‖μ‖² and tr Σ are measured each step:

            - `"two_batch"`: from the squared norms of the micro-batch gradients and of the full-step gradient. Needs
              at least two micro-batches per optimizer step across processes (`gradient_accumulation_steps` × number
              of processes ≥ 2); with one, the trainer refuses to start rather than silently leave the rate as is.
            - `"per_sample"`: from per-completion gradient norms of the loss (one extra batched forward and backward
              per micro-batch, `oblr_trl.ghost_norms`; one backward per completion with an entropy bonus).
        snr_ema_decay (`float`, *optional*, defaults to `0.9`):
            Decay β of the bias-corrected moving averages that smooth the ‖μ‖² and tr Σ estimates, in [0, 1).
        snr_warmup_steps (`int`, *optional*, defaults to `5`):
            Number of optimizer steps measured before the factor is applied; until then it is 1.
        snr_lr_floor (`float`, *optional*, defaults to `0.1`):
            Smallest factor, in (0, 1]: a flat reward landscape (no signal) cannot stall training.

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
            "help": "Multiply the scheduled learning rate of every optimizer step by f_t = N·SNR/(1 + N·SNR) in "
            "[snr_lr_floor, 1], SNR = ‖μ‖²/tr Σ measured from the gradients, N the completions per step."
        },
    )
    snr_estimator: str = field(
        default="two_batch",
        metadata={
            "help": "Estimator of ‖μ‖² and tr Σ: 'two_batch' (micro-batch vs full-step gradient norms; needs "
            "gradient_accumulation_steps × processes >= 2) or 'per_sample' (per-completion gradient norms of the loss, "
            "one extra batched forward and backward per micro-batch).",
            "choices": list(SNR_ESTIMATORS),
        },
    )
    snr_ema_decay: float = field(
        default=0.9,
        metadata={"help": "Decay of the bias-corrected moving averages of the ‖μ‖² and tr Σ estimates, in [0, 1)."},
    )
    snr_warmup_steps: int = field(
        default=5,
        metadata={"help": "Optimizer steps measured before the SNR factor is applied (it is 1 until then)."},
    )
    snr_lr_floor: float = field(
        default=0.1,
        metadata={"help": "Smallest SNR learning-rate factor, in (0, 1]: no signal cannot stall training."},
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
