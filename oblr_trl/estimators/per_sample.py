"""Exact per-sample squared gradient norms by one backward pass per sample (the reference implementation).

Used for the `exact` baseline weights, w_i = ‖∇_θ log π(o_i|q)‖² over the trainable parameters (docs/math.md),
and for the `per_sample` SNR estimator. It costs one backward per sample; it is the oracle that faster
implementations are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["per_sample_grad_sq_norms", "row_objective"]


def per_sample_grad_sq_norms(
    sample_objective: Callable[[int], torch.Tensor],
    num_samples: int,
    params: Sequence[torch.Tensor],
    retain_graph: bool = False,
) -> torch.Tensor:
    """‖∇_θ f_i‖² = Σ_p ‖∂f_i/∂p‖² for i = 0..num_samples−1, with f_i = ``sample_objective(i)`` a scalar.

    ``torch.autograd.grad`` is used instead of ``backward`` so that ``.grad`` (the training gradient) is untouched.
    A sample whose objective does not depend on ``params`` (e.g. an empty completion) has norm 0.

    Returns:
        ``(num_samples,)`` float32 on the device of the objectives.
    """
    params = [p for p in params if p.requires_grad]
    norms = []
    for i in range(num_samples):
        objective = sample_objective(i)
        if not objective.requires_grad:
            norms.append(torch.zeros((), dtype=torch.float32, device=objective.device))
            continue
        grads = torch.autograd.grad(objective, params, retain_graph=retain_graph, allow_unused=True)
        sq = [g.float().pow(2).sum() for g in grads if g is not None]
        norms.append(torch.stack(sq).sum() if sq else torch.zeros((), device=objective.device))
    return torch.stack(norms)


def row_objective(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """The part of a loss that flows through batch row i: f_i = Σ_k ⟨outputs_k[i], output_grads_k[i]⟩.

    If a loss L depends on the parameters only through per-row model outputs (rows of a transformer batch do not
    interact), then ∂L/∂θ = Σ_i J_iᵀ v_i with v = ∂L/∂outputs, and the gradient of f_i (v held fixed) is row i's
    contribution to ∂L/∂θ. This gives per-sample gradients of any TRL loss without re-deriving its formula.
    """

    def objective(i: int) -> torch.Tensor:
        terms = [(out[i] * grad[i].detach()).sum() for out, grad in zip(outputs, output_grads, strict=True)]
        return torch.stack(terms).sum()

    return objective
