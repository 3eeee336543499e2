"""Backend glue: read the logit-proxy inputs off the logits that generation computes anyway.

When transformers' `generate` samples a completion it computes, at every step, the next-token logits of every
sequence. The `logit` weights need, per completion token, log p_t(y_t) and log Σ_v p_t(v)² of the temperature-scaled
distribution — two reductions over those logits. A forward hook on the policy collects them as generation runs, so no
extra forward pass is needed for the weights.

The hook sees step t's logits before y_t is sampled; it keeps that step's log-probabilities and reads log p_t(y_t) at
step t+1, whose input is y_t. The last step's token is read from the finished completions.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["GenerationLogitStats", "empty_completions_as_eos"]


def empty_completions_as_eos(completion_ids: list, logprobs: list | None, eos: int) -> tuple[list, list | None, int]:
    """A generator can return no token at all (vLLM at the context limit, a custom rollout); TRL cannot score such
    a completion. Read it as the model stopping at once: a lone ``eos`` (its sampling log-probability unknown, so no
    importance-sampling correction). Returns the completions, their log-probabilities and how many were empty."""
    empty = sum(1 for ids in completion_ids if len(ids) == 0)
    if not empty:
        return completion_ids, logprobs, 0
    warnings.warn(f"{empty} empty completion(s) read as a lone EOS token (counted in oblr/empty_completions).")
    if logprobs is not None:
        logprobs = [lp if len(ids) else [None] for ids, lp in zip(completion_ids, logprobs, strict=True)]
    return [ids if len(ids) else [eos] for ids in completion_ids], logprobs, empty


class GenerationLogitStats:
    """Forward hook collecting (log p_t(y_t), log Σ_v p_t(v)²) for each generation step, at ``temperature``."""

    def __init__(self, module: torch.nn.Module, temperature: float):
        self.temperature = temperature
        self.failed = False
        self._log_probs: list[torch.Tensor] = []
        self._log_sum_sq: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        if kwargs.get("fused_lm_head") or self.failed:
            return
        logits = getattr(output, "logits", None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if logits is None or input_ids is None:
            self.failed = True  # e.g. generation from embeddings: the caller falls back to a forward pass
            return
        if self._previous is not None:
            self._log_probs.append(self._previous.gather(-1, input_ids[:, -1:].to(self._previous.device)).squeeze(-1))
        step = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)
        self._log_sum_sq.append(torch.logsumexp(2 * step, dim=-1))
        self._previous = step

    def finish(self, completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Remove the hook; ``(log_probs, log_sum_sq)`` of shape ``(B, steps)``, or None if capture failed."""
        self._handle.remove()
        if self.failed or self._previous is None or len(completion_ids) != self._previous.size(0):
            return None
        steps = len(self._log_sum_sq)
        last_tokens = [ids[steps - 1] if len(ids) >= steps else 0 for ids in completion_ids]
        index = torch.tensor(last_tokens, device=self._previous.device).unsqueeze(-1)
        self._log_probs.append(self._previous.gather(-1, index).squeeze(-1))
        self._previous = None
        return torch.stack(self._log_probs, dim=1), torch.stack(self._log_sum_sq, dim=1)
