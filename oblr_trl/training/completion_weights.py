"""Where each completion's weight w_i comes from, for the trainer's gradient-weighted baseline (docs/math.md).

[`CompletionWeights`] is the trainer's collaborator for the weights, as `StepNoiseRecorder` is for the SNR: it holds
what the weights need across generation batches (the fused LM-head forward that also returns log Σ_v p², whether ghost
norms run on this model) and turns a generation batch into one weight per completion with the pure functions of
`estimators.weights`, `estimators.ghost_norms` and `estimators.per_sample`. It also measures the per-sample gradient
norms the `per_sample` SNR estimator asks for, through the same code.

It never sees the trainer: the trainer hands it the functions and values it uses (TRL's forward, the model, the
metrics, how generation and TRL's own forwards run), in one place, `OBLRPOTrainer.__init__`.

Sources of the `logit` weights' inputs, cheapest first: the logits transformers' `generate` computed anyway
(`GenerationLogitStats`); TRL's own no-grad forward (old log-probabilities), recorded while it runs; one chunked
no-grad forward of its own (logged as `oblr/weights/extra_forward`). The first two are collected per generation batch
in a [`LogitSources`] that `CompletionWeights.generation_batch` opens and yields, and `compute` takes them from it.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import add_fused_lm_head

from ..estimators.ghost_norms import log_likelihood_grad_sq_norms, pass_bytes_per_row
from ..estimators.per_sample import per_sample_grad_sq_norms, row_objective
from ..estimators.weights import length_weights, logit_proxy_weights, loss_token_gains, uniform_weights
from .generation_hooks import GenerationLogitStats
from .step_kl import select_rows

__all__ = ["CompletionWeights", "LogitSources", "initialise_fsdp2_root", "reshard_fsdp2"]

# Keys of TRL's generation output that its per-token forward (`token_forward`) takes as keyword arguments.
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


def sequence_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, logits_to_keep) of prompt + completion, as TRL's forwards take them."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, batch["completion_ids"].size(1)


def initialise_fsdp2_root(model: torch.nn.Module) -> None:
    """Make FSDP2 take ``model`` as its root before any of its submodules runs a forward of its own.

    FSDP2 picks its root lazily: the first FSDP module to run a forward. The ghost-norm pass calls the input embeddings
    (and, tied, the group of the final norm, embeddings and LM head that accelerate shards as one unit) directly; under
    TRL's default `num_iterations=1` nothing has run the whole model before the first weights are measured, so that
    group would claim the root and fail ("FSDP requires a single root module"). Initialising the root state first is
    what its first forward would do, without the all-gather of a forward.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()  # idempotent: a no-op once the root is known


def reshard_fsdp2(model: torch.nn.Module) -> None:
    """Free the parameters a forward outside the training step left gathered under FSDP2 (the root and the final
    norm/LM-head group do not reshard after their forward), so that the next training step starts from shards as it
    would have without that forward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class LogitSources:
    """What one generation batch already computed that the `logit` weights can read instead of a forward of their own.

    Filled by `CompletionWeights` while the batch is generated and scored (`CompletionWeights.generation_batch`), and
    emptied by `take`, which `compute` calls: the values are not kept past the weights they are read for.

    Attributes:
        generation: ``(log_probs, log_sum_sq)``, ``(B, steps)``, read off the logits of the batch's generation call.
        trl_forward: the ``(log_probs, log_sum_sq)`` chunks of TRL's own no-grad forward of the batch, as it ran.
    """

    generation: tuple[torch.Tensor, torch.Tensor] | None = None
    trl_forward: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def take(self) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """``(generation, trl_forward)``, and forget both."""
        taken = self.generation, self.trl_forward
        self.generation = self.trl_forward = None
        return taken


class CompletionWeights:
    """The weights w_i of a generation batch (`compute`) and per-sample gradient norms (`grad_sq_norms`).

    Args:
        args: the run's `OBLRPOConfig`.
        policy: the causal LM (the base model under PEFT), the module the ghost norms and the fused LM head run on.
        model: returns the model as the trainer runs it now (wrapped by accelerate once training starts).
        token_forward: TRL's chunked forward, ``(input_ids, attention_mask, logits_to_keep, batch_size=,
            **multimodal) -> (log_probs, entropies, ...)`` of the completion tokens under the current model.
        trainable_parameters: returns the parameters that train.
        metrics: the trainer's metric lists by mode (``"train"``/``"eval"`` → name → values).
        temperature: the sampling temperature the log-probabilities are taken at.
        loss_type: TRL's loss type (how the loss scales each completion's tokens).
        generation_hands_logits: whether generation runs transformers' `generate` in this process and keeps its
            logits (not vLLM, continuous batching or tool calls).
        trl_computes_old_log_probs: whether TRL runs its own no-grad forward of every generation batch.
        sharded: whether the model is sharded by FSDP2 (every process must run the same passes).
        gather: concatenates a tensor over processes.
        autocast: the mixed-precision context training runs the model's forward in.
    """

    def __init__(
        self,
        args,
        policy: torch.nn.Module,
        *,
        model: Callable[[], torch.nn.Module],
        token_forward: Callable[..., tuple],
        trainable_parameters: Callable[[], list[torch.nn.Parameter]],
        metrics: Mapping[str, MutableMapping[str, list]],
        temperature: float,
        loss_type: str,
        generation_hands_logits: bool,
        trl_computes_old_log_probs: bool,
        sharded: bool,
        gather: Callable[[torch.Tensor], torch.Tensor],
        autocast: Callable[[], contextlib.AbstractContextManager],
    ):
        self.args, self.policy, self.model, self.token_forward = args, policy, model, token_forward
        self.trainable_parameters, self.metrics = trainable_parameters, metrics
        self.temperature, self.loss_type = temperature, loss_type
        self.generation_hands_logits = generation_hands_logits
        self.trl_computes_old_log_probs = trl_computes_old_log_probs
        self.sharded, self.gather, self.autocast = sharded, gather, autocast
        self.log_sum_sq_forward = self._make_log_sum_sq_forward() if self.args.baseline_weights == "logit" else None
        self._open_batch: LogitSources | None = None  # the generation batch being generated (`generation_batch`)
        self.ghost_norms_unsupported: str | None = None  # why ghost norms cannot run on this model, once known
        self._warned_no_reuse = False

    # The fused LM head's log Σ_v p² ----------------------------------------------------------------------------------

    def _make_log_sum_sq_forward(self):
        """A second fused-LM-head forward of the policy that also returns log Σ_v p_v², without changing TRL's.

        `add_fused_lm_head` replaces `forward` on the instance; patch once more with the extra output, keep that
        bound method, and put TRL's forward back.
        """
        module, trl_forward = self.policy, self.policy.forward
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
    def recording_log_sum_sq(self):
        """While active, fused forwards of the policy also compute log Σ p², recorded as (log_probs, log_sum_sq)."""
        module, trl_forward, record = self.policy, self.policy.forward, []

        def recording_forward(*args, **kwargs):
            outputs = self.log_sum_sq_forward(*args, **kwargs)
            if kwargs.get("fused_lm_head"):
                record.append((outputs.log_probs, outputs.log_sum_sq_probs))
            return outputs

        module.forward = recording_forward
        try:
            yield record
        finally:
            module.forward = trl_forward

    def captures_generation_logits(self) -> bool:
        # transformers' generate computes every step's logits; vLLM, continuous batching and tool loops do not hand
        # them over (or interleave tool tokens), so those paths use a forward pass instead.
        return self.log_sum_sq_forward is not None and self.generation_hands_logits

    @contextlib.contextmanager
    def generation_batch(self):
        """The scope of one generation batch (TRL's `_generate_and_score_completions`): yields its `LogitSources`,
        filled while the block runs by `generate_capturing_logits` and, where the weights reuse it
        (`reuses_trl_forward`), by TRL's own no-grad forward; pass them to `compute` once the block has ended."""
        sources = LogitSources()
        self._open_batch = sources
        try:
            with self.recording_log_sum_sq() if self.reuses_trl_forward() else contextlib.nullcontext() as record:
                sources.trl_forward = record
                yield sources
        finally:
            self._open_batch = None

    def generate_capturing_logits(self, generate: Callable[[], tuple[list, Any]]) -> tuple[list, Any]:
        """Run one generation call (``generate()`` → completion ids, log-probs) and, where it can, keep the
        logit-proxy inputs read off the logits it computes in the `LogitSources` of the open `generation_batch`."""
        sources = self._open_batch
        capture = sources is not None and self.captures_generation_logits()
        stats = GenerationLogitStats(self.policy, self.temperature) if capture else None
        completion_ids = None
        try:
            completion_ids, logprobs = generate()
        finally:
            if stats is not None:
                sources.generation = stats.finish(completion_ids or [])
        return completion_ids, logprobs

    def reuses_trl_forward(self) -> bool:
        """Whether the logit weights are read off TRL's own no-grad forward of this generation batch."""
        return (
            self.log_sum_sq_forward is not None
            and not self.captures_generation_logits()
            and self.trl_computes_old_log_probs
        )

    # The weights -----------------------------------------------------------------------------------------------------

    def compute(
        self, output: dict[str, Any], sources: LogitSources | None, mode: str, measure: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Local weights w_i, one per completion of this process (docs/math.md).

        ``sources``: what the batch's generation and TRL's forward computed (`generation_batch`), taken for the
        `logit` weights; None: the `logit` weights run a forward of their own.

        Each token's gradient enters the loss times a gain: the IS ratio ρ_t (vLLM correction) and the loss type's
        per-completion factor (1/L_i for a per-completion token mean); squared norms take the gains squared.
        ``measure`` (bool per local completion): the completions whose `exact` weight is measured, NaN for the others
        (`advantages.rows_whose_weights_matter`); the cheap estimators weigh every completion.
        """
        mask = loss_mask(output)
        estimator = self.args.baseline_weights
        if estimator == "uniform":
            return uniform_weights(mask)
        gains = loss_token_gains(mask, self.loss_type)
        if "importance_sampling_ratio" in output:  # the baseline optimal for the IS-corrected estimator
            gains = gains * output["importance_sampling_ratio"].float()
        if estimator == "length":
            return length_weights(mask, gains.square())
        if estimator == "logit":
            log_probs, log_sum_sq = self.logit_inputs(output, sources, mode)
            return logit_proxy_weights(log_probs, log_sum_sq, mask, gains.square())
        return self.exact_weights(output, mask.float() * gains, measure)

    def exact_weights(
        self, batch: dict[str, Any], token_scale: torch.Tensor, measure: torch.Tensor | None
    ) -> torch.Tensor:
        """`grad_sq_norms` of the completions in ``measure`` (all if None), NaN for the others.

        Under FSDP2 every process must run the same ghost-norm passes (each all-gathers the parameters layer by
        layer), so a process with fewer completions to measure pads them, as the trust region's sample is padded, with
        rows of token scale 0 up to the most any process measures; processes wait for each other there anyway.
        """
        rows = batch["completion_ids"].size(0)
        index = torch.arange(rows, device=token_scale.device) if measure is None else measure.nonzero().flatten()
        measured = len(index)
        if self.sharded:
            most = int(self.gather(torch.tensor([measured], device=token_scale.device)).max())
            index = torch.cat([index, index.new_zeros(most - measured)])
        scale = token_scale[index]
        scale[measured:] = 0.0
        weights = torch.full((rows,), float("nan"), device=token_scale.device)
        if len(index):
            subset = batch if measured == rows == len(index) else select_rows(batch, index, rows)
            weights[index[:measured]] = self.grad_sq_norms(subset, scale)[:measured]
        return weights

    def logit_inputs(
        self, output: dict[str, Any], sources: LogitSources | None, mode: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p_t(y_t) and log Σ_v p_t(v)² of the completion tokens, ``(B, T)`` like ``completion_ids``.

        From the logits generation already computed if ``sources`` has them, else from TRL's own no-grad forward if
        ``sources`` recorded one, else from one chunked no-grad forward of our own (logged as
        `oblr/weights/extra_forward`). Takes what it reads out of ``sources``.
        """
        metrics = self.metrics[mode]
        completion_ids = output["completion_ids"]
        captured, record = sources.take() if sources is not None else (None, None)
        if captured is not None and captured[0].size(0) == completion_ids.size(0):
            metrics["oblr/weights/extra_forward"].append(0.0)
            return tuple(_fit_width(t, completion_ids.size(1)) for t in captured)
        logits_to_keep = completion_ids.size(1)
        if record is not None and "old_per_token_logps" in output:
            chunks = record[: math.ceil(completion_ids.size(0) / self._forward_batch_size(mode))]
            if chunks:
                log_probs = torch.cat([lp for lp, _ in chunks])[:, -logits_to_keep:]
                if log_probs.shape == output["old_per_token_logps"].shape and torch.equal(
                    log_probs, output["old_per_token_logps"]
                ):
                    metrics["oblr/weights/extra_forward"].append(0.0)
                    return log_probs, torch.cat([lss for _, lss in chunks])[:, -logits_to_keep:]
            if not self._warned_no_reuse:
                warnings.warn("Could not reuse TRL's no-grad forward for the logit weights; running a separate one.")
                self._warned_no_reuse = True
        metrics["oblr/weights/extra_forward"].append(1.0)
        with self.recording_log_sum_sq() as record:
            log_probs = self.token_log_probs(output, mode)
        return log_probs, torch.cat([lss for _, lss in record])[:, -logits_to_keep:]

    def token_log_probs(self, batch: dict[str, Any], mode: str = "train") -> torch.Tensor:
        """log p_t(y_t) of the batch's completion tokens under the current policy: TRL's chunked forward, no grad."""
        input_ids, attention_mask, logits_to_keep = sequence_inputs(batch)
        multimodal = {key: batch[key] for key in _MULTIMODAL_KEYS if key in batch}
        with torch.no_grad():
            log_probs, _, _ = self.token_forward(
                input_ids, attention_mask, logits_to_keep, batch_size=self._forward_batch_size(mode), **multimodal
            )
        return log_probs

    def _forward_batch_size(self, mode: str) -> int:
        return self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size

    # Per-sample gradient norms ---------------------------------------------------------------------------------------

    def grad_sq_norms(self, batch: dict[str, Any], token_scale: torch.Tensor) -> torch.Tensor:
        """‖∇_θ Σ_t s_t log p_t(y_t)‖² per completion (`estimators.ghost_norms`), in chunks of `per_sample_batch_size`
        rows (None: `rows_per_pass`).

        A model with a layer the ghost norms do not know is measured by one backward per completion instead
        (`looped_grad_sq_norms`), after one warning naming the layer: slower, never wrong, never an error.
        """
        input_ids, attention_mask, logits_to_keep = sequence_inputs(batch)
        mode = "train" if self.model().training else "eval"
        size = self.args.per_sample_batch_size or self._forward_batch_size(mode)
        if self.ghost_norms_unsupported is None:
            initialise_fsdp2_root(self.model())
            try:
                # under the mixed precision the training forward runs in (accelerate wraps the model's own forward in
                # it; the pass calls the backbone directly): the gradients measured are the ones training computes,
                # and a float32 model under bf16 training is not measured in float32 (2.6× slower on an H100)
                layers = self.recomputed_layers()
                keep_checkpointing = contextlib.nullcontext() if layers else disable_gradient_checkpointing(
                    self.policy, self.args.gradient_checkpointing_kwargs
                )
                with keep_checkpointing, self.autocast():
                    rows = (size if self.args.per_sample_batch_size
                            else self.rows_per_pass(input_ids, size, len(layers)))
                    return torch.cat(
                        [
                            log_likelihood_grad_sq_norms(
                                self.policy,
                                input_ids[start : start + rows],
                                attention_mask[start : start + rows],
                                logits_to_keep,
                                token_scale[start : start + rows],
                                self.temperature,
                                checkpointed_layers=layers,
                            )
                            for start in range(0, input_ids.size(0), rows)
                        ]
                    )
            except NotImplementedError as error:
                self.ghost_norms_unsupported = str(error)
                self.refuse_parameter_gradients_under_fsdp2(str(error))
                warnings.warn(
                    f"{error} Per-sample gradient norms fall back to one backward per completion for this model "
                    "(correct, slower)."
                )
        return self.looped_grad_sq_norms(batch, token_scale, size)

    def rows_per_pass(self, input_ids: torch.Tensor, micro_batch: int, checkpointed_layers: int) -> int:
        """Rows per ghost-norm pass when `per_sample_batch_size` is None.

        As many of the ``input_ids``' rows as fit in the memory the pass may take, at `pass_bytes_per_row`'s upper
        estimate, never fewer than ``micro_batch`` (a training micro-batch): on a CUDA device 80 % of the memory this
        process has already needed and freed again — its peak so far (generation, earlier training steps) minus what
        is allocated now; on a CPU half of the memory the system has available. Fewer, larger passes: on an H100 each
        pass of a micro-batch was short enough that its fixed costs (kernel launches, the hooks) weighed (1.22 → 0.39
        s a step, 4 passes → 1); on 2 CPU cores a pass of 8 rows took 0.83× the time of two of 4 (larger products).
        On other devices ``micro_batch``. Under FSDP2 the smallest over the processes, which must run the same passes.
        Called under the pass's autocast.
        """
        device = input_ids.device
        if device.type == "cuda":
            headroom = 0.8 * (torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))
        elif device.type == "cpu":
            headroom = 0.5 * psutil.virtual_memory().available
        else:
            return micro_batch
        element_size = next(self.policy.parameters()).element_size()
        if torch.is_autocast_enabled(device.type):
            element_size = max(element_size, torch.get_autocast_dtype(device.type).itemsize)
        per_row = pass_bytes_per_row(self.policy.config, input_ids.size(1), element_size, checkpointed_layers)
        size = max(micro_batch, min(input_ids.size(0), int(headroom) // per_row))
        if self.sharded:
            size = int(self.gather(torch.tensor([size], device=device)).min())
        return size

    def recomputed_layers(self) -> list[torch.nn.Module]:
        """The policy's layers that the backward recomputes: transformers' checkpointed layers, in training mode,
        under non-reentrant checkpointing (transformers' and TRL's default). The ghost-norm pass keeps them
        checkpointed and holds one layer's activations at a time, as training does (on an H100 the pass without it
        held 7.8 GiB more than GRPO's whole LoRA step). Reentrant checkpointing cannot be differentiated by
        `torch.autograd.grad`: empty, and the pass runs with checkpointing off."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [
            module for module in self.policy.modules()
            if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing and module.training
        ]
        # transformers binds the checkpoint's keywords to the layer; torch's default is reentrant
        checkpoint_kwargs = [getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {})
                             for layer in layers]
        return layers if all(kwargs.get("use_reentrant", True) is False for kwargs in checkpoint_kwargs) else []

    def refuse_parameter_gradients_under_fsdp2(self, reason: str) -> None:
        """The per-row fallback differentiates with respect to the parameters, which FSDP2 holds as shards outside
        the autograd graph: under FSDP2 it would measure nothing, so it is refused instead."""
        if self.sharded:
            raise NotImplementedError(
                f"{reason} Under FSDP2 per-sample gradient norms come only from the ghost norms (the per-row fallback "
                "needs unsharded parameters). Use baseline_weights='logit' and snr_estimator='cross_step' (the "
                "defaults) for this model under FSDP2."
            )

    def looped_grad_sq_norms(self, batch: dict[str, Any], token_scale: torch.Tensor, size: int) -> torch.Tensor:
        """The same norms through the model's own forward (TRL's), one backward per completion: any architecture."""
        input_ids, attention_mask, logits_to_keep = sequence_inputs(batch)
        multimodal = {key: batch[key] for key in _MULTIMODAL_KEYS if key in batch}
        params = self.trainable_parameters()
        norms = []
        with torch.enable_grad(), disable_gradient_checkpointing(self.policy, self.args.gradient_checkpointing_kwargs):
            for start in range(0, input_ids.size(0), size):
                rows = slice(start, start + size)
                log_probs, _, _ = self.token_forward(
                    input_ids[rows], attention_mask[rows], logits_to_keep, batch_size=size,
                    **{key: value[rows] if torch.is_tensor(value) else value for key, value in multimodal.items()},
                )
                objectives = (log_probs * token_scale[rows].to(log_probs.dtype)).sum(-1)
                norms.append(
                    per_sample_grad_sq_norms(
                        lambda i, objectives=objectives: objectives[i], objectives.size(0), params, retain_graph=True,
                    )
                )
        return torch.cat(norms).detach()

    def loss_rows_grad_sq(
        self, loss: torch.Tensor, inputs: dict[str, Any], log_probs: torch.Tensor, entropies: torch.Tensor | None
    ) -> torch.Tensor:
        """Σ_i ‖∂loss_i/∂θ‖² over the rows of a training micro-batch (the `per_sample` SNR estimator).

        With v = ∂loss/∂(per-token log-probs), row i's gradient is ∇_θ Σ_t v_it log p_t: one batched ghost-norm pass.
        If the loss also depends on the entropies (an entropy bonus), one backward per row instead (`row_objective`).
        """
        outputs = [t for t in (log_probs, entropies) if t is not None and t.requires_grad]
        grads = dict(zip(map(id, outputs), torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)))
        if entropies is None or grads.get(id(entropies)) is None:
            return self.grad_sq_norms(inputs, grads[id(log_probs)].detach()).sum()
        self.refuse_parameter_gradients_under_fsdp2("The loss depends on the entropies (an entropy term).")
        pairs = [(o, grads[id(o)]) for o in outputs if grads[id(o)] is not None]
        objective = row_objective([o for o, _ in pairs], [g for _, g in pairs])
        params = self.trainable_parameters()
        return per_sample_grad_sq_norms(objective, log_probs.size(0), params, retain_graph=True).sum()


def loss_mask(output: dict[str, Any]) -> torch.Tensor:
    """The completion tokens the loss trains on (tool-call results masked out)."""
    mask = output["completion_mask"]
    return mask if "tool_mask" not in output else mask * output["tool_mask"]
