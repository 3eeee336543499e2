"""Backend glue: where the trainer reads gradients and sets the step's learning rate.

Two small pieces, each the single place that touches a training backend:

* [`MicroBatchGradSqNorms`] sums ‖h_k‖² over the micro-batch gradients h_k of an optimizer step (and, optionally, a
  random-projection sketch of Σ_k h_k for the cross-step SNR estimator). It registers a hook
  on every trainable parameter; a hook on a leaf tensor sees the gradient of the current backward *before* it is added
  to ``.grad`` and before DDP or DeepSpeed reduce it across ranks, so each micro-batch's local gradient is observed
  without keeping a copy of the accumulated one.
* [`sketch_step_gradients`] sketches the step's accumulated gradients once, after the last backward: whole tensors
  (one process, DDP) or the rows of each gradient a process holds under FSDP2, where no hook ever sees a micro-batch
  gradient (the parameters are sharded DTensors, the gradients are reduce-scattered into them).
* [`StepLearningRateScale`] multiplies every param group's learning rate by a factor for the duration of one
  ``optimizer.step()`` and puts the scheduled value back afterwards. It hooks the innermost torch optimizer, which
  every backend ends up stepping, also when DeepSpeed runs the step inside ``backward``.
* [`OptimizerStepGate`] refuses a step (non-finite loss, gradient norm or factor), on the same innermost optimizer.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Sequence

import torch

from ..estimators.sketch import GradientSketch

__all__ = [
    "MicroBatchGradSqNorms",
    "OptimizerStepGate",
    "StepLearningRateScale",
    "innermost_optimizer",
    "sketch_step_gradients",
]


class MicroBatchGradSqNorms:
    """Accumulates Σ_k ‖h_k‖² of the gradients that reach the given parameters while ``active`` is True.

    Hooks also fire for ``torch.autograd.grad`` calls (per-sample norms, `exact` weights); the owner sets ``active``
    only around the training backward. With a ``sketch`` (`estimators.sketch.GradientSketch` built for the same
    parameters, in the same order), each gradient is also added to it.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], sketch: GradientSketch | None = None):
        self.active = False
        self.sketch = sketch
        self._total: torch.Tensor | None = None
        trainable = [p for p in params if p.requires_grad]
        self._handles = [p.register_hook(self._hook(index)) for index, p in enumerate(trainable)]
        if not self._handles:
            raise ValueError("no trainable parameters to measure gradients on.")

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        return lambda grad: self._accumulate(index, grad)

    def _accumulate(self, index: int, grad: torch.Tensor) -> None:
        if not self.active:
            return
        sq = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).square()
        self._total = sq if self._total is None else self._total + sq.to(self._total.device)
        if self.sketch is not None:
            self.sketch.add(index, grad)

    def pop(self, device: torch.device) -> torch.Tensor:
        """Σ_k ‖h_k‖² since the last call (a float32 scalar on ``device``), and reset."""
        total = torch.zeros((), dtype=torch.float32, device=device) if self._total is None else self._total.to(device)
        self._total = None
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def sketch_step_gradients(params: Sequence[torch.nn.Parameter], sketch: GradientSketch, sharded: bool) -> None:
    """Add the ``.grad`` this process holds of every parameter to ``sketch``, after the step's last backward.

    Unsharded (one process, DDP): the whole accumulated gradient. ``sharded`` (FSDP2): each gradient is a DTensor
    sharded on its first dimension over a 1-D device mesh, split the way
    ``torch.chunk`` splits: of n rows and W processes, process r holds rows r·c … min((r+1)·c, n) with c = ⌈n/W⌉ (the
    last processes may hold fewer rows, or none). ``params`` are in the order ``sketch`` was built for. Any other
    layout (HSDP's 2-D mesh, tensor parallelism) raises instead of measuring a wrong gradient.
    """
    from torch.distributed.tensor import DTensor, Shard

    for index, param in enumerate(params):
        grad = param.grad
        if grad is None:
            continue
        if not sharded:
            sketch.add(index, grad)
            continue
        if not isinstance(grad, DTensor):
            raise NotImplementedError(
                f"parameter {index} (shape {tuple(param.shape)}) has a gradient that is not a sharded DTensor under "
                "FSDP2: its sketch would count a local gradient as the step's. Shard every trainable parameter with "
                "FSDP2, or set use_snr_lr=False."
            )
        mesh, placements = grad.device_mesh, tuple(grad.placements)
        if mesh.ndim != 1 or placements != (Shard(0),):
            raise NotImplementedError(
                f"parameter {index} (shape {tuple(grad.shape)}): the SNR estimator reads FSDP2 gradients sharded on "
                f"their first dimension over a 1-D mesh; this one is placed {placements} on a {mesh.ndim}-D mesh "
                "(HSDP or tensor parallelism). Set use_snr_lr=False for this layout."
            )
        local, rows = grad.to_local(), grad.shape[0]
        chunk = -(-rows // mesh.size())
        start = min(mesh.get_local_rank() * chunk, rows)
        if local.shape[0] != min(chunk, rows - start):
            raise NotImplementedError(
                f"parameter {index} (shape {tuple(grad.shape)}): this process holds {local.shape[0]} rows of its "
                f"gradient where torch.chunk's split gives {min(chunk, rows - start)}; the SNR estimator cannot place "
                "them. Set use_snr_lr=False."
            )
        if local.numel():
            sketch.add(index, local, start)


def innermost_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that actually updates the parameters, under accelerate's and DeepSpeed's wrappers.

    accelerate's ``AcceleratedOptimizer`` and DeepSpeed's ZeRO / bf16 optimizers all keep the wrapped optimizer in an
    ``optimizer`` attribute; plain torch optimizers have none.
    """
    seen = set()
    while getattr(optimizer, "optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer under the wrappers, found {type(optimizer).__name__}.")
    return optimizer


class StepLearningRateScale:
    """Scales the learning rate of each ``step()`` of an optimizer by ``factor_fn()``, only during that step.

    ``on_scaled(scheduled_lr, factor)`` is called once per step with the first group's scheduled learning rate, for
    logging.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        factor_fn: Callable[[], float],
        on_scaled: Callable[[float, float], None] | None = None,
    ):
        self.optimizer = innermost_optimizer(optimizer)
        self.factor_fn = factor_fn
        self.on_scaled = on_scaled
        self._scheduled: list[float] | None = None
        self._handles = [
            self.optimizer.register_step_pre_hook(self._scale),
            self.optimizer.register_step_post_hook(self._restore),
        ]

    def _scale(self, optimizer, args, kwargs) -> None:
        factor = float(self.factor_fn())
        self._scheduled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self._scheduled, strict=True):
            # out of place: some optimizers keep the rate as a tensor (capturable / fused Adam)
            group["lr"] = lr * factor
        if self.on_scaled is not None:
            self.on_scaled(float(self._scheduled[0]), factor)

    def _restore(self, optimizer, args, kwargs) -> None:
        if self._scheduled is None:
            return
        for group, lr in zip(optimizer.param_groups, self._scheduled, strict=True):
            group["lr"] = lr
        self._scheduled = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class OptimizerStepGate:
    """Lets ``optimizer.step()`` through only when ``allowed()`` says so; otherwise the step is skipped entirely.

    Skipping the step (rather than zeroing gradients or the learning rate) also keeps non-finite gradients out of the
    optimizer's state (Adam's moments). ``on_skip()`` is called for each refused step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, allowed: Callable[[], bool], on_skip: Callable[[], None]):
        self.optimizer = innermost_optimizer(optimizer)
        self._original_step = self.optimizer.step
        self.allowed, self.on_skip = allowed, on_skip

        def gated_step(optimizer, *args, **kwargs):
            if self.allowed():
                return self._original_step(*args, **kwargs)
            self.on_skip()
            return None

        # a bound method, like the step it replaces: torch's LR schedulers wrap `step.__func__`
        self.optimizer.step = types.MethodType(gated_step, self.optimizer)

    def remove(self) -> None:
        self.optimizer.step = self._original_step
