"""How far each optimizer step moved the policy, and the trust-region factor of the next step (docs/rate_rule.md).

[`StepKLRecorder`] is the trainer's collaborator for the step KL, as `StepNoiseRecorder` is for the SNR: the trainer
hands it each training micro-batch with the log-probabilities the loss computed (the policy before the step; no extra
forward), and after the optimizer step it runs one no-grad forward of each of the step's micro-batches under the
updated policy, sums the k3 estimates of KL(π_t ‖ π_{t+1}) and the token counts over processes (one collective), logs
the mean per token as `oblr/step_kl` and, with a `TrustRegionRate`, folds it into the curvature that sizes the next
step. With a rule, every step after the probe also logs `oblr/step_kl_target`, the KL the curvature known before the
step predicted for its rate (δ at the rule's rate), so that what a step aimed at and what it did sit side by side.

By default every token of the step counts; it costs one no-grad forward of the step's completions, as TRL's own
old-log-probability pass does when `num_iterations > 1`. With ``measure_every`` = k > 1 only the first step and every
k-th step after the last one measured are (k − 1 forwards in k saved), and every step until one has moved the policy
(a step at rate 0, the first of a warm-up, does not); the rule sizes the steps in between with the curvature it last
measured (the per-step curvature is mostly noise from one step to the next:
benchmarks/results/overhead/step_kl_sampling.md). With ``short_early_gaps`` (the `"per_update"` curvature) the steps
with a gradient 1, 2, 4, … apart are measured before the gap reaches k, because the curvature falls fastest over a
run's first steps (benchmarks/results/stability/kl_prediction.md). With a sample size n, the forward runs on n of the
step's completions only, drawn uniformly without replacement over every process's completions of the step (the same draw
in any process layout: a permutation of the step's global row order seeded by the run's seed and the step), and the
KL is the mean per token over the sampled completions' tokens. Either way the measurement does not depend on how the
step is split into micro-batches and processes (2 processes measure what 1 does). A sample is measured in one forward
per process, its drawn rows of every micro-batch together (a forward of a few rows costs about what a forward of one
does on a GPU: four forwards of 2 rows took 0.21 s a step on an H100, a fifth of the trainer's own part), or, where the
micro-batches' widths differ on some process, one forward per micro-batch. Every process runs as many forwards as the
others even when none of its rows was drawn (one row, counted with weight 0), because a sharded model (FSDP2, ZeRO-3)
needs every process in every forward. With `num_iterations > 1` or `steps_per_generation >
gradient_accumulation_steps` the tokens were sampled from an older policy than π_t; the k3 estimate then carries a
small bias of that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from ..estimators.trust_region import TrustRegionRate, sampled_token_kl

__all__ = ["StepKLRecorder"]


class StepKLRecorder:
    """The measured KL of each optimizer step and, optionally, the trust-region rule it drives.

    Args:
        rule: the trust-region rule fed with each step's KL and rate; None to measure and log only.
        token_log_probs: ``batch -> (B, T)`` log-probabilities of the batch's completion tokens under the current
            policy, without gradients (TRL's forward).
        reduce_sum: sums a tensor over processes.
        sample_size: the number of the step's completions (over all processes) measured; None: all of them.
        gather: concatenates a 1-D tensor over processes in process order (needed with ``sample_size``).
        process_index: this process's place in that order.
        seed: seed of the draws (the run's seed).
        measure_every: k: measure the first step and then every k-th step with a gradient after the last one
            measured (1: every step; with ``short_early_gaps``, steps 1, 2, 4, … apart first). The rule keeps the
            curvature it last measured in between; a step whose gradient is zero is not measured when k > 1 (it
            would not be folded in, `after_step`) and does not count.
        update_square_sum: ``() ->`` this process's ``[Σ u², count]`` of the optimizer's last update per unit rate
            (`estimators.trust_region.adam_update_square_sum`; None where the optimizer is not Adam's): its mean over
            processes is logged as `oblr/update_rms` on every measured step (every step when the rule reads per
            update) and handed to the rule.
        short_early_gaps: after the first reading, measure the steps with a gradient 1, 2, 4, … apart until the gap
            reaches k (`gap`).
    """

    def __init__(
        self,
        rule: TrustRegionRate | None,
        token_log_probs: Callable[[dict[str, Any]], torch.Tensor],
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        sample_size: int | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        process_index: int = 0,
        seed: int = 0,
        measure_every: int = 1,
        update_square_sum: Callable[[], torch.Tensor | None] | None = None,
        short_early_gaps: bool = False,
    ):
        if sample_size is not None and gather is None:
            raise ValueError("a sample of the step's completions needs `gather` to draw it over every process.")
        if measure_every < 1:
            raise ValueError(f"measure_every must be an integer >= 1; got {measure_every}.")
        self.rule = rule
        self.token_log_probs = token_log_probs
        self.reduce_sum = reduce_sum
        self.sample_size, self.gather, self.process_index, self.seed = sample_size, gather, process_index, seed
        self.measured_steps = 0  # seeds each step's draw; saved with the checkpoint so that a resume draws the same
        self.measure_every = measure_every
        self.update_square_sum = update_square_sum
        self.short_early_gaps = short_early_gaps
        self.unmeasured_steps = measure_every - 1  # steps with a gradient since the last one measured: the first is due
        self.readings = 0  # measured gradient steps folded into the rule's curvature: they set the `gap`
        self._batches: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []

    def keep(self, batch: dict[str, Any], log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        """A training micro-batch of this step and its log-probabilities before the step."""
        self._batches.append((batch, log_probs.detach(), mask))

    def after_step(self, lr: float | None, metrics: MutableMapping[str, list], grad_norm: float | None = None) -> None:
        """The optimizer stepped with rate ``lr`` (None: the step was refused) on a gradient of norm ``grad_norm``
        (None: unknown): measure and log the step's KL, and fold it into the rule unless the gradient was zero.

        A step whose gradient is zero (every group of the step scored alike, so every advantage is 0) still moves the
        parameters by the optimizer's momentum, a move much smaller than a gradient step of the same rate; its KL/lr²
        would understate the curvature the next gradient step meets (`estimators.trust_region`), so it is logged and
        not folded in."""
        kept, self._batches = self._batches, []
        if not kept or lr is None:  # no micro-batch ran, or the step was refused (on every process alike): no move
            return
        if self.rule is not None and not self.rule.probing:  # what the curvature known before the step predicted
            metrics["oblr/step_kl_target"].append(self.rule.aimed_kl(lr))
        due = self._due(grad_norm)
        # Adam's update size: every step where the rule reads per update, else only beside a measurement (its
        # collective and host sync stay off the steps that measure nothing)
        mean_square = (self._update_mean_square(kept[0][2].device)
                       if due or (self.rule is not None and self.rule.per_update) else None)
        if mean_square is not None:
            metrics["oblr/update_rms"].append(math.sqrt(mean_square))
            if self.rule is not None and grad_norm != 0.0:  # momentum alone moves less: not the next step's size
                self.rule.note_update(mean_square)
        if not due:
            self._log_rate(metrics)
            return
        with torch.no_grad():
            rows, largest = self._drawn_rows(kept)
            if largest:  # one forward of this process's drawn rows, padded to as many rows as any process has
                parts = [self._rows_of(micro_batch, drawn.nonzero().flatten(), 1.0)
                         for micro_batch, drawn in zip(kept, rows, strict=True) if drawn.any()]
                missing = largest - sum(old.size(0) for _, old, _ in parts)
                if missing:  # weight-0 rows: the same number of forward chunks on every process
                    parts.append(self._rows_of(kept[0], torch.zeros(missing, dtype=torch.long), 0.0))
                measured = [(concat_rows([batch for batch, _, _ in parts], parts[0][1].size(0)),
                             torch.cat([old for _, old, _ in parts]), torch.cat([weight for _, _, weight in parts]))]
            else:  # one forward per micro-batch: all its rows, or its drawn ones (one row with weight 0 if none)
                measured = [micro_batch if drawn is None else
                            self._rows_of(micro_batch, drawn.nonzero().flatten(), 1.0) if drawn.any() else
                            self._rows_of(micro_batch, torch.zeros(1, dtype=torch.long), 0.0)
                            for micro_batch, drawn in zip(kept, rows, strict=True)]
            sums = [torch.stack(sampled_token_kl(self.token_log_probs(batch), old, weight))
                    for batch, old, weight in measured]
            total, tokens = self.reduce_sum(torch.stack(sums).sum(0)).tolist()
        self.measured_steps += 1
        kl = total / tokens if tokens > 0 else float("nan")
        metrics["oblr/step_kl"].append(kl)
        if self.rule is not None and grad_norm != 0.0 and self.rule.update(kl, lr) and not self.rule.probing:
            self.readings += 1
        self._log_rate(metrics)

    def _update_mean_square(self, device: torch.device) -> float | None:
        """The mean square of the step's update per unit rate over every process's coordinates (one collective on
        every process alike), or None without a reader or an Adam state."""
        if self.update_square_sum is None:
            return None
        local = self.update_square_sum()
        local = torch.zeros(2, device=device) if local is None else local.to(device)
        total, count = self.reduce_sum(local).tolist()
        return total / count if count > 0 else None

    def _log_rate(self, metrics: MutableMapping[str, list]) -> None:
        """The rate the rule leaves for the next step (NaN before any measurement), with a rule."""
        if self.rule is not None:
            rate = self.rule.rate
            metrics["oblr/trust_region_rate"].append(rate if math.isfinite(rate) else float("nan"))

    @property
    def gap(self) -> int:
        """Steps with a gradient from one measurement to the next: ``measure_every``, or with ``short_early_gaps``
        1, 2, 4, … after the first readings until it reaches ``measure_every``. The curvature a step meets falls
        fastest over a run's first steps (Adam's update shrinks as v̂ accumulates, the policy sharpens), so a reading
        taken then goes stale soonest."""
        if not self.short_early_gaps:
            return self.measure_every
        return min(self.measure_every, 2 ** max(self.readings - 1, 0))

    def _due(self, grad_norm: float | None) -> bool:
        """Whether the step just taken is measured (`gap`); counts it among the unmeasured otherwise.
        Until a measured step has moved the policy the rule has no curvature to size the steps in between with, so
        every step with a gradient is measured: a warm-up that starts at rate 0 would otherwise hold the probe's
        factor for k steps. In the ``"peak"`` form the step after the probe is measured too (its reading replaces the
        probe's, `TrustRegionRate.needs_measurement`). Every process decides alike: the gradient norm, the step count
        and the rule's state are the same on all of them."""
        if self.measure_every == 1:
            return True
        if grad_norm == 0.0:
            return False
        if self.unmeasured_steps + 1 >= self.gap or (self.rule is not None and self.rule.needs_measurement):
            self.unmeasured_steps = 0
            return True
        self.unmeasured_steps += 1
        return False

    def _drawn_rows(self, kept: list) -> tuple[list[torch.Tensor | None], int]:
        """Per kept micro-batch, a boolean mask of its rows drawn for the measurement (None where every row counts);
        and, where every process can measure its drawn rows in one forward (its micro-batches' widths agree), the
        largest number of rows any process drew (0 otherwise)."""
        if self.sample_size is None:
            return [None] * len(kept), 0
        local = sum(mask.size(0) for _, _, mask in kept)
        widths = {tuple((key, tuple(value.shape[1:])) for key, value in batch.items() if _is_rows(value, mask.size(0)))
                  for batch, _, mask in kept}
        device = kept[0][2].device
        gathered = self.gather(torch.tensor([local, len(widths) == 1], dtype=torch.long, device=device)).cpu()
        counts, together = gathered.view(-1, 2).unbind(1)
        total = int(counts.sum())
        if self.sample_size >= total:
            return [None] * len(kept), 0
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.measured_steps)
        drawn = torch.zeros(total, dtype=torch.bool)
        drawn[torch.randperm(total, generator=generator)[: self.sample_size]] = True
        per_process = drawn.split(counts.tolist())
        mine = per_process[self.process_index]
        largest = max(int(d.sum()) for d in per_process) if together.all() else 0
        return list(mine.split([mask.size(0) for _, _, mask in kept])), largest

    @staticmethod
    def _rows_of(micro_batch: tuple, index: torch.Tensor, counted: float) -> tuple[dict[str, Any], torch.Tensor,
                                                                                      torch.Tensor]:
        """Rows ``index`` of a kept micro-batch, their old log-probabilities and token weights (its mask times
        ``counted``: 0 for a row measured only so that every process runs the same forwards)."""
        batch, old, mask = micro_batch
        index = index.to(mask.device)
        return select_rows(batch, index, mask.size(0)), old[index], mask[index] * counted

    def factor(self, base_lr: float, peak_lr: float | None = None) -> float:
        """The trust-region factor on ``base_lr`` (scheduled rate × SNR factor) for the next step, ``peak_lr`` the
        schedule's peak; 1 without a rule."""
        return 1.0 if self.rule is None else self.rule.factor(base_lr, peak_lr)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"measured_steps": self.measured_steps, "unmeasured_steps": self.unmeasured_steps,
                                 "readings": self.readings}
        if self.rule is not None:
            state["trust_region"] = self.rule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.measured_steps = int(state.get("measured_steps", 0))
        self.unmeasured_steps = int(state.get("unmeasured_steps", self.measure_every - 1))
        self.readings = int(state.get("readings", self.measure_every))  # not saved: past the short gaps
        if self.rule is not None and "trust_region" in state:
            self.rule.load_state_dict(state["trust_region"])


def _is_rows(value: Any, rows: int) -> bool:
    """Whether ``value`` is a per-row tensor of a micro-batch of ``rows`` rows."""
    return torch.is_tensor(value) and value.dim() > 0 and value.size(0) == rows


def select_rows(batch: dict[str, Any], index: torch.Tensor, rows: int) -> dict[str, Any]:
    """The rows ``index`` of a micro-batch of ``rows`` rows: every tensor whose first dimension is the rows, indexed;
    everything else (scalars, per-batch values) as is."""
    return {key: value[index.to(value.device)] if _is_rows(value, rows) else value for key, value in batch.items()}


def concat_rows(batches: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    """Micro-batches of equal widths as one: their per-row tensors (those of the first's ``rows`` rows) concatenated,
    everything else the first's."""
    return {
        key: torch.cat([batch[key] for batch in batches]) if _is_rows(value, rows) else value
        for key, value in batches[0].items()
    }
