"""`OBLRPOConfig`: TRL's `GRPOConfig` plus the OBLR-PO baseline and learning-rate options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .options import TRAINER_VALUE_RULES, OBLRPOOptions, check_one_of, invalid_value

__all__ = ["OBLRPOConfig", "check_backend", "deepspeed_fp16"]

SCALE_REWARDS = ("none", "group", "batch")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def bf16_available(use_cpu: bool) -> bool:
    """Whether bf16 mixed precision runs here: on a GPU (or TPU) that has it, not on a CPU.

    GRPOConfig resolves `bf16=None` to True everywhere, which transformers then refuses on a machine without such an
    accelerator ("Your setup doesn't support bf16/gpu"), so `OBLRPOConfig()` could not train on a CPU at all.
    """
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return not use_cpu and (is_torch_bf16_gpu_available() or is_torch_xla_available())


def deepspeed_fp16(accelerator, args) -> bool:
    """Whether DeepSpeed runs this job in fp16: the Trainer's fp16, or `fp16.enabled` set in DeepSpeed's own config
    (the Trainer has resolved "auto" to its fp16 by now)."""
    plugin = accelerator.state.deepspeed_plugin
    enabled = (plugin.deepspeed_config.get("fp16") or {}).get("enabled", False) if plugin is not None else False
    return bool(args.fp16) or enabled is True


def check_backend(options: OBLRPOOptions, *, fsdp_version: int | None, deepspeed: bool, deepspeed_fp16: bool) -> None:
    """Refuse the OBLR-PO options a distributed backend cannot honour, naming what to change.

    Called twice: by `OBLRPOConfig` with the backend its fields and accelerate's environment announce (before any
    model loads), and by the trainer with the backend accelerate really set up.
    """
    per_sample_grads = options.baseline_weights == "exact" or (
        options.use_snr_lr and options.snr_estimator == "per_sample"
    )
    if per_sample_grads and deepspeed:
        raise ValueError(
            "Invalid configuration: baseline_weights='exact' and snr_estimator='per_sample' are not available under "
            "DeepSpeed (never verified with ZeRO's partitioned parameters). Allowed with DeepSpeed: baseline_weights "
            "in ('logit', 'length', 'uniform') and snr_estimator in ('cross_step', 'two_batch'); FSDP2 runs both."
        )
    if not options.use_snr_lr:
        return
    if deepspeed and deepspeed_fp16:
        raise ValueError(
            "Invalid configuration: fp16 under DeepSpeed with use_snr_lr=True. DeepSpeed's loss scale multiplies the "
            "gradients the SNR estimator reads and is not taken off them. Use bf16 (bf16=True, fp16=False), or "
            "use_snr_lr=False."
        )
    if fsdp_version == 1:
        raise ValueError(
            "Invalid configuration: the SNR learning-rate factor reads sharded gradients under FSDP2 only, and this "
            "run uses FSDP version 1. Set fsdp_version: 2 (accelerate config or fsdp_config; accelerate >= 1.7), or "
            "use_snr_lr=False."
        )
    if fsdp_version == 2 and options.snr_estimator == "two_batch":
        raise ValueError(
            "Invalid value for `snr_estimator`: 'two_batch' needs each process's micro-batch gradients, which FSDP2 "
            "reduce-scatters before anything can read them. Allowed values under FSDP2: 'cross_step' (the default), "
            "'per_sample'."
        )


@dataclass
class OBLRPOConfig(OBLRPOOptions, GRPOConfig):  # this base order keeps GRPOConfig's fields first: OBLRPOConfig("out")
    r"""
    Configuration class for [`OBLRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the ones below.

    OBLR-PO (Huang, Sheng, Zheng, [arXiv 2511.23310](https://huggingface.co/papers/2511.23310)) changes two things in
    GRPO: the advantage baseline is the variance-optimal, gradient-weighted one, and the learning rate of each
    optimizer step is scaled by a factor driven by the measured gradient signal-to-noise ratio. On top of the paper, a
    trust region measures the policy KL a step causes and sets the rate that moves the policy by δ (ours: the paper
    leaves its η_max unmeasured); in the default `"peak"` form that rate is the schedule's peak, within 0.01–10× the
    configured one, and the schedule and the SNR factor shape every step around it.

    Parameters:
        > Parameters that control the baseline

        baseline_weights (`str`, *optional*, defaults to `"logit"`):
            How the weight w_i ∝ ‖∇_θ log π(o_i|q)‖² of each completion is estimated:

            - `"logit"`: Σ_t ‖∂ log p_t(y_t)/∂z_t‖² = Σ_t (1 − 2 p_t(y_t) + Σ_v p_t(v)²), the squared gradient w.r.t.
              the logits, from one chunked no-grad forward per generation batch (reused when TRL already runs one).
            - `"length"`: the number of completion tokens (verl OPO's proxy). Free.
            - `"exact"`: the true squared gradient norm over the trainable parameters (LoRA parameters under PEFT),
              one extra forward and backward of the completions whose group's rewards differ (elsewhere no weight can
              change an advantage: NaN, logged as `oblr/weights/measured_frac`).
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
            SNR). Under non-reentrant gradient checkpointing (the default when `gradient_checkpointing` is on) that
            pass recomputes each layer in its backward as training does and holds one layer's activations at a time
            (on an H100 its peak memory stayed within 1.004× GRPO's step; the recompute makes it 30–55 % slower).
            Otherwise it holds every layer's activations for its chunk, so a smaller value trades speed for peak
            memory. `None`: as many sequences as fit (`estimators.ghost_norms.pass_bytes_per_row` estimates a
            sequence's share from above), never fewer than `per_device_train_batch_size` — on a CUDA device in 80 % of
            the memory the run has already needed and freed again (its peak so far minus what is allocated now):
            fewer, larger passes without raising the peak; on a CPU in half of the memory the system has available;
            elsewhere `per_device_train_batch_size`.

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
              (`estimators.sketch`; a few MB). Works with one micro-batch per step; steps that reuse the previous
              step's generation batch (`num_iterations > 1`, `steps_per_generation` > `gradient_accumulation_steps`)
              are not paired.
            - `"two_batch"`: from the squared norms of the micro-batch gradients and of the full-step gradient
              (McCandlish et al.'s estimator; completions as samples). Needs at least two micro-batches per optimizer
              step across processes (`gradient_accumulation_steps` × number of processes ≥ 2).
            - `"per_sample"`: from per-completion gradient norms of the loss (one extra batched forward and backward
              per micro-batch, `oblr_trl.estimators.ghost_norms`; one backward per completion with an entropy bonus).
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

        > Parameters that control the trust region of the step (docs/rate_rule.md)

        lr_trust_region_kl (`float` or `None`, *optional*, defaults to `0.005`):
            Target δ of the mean per-token KL(π_t ‖ π_{t+1}) one optimizer step may move the policy by. After a step
            (every `lr_trust_region_measure_steps`-th) the KL is measured on the step's completions (one no-grad
            forward, k3 estimator on the sampled tokens) and the curvature (per `lr_trust_region_curvature`)
            smoothed; η_δ is the rate that moves the policy by δ, used as `lr_trust_region_mode` says. Until a step
            has moved the policy, the step is a probe at `lr_trust_region_min_ratio` × the base rate (Adam's first
            step is its largest). A step whose gradient is zero (every group scored alike) moves the policy by Adam's
            momentum only: its KL is logged but not folded into the curvature, which it would understate. It composes
            with the rest as lr = scheduled · f_SNR · g_TR: the schedule (warm-up included) and the SNR factor set the
            base rate, the trust-region factor g_TR is computed on it; gradient clipping acts on the gradient before
            (the KL measures the clipped step); the curvature is saved in checkpoints and restored on resume; the KL
            is summed over every process's tokens; under FSDP2 and DeepSpeed the measuring forward runs on every
            process like a training forward. The default 0.005 is the median per-step KL of validation runs at GRPO's
            best rate on SmolLM2 sums (a + b), scaled to their schedule's peak: the KL of a well-tuned peak step. It
            costs one no-grad forward of at most 8 of the step's completions on the steps measured (the first steps
            1, 2, 4, 8 apart, then every 16th with a gradient) and, per update, a read of Adam's state after every
            step: 1.02× a GRPO step in a long run on 2 CPU cores, 1.10× over a run's first 7 steps
            (benchmarks/README.md). `None`: no trust region and no measuring forward (TRL's step).
        lr_trust_region_mode (`str`, *optional*, defaults to `"peak"`):
            How the trust-region rate η_δ sets the rate used, η_s = scheduled · f_SNR:

            - `"peak"`: η_s · clip(η_δ / η_peak, ...) with η_peak the schedule's peak (`learning_rate`) — the paper's
              η_t = η_max · f_t with η_max measured: η_δ replaces the configured peak (within
              [`lr_trust_region_min_ratio`, `lr_trust_region_max_ratio`] × it), and the schedule's shape (warm-up,
              decay) and the SNR factor act on every step. δ is the KL aimed at at the peak; a step below it aims at
              δ·(η/η̂_max)² (`oblr/step_kl_target`). The probe's reading (Adam's first step, which overstates the
              curvature) is replaced by the next step's, which is measured too.
            - `"target"`: clip(η_δ, `lr_trust_region_min_ratio` · η_s, `lr_trust_region_max_ratio` · η_s). Inside
              the bounds the rate used is η_δ: the schedule and the SNR factor cancel, and the rate is constant
              between measurements. A step with a zero gradient, which Adam's momentum alone drives, is never raised
              above η_s.
            - `"cap"`: min(η_s, η_δ) — the configured rate becomes a ceiling; it only ever lowers the rate.
        lr_trust_region_min_ratio (`float`, *optional*, defaults to `0.01`):
            Smallest trust-region factor, in (0, 1]: a spike of curvature cannot stall training. Also the factor of
            the probe, the first step(s), before any curvature is measured.
        lr_trust_region_max_ratio (`float`, *optional*, defaults to `10.0`):
            Largest trust-region factor of `"target"` and `"peak"`, ≥ 1 (`"cap"` never exceeds 1).
        lr_trust_region_ema_decay (`float`, *optional*, defaults to `0.5`):
            Decay of the bias-corrected moving average of the curvature KL/lr², in [0, 1).
        lr_trust_region_curvature (`str`, *optional*, defaults to `"per_update"`):
            How the trust region reads and predicts the curvature:

            - `"per_update"`: c = KL/(lr² · ū²), ū² the mean square of the step's update per unit rate
              u = m̂/(√v̂ + ε) (read from the optimizer's state after the step, logged as `oblr/update_rms`), the next
              step sized with the last gradient step's ū²; measured on the steps with a gradient 1, 2, 4, … apart
              before every `lr_trust_region_measure_steps`-th. Adam's first update is sign(g) (ū² = 1) and ū² shrinks
              over the first tens of steps as v̂ accumulates gradients whose signs disagree, which KL/lr² alone reads
              as a curvature that keeps falling, and the curvature falls fastest early: replayed on validation runs
              that measured every step (SmolLM2 a + b), steps land at a median 0.79× the KL aimed at (quartiles
              0.43–1.70) against 0.17× per unit rate measured every 16th step
              (benchmarks/results/stability/kl_prediction.md). An optimizer without Adam's state reads as
              `"per_rate"` with the short gaps.
            - `"per_rate"`: c = KL/lr², measured every `lr_trust_region_measure_steps`-th step with a gradient. Its
              steps land at about a tenth of the KL aimed at.
        lr_trust_region_sample_size (`int` or `None`, *optional*, defaults to `8`):
            Measure each step's KL on at most this many of the step's completions (over all processes, drawn uniformly
            without replacement, the same draw in any process layout); a step with no more completions than this is
            measured whole, exactly as with `None`. The measuring forward then costs a bounded share of a step however
            large the batch (on an H100 the whole-step forward added 1.21× to the trainer's part of a 64-completion
            step). The default 8 is the number of completions a step of the runs the trust region was validated on
            (SmolLM2 a + b, every step measured whole), so a larger step is measured at least as precisely relative to
            the policy's expected KL as those were. Per-completion KLs are heavy-tailed (one completion often holds
            most of a step's KL): smaller samples are noisy, measured in
            benchmarks/results/overhead/step_kl_sampling.md. `None`: every completion. Vision-language models always
            measure every completion.
        lr_trust_region_measure_steps (`int`, *optional*, defaults to `16`):
            Measure the step KL on the first step and then on every this-many-th optimizer step with a gradient
            after the last one measured (1: every step). The trust region sizes the steps in between with the
            curvature it last measured: k saves k − 1 of every k measuring forwards, and a jump of curvature is seen
            up to k − 1 steps later. A step whose gradient is zero is not measured when k > 1; until a measured step
            has moved the policy (a warm-up's first step, at rate 0, does not) every step with a gradient is. The
            default 16 held every cell of the a + b grid (1e-6 … 3e-4, 5 seeds, 10 at 1e-6 and 1e-5) as measuring
            every 8th step did (regret difference −0.003 [−0.023, +0.017]), for half its measuring forwards
            (CHANGELOG.md). `log_step_kl` without a trust region measures every step.
        log_step_kl (`bool`, *optional*, defaults to `False`):
            Measure and log each step's KL (`oblr/step_kl`) without a trust region (one no-grad forward of the
            step's completions). Always on with `lr_trust_region_kl`.

        > Parameters that control robustness

        skip_nonfinite_steps (`bool`, *optional*, defaults to `True`):
            Refuse an optimizer step whose loss, gradient norm or learning-rate factor is not finite (the step is
            skipped, the optimizer state untouched, and `oblr/skipped_nonfinite_steps` counts it) instead of writing
            NaN into the parameters.
        save_on_preemption (`bool`, *optional*, defaults to `True`):
            On SIGTERM or SIGINT, finish the current optimizer step, save a resumable checkpoint and stop (a second
            SIGINT interrupts at once).

    > [!NOTE]
    > `scale_rewards` keeps GRPOConfig's default, `"group"` (advantages divided by the group's reward std), although
    > the variance-optimal baseline of the theory has no std scaling: over a grid of learning rates from the best one
    > to 30× it (benchmarks/results/stability, synthetic testbed, 100 paired seeds) OBLR-PO without it lost 0.008
    > [0.004, 0.012] of final score against GRPO, and with it was level (+0.001 [−0.002, +0.004]); at the best rate
    > the two are level. `"none"` is the theory's choice.
    >
    > One default differs from [`~trl.GRPOConfig`]:
    > - `bf16`: `None` resolves to what the machine supports (True on a GPU with bf16, False, i.e. fp32, on a CPU or
    >   with `use_cpu=True`) instead of always True, which transformers refuses on a CPU. An explicit `bf16=True`
    >   behaves as in GRPOConfig.
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Alias of `activation_checkpointing` (TRL's GRPOConfig default, True, applies when neither is set)."
        },
    )

    def __post_init__(self):
        # TRL sets the old name's default to True, which makes transformers >= 5.2x warn that the user passed a
        # deprecated name on every config; resolve the alias here so the warning is left to nobody.
        if "activation_checkpointing" in self.__dataclass_fields__ and self.activation_checkpointing is None:
            self.activation_checkpointing = True if self.gradient_checkpointing is None else self.gradient_checkpointing
        elif self.gradient_checkpointing is None:
            self.gradient_checkpointing = True
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        check_one_of("scale_rewards", scale, SCALE_REWARDS)
        check_one_of("multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
        self.validate_options()
        self._validate_trainer_values()
        if self.bf16 is None and not self.fp16:
            self.bf16 = bf16_available(self.use_cpu)
        super().__post_init__()
        self._validate_batch_layout()
        check_backend(self, fsdp_version=self._announced_fsdp_version(), deepspeed=self.deepspeed is not None,
                      deepspeed_fp16=bool(self.fp16))

    def _announced_fsdp_version(self) -> int | None:
        """The FSDP version this run will use, as far as the config and `accelerate launch`'s environment tell."""
        if self.fsdp:
            return int(self.fsdp_config.get("version", 2))  # transformers' default
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            return int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's default
        return None

    def _validate_trainer_values(self) -> None:
        """The GRPOConfig/TrainingArguments values that torch or the Trainer would only refuse after the model loads."""
        for name, allowed, valid in TRAINER_VALUE_RULES:
            value = getattr(self, name)
            if isinstance(value, bool) or not valid(value):
                raise invalid_value(name, value, allowed)

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
