"""Per-sample squared gradient norms of a causal LM in one batched forward and backward ("ghost norms").

For every row i of a batch this computes

    w_i = ‖∇_θ Σ_t s_it log p_θ(y_it | y_i,<t)‖²      over the trainable parameters θ,

without one backward per row and without materialising a per-sample gradient (DESIGN §2 `exact` row, §4). Rows of a
transformer batch do not interact, so row i's gradient of a parameter is built from row i's activations only:

* linear layer y = x Wᵀ + b, inputs A_i (T×d_in), output gradients G_i (T×d_out):
  ‖A_iᵀ G_i‖²_F = Σ_{t,t'} (a_t·a_t')(g_t·g_t')  ("ghost" form, O(T²(d_in+d_out))) or the materialised G_iᵀA_i
  (O(T·d_in·d_out)), whichever is cheaper; bias: ‖Σ_t g_t‖²;
* embedding: Σ_{t,t'} [id_t = id_t'] (g_t·g_t'), i.e. the norm of the per-token gradients summed per token id (the
  padding index, which nn.Embedding never updates, left out; times the square of `embed_scale` for Gemma's scaled
  embeddings);
* RMSNorm weight: ‖Σ_t g_t ⊙ x̂_t‖² with x̂ the normalised input;
* LM head W (V×d), which TRL never calls as a module: with δ_t = s_t (e_{y_t} − p_t)/T the gradient w.r.t. the
  logits (times 1 − tanh²(z/cap) under Gemma-style `final_logit_softcapping`) and h_t the final hidden state,
  Σ_{t,t'} (h_t·h_t')(δ_t·δ_t');
* tied input/output embeddings: the two contributions add before the norm, so the cross term
  2 Σ_{t,t'} δ_t'[id_t] (g_t·h_t') is added.

PEFT LoRA adapters are linear layers, so they are covered. A trainable parameter of any other kind raises
`NotImplementedError`: it is never skipped silently (the trainer then measures that model by one backward per row). The backward asks only for the gradient of the input embeddings,
so autograd computes activation gradients but no parameter gradients (and `.grad` is left alone).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

__all__ = ["log_likelihood_grad_sq_norms"]

_HEAD_CHUNK = 4096  # vocabulary-sized rows of the LM head processed at once per sequence


def _is_rms_norm(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return type(module).__name__.endswith("RMSNorm") and set(params) == {"weight"} and (
        hasattr(module, "variance_epsilon") or hasattr(module, "eps")
    )


class _Norms:
    """Accumulates each row's squared norm and keeps what the tied-embedding cross term needs."""

    def __init__(self, batch: int, device: torch.device):
        self.sq = torch.zeros(batch, dtype=torch.float32, device=device)
        self.head_cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, values: torch.Tensor) -> None:
        self.sq += values.float()


def _linear_sq(inputs: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Row-wise ‖Σ_t g_t a_tᵀ‖²_F, by the cheaper of the ghost and the materialised form."""
    a, g = inputs.float().flatten(1, -2), grads.float().flatten(1, -2)  # (B, T, d)
    tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if tokens * (d_in + d_out) <= d_in * d_out:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


def _embedding_sq(ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Row-wise ‖Σ_t e_{id_t} g_tᵀ‖²: per-token gradients summed per token id, then the squared norm."""
    values = []
    for row_ids, row_grads in zip(ids, grads.float(), strict=True):
        unique, inverse = torch.unique(row_ids, return_inverse=True)
        buckets = torch.zeros(len(unique), row_grads.shape[-1], device=row_grads.device).index_add_(0, inverse, row_grads)
        values.append(buckets.pow(2).sum())
    return torch.stack(values)


def _rms_norm_sq(module: nn.Module, inputs: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    x = inputs.float()
    normalised = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(inputs.dtype).float()
    per_row = (grads.float() * normalised).flatten(1, -2).sum(1)  # (B, d)
    return per_row.pow(2).sum(-1)


def _softcapped(raw: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-2-style final logit soft-capping, cap·tanh(z/cap) (identity without a cap)."""
    return raw if cap is None else cap * torch.tanh(raw / cap)


class _LogLikelihoodHead(torch.autograd.Function):
    """Σ_t s_t log softmax(c(h_t Wᵀ) / T)[y_t] per row, c the optional logit soft-cap, one sequence at a time.

    The backward recomputes the logits of one sequence at a time and, from the same probabilities, adds the LM head's
    per-sample term (and keeps what the tied cross term needs) to ``norms``. With a soft-cap, the gradient w.r.t. the
    raw logits z is the one w.r.t. the capped logits times c'(z) = 1 − tanh²(z/cap).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_scale, temperature, norms, head_trainable, tied_ids, softcap):
        log_probs = []
        for row_hidden, row_labels in zip(hidden, labels, strict=True):
            logits = _softcapped(row_hidden.float() @ weight.float().T, softcap) / temperature
            log_probs.append(torch.log_softmax(logits, -1).gather(-1, row_labels.unsqueeze(-1)).squeeze(-1))
        ctx.save_for_backward(hidden, weight, labels, token_scale)
        ctx.temperature, ctx.norms, ctx.head_trainable, ctx.tied_ids = temperature, norms, head_trainable, tied_ids
        ctx.softcap = softcap
        return (torch.stack(log_probs) * token_scale).sum(-1)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, labels, token_scale = ctx.saved_tensors
        w = weight.float()
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        head_sq = torch.zeros(hidden.shape[0], device=hidden.device)
        for i, (row_hidden, row_labels) in enumerate(zip(hidden.float(), labels, strict=True)):
            raw = row_hidden @ w.T
            probs = torch.softmax(_softcapped(raw, ctx.softcap) / ctx.temperature, -1)
            delta = -probs
            delta[torch.arange(len(row_labels)), row_labels] += 1.0
            delta *= (grad_output[i] * token_scale[i] / ctx.temperature).unsqueeze(-1)  # ∂objective/∂logits
            if ctx.softcap is not None:
                delta *= 1.0 - torch.tanh(raw / ctx.softcap).square()  # ∂objective/∂(raw logits)
            grad_hidden[i] = delta @ w
            if ctx.head_trainable:
                head_sq[i] = ((row_hidden @ row_hidden.T) * (delta @ delta.T)).sum()
            if ctx.tied_ids is not None:
                ctx.norms.head_cross[i] = (delta[:, ctx.tied_ids[i]], row_hidden)
        ctx.norms.add(head_sq)
        return grad_hidden.to(hidden.dtype), None, None, None, None, None, None, None, None


def _model_parts(model: nn.Module):
    backbone = getattr(model, model.base_model_prefix)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    config = model.config.get_text_config()
    for name in ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"per-sample gradient norms do not support models with `{name}` (LM head scaling).")
    if head is None or getattr(head, "bias", None) is not None:
        raise NotImplementedError("per-sample gradient norms need a bias-free LM head.")
    softcap = getattr(config, "final_logit_softcapping", None)
    return backbone, embedding, head, float(softcap) if softcap else None


def _hooked_modules(model: nn.Module, embedding: nn.Module, head: nn.Module) -> list[nn.Module]:
    """The modules whose own trainable parameters need a per-sample term; fails loudly on unsupported ones."""
    modules, owners = [], defaultdict(list)
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params or module is head:
            continue
        for p in params:
            owners[id(p)].append(name)
        if isinstance(module, (nn.Linear, nn.Embedding)) or _is_rms_norm(module):
            modules.append(module)
        else:
            raise NotImplementedError(
                f"per-sample gradient norms: trainable parameters of `{name}` ({type(module).__name__}) are not "
                "supported (supported: nn.Linear incl. LoRA adapters, nn.Embedding, RMSNorm, the LM head)."
            )
    shared = [names for names in owners.values() if len(names) > 1]
    if shared:
        raise NotImplementedError(f"per-sample gradient norms: parameters shared between modules {shared}.")
    return modules


def log_likelihood_grad_sq_norms(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    token_scale: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """‖∇_θ Σ_t s_t log p_θ(y_t)‖² for each row, over the trainable parameters, in one forward and backward.

    Args:
        model: a causal LM (a PEFT model's base model is used as is: its LoRA layers are part of it).
        input_ids, attention_mask: ``(B, L)`` prompt and completion tokens.
        logits_to_keep: the number of completion positions at the end of each row.
        token_scale: ``(B, logits_to_keep)`` weights s_t of the completion tokens (0 masks a token).
        temperature: the policy's sampling temperature (logits are divided by it).

    Returns:
        ``(B,)`` float32.
    """
    backbone, embedding, head, softcap = _model_parts(model)
    modules = _hooked_modules(model, embedding, head)
    norms = _Norms(input_ids.shape[0], input_ids.device)
    saved: dict[nn.Module, list[torch.Tensor]] = defaultdict(list)  # a module may run more than once per forward

    def on_forward(module, args, output):
        if module is embedding:
            return  # its gradient is the one requested from the backward, handled after it
        if not args or not torch.is_tensor(output):
            raise NotImplementedError(f"per-sample gradient norms: unexpected call of {type(module).__name__}.")
        saved[module].append(args[0].detach())
        output.register_hook(lambda grad, module=module: on_grad(module, grad))

    def on_grad(module, grad):
        inputs = saved[module].pop()  # backward visits the calls in reverse order
        if isinstance(module, nn.Linear):
            norms.add(_linear_sq(inputs, grad))
            if module.bias is not None and module.bias.requires_grad:
                norms.add(grad.float().flatten(1, -2).sum(1).pow(2).sum(-1))
        else:
            norms.add(_rms_norm_sq(module, inputs, grad))

    handles = [m.register_forward_hook(on_forward) for m in modules]
    tied = embedding.weight is head.weight and head.weight.requires_grad
    try:
        with torch.enable_grad():
            embeddings = embedding(input_ids).detach().requires_grad_(True)
            hidden = backbone(inputs_embeds=embeddings, attention_mask=attention_mask, use_cache=False).last_hidden_state
            completion_hidden = hidden[:, -logits_to_keep - 1 : -1]
            objective = _LogLikelihoodHead.apply(
                completion_hidden, head.weight, input_ids[:, -logits_to_keep:], token_scale.to(hidden.dtype),
                temperature, norms, head.weight.requires_grad, input_ids if tied else None, softcap,
            )
            (embedding_grad,) = torch.autograd.grad(objective.sum(), embeddings)
    finally:
        for handle in handles:
            handle.remove()
        saved.clear()
    embed_scale = getattr(embedding, "embed_scale", None)  # Gemma's scaled embeddings: output = W[id]·scale
    if embed_scale is not None:
        embedding_grad = embedding_grad * float(embed_scale)  # from ∂/∂output to ∂/∂W[id]
    if embedding.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
        embedding_grad = embedding_grad.masked_fill((input_ids == embedding.padding_idx).unsqueeze(-1), 0.0)
    if embedding.weight.requires_grad:
        norms.add(_embedding_sq(input_ids, embedding_grad))
    if tied:  # outside the graph: the norms are weights of the loss, never a path for its gradient
        with torch.no_grad():
            cross = torch.stack(
                [
                    (delta_at_ids * (row_hidden @ embedding_grad[i].float().T)).sum()
                    for i, (delta_at_ids, row_hidden) in sorted(norms.head_cross.items())
                ]
            )
            norms.add(2 * cross)
    return norms.sq.detach()
