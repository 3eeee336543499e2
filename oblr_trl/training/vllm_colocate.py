"""Glue for TRL's colocated vLLM engine (`use_vllm=True, vllm_mode="colocate"`): what TRL 1.16 leaves to the engine.

* **The dtype it samples in.** TRL builds `vllm.LLM(...)` without a `dtype`, so vLLM reads the checkpoint's
  (`"auto"`): a float32 policy trained on a CPU was sampled in bfloat16, and the sampling log-probabilities differed
  from the trainer's by 0.03 a token (mean) before any update. `vllm_loads_in` passes the dtype the policy's forward
  computes in: the autocast dtype under `bf16`/`fp16`, the parameters' otherwise.
* **Weights on vLLM's CPU backend.** After loading, that backend packs every linear layer's weight into a oneDNN
  handle and drops the parameter, so TRL's per-parameter `load_weights` sync fails (`'Parameter' object has no
  attribute 'weight_loader'`). `track_repacked_weights` runs TRL's sync inside vLLM's layerwise reload, which restores
  the layers, loads the weights and packs them again, and repacks the layers that keep their weight (the embeddings
  and a tied head, whose packed copy would otherwise stay stale).
* **Shutdown.** vLLM tears its engine down from a finalizer at interpreter exit; by then the CLI has destroyed the
  process group the engine's groups belong to, and the teardown prints a traceback. `close_colocated_vllm` shuts the
  engine down while the group still exists.

`ColocatedVLLMSetup` applies the first two to any `GRPOTrainer` subclass (`OBLRPOTrainer`, and the benchmarks' GRPO
reference on vLLM's CPU build).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["ColocatedVLLMSetup", "close_colocated_vllm", "generation_dtype", "track_repacked_weights", "vllm_loads_in"]


def generation_dtype(model: torch.nn.Module, bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype the policy's forward computes in: the autocast dtype of mixed precision, else its parameters'."""
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@contextmanager
def vllm_loads_in(dtype_of: Callable[[], torch.dtype]) -> Iterator[None]:
    """While the trainer is built, TRL's colocated `LLM(...)` gets ``dtype=dtype_of()`` unless a dtype is given."""
    module = sys.modules.get("trl.generation.vllm_generation")
    engine = getattr(module, "LLM", None)
    if engine is None:  # vLLM not installed: TRL builds no engine
        yield
        return

    def loaded_in_policy_dtype(*args, **kwargs):
        kwargs.setdefault("dtype", str(dtype_of()).removeprefix("torch."))
        return engine(*args, **kwargs)

    module.LLM = loaded_in_policy_dtype
    try:
        yield
    finally:
        module.LLM = engine


def track_repacked_weights(generation) -> bool:
    """Make ``generation.sync_weights`` (TRL's `VLLMGeneration`) reach a colocated engine on vLLM's CPU backend;
    returns whether it needed to (no engine, or another platform: TRL's sync is left as it is)."""
    llm = getattr(generation, "llm", None)
    runner = getattr(getattr(getattr(getattr(llm, "llm_engine", None), "model_executor", None), "driver_worker", None),
                     "model_runner", None)  # where TRL's sync loads the weights
    modules = getattr(getattr(runner, "model", None), "modules", None)
    if modules is None or not any(hasattr(module, "cpu_linear") for module in modules()):  # not the CPU build
        return False
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    sync = generation.sync_weights

    def sync_weights() -> None:
        model = runner.model
        initialize_layerwise_reload(model)
        sync()
        finalize_layerwise_reload(model, runner.model_config)
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
                module.quant_method.process_weights_after_loading(module)

    generation.sync_weights = sync_weights
    return True


class ColocatedVLLMSetup:
    """Mixin before `trl.GRPOTrainer` in a trainer's bases: its colocated engine loads in the dtype the policy computes
    in (`vllm_loads_in`) and its weight sync reaches vLLM's CPU backend (`track_repacked_weights`)."""

    def __init__(self, model, reward_funcs=None, args=None, *trainer_args, **trainer_kwargs):
        with vllm_loads_in(lambda: generation_dtype(self.model, self.args.bf16, self.args.fp16)):
            super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        if self.use_vllm and self.args.vllm_mode == "colocate":
            track_repacked_weights(self.vllm_generation)


def close_colocated_vllm(trainer) -> None:
    """Shut down the trainer's colocated vLLM engine, if it has one, while the process group still exists."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
