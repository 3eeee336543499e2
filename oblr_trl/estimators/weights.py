"""Estimators of the per-completion weight w_i ∝ ‖∇_θ log π(o_i|q)‖² used by the baseline
(docs/math.md).

The baseline only needs the weights up to a common scale, so a cheap proxy is enough when it ranks completions like the
true gradient norm does. Pure tensor code: inputs are per-token tensors ``(B, T)`` with a ``(B, T)`` mask of the tokens
that take part in the loss.
"""

from __future__ import annotations

import torch

__all__ = [
    "SEQUENCE_MEAN_LOSS_TYPES",
    "length_weights",
    "log_sum_sq_probs",
    "loss_token_gains",
    "logit_gradient_sq_norms",
    "logit_proxy_weights",
    "uniform_weights",
]


# TRL loss types that average each completion's token terms over its own length (TRL 1.16 `_compute_loss`); every
# other loss type divides the token sum by a normaliser the whole batch shares.
SEQUENCE_MEAN_LOSS_TYPES = ("grpo", "sapo")


def loss_token_gains(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The factor c_i by which the loss scales completion i's token terms, relative to the other completions.

    A completion's contribution to the loss gradient is A_i · c_i · Σ_t ψ_t (ψ_t = ∇ log p_t(y_t)); the weight of the
    variance-optimal baseline is the squared norm of that contribution without A_i (docs/math.md: w_i is the squared
    norm of completion i's actual contribution for the configured `loss_type`). With a per-completion token mean
    (`"grpo"`, `"sapo"`) c_i = 1/L_i, which reverses the length trend of a token-sum weight; otherwise c_i = 1 (a
    normaliser shared by the batch is a common scale, which the baseline ignores).

    Args:
        mask: ``(B, T)`` 1 for tokens in the loss.
        loss_type: TRL's ``loss_type``.

    Returns:
        ``(B, 1)`` float32 gains, to multiply per-token gradients by (their squares multiply squared norms).
    """
    if loss_type in SEQUENCE_MEAN_LOSS_TYPES:
        return 1.0 / mask.float().sum(-1, keepdim=True).clamp(min=1.0)
    return torch.ones(mask.shape[0], 1, dtype=torch.float32, device=mask.device)


def log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v p(v)² of softmax(logits) over the last axis, computed stably (docs/math.md, `logit` row).

        log Σ_v p_v² = logsumexp(2z) − 2·logsumexp(z)

    TRL's fused LM head returns the same quantity (``log_sum_sq_probs``) without materialising the logits; this
    function is the reference for code that has the logits anyway.
    """
    logits = logits.float()
    return torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)


def logit_gradient_sq_norms(log_probs: torch.Tensor, log_sum_sq: torch.Tensor) -> torch.Tensor:
    """Per-token ‖∂ log p_t(y_t)/∂z_t‖², the squared gradient of a token's log-probability w.r.t. its logits.

        ‖e_{y_t} − p_t‖² = 1 − 2 p_t(y_t) + Σ_v p_t(v)²

    Args:
        log_probs: ``(B, T)`` log p_t(y_t) of the sampled tokens.
        log_sum_sq: ``(B, T)`` log Σ_v p_t(v)² of the same next-token distributions.

    Returns:
        ``(B, T)`` non-negative values (exactly (1 − p)² + Σ_{v≠y} p_v² ≥ 0; rounding is clamped away).
    """
    return (1.0 - 2.0 * log_probs.float().exp() + log_sum_sq.float().exp()).clamp(min=0.0)


def logit_proxy_weights(
    log_probs: torch.Tensor,
    log_sum_sq: torch.Tensor,
    mask: torch.Tensor,
    token_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The default `logit` weight: w_i = Σ_t s_t ‖∂ log p_t(y_t)/∂z_t‖² over the completion tokens of i.

    This is the squared norm of the gradient of log π(o_i|q) with respect to the logits, token by token
    (docs/math.md); it is exact for a policy whose parameters are the logits and a proxy for the parameter-gradient
    norm of a network. ``token_scale`` s_t (default 1) carries the importance-sampling correction: with an IS ratio ρ_t on each
    token's loss term, the token's gradient is scaled by ρ_t, so its squared norm by ρ_t² (docs/math.md; see
    ``docs/importance_sampling.md``).

    Args:
        log_probs: ``(B, T)`` log-probabilities of the sampled tokens.
        log_sum_sq: ``(B, T)`` log Σ_v p_t(v)².
        mask: ``(B, T)`` 1 for tokens in the loss, 0 for padding.
        token_scale: optional, broadcastable to ``(B, T)``.

    Returns:
        ``(B,)`` weights, float32.
    """
    per_token = logit_gradient_sq_norms(log_probs, log_sum_sq)
    return _masked_sum(per_token, mask, token_scale)


def length_weights(mask: torch.Tensor, token_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The `length` weight: w_i = Σ_t s_t, the number of completion tokens (verl OPO's proxy, docs/math.md).

    ``token_scale`` as in [`logit_proxy_weights`]. Returns ``(B,)`` float32.
    """
    return _masked_sum(torch.ones_like(mask, dtype=torch.float32), mask, token_scale)


def uniform_weights(mask: torch.Tensor) -> torch.Tensor:
    """The `uniform` weight: w_i = 1, which turns the weighted leave-one-out baseline into RLOO's
    (docs/math.md)."""
    return torch.ones(mask.shape[0], dtype=torch.float32, device=mask.device)


def _masked_sum(per_token: torch.Tensor, mask: torch.Tensor, token_scale: torch.Tensor | None) -> torch.Tensor:
    if token_scale is not None:
        per_token = per_token * token_scale.float()
    # `where`, not a product with the mask: padding may hold non-finite values and 0·inf is NaN
    return torch.where(mask.bool(), per_token, torch.zeros((), device=per_token.device)).sum(dim=-1)
