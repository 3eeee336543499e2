"""`OBLRPOTrainer`: TRL's `GRPOTrainer` with the gradient-weighted baseline and the SNR-driven learning rate.

The trainer is glue. It wires the pure functions of `weights`, `advantages`, `per_sample` and `snr` into the hooks of
TRL 1.16 that DESIGN §3 names:

* advantages are recomputed at the end of `_generate_and_score_completions`, on the rewards and weights gathered from
  every process, before the generation batch is split into micro-batches (a group can span ranks and micro-batches);
* each optimizer step's ‖μ‖² and tr Σ are measured from the micro-batch gradients (hooks on the parameters) and the
  pre-clip step gradient (`_get_grad_norm`), and the learning rate of the next optimizer step is scaled by f_t.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from transformers.utils import logging
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import add_fused_lm_head, get_callable_name, get_config_model_id

from .advantages import aggregate_rewards, gradient_weighted_advantages
from .baselines import PooledSlope
from .config import OBLRPOConfig, check_backend
from .optim_hooks import OptimizerStepGate, StepLearningRateScale, innermost_optimizer
from .generation_hooks import GenerationLogitStats
from .ghost_norms import log_likelihood_grad_sq_norms
from .model_card import ModelCardFacts, model_card_text
from . import models
from .guards import PreemptionSignal, TrainingPreempted, name_reward_errors, validate_training_data
from .per_sample import per_sample_grad_sq_norms, row_objective
from .snr import SNRLearningRateController
from .step_noise import StepNoiseRecorder
from .weights import length_weights, logit_proxy_weights, loss_token_gains, uniform_weights

__all__ = ["OBLRPOTrainer"]

logger = logging.get_logger(__name__)

STATE_FILE = "oblr_state.json"
POOLED_SLOPE_DECAY = 0.9  # moving-average decay of the pooled slope's fit, over generation batches
PREEMPTION_MARKER = "oblr_preemption.json"  # in a checkpoint saved on SIGTERM/SIGINT: only the newest is kept
SKETCH_FILE = "oblr_gradient_sketch.pt"  # the last step's gradient sketch, for the cross-step SNR estimator

# Keys of TRL's generation output that `_get_per_token_logps_and_entropies` takes as keyword arguments.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _fit_width(values: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad per-step values ``(B, steps)`` to the padded completion width (padding is masked anyway)."""
    if values.size(1) >= width:
        return values[:, :width]
    return torch.nn.functional.pad(values, (0, width - values.size(1)))


class _OBLRPOCallback(TrainerCallback):
    """The trainer's own hooks into the training loop: optimizer hooks once the optimizer is final (DeepSpeed builds
    its own in `prepare`), the learning-rate factor of each step fixed before its first micro-batch (DeepSpeed steps
    inside the last `backward`), and the graceful stop on SIGTERM/SIGINT."""

    def __init__(self, trainer: OBLRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._attach_optimizer_hooks()
        # the calibration of the SNR factor starts once the learning rate has reached its scheduled value
        calibration = self.trainer.snr_controller.calibration
        calibration.start = max(args.snr_warmup_steps, args.get_warmup_steps(state.max_steps))
        if args.save_on_preemption:
            self.trainer.preemption.install()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._begin_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if args.save_on_preemption and self.trainer._preemption_requested():
            self.trainer._preempted_at_step = state.global_step
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.preemption.uninstall()


class OBLRPOTrainer(GRPOTrainer):
    """Trainer for OBLR-PO (Optimal Baseline and Learning-Rate Policy Optimization, arXiv 2511.23310).

    A drop-in replacement for [`~trl.GRPOTrainer`] (same arguments) that changes two things:

    1. Advantages are r_i − b_i with a leave-one-out estimate of the variance-optimal baseline b* = E[w r]/E[w],
       w ∝ ‖∇_θ log π(o|q)‖² (see `OBLRPOConfig.baseline_estimator` and `baseline_weights`).
    2. The scheduled learning rate of each optimizer step is scaled by a factor driven by the measured gradient
       SNR = ‖μ‖²/tr Σ through f_t = N·SNR/(1 + N·SNR) (see `OBLRPOConfig.snr_lr_reference`).

    Example:

    ```python
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    trainer = OBLRPOTrainer(
        model="Qwen/Qwen3-4B-Base",
        reward_funcs=accuracy_reward,
        args=OBLRPOConfig(output_dir="qwen3-oblrpo"),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model, reward_funcs, **kwargs: as for [`~trl.GRPOTrainer`].
        args ([`OBLRPOConfig`], *optional*): configuration; a default one is built when `None`.
    """

    _tag_names = ["trl", "oblr-po"]
    _name = "OBLR-PO"
    _paper = {
        "title": "OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning",
        "id": "2511.23310",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{huang2025oblrpo,
                title        = {{OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning}},
                author       = {Zixun Huang and Jiayi Sheng and Zeyu Zheng},
                year         = 2025,
                eprint       = {arXiv:2511.23310},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: OBLRPOConfig | None = None, *trainer_args, **trainer_kwargs):
        base_model_id = None
        if isinstance(model, str) and model.startswith(models.BUILTIN_PREFIX):  # the ids `oblr-trl train` accepts
            base_model_id = models.model_card_id(model)
            name, model = model[len(models.BUILTIN_PREFIX):], models.resolve_model(model)
        else:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
        if args is None:
            args = OBLRPOConfig(f"{name.rstrip('/').split('/')[-1]}-OBLR-PO")
        elif not isinstance(args, OBLRPOConfig):
            raise TypeError(
                f"OBLRPOTrainer needs an OBLRPOConfig, got {type(args).__name__}. OBLRPOConfig takes every GRPOConfig "
                "argument: replace `GRPOConfig(...)` with `OBLRPOConfig(...)`."
            )
        environment_owned = any(trainer_kwargs.get(key) is not None for key in ("environment_factory", "rollout_func"))
        reward_funcs = self._checked_reward_funcs(
            reward_funcs, trainer_kwargs.get("train_dataset", (*trainer_args, None)[0]), not environment_owned
        )
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        self._check_supported(args)
        # what the model card cannot read from the model and the data (set by `oblr-trl train`): the YAML recipe, the
        # base model's Hub id (a built-in model is a local folder) and where the problems came from
        self.recipe: str | None = None
        self.base_model_id: str | None = base_model_id
        self.dataset_description: str | None = None

        self._policy_module = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self._log_sum_sq_forward = self._make_log_sum_sq_forward() if args.baseline_weights == "logit" else None
        self._gathered_rewards_per_func: torch.Tensor | None = None
        self._generation_logits: tuple[torch.Tensor, torch.Tensor] | None = None
        self._loss_outputs: tuple[torch.Tensor, ...] | None = None
        self._warned_no_reuse = False
        self._warned_context = False
        self._ghost_norms_unsupported: str | None = None  # why ghost norms cannot run on this model, once known

        # The `pooled_slope` baseline's ρ̂, fitted on the batches before the current one
        self.pooled_slope = PooledSlope(POOLED_SLOPE_DECAY)

        # SNR-driven learning rate
        self.snr_controller = SNRLearningRateController(
            args.snr_ema_decay,
            args.snr_warmup_steps,
            args.snr_lr_floor,
            reference=args.snr_lr_reference,
            calibration_start=args.snr_warmup_steps,  # moved past the learning-rate warm-up in on_train_begin
            calibration_steps=args.resolved_snr_calibration_steps,
            min_ratio=args.snr_lr_min_ratio,
            max_ratio=args.snr_lr_max_ratio,
        )
        # f_t of step t comes from the estimates of steps < t: under DeepSpeed the optimizer steps inside the last
        # backward, before step t's gradient norm exists, and a batch's own noise should not size its own step.
        self._step_lr_factor = 1.0
        self._step_allowed: bool | None = None
        self._step_logged = False
        self._lr_scale: StepLearningRateScale | None = None
        self.snr_recorder: StepNoiseRecorder | None = None
        if args.use_snr_lr:
            self.snr_recorder = StepNoiseRecorder(
                self._trainable_parameters(), self.snr_controller, args.snr_estimator, self.num_generations,
                sharded=self._is_fsdp2, gradients_in_grad=not self.is_deepspeed_enabled, seed=args.seed,
            )

        # Robustness: refuse non-finite steps, stop gracefully on SIGTERM/SIGINT
        self._step_gate: OptimizerStepGate | None = None
        self._step_loss_finite = torch.ones((), dtype=torch.bool)
        self._step_grad_norm_finite = True
        self.skipped_nonfinite_steps = 0
        self.preemption = PreemptionSignal()
        self._preempted_at_step: int | None = None
        self._preemption_checkpoint: str | None = None
        self.add_callback(_OBLRPOCallback(self))

    def train(self, *args, **kwargs):
        """`GRPOTrainer.train`; raises [`TrainingPreempted`] after a SIGTERM/SIGINT stopped it early and saved a
        checkpoint (`save_on_preemption`), instead of returning as if training had finished."""
        self._preempted_at_step = self._preemption_checkpoint = None
        output = super().train(*args, **kwargs)
        if self._preempted_at_step is not None:
            stopped = TrainingPreempted(self.preemption.received, self._preempted_at_step, self._preemption_checkpoint)
            logger.warning(str(stopped))
            raise stopped
        return output

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------

    @property
    def _is_fsdp2(self) -> bool:
        return self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2

    def _check_supported(self, args: OBLRPOConfig) -> None:
        fsdp_version = getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) if self.is_fsdp_enabled else None
        check_backend(args, fsdp_version=fsdp_version, deepspeed=self.is_deepspeed_enabled,
                      deepspeed_fp16=self.is_deepspeed_enabled and _deepspeed_fp16(self.accelerator, args))
        if args.baseline_weights == "exact" and self._is_vlm:
            raise ValueError(
                "Invalid value for `baseline_weights`: 'exact' is not supported for vision-language models. Allowed "
                "values for them: 'logit', 'length', 'uniform'."
            )

    @staticmethod
    def _checked_reward_funcs(reward_funcs, train_dataset, requires_prompt: bool = True) -> list:
        """Check the data against the reward functions before any model loads; name a reward function that fails."""
        funcs = reward_funcs if isinstance(reward_funcs, list) else [] if reward_funcs is None else [reward_funcs]
        names = [f if isinstance(f, str) else get_callable_name(f) for f in funcs]
        validate_training_data(train_dataset, [f for f in funcs if not isinstance(f, str)],
                               [n for f, n in zip(funcs, names, strict=True) if not isinstance(f, str)], requires_prompt)
        return [
            f if isinstance(f, (str, torch.nn.Module)) else name_reward_errors(f, name)
            for f, name in zip(funcs, names, strict=True)
        ]

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = self._context_limit()
        longest = max((len(ids) for ids in prompt_ids), default=0)
        if limit is not None and longest >= limit:
            raise ValueError(
                f"A prompt of {longest} tokens exceeds the model's context of {limit} tokens: nothing can be generated. "
                f"Allowed: prompts of fewer than {limit} tokens (filter or truncate the dataset)."
            )
        if limit is not None and longest + self.max_completion_length > limit and not self._warned_context:
            # TRL generates anyway (rotary models run past max_position_embeddings, degraded); say so once
            self._warned_context = True
            warnings.warn(
                f"A prompt of {longest} tokens plus max_completion_length={self.max_completion_length} exceeds the "
                f"model's context of {limit} tokens; completions may be cut or degraded past it."
            )
        return prompt_ids, images, multimodal_fields

    def _context_limit(self) -> int | None:
        if self.use_vllm and self.args.vllm_max_model_length is not None:
            return self.args.vllm_max_model_length
        config = self._policy_module.config.get_text_config()
        return getattr(config, "max_position_embeddings", None)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _make_log_sum_sq_forward(self):
        """A second fused-LM-head forward of the policy that also returns log Σ_v p_v², without changing TRL's.

        `add_fused_lm_head` replaces `forward` on the instance; patch once more with the extra output, keep that
        bound method, and put TRL's forward back.
        """
        module = self._policy_module
        trl_forward = module.forward
        add_fused_lm_head(
            module,
            temperature=self.temperature,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
            outputs=("log_probs", "log_sum_sq_probs"),
        )
        log_sum_sq_forward = module.forward
        module.forward = trl_forward
        return log_sum_sq_forward

    @contextlib.contextmanager
    def _recording_log_sum_sq(self):
        """While active, fused forwards of the policy also compute log Σ p², recorded as (log_probs, log_sum_sq)."""
        module, trl_forward, record = self._policy_module, self._policy_module.forward, []

        def recording_forward(*args, **kwargs):
            outputs = self._log_sum_sq_forward(*args, **kwargs)
            if kwargs.get("fused_lm_head"):
                record.append((outputs.log_probs, outputs.log_sum_sq_probs))
            return outputs

        module.forward = recording_forward
        try:
            yield record
        finally:
            module.forward = trl_forward

    # ------------------------------------------------------------------------------------------------------------
    # Advantages (DESIGN §2, §3)
    # ------------------------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards_per_func = rewards_per_func  # gathered over processes, group by group
        return rewards_per_func

    def _captures_generation_logits(self) -> bool:
        # transformers' generate computes every step's logits; vLLM, continuous batching and tool loops do not hand
        # them over (or interleave tool tokens), so those paths use a forward pass instead.
        return (
            self._log_sum_sq_forward is not None
            and not self.use_vllm
            and not self.args.use_transformers_continuous_batching
            and not self.tools
        )

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        stats = GenerationLogitStats(self._policy_module, self.temperature) if self._captures_generation_logits() else None
        completion_ids = None
        try:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        finally:
            if stats is not None:
                self._generation_logits = stats.finish(completion_ids or [])
        return self._without_empty_completions(completion_ids, logprobs)

    def _without_empty_completions(self, completion_ids, logprobs):
        """A generator can return no token at all (vLLM at the context limit, a custom rollout); TRL cannot score such
        a completion. Read it as the model stopping at once: a lone EOS (its sampling log-probability unknown, so no
        importance-sampling correction), counted in `oblr/empty_completions`."""
        empty = [i for i, ids in enumerate(completion_ids) if len(ids) == 0]
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["oblr/empty_completions"].append(float(len(empty)))
        if not empty:
            return completion_ids, logprobs
        warnings.warn(f"{len(empty)} empty completion(s) read as a lone EOS token (counted in oblr/empty_completions).")
        eos = self.eos_token_ids[0]
        completion_ids = [ids if len(ids) else [eos] for ids in completion_ids]
        if logprobs is not None:
            logprobs = [lp if len(ids) else [None] for ids, lp in zip(completion_ids, logprobs, strict=True)]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        if self.model.training and self.snr_recorder is not None:
            self.snr_recorder.new_generation()
        self._generation_logits = None
        reuse = self._log_sum_sq_forward is not None and not self._captures_generation_logits()
        reuse = reuse and self._trl_computes_old_logps()
        with self._recording_log_sum_sq() if reuse else contextlib.nullcontext() as record:
            output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if mode == "eval" and self.num_generations_eval < 2:
            return output  # no group to take a baseline from; evaluation does not use the advantages
        local_weights = self._completion_weights(output, record if reuse else None, mode)
        self._replace_advantages(output, local_weights, mode)
        return output

    def _trl_computes_old_logps(self) -> bool:
        # The condition under which GRPOTrainer runs its own no-grad forward of the policy (old_per_token_logps).
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _loss_mask(self, output: dict[str, Any]) -> torch.Tensor:
        mask = output["completion_mask"]
        return mask if "tool_mask" not in output else mask * output["tool_mask"]

    def _importance_scale(self, output: dict[str, Any]) -> torch.Tensor | None:
        """ρ (per sequence or per token) when vLLM IS correction is on and the baseline should account for it."""
        if self.args.importance_weighted_baseline and "importance_sampling_ratio" in output:
            return output["importance_sampling_ratio"]
        return None

    def _completion_weights(self, output: dict[str, Any], record: list | None, mode: str) -> torch.Tensor:
        """Local weights w_i, one per completion of this process (DESIGN §2 table).

        Each token's gradient enters the loss times a gain: the IS ratio ρ_t (vLLM correction) and the loss type's
        per-completion factor (1/L_i for a per-completion token mean); squared norms take the gains squared.
        """
        mask = self._loss_mask(output)
        estimator = self.args.baseline_weights
        if estimator == "uniform":
            return uniform_weights(mask)
        gains = loss_token_gains(mask, self.loss_type)
        ratio = self._importance_scale(output)
        if ratio is not None:
            gains = gains * ratio.float()
        if estimator == "length":
            return length_weights(mask, gains.square())
        if estimator == "logit":
            log_probs, log_sum_sq = self._logit_weight_inputs(output, record, mode)
            return logit_proxy_weights(log_probs, log_sum_sq, mask, gains.square())
        return self._per_sample_grad_sq_norms(output, mask.float() * gains)

    def _logit_weight_inputs(
        self, output: dict[str, Any], record: list | None, mode: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p_t(y_t) and log Σ_v p_t(v)² of the completion tokens, ``(B, T)`` like ``completion_ids``.

        From the logits generation already computed if they were captured, else from TRL's own no-grad forward if it
        ran one, else from one chunked no-grad forward of our own (logged as `oblr/weights/extra_forward`).
        """
        completion_ids = output["completion_ids"]
        captured, self._generation_logits = self._generation_logits, None
        if captured is not None and captured[0].size(0) == completion_ids.size(0):
            self._metrics[mode]["oblr/weights/extra_forward"].append(0.0)
            return tuple(_fit_width(t, completion_ids.size(1)) for t in captured)
        logits_to_keep = completion_ids.size(1)
        if record is not None and "old_per_token_logps" in output:
            chunks = record[: math.ceil(completion_ids.size(0) / self._forward_batch_size(mode))]
            if chunks:
                log_probs = torch.cat([lp for lp, _ in chunks])[:, -logits_to_keep:]
                if log_probs.shape == output["old_per_token_logps"].shape and torch.equal(
                    log_probs, output["old_per_token_logps"]
                ):
                    self._metrics[mode]["oblr/weights/extra_forward"].append(0.0)
                    return log_probs, torch.cat([lss for _, lss in chunks])[:, -logits_to_keep:]
            if not self._warned_no_reuse:
                warnings.warn("Could not reuse TRL's no-grad forward for the logit weights; running a separate one.")
                self._warned_no_reuse = True
        self._metrics[mode]["oblr/weights/extra_forward"].append(1.0)
        input_ids, attention_mask, _ = self._sequence_inputs(output)
        multimodal = {key: output[key] for key in _MULTIMODAL_KEYS if key in output}
        with torch.no_grad(), self._recording_log_sum_sq() as record:
            log_probs, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=self._forward_batch_size(mode),
                **multimodal,
            )
        return log_probs, torch.cat([lss for _, lss in record])[:, -logits_to_keep:]

    def _forward_batch_size(self, mode: str) -> int:
        return self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size

    @staticmethod
    def _sequence_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input_ids, attention_mask, logits_to_keep) of prompt + completion, as TRL's forwards take them."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return input_ids, attention_mask, batch["completion_ids"].size(1)

    def _per_sample_grad_sq_norms(self, batch: dict[str, Any], token_scale: torch.Tensor) -> torch.Tensor:
        """‖∇_θ Σ_t s_t log p_t(y_t)‖² per completion (`oblr_trl.ghost_norms`), in chunks of `per_sample_batch_size`.

        A model with a layer the ghost norms do not know is measured by one backward per completion instead
        (`_looped_grad_sq_norms`), after one warning naming the layer: slower, never wrong, never an error.
        """
        input_ids, attention_mask, logits_to_keep = self._sequence_inputs(batch)
        size = self.args.per_sample_batch_size or self._forward_batch_size("train" if self.model.training else "eval")
        if self._ghost_norms_unsupported is None:
            try:
                with disable_gradient_checkpointing(self._policy_module, self.args.gradient_checkpointing_kwargs):
                    return torch.cat(
                        [
                            log_likelihood_grad_sq_norms(
                                self._policy_module,
                                input_ids[start : start + size],
                                attention_mask[start : start + size],
                                logits_to_keep,
                                token_scale[start : start + size],
                                self.temperature,
                            )
                            for start in range(0, input_ids.size(0), size)
                        ]
                    )
            except NotImplementedError as error:
                self._ghost_norms_unsupported = str(error)
                self._refuse_parameter_gradients_under_fsdp2(str(error))
                warnings.warn(
                    f"{error} Per-sample gradient norms fall back to one backward per completion for this model "
                    "(correct, slower)."
                )
        return self._looped_grad_sq_norms(batch, token_scale, size)

    def _refuse_parameter_gradients_under_fsdp2(self, reason: str) -> None:
        """The per-row fallback differentiates with respect to the parameters, which FSDP2 holds as shards outside
        the autograd graph: under FSDP2 it would measure nothing, so it is refused instead."""
        if self._is_fsdp2:
            raise NotImplementedError(
                f"{reason} Under FSDP2 per-sample gradient norms come only from the ghost norms (the per-row fallback "
                "needs unsharded parameters). Use baseline_weights='logit' and snr_estimator='cross_step' (the "
                "defaults) for this model under FSDP2."
            )

    def _looped_grad_sq_norms(self, batch: dict[str, Any], token_scale: torch.Tensor, size: int) -> torch.Tensor:
        """The same norms through the model's own forward (TRL's), one backward per completion: any architecture."""
        input_ids, attention_mask, logits_to_keep = self._sequence_inputs(batch)
        multimodal = {key: batch[key] for key in _MULTIMODAL_KEYS if key in batch}
        norms = []
        with torch.enable_grad(), disable_gradient_checkpointing(
            self._policy_module, self.args.gradient_checkpointing_kwargs
        ):
            for start in range(0, input_ids.size(0), size):
                rows = slice(start, start + size)
                log_probs, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids[rows], attention_mask[rows], logits_to_keep, batch_size=size,
                    **{key: value[rows] if torch.is_tensor(value) else value for key, value in multimodal.items()},
                )
                objectives = (log_probs * token_scale[rows].to(log_probs.dtype)).sum(-1)
                norms.append(
                    per_sample_grad_sq_norms(
                        lambda i, objectives=objectives: objectives[i], objectives.size(0),
                        self._trainable_parameters(), retain_graph=True,
                    )
                )
        return torch.cat(norms).detach()

    def _replace_advantages(self, output: dict[str, Any], local_weights: torch.Tensor, mode: str) -> None:
        """Swap TRL's group-mean advantages for r_i − b_i computed on the gathered rewards and weights."""
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        weights = self.accelerator.gather(local_weights.float().contiguous())
        rewards = aggregate_rewards(
            self._gathered_rewards_per_func, self.reward_weights, num_generations, self.multi_objective_aggregation
        )
        result = gradient_weighted_advantages(
            rewards, weights, num_generations, self.args.leave_one_out, self.scale_rewards,
            estimator=self.args.baseline_estimator, shrinkage=self.args.baseline_shrinkage,
            slope=self.pooled_slope.value,
        )
        if self.args.baseline_estimator == "pooled_slope":
            self._metrics[mode]["oblr/baseline_slope"].append(self.pooled_slope.value)
            if mode == "train":  # after this batch's baselines: the slope a baseline uses never saw its group
                self.pooled_slope.update(
                    rewards.view(-1, num_generations), weights.view(-1, num_generations), self.args.leave_one_out
                )
        local = output["completion_ids"].size(0)
        process_slice = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
        output["advantages"] = result.advantages[process_slice].to(output["advantages"])

        # TRL logged its own advantages for the completions table; replace them with the ones used.
        for _ in range(min(len(result.advantages), len(self._logs["advantages"]))):
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(result.advantages.tolist())
        self._log_advantage_metrics(result, weights, num_generations, mode)

    def _log_advantage_metrics(self, result, weights: torch.Tensor, num_generations: int, mode: str) -> None:
        metrics = self._metrics[mode]
        scored = result.scored
        metrics["oblr/unscorable_frac"].append(1.0 - scored.float().mean().item())
        if not scored.any():
            return
        metrics["oblr/baseline_mean"].append(torch.nanmean(result.baseline).item())
        metrics["oblr/advantage_mean"].append(result.advantages[scored].mean().item())
        metrics["oblr/advantage_std"].append(result.advantages[scored].std(unbiased=False).item())
        metrics["oblr/loo_fallback_frac"].append(result.fallback[scored].float().mean().item())
        usable = scored & torch.isfinite(weights)
        if usable.any():
            metrics["oblr/weights/mean"].append(weights[usable].mean().item())
        grouped = torch.where(usable, weights, torch.full_like(weights, float("nan"))).view(-1, num_generations)
        largest = torch.nan_to_num(grouped, nan=-math.inf).amax(dim=1)
        smallest = torch.nan_to_num(grouped, nan=math.inf).amin(dim=1)
        spread = (largest / smallest)[(smallest > 0) & torch.isfinite(largest)]
        if spread.numel():
            metrics["oblr/weights/group_max_min_ratio"].append(spread.mean().item())

    # ------------------------------------------------------------------------------------------------------------
    # SNR-driven learning rate (DESIGN §2, §3)
    # ------------------------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if self._loss_outputs is not None and torch.is_grad_enabled():
            # compute_loss's forward: keep its outputs for the per-sample gradient norms
            self._loss_outputs = (result[0], result[1])
        return result

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        recorder = self.snr_recorder if self.model.training and torch.is_grad_enabled() else None
        per_sample = recorder is not None and self.args.snr_estimator == "per_sample"
        if per_sample:
            self._loss_outputs = ()
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if per_sample:
                recorder.add_per_sample_sq(self._per_row_grad_sq(loss, inputs))
        finally:
            self._loss_outputs = None
        if recorder is not None:
            recorder.start_backward(inputs["completion_ids"].size(0))
        if self.model.training and torch.is_grad_enabled():
            self._step_loss_finite = self._step_loss_finite.to(loss.device) & torch.isfinite(loss.detach()).all()
        return loss

    def _per_row_grad_sq(self, loss: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """Σ_i ‖∂loss_i/∂θ‖² over the rows of this micro-batch.

        With v = ∂loss/∂(per-token log-probs), row i's gradient is ∇_θ Σ_t v_it log p_t: one batched ghost-norm pass.
        If the loss also depends on the entropies (an entropy bonus), one backward per row instead (`row_objective`).
        """
        log_probs, entropies = self._loss_outputs
        outputs = [t for t in (log_probs, entropies) if t is not None and t.requires_grad]
        grads = dict(zip(map(id, outputs), torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)))
        if entropies is None or grads.get(id(entropies)) is None:
            return self._per_sample_grad_sq_norms(inputs, grads[id(log_probs)].detach()).sum()
        self._refuse_parameter_gradients_under_fsdp2("The loss depends on the entropies (an entropy term).")
        pairs = [(o, grads[id(o)]) for o in outputs if grads[id(o)] is not None]
        objective = row_objective([o for o, _ in pairs], [g for _, g in pairs])
        norms = per_sample_grad_sq_norms(objective, log_probs.size(0), self._trainable_parameters(), retain_graph=True)
        return norms.sum()

    def training_step(self, model, inputs, num_items_in_batch):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self.snr_recorder is not None:
                self.snr_recorder.end_backward()

    def _clip_grad_norm(self, model):
        if self.snr_recorder is not None:
            self.snr_recorder.read_step_gradients(model.parameters())  # before clipping rescales the gradients
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.snr_recorder is not None and grad_norm is None:
            self.snr_recorder.read_step_gradients(model.parameters())  # max_grad_norm=0: no clipping step
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._step_grad_norm_finite = grad_norm is None or math.isfinite(float(grad_norm))
        if self.snr_recorder is not None:
            self.snr_recorder.finish_step(
                float(grad_norm), lambda stats: self.accelerator.reduce(stats, reduction="sum"),
                self.accelerator.device, self.accelerator.num_processes, self._loss_scale(), self._metrics["train"],
            )
        return grad_norm

    def _loss_scale(self) -> float:
        """The fp16 loss scale the micro-batch gradients were multiplied by (1 without one)."""
        scaler = self.accelerator.scaler
        if scaler is not None and scaler.is_enabled():
            return float(scaler.get_scale())
        return 1.0

    def _attach_optimizer_hooks(self) -> None:
        """Gate and scale the steps of the optimizer that updates the parameters (once per optimizer object).

        The gate goes on first: a refused step does not reach the learning-rate hooks.
        """
        optimizer = innermost_optimizer(self.optimizer)
        if self._step_gate is not None and self._step_gate.optimizer is optimizer:
            return
        for hooks in (self._step_gate, self._lr_scale):
            if hooks is not None:
                hooks.remove()
        if self.snr_recorder is not None:
            self._lr_scale = StepLearningRateScale(optimizer, lambda: self._step_lr_factor, self._log_lr_factor)
        if self.args.skip_nonfinite_steps:
            self._step_gate = OptimizerStepGate(optimizer, self._optimizer_step_allowed, self._log_skipped_step)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self._attach_optimizer_hooks()
        return optimizer

    def _begin_optimizer_step(self) -> None:
        self._step_lr_factor = self.snr_recorder.next_factor if self.snr_recorder is not None else 1.0
        self._step_loss_finite = torch.ones((), dtype=torch.bool)
        self._step_grad_norm_finite = True
        # DeepSpeed's ZeRO optimizers call the torch optimizer's step once per param group: decide and log once
        self._step_allowed = None
        self._step_logged = False  # the factor of an applied step, or the skip of a refused one

    def _optimizer_step_allowed(self) -> bool:
        """Every process agrees: the step's losses, pre-clip gradient norm (when known before the step; DeepSpeed
        computes it inside its step) and learning-rate factor are all finite."""
        if self._step_allowed is not None:
            return self._step_allowed
        finite = self._step_loss_finite.to(self.accelerator.device) & torch.tensor(
            self._step_grad_norm_finite and math.isfinite(self._step_lr_factor), device=self.accelerator.device
        )
        if self.accelerator.num_processes > 1:
            finite = self.accelerator.gather(finite.reshape(1)).all()
        self._step_allowed = bool(finite)
        return self._step_allowed

    def _log_skipped_step(self) -> None:
        if self._step_logged:
            return
        self._step_logged = True
        self.skipped_nonfinite_steps += 1
        self._metrics["train"]["oblr/skipped_nonfinite_steps"].append(float(self.skipped_nonfinite_steps))
        warnings.warn(
            f"Optimizer step {self.state.global_step + 1} skipped: non-finite loss, gradient norm or learning-rate "
            f"factor ({self.skipped_nonfinite_steps} skipped so far). The parameters and optimizer state are unchanged."
        )

    def _preemption_requested(self) -> bool:
        requested = torch.tensor(self.preemption.received is not None, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # stop together even if only some processes got the signal
            requested = self.accelerator.gather(requested.reshape(1)).any()
        return bool(requested)

    def _log_lr_factor(self, scheduled_lr: float, factor: float) -> None:
        if self._step_logged:
            return
        self._step_logged = True
        self._metrics["train"]["snr/lr_factor"].append(factor)
        self._metrics["train"]["snr/effective_lr"].append(scheduled_lr * factor)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """README.md in output_dir: base model, problems, settings and results of this run (`oblr_trl.model_card`)."""
        if not self.is_world_process_zero():
            return
        try:
            self._write_model_card(model_name, dataset_name, tags)
        except Exception as error:  # noqa: BLE001 - TRL writes the card before every checkpoint: never lose one to it
            warnings.warn(f"The model card was not written ({type(error).__name__}: {error}); training goes on.")

    def _write_model_card(self, model_name, dataset_name, tags) -> None:
        source = get_config_model_id(self.model.config) or ""
        on_disk = os.path.isdir(source)
        args = self.args
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        curves = Path(args.output_dir) / "training_curves.png"
        facts = ModelCardFacts(
            model_name=model_name or Path(args.output_dir).name,
            base_model=self.base_model_id or (None if on_disk else source or None),
            base_model_path=source if on_disk else None,
            hub_model_id=self.hub_model_id if args.push_to_hub else None,
            output_dir=args.output_dir,
            dataset_id=dataset_name,
            dataset_description=self.dataset_description,
            settings=self._model_card_settings(),
            log_history=self.state.log_history,
            tags=sorted({*self._tag_names, *tags}),
            curves=curves.name if curves.exists() else None,
            tracker_urls=_tracker_urls(),
            recipe=self.recipe,
            paper=self._paper,
        )
        (Path(args.output_dir) / "README.md").write_text(model_card_text(facts))

    def _model_card_settings(self) -> dict[str, str]:
        args = self.args
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        if args.use_snr_lr and args.snr_lr_reference == "calibrated":
            rate_rule = (f"calibrated SNR factor in [{args.snr_lr_min_ratio:g}, {args.snr_lr_max_ratio:g}] "
                         f"(`{args.snr_estimator}` estimator)")
        elif args.use_snr_lr:
            rate_rule = f"absolute SNR factor, floor {args.snr_lr_floor:g} (`{args.snr_estimator}` estimator)"
        else:
            rate_rule = "off (the scheduled rate)"
        return {
            "learning rate": f"{args.learning_rate:g}, `{_plain(args.lr_scheduler_type)}`, {args.warmup_steps:g} warm-up steps",
            "learning-rate factor": rate_rule,
            "baseline": (f"`{args.baseline_weights}` weights, `{args.baseline_estimator}` estimate"
                         f"{', leave-one-out' if args.leave_one_out else ''}; scale_rewards `{args.scale_rewards}`"),
            "completions per step": f"{per_step} ({per_step // self.num_generations} prompts × {self.num_generations})",
            "max completion length": str(args.max_completion_length),
            "loss type, KL β": f"`{args.loss_type}`, {args.beta:g}",
            "optimizer, max grad norm": f"`{_plain(args.optim)}`, {args.max_grad_norm:g}",
            "reward functions": ", ".join(f"`{name}`" for name in self.reward_func_names),
        }

    def _issue_warnings_after_load(self, load_result) -> None:
        # transformers 5 reports a tied parameter (lm_head.weight tied to the embeddings) as missing from a resumed
        # checkpoint: it is never saved, and tying it again restores it. Only the untied ones deserve the warning.
        tied = {name for name, _ in self.model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in self.model.named_parameters()
        }
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: the SNR state travels with them
    # ------------------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self._preempted_at_step is not None:
            self._preemption_checkpoint = str(folder)
        if not self.args.should_save:
            return
        if self._preempted_at_step is not None:
            self._keep_one_preemption_checkpoint(folder)
        state: dict[str, Any] = {"pooled_slope": self.pooled_slope.state_dict()}
        if self.snr_recorder is not None:
            state |= self.snr_recorder.state_dict()
            previous_sketch = self.snr_recorder.previous_sketch_state()
            if previous_sketch is not None:
                torch.save(previous_sketch, folder / SKETCH_FILE)
        (folder / STATE_FILE).write_text(json.dumps(state, indent=2))

    def _keep_one_preemption_checkpoint(self, newest: Path) -> None:
        """Mark ``newest`` as saved on preemption and delete the run's earlier preemption checkpoints: each interruption
        would otherwise leave a full checkpoint behind (1.6 GB for a 135M model with AdamW's state). With
        `save_total_limit` set, the Trainer's own rotation decides instead."""
        (newest / PREEMPTION_MARKER).write_text(json.dumps({"signal": self.preemption.received,
                                                            "step": self.state.global_step}))
        if self.args.save_total_limit is not None:
            return
        for folder in newest.parent.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            if folder != newest and (folder / PREEMPTION_MARKER).exists():
                shutil.rmtree(folder, ignore_errors=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"{checkpoint} has no {STATE_FILE} (saved by an older version): the SNR averages and the baseline's "
                "pooled slope restart from scratch, with a new warm-up."
            )
            return
        state = json.loads(Path(path).read_text())
        if "pooled_slope" in state:
            self.pooled_slope.load_state_dict(state["pooled_slope"])
        if self.snr_recorder is None or "snr_controller" not in state:
            return
        self.snr_recorder.load_state_dict(state)
        sketch_path = os.path.join(checkpoint, SKETCH_FILE)
        if os.path.exists(sketch_path):
            self.snr_recorder.load_previous_sketch_state(torch.load(sketch_path, weights_only=True),
                                                         self.accelerator.device)


def _deepspeed_fp16(accelerator, args: OBLRPOConfig) -> bool:
    """Whether DeepSpeed runs this job in fp16: the Trainer's fp16, or `fp16.enabled` set in DeepSpeed's own config
    (the Trainer has resolved "auto" to its fp16 by now)."""
    plugin = accelerator.state.deepspeed_plugin
    enabled = (plugin.deepspeed_config.get("fp16") or {}).get("enabled", False) if plugin is not None else False
    return bool(args.fp16) or enabled is True


def _plain(value) -> str:
    """An enum's value ('constant_with_warmup'), anything else as is."""
    return str(getattr(value, "value", value))


def _tracker_urls() -> list[str]:
    """Where this run is tracked (Weights & Biases, Trackio, Comet), found the way TRL's own model card finds them."""
    from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

    wandb = sys.modules.get("wandb")  # open runs only: never imported for this
    urls = [getattr(getattr(wandb, "run", None), "url", None), get_trackio_space_url(), get_comet_experiment_url()]
    return [url for url in urls if url]
