"""How far each optimizer step moved the policy, and the trust-region factor of the next step (DESIGN §2).

[`StepKLRecorder`] is the trainer's collaborator for the step KL, as `StepNoiseRecorder` is for the SNR: the trainer
hands it each training micro-batch with the log-probabilities the loss computed (the policy before the step; no extra
forward), and after the optimizer step it runs one no-grad forward of each of the step's micro-batches under the
updated policy, sums the k3 estimates of KL(π_t ‖ π_{t+1}) and the token counts over processes (one collective), logs
the mean per token as `oblr/step_kl` and, with a `TrustRegionRate`, folds it into the curvature that sizes the next
step.

Every token of the step counts, so the measurement does not depend on how the step is split into micro-batches and
processes (2 processes measure what 1 does); it costs one no-grad forward of the step's completions, as TRL's own
old-log-probability pass does when `num_iterations > 1`. With `num_iterations > 1` or `steps_per_generation >
gradient_accumulation_steps` the tokens were sampled from an older policy than π_t; the k3 estimate then carries a
small bias of that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from .trust_region import TrustRegionRate, sampled_token_kl

__all__ = ["StepKLRecorder"]


class StepKLRecorder:
    """The measured KL of each optimizer step and, optionally, the trust-region rule it drives.

    Args:
        rule: the trust-region rule fed with each step's KL and rate; None to measure and log only.
        token_log_probs: ``batch -> (B, T)`` log-probabilities of the batch's completion tokens under the current
            policy, without gradients (TRL's forward).
        reduce_sum: sums a tensor over processes.
    """

    def __init__(
        self,
        rule: TrustRegionRate | None,
        token_log_probs: Callable[[dict[str, Any]], torch.Tensor],
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.rule = rule
        self.token_log_probs = token_log_probs
        self.reduce_sum = reduce_sum
        self._batches: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []

    def keep(self, batch: dict[str, Any], log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        """A training micro-batch of this step and its log-probabilities before the step."""
        self._batches.append((batch, log_probs.detach(), mask))

    def after_step(self, lr: float | None, metrics: MutableMapping[str, list], grad_norm: float | None = None) -> None:
        """The optimizer stepped with rate ``lr`` (None: the step was refused) on a gradient of norm ``grad_norm``
        (None: unknown): measure and log the step's KL, and fold it into the rule unless the gradient was zero.

        A step whose gradient is zero (every group of the step scored alike, so every advantage is 0) still moves the
        parameters by the optimizer's momentum, a move much smaller than a gradient step of the same rate; its KL/lr²
        would understate the curvature the next gradient step meets (`oblr_trl.trust_region`), so it is logged and
        not folded in."""
        kept, self._batches = self._batches, []
        if not kept or lr is None:  # no micro-batch ran, or the step was refused (on every process alike): no move
            return
        with torch.no_grad():
            sums = [torch.stack(sampled_token_kl(self.token_log_probs(batch), old, mask)) for batch, old, mask in kept]
            total, tokens = self.reduce_sum(torch.stack(sums).sum(0)).tolist()
        kl = total / tokens if tokens > 0 else float("nan")
        metrics["oblr/step_kl"].append(kl)
        if self.rule is not None:
            if grad_norm != 0.0:
                self.rule.update(kl, lr)
            rate = self.rule.rate
            metrics["oblr/trust_region_rate"].append(rate if math.isfinite(rate) else float("nan"))

    def factor(self, base_lr: float) -> float:
        """The trust-region factor on ``base_lr`` (scheduled rate × SNR factor) for the next step; 1 without a rule."""
        return 1.0 if self.rule is None else self.rule.factor(base_lr)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.rule is None else {"trust_region": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rule is not None and "trust_region" in state:
            self.rule.load_state_dict(state["trust_region"])
