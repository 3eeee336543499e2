"""What each optimizer step measured for the SNR-driven learning rate, and the factor of the next step (DESIGN §2, §3).

The trainer tells a [`StepNoiseRecorder`] where a step is (a new generation batch, each training micro-batch, the
step's gradient norm once every micro-batch is in); the recorder sums the step's statistics over processes in one
collective, turns them into ‖μ‖² and tr Σ with the pure estimators of `oblr_trl.snr`, feeds the
`SNRLearningRateController`, logs what it saw and leaves the factor of the next step in ``next_factor``.

It reads gradients in one of two ways, chosen by the backend:

* **hooks** (one process, DDP, DeepSpeed): `MicroBatchGradSqNorms` sees each micro-batch's local gradient h_k before
  it is reduced across processes, and sketches it for the cross-step estimator.
* **shards** (FSDP2): gradients exist only reduced and sharded. After the last micro-batch, before clipping, each
  process sketches the rows it holds of the step's (process-averaged) gradient; summed over processes this is the
  sketch of the whole gradient, the same as one process computes (`GradientSketch.add`). No micro-batch gradient is
  ever visible, so `two_batch` cannot run there (the trainer refuses it up front) and its side metrics are not logged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

import torch

from .optim_hooks import MicroBatchGradSqNorms, sketch_gradient_shards
from .sketch import GradientSketch
from .snr import (
    NoiseEstimate,
    SNRLearningRateController,
    cross_step_noise_estimate,
    per_sample_noise_estimate,
    two_batch_noise_estimate,
)

__all__ = ["StepNoiseRecorder"]


class StepNoiseRecorder:
    """Per-step bookkeeping of the SNR estimators (see the module docstring).

    Args:
        params: the trainable parameters, in a fixed order (their shapes size the sketch; hooks go on them unless
            ``sharded``).
        controller: turns the step estimates into the learning-rate factor.
        estimator: ``cross_step``, ``two_batch`` or ``per_sample`` (`OBLRPOConfig.snr_estimator`).
        num_generations: completions per prompt (``cross_step`` counts prompts as its samples).
        sharded: gradients are read from FSDP2 shards at the end of the step instead of hooks.
        seed: seed of the sketch's projections (the same on every process).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        controller: SNRLearningRateController,
        estimator: str,
        num_generations: int,
        *,
        sharded: bool = False,
        seed: int = 0,
    ):
        self.controller = controller
        self.estimator = estimator
        self.num_generations = num_generations
        self.sharded = sharded
        # DeepSpeed ZeRO-3 keeps the full shape in `ds_shape` and an empty placeholder in `shape`
        shapes = [getattr(p, "ds_shape", p.shape) for p in params]
        self.sketch = GradientSketch(shapes, seed=seed) if estimator == "cross_step" else None
        self.hooks = None if sharded else MicroBatchGradSqNorms(params, self.sketch)
        self.next_factor = 1.0
        self.generation = 0  # training generation batches so far; two steps pair when they share none
        self.previous: tuple[torch.Tensor, set[int]] | None = None  # the last step's sketch and generation batches
        self._start_step()

    def _start_step(self) -> None:
        self.micro_batches = 0
        self.samples = 0
        self.per_sample_sq = torch.zeros((), dtype=torch.float32)
        self.generations: set[int] = set()
        self._shards_read = False

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

    def read_shards(self, params: Iterable[torch.nn.Parameter]) -> None:
        """FSDP2: sketch this process's rows of the step's gradient, once per step and before clipping changes it."""
        if self.sharded and self.sketch is not None and not self._shards_read:
            sketch_gradient_shards([p for p in params if p.requires_grad], self.sketch)
            self._shards_read = True

    def finish_step(
        self,
        grad_norm: float,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        processes: int,
        loss_scale: float,
        metrics: MutableMapping[str, list],
    ) -> None:
        """Measure ‖μ‖² and tr Σ of the step that just finished, log them and set ``next_factor``.

        Scales (W processes, K micro-batches h_k in all, N samples): the optimizer's gradient is G_N = (1/W) Σ_k h_k,
        so the micro-batch estimate of the same mean is (K/W)·h_k and |G_b|² = K Σ_k ‖h_k‖² / W², with b = N/K.
        Per-sample: the estimate from row i is (N/W)·c_i, with c_i its contribution to Σ_k h_k. Cross-step: with
        hooks the sketch of G_N is the sum of the processes' sketches of their Σ_k h_k, over W; with shards it is
        the sum of the processes' sketches of their rows of G_N. Hooks and shards see the gradients before the fp16
        loss scale S is taken off: norms are divided by S², sketches by S.
        """
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

        controller = self.controller
        if estimate is not None and controller.update(estimate):
            metrics["snr/grad_sq_norm"].append(estimate.grad_sq_norm)
            metrics["snr/trace_cov"].append(estimate.trace_cov)
        metrics["snr/skipped_steps"].append(float(controller.skipped))
        snr = controller.snr
        metrics["snr/grad_sq_norm_ema"].append(controller.grad_sq_norm.value)
        metrics["snr/trace_cov_ema"].append(controller.trace_cov.value)
        metrics["snr/snr"].append(snr if math.isfinite(snr) else float("nan"))
        metrics["snr/noise_scale"].append(1.0 / snr if math.isfinite(snr) and snr > 0 else float("nan"))
        metrics["snr/bound_factor"].append(controller.bound_factor(units))
        metrics["snr/resolved"].append(float(controller.resolved))
        if controller.reference == "calibrated":
            if math.isfinite(controller.calibration.t_statistic):
                metrics["snr/calibration_t"].append(controller.calibration.t_statistic)
            if controller.calibration.resolved:
                metrics["snr/reference_factor"].append(controller.calibration.reference(units))
        self.next_factor = controller.factor(units)

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
        return {"snr_controller": self.controller.state_dict(), "next_lr_factor": self.next_factor,
                "generation_count": self.generation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state["snr_controller"])
        self.next_factor = float(state["next_lr_factor"])
        self.generation = int(state.get("generation_count", 0))

    def previous_sketch_state(self) -> dict[str, Any] | None:
        if self.previous is None:
            return None
        sketch, generations = self.previous
        return {"sketch": sketch.cpu(), "generations": sorted(generations)}

    def load_previous_sketch_state(self, saved: dict[str, Any], device: torch.device) -> None:
        self.previous = (saved["sketch"].to(device), set(saved["generations"]))
