"""What each optimizer step measured for the SNR-driven learning rate (docs/math.md).

The trainer tells a [`StepNoiseRecorder`] where a step is (a new generation batch, each training micro-batch, the
step's gradient norm once every micro-batch is in); the recorder sums the step's statistics over processes in one
collective, turns them into ‖μ‖² and tr Σ with the pure estimators of `oblr_trl.estimators.snr`, logs what it saw and
returns the estimate, which the trainer hands to the rate rule (`OptimizerStepControl.observe_noise`).

It reads gradients in one of two ways:

* **at the step's end** (the default `cross_step` estimator, outside DeepSpeed): after the last micro-batch, before
  clipping, the sketch is taken once of the accumulated ``.grad`` — the whole (process-averaged) gradient on one
  process or under DDP; under FSDP2 the rows each process holds, whose sketches add up over processes to the sketch
  of the whole gradient (`GradientSketch.add`). One sketch per step instead of one per micro-batch, and no hooks.
* **hooks** (`two_batch`, `per_sample`, and DeepSpeed, whose ZeRO optimizers keep gradients in their own buffers):
  `MicroBatchGradSqNorms` sees each micro-batch's local gradient h_k before it is reduced across processes, sums
  ‖h_k‖² and (`cross_step` under DeepSpeed) sketches it. FSDP2 never exposes a micro-batch gradient, so there
  `two_batch` is refused up front and `per_sample` reads only the per-sample norms.

The micro-batch norms, and with them the `snr/small_batch_grad_sq_norm` and `snr/two_batch/*` side metrics, exist
only with hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

import torch

from ..estimators.sketch import GradientSketch
from ..estimators.snr import (
    NoiseEstimate,
    cross_step_noise_estimate,
    per_sample_noise_estimate,
    two_batch_noise_estimate,
)
from .optim_hooks import MicroBatchGradSqNorms, sketch_step_gradients

__all__ = ["StepNoiseRecorder", "loss_scale"]


def loss_scale(scaler) -> float:
    """The fp16 loss scale a `GradScaler` multiplied the micro-batch gradients by (1 without one)."""
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


class StepNoiseRecorder:
    """Per-step bookkeeping of the SNR estimators (see the module docstring).

    Args:
        params: the trainable parameters, in a fixed order (their shapes size the sketch; hooks go on them unless
            ``sharded``).
        estimator: ``cross_step``, ``two_batch`` or ``per_sample`` (`OBLRPOConfig.snr_estimator`).
        num_generations: completions per prompt (``cross_step`` counts prompts as its samples).
        sharded: FSDP2 holds the parameters and gradients as shards: never hooks.
        gradients_in_grad: the accumulated gradient is in each parameter's ``.grad`` before clipping (False under
            DeepSpeed): ``cross_step`` sketches it there, once per step, instead of hooking every micro-batch.
        seed: seed of the sketch's projections (the same on every process).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        estimator: str,
        num_generations: int,
        *,
        sharded: bool = False,
        gradients_in_grad: bool = True,
        seed: int = 0,
    ):
        self.estimator = estimator
        self.num_generations = num_generations
        self.sharded = sharded
        # DeepSpeed ZeRO-3 keeps the full shape in `ds_shape` and an empty placeholder in `shape`
        shapes = [getattr(p, "ds_shape", p.shape) for p in params]
        self.sketch = GradientSketch(shapes, seed=seed) if estimator == "cross_step" else None
        self.sketch_at_step_end = self.sketch is not None and (sharded or gradients_in_grad)
        needs_hooks = not sharded and (estimator != "cross_step" or not gradients_in_grad)
        hooked_sketch = None if self.sketch_at_step_end else self.sketch
        self.hooks = MicroBatchGradSqNorms(params, hooked_sketch) if needs_hooks else None
        self.generation = 0  # training generation batches so far; two steps pair when they share none
        self.previous: tuple[torch.Tensor, set[int]] | None = None  # the last step's sketch and generation batches
        self._start_step()

    def _start_step(self) -> None:
        self.micro_batches = 0
        self.samples = 0
        self.per_sample_sq = torch.zeros((), dtype=torch.float32)
        self.generations: set[int] = set()
        self._step_end_read = False

    def new_generation(self) -> None:
        self.generation += 1

    def start_backward(self, samples: int) -> None:
        """A training micro-batch of ``samples`` completions: the backward that follows is the training one."""
        self.generations.add(self.generation)
        self.micro_batches += 1
        self.samples += samples
        if self.hooks is not None:
            self.hooks.active = True

    def end_backward(self) -> None:
        if self.hooks is not None:
            self.hooks.active = False

    def add_per_sample_sq(self, value: torch.Tensor) -> None:
        """Σ_i ‖c_i‖² of a micro-batch's rows (``per_sample``)."""
        self.per_sample_sq = self.per_sample_sq.to(value.device) + value.detach().float()

    def read_step_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sketch the step's accumulated gradient (this process's rows of it under FSDP2), once per step and before
        clipping changes it."""
        if self.sketch_at_step_end and not self._step_end_read:
            sketch_step_gradients([p for p in params if p.requires_grad], self.sketch, self.sharded)
            self._step_end_read = True

    def finish_step(
        self,
        grad_norm: float,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        processes: int,
        loss_scale: float,
        metrics: MutableMapping[str, list],
    ) -> tuple[NoiseEstimate | None, float, float]:
        """Measure ‖μ‖² and tr Σ of the step that just finished and log them; returns the estimate (None where the
        step has no independent partner), the samples it counts (prompts for ``cross_step``, else completions) and
        the step's completions.

        Scales (W processes, K micro-batches h_k in all, N samples): the optimizer's gradient is G_N = (1/W) Σ_k h_k,
        so the micro-batch estimate of the same mean is (K/W)·h_k and |G_b|² = K Σ_k ‖h_k‖² / W², with b = N/K.
        Per-sample: the estimate from row i is (N/W)·c_i, with c_i its contribution to Σ_k h_k. Cross-step: with
        hooks the sketch of G_N is the sum of the processes' sketches of their Σ_k h_k, over W; read at the step's end
        it is the sum of W identical sketches of G_N, over W (DDP), or of the processes' rows of G_N (FSDP2). Both
        see the gradients before the fp16 loss scale S is taken off: norms are divided by S², sketches by S.
        """
        if self.sketch_at_step_end and not self._step_end_read and self.micro_batches:
            raise RuntimeError(
                "The SNR estimator did not read this step's gradient before clipping: the Trainer did not call "
                "`_clip_grad_norm` / `_get_grad_norm` where oblr-trl reads it (tested with transformers 5.23). Use "
                "that version, or set use_snr_lr=False."
            )
        stats = torch.stack(
            [
                self.hooks.pop(device) if self.hooks is not None else torch.zeros((), device=device),
                torch.tensor(float(self.micro_batches), device=device),
                torch.tensor(float(self.samples), device=device),
                self.per_sample_sq.to(device),
            ]
        )
        if self.sketch is not None:  # one collective for the scalars and the sketch
            stats = torch.cat([stats, self.sketch.pop(device)])
        generations = self.generations
        self._start_step()
        reduced = reduce_sum(stats)
        micro_sq, micro_batches, samples, per_sample_sq = reduced[:4].tolist()
        micro_sq /= loss_scale**2
        full_sq = grad_norm**2
        if self.hooks is not None and micro_batches >= 1 and micro_sq == 0.0 and full_sq > 0.0:
            raise RuntimeError(
                "The SNR estimator saw no micro-batch gradient although the step gradient is not zero: this backend "
                "does not route gradients through the parameters' hooks. Set use_snr_lr=False to train without the "
                "SNR learning-rate factor."
            )
        metrics["snr/full_batch_grad_sq_norm"].append(full_sq)
        units = samples  # what N counts in f = N·SNR/(1 + N·SNR): completions, or prompts for cross_step

        two_batch = None
        if self.hooks is not None and micro_batches >= 2:
            small_sq = micro_batches * micro_sq / processes**2
            two_batch = two_batch_noise_estimate(small_sq, samples / micro_batches, full_sq, samples)
            metrics["snr/small_batch_grad_sq_norm"].append(small_sq)
        if self.estimator == "per_sample":
            estimate = per_sample_noise_estimate((samples / processes) ** 2 * per_sample_sq, full_sq, samples)
        elif self.estimator == "cross_step":
            units = samples / self.num_generations
            sketch = reduced[4:] / ((1 if self.sharded else processes) * loss_scale)
            estimate = self._cross_step_estimate(sketch, generations, full_sq, units)
        else:
            estimate = two_batch if two_batch is not None else NoiseEstimate(float("nan"), float("nan"))
        if two_batch is not None and self.estimator != "two_batch":
            metrics["snr/two_batch/grad_sq_norm"].append(two_batch.grad_sq_norm)
            metrics["snr/two_batch/trace_cov"].append(two_batch.trace_cov)

        if estimate is not None and estimate.is_finite:
            metrics["snr/grad_sq_norm"].append(estimate.grad_sq_norm)
            metrics["snr/trace_cov"].append(estimate.trace_cov)
        metrics["oblr/completions_per_step"].append(samples)
        return estimate, units, samples

    def _cross_step_estimate(
        self, sketch: torch.Tensor, generations: set[int], full_sq: float, groups: float
    ) -> NoiseEstimate | None:
        """Pair this step's gradient sketch with the previous step's when their generation batches are disjoint."""
        previous, self.previous = self.previous, None
        if bool(torch.isfinite(sketch).all()):
            self.previous = (sketch, generations)
        if previous is None or previous[1] & generations:
            return None  # no independent pair: not an estimate, and not a failed one
        dot = float(torch.dot(sketch, previous[0].to(sketch.device)))
        return cross_step_noise_estimate(full_sq, dot, groups)

    # Checkpoints ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (the last step's sketch is saved apart: `previous_sketch_state`)."""
        return {"generation_count": self.generation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generation = int(state.get("generation_count", 0))

    def previous_sketch_state(self) -> dict[str, Any] | None:
        if self.previous is None:
            return None
        sketch, generations = self.previous
        return {"sketch": sketch.cpu(), "generations": sorted(generations)}

    def load_previous_sketch_state(self, saved: dict[str, Any], device: torch.device) -> None:
        self.previous = (saved["sketch"].to(device), set(saved["generations"]))
