"""How far each optimizer step moved the policy (docs/rate_rule.md).

[`StepKLRecorder`] is the trainer's collaborator for the step KL, as `StepNoiseRecorder` is for the SNR: the trainer
hands it each training micro-batch with the log-probabilities the loss computed (the policy before the step; no extra
forward), and after the optimizer step, where the rate rule asks for it (`estimators.step_rate.StepRateRule`), it runs
one no-grad forward of each of the step's micro-batches under the updated policy and sums the k3 estimates of
KL(π_t ‖ π_{t+1}) and the token counts over processes (one collective): the mean per token is the step's KL.

By default every token of the step counts; it costs one no-grad forward of the step's completions, as TRL's own
old-log-probability pass does when `num_iterations > 1`. With a sample size n, the forward runs on n of the
step's completions only, drawn uniformly without replacement over every process's completions of the step (the same
draw in any process layout: a permutation of the step's global row order seeded by the run's seed and the step), and the
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

from collections.abc import Callable
from typing import Any

import torch

from ..estimators.trust_region import sampled_token_kl

__all__ = ["StepKLRecorder"]


class StepKLRecorder:
    """The measured KL of an optimizer step, on its completions.

    Args:
        token_log_probs: ``batch -> (B, T)`` log-probabilities of the batch's completion tokens under the current
            policy, without gradients (TRL's forward).
        reduce_sum: sums a tensor over processes.
        sample_size: the number of the step's completions (over all processes) measured; None: all of them.
        gather: concatenates a 1-D tensor over processes in process order (needed with ``sample_size``).
        process_index: this process's place in that order.
        seed: seed of the draws (the run's seed).
    """

    def __init__(
        self,
        token_log_probs: Callable[[dict[str, Any]], torch.Tensor],
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        sample_size: int | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        process_index: int = 0,
        seed: int = 0,
    ):
        if sample_size is not None and gather is None:
            raise ValueError("a sample of the step's completions needs `gather` to draw it over every process.")
        self.token_log_probs = token_log_probs
        self.reduce_sum = reduce_sum
        self.sample_size, self.gather, self.process_index, self.seed = sample_size, gather, process_index, seed
        self.measured_steps = 0  # seeds each step's draw; saved with the checkpoint so that a resume draws the same
        self._batches: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []

    def keep(self, batch: dict[str, Any], log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        """A training micro-batch of this step and its log-probabilities before the step."""
        self._batches.append((batch, log_probs.detach(), mask))

    def after_step(self, measure: bool) -> float | None:
        """The optimizer step ran: with ``measure``, its KL per token on the kept micro-batches (NaN without a token;
        None where no micro-batch was kept); the micro-batches are forgotten either way."""
        kept, self._batches = self._batches, []
        if not measure or not kept:
            return None
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
        return total / tokens if tokens > 0 else float("nan")

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

    def state_dict(self) -> dict[str, Any]:
        return {"measured_steps": self.measured_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.measured_steps = int(state.get("measured_steps", 0))


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
