"""`OBLRPOConfig`: TRL's `GRPOConfig` plus the OBLR-PO baseline and learning-rate options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .options import TRAINER_VALUE_RULES, OBLRPOOptions, check_one_of, invalid_value, parameters_doc

__all__ = ["OBLRPOConfig", "check_backend", "deepspeed_fp16"]

# The values GRPOTrainer branches on when it computes the first advantages, after the model has loaded and generated;
# GRPOConfig states them only in its help and refuses none. tests/test_trl_fields.py compares them with TRL's code.
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
    """
    Configuration class for [`OBLRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the ones below.

    OBLR-PO (Huang, Sheng, Zheng, [arXiv 2511.23310](https://huggingface.co/papers/2511.23310)) changes two things in
    GRPO: the advantage baseline is weighted by each completion's gradient (by default estimated as RLOO's
    leave-one-out mean plus a shift fitted on earlier batches), and the learning rate of each
    optimizer step is scaled by a factor driven by the measured gradient signal-to-noise ratio. On top of the paper, a
    trust region measures the policy KL a step causes and sets the rate that moves the policy by δ (ours: the paper
    leaves its η_max unmeasured); in the default `"peak"` form that rate is the schedule's peak, within 0.01–10× the
    configured one, and the schedule and the SNR factor shape every step around it.

    {parameters}

    > [!NOTE]
    > `scale_rewards` keeps GRPOConfig's default, `"group"` (advantages divided by the group's reward std), although
    > the variance-optimal baseline of the theory has no std scaling: over a grid of learning rates from the best one
    > to 30× it (benchmarks/results/stability, synthetic testbed, 100 paired seeds) OBLR-PO without it lost 0.008
    > [0.004, 0.012] of final score against GRPO, and with it was level (+0.001 [−0.002, +0.004], inside the
    > benchmarks' ±0.05 equivalence margin); at the best rate the two are level within that margin too. `"none"` is
    > the theory's choice.
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
        self.validate_options()
        self._validate_trainer_values()
        if self.bf16 is None and not self.fp16:
            self.bf16 = bf16_available(self.use_cpu)
        super().__post_init__()  # resolves scale_rewards=True/False to "group"/"none"
        check_one_of("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_one_of("multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
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
        """The GRPOConfig/TrainingArguments values that torch, the Trainer or generation would only refuse, or run
        wrong, after the model loads (`TRAINER_VALUE_RULES`)."""
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


OBLRPOConfig.__doc__ = OBLRPOConfig.__doc__.replace("{parameters}", parameters_doc())
