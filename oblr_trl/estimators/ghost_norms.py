"""Per-sample squared gradient norms of a causal LM in one batched forward and backward ("ghost norms").

For every row i of a batch this computes

    w_i = ‖∇_θ Σ_t s_it log p_θ(y_it | y_i,<t)‖²      over the trainable parameters θ,

without one backward per row and without materialising a per-sample gradient (docs/per_sample_norms.md). Rows of a
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

Each phase runs under a `torch.profiler.record_function` label `ghost_norms.<phase>` (the backbone's forward, the
backward and in it the linear, RMSNorm and head terms, then the embedding terms), so that a profile of a training
step splits the pass without changing it (benchmarks/README.md: the profile's pages).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from torch.profiler import record_function

__all__ = ["log_likelihood_grad_sq_norms", "pass_bytes_per_row"]

# the float32 logits the LM head's backward holds at once: as many sequences as fit, at least one. One sequence at a
# time left each of its products a few dozen rows tall: on 2 CPU cores the head took twice as long as in blocks of 4
# sequences (24 completion tokens, SmolLM2's 49 152 words)
_HEAD_BLOCK_BYTES = 64 * 2**20


def pass_bytes_per_row(config, tokens: int, element_size: int, checkpointed_layers: int) -> int:
    """An upper estimate of the bytes one more row adds to the peak of `log_likelihood_grad_sq_norms`.

    With T tokens a row, hidden size d, MLP width m, H attention heads, L layers of which C are checkpointed, and e
    bytes an activation:

        T·e·(C·d + (L − C + 2)·(8·d + 4·m + a·H·T)) + 8·T·d + 4·min(2·T², d·m),    a = 2 under eager attention, else 0

    A checkpointed layer keeps its input (T·d); every other layer, and the one the backward recomputes, keeps its
    internals: at most 8·d + 4·m a token for a pre-norm decoder layer (norm inputs, q, k, v, the attention output,
    the MLP's gate, up and product), and under eager attention the attention's probabilities and their softmax input
    (SDPA and flash attention keep none); the gradients of the layer being differentiated are as large again. Plus the
    float32 gradients of the input embeddings and of the head's hidden states (2·T·d·4), and one linear layer's
    float32 contraction at a time (two T×T Gram matrices, or the materialised d_out×d_in gradient where that is
    smaller: `_linear_sq`). The head's logits take at most a fixed 64 MiB at a time (`_HEAD_BLOCK_BYTES`), whatever
    the rows. Used to size the pass's chunks from the memory left under the step's peak: an overestimate only makes
    the chunks smaller. e: the larger of the parameters' and the autocast dtype's sizes (under autocast a float32
    model's residual stream, which the checkpoints keep, stays float32). On a Llama of 8 layers (d 64, 200 tokens,
    CPU) a row measured 1.34 MB checkpointed (estimate 2.18 MB) and 7.21 MB without (8.33 MB).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    width = getattr(text, "intermediate_size", None) or 4 * hidden
    eager = getattr(text, "_attn_implementation", None) == "eager"
    internals = 8 * hidden + 4 * width + (2 * text.num_attention_heads * tokens if eager else 0)
    checkpointed_layers = min(checkpointed_layers, layers)
    per_token = element_size * (checkpointed_layers * hidden + (layers - checkpointed_layers + 2) * internals)
    return int(tokens * (per_token + 8 * hidden) + 4 * min(2 * tokens**2, hidden * width))


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


@functools.cache
def _half_matmul_returns_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices on this device into a float32 result (``out_dtype``: CUDA, torch
    2.8 and later)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        one = torch.ones(1, 1, 1, dtype=dtype, device=device_type)
        torch.bmm(one, one, out_dtype=torch.float32)
        torch.mm(one[0], one[0], out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched or not) with a float32 result.

    Where either factor is half precision (a bf16 model, or an activation a layer computed under autocast) and the
    device can, both are multiplied in that precision, accumulating and returning in float32 — as the layer itself
    multiplied them (tensor cores, and no float32 copies of the activations: those copies and float32 products took
    half the pass on an H100). Anything else in float32.
    """
    half = next((t.dtype for t in (a, b) if t.dtype in (torch.bfloat16, torch.float16)), None)
    if half is not None and _half_matmul_returns_fp32(a.device.type, half):
        return (torch.bmm if a.dim() == 3 else torch.mm)(a.to(half), b.to(half), out_dtype=torch.float32)
    return a.float() @ b.float()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matrix products in on this device, None when it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _linear_sq(inputs: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Row-wise ‖Σ_t g_t a_tᵀ‖²_F, by the cheaper of the ghost and the materialised form."""
    a, g = inputs.flatten(1, -2), grads.flatten(1, -2)  # (B, T, d)
    tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if tokens * (d_in + d_out) <= d_in * d_out:
        return (_matmul_fp32(a, a.transpose(1, 2)) * _matmul_fp32(g, g.transpose(1, 2))).sum((1, 2))
    return _matmul_fp32(g.transpose(1, 2), a).pow(2).sum((1, 2))


def _embedding_sq(ids: torch.Tensor, grads: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row-wise ‖Σ_t e_{id_t} g_tᵀ‖²: per-token gradients summed per (row, token id), then the squared norm per row.

    All rows at once (one `unique` over row·V + id, not one per row: each `unique` waits for the GPU)."""
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(-1).expand_as(ids)
    unique, inverse = torch.unique((rows * vocab_size + ids).reshape(-1), return_inverse=True)
    flat = grads.float().reshape(-1, grads.shape[-1])
    buckets = torch.zeros(len(unique), flat.shape[-1], device=flat.device).index_add_(0, inverse, flat)
    bucket_rows = unique // vocab_size
    return torch.zeros(ids.shape[0], device=flat.device).index_add_(0, bucket_rows, buckets.pow(2).sum(-1))


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
    """The gradient of Σ_t s_t log softmax(c(h_t Wᵀ) / T)[y_t] per row, c the optional logit soft-cap.

    Only the objective's gradient is ever used (the pass differentiates it; its value is never read), so the forward
    returns zeros and computes nothing. The backward computes the logits a block of sequences at a time (as many as
    `_HEAD_BLOCK_BYTES` of float32 logits hold) and, from the same probabilities, adds the LM head's per-sample term
    (and keeps what the tied cross term needs) to ``norms``. With a soft-cap, the gradient w.r.t. the raw logits z is
    the one w.r.t. the capped logits times c'(z) = 1 − tanh²(z/cap).
    The logits and the head's contractions are multiplied in the precision the model's own head would use (its
    weight's, or autocast's when the pass runs under it, as the training forward does) with float32 accumulation and
    result where the device can (`_matmul_fp32`), else in float32; softmax and everything after it in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_scale, temperature, norms, head_trainable, tied_ids, softcap):
        ctx.head_dtype = _autocast_dtype(hidden.device.type) or weight.dtype
        ctx.save_for_backward(hidden, weight, labels, token_scale)
        ctx.temperature, ctx.norms, ctx.head_trainable, ctx.tied_ids = temperature, norms, head_trainable, tied_ids
        ctx.softcap = softcap
        return hidden.new_zeros(hidden.shape[0], dtype=torch.float32)

    @staticmethod
    @record_function("ghost_norms.head_backward")
    def backward(ctx, grad_output):
        hidden, weight, labels, token_scale = ctx.saved_tensors
        dtype = ctx.head_dtype if _half_matmul_returns_fp32(hidden.device.type, ctx.head_dtype) else torch.float32
        w = weight.to(dtype)
        rows, tokens = labels.shape
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32)
        head_sq = torch.zeros(rows, device=hidden.device)
        block = max(1, _HEAD_BLOCK_BYTES // (4 * tokens * w.shape[0]))
        for start in range(0, rows, block):
            at = slice(start, start + block)
            block_hidden = hidden[at].to(dtype)
            raw = _matmul_fp32(block_hidden.flatten(0, 1), w.T).unflatten(0, block_hidden.shape[:2])  # (b, T, V)
            probs = torch.softmax(_softcapped(raw, ctx.softcap) / ctx.temperature, -1)
            delta = probs.neg_()
            chosen = labels[at].unsqueeze(-1)
            delta.scatter_add_(-1, chosen, torch.ones_like(chosen, dtype=delta.dtype))
            delta *= (grad_output[at, None] * token_scale[at] / ctx.temperature).unsqueeze(-1)  # ∂objective/∂logits
            if ctx.softcap is not None:
                delta *= 1.0 - torch.tanh(raw / ctx.softcap).square()  # ∂objective/∂(raw logits)
            delta_in = delta.to(w.dtype)
            grad_hidden[at] = _matmul_fp32(delta_in.flatten(0, 1), w).view_as(block_hidden)
            if ctx.head_trainable:
                gram_hidden = _matmul_fp32(block_hidden, block_hidden.transpose(1, 2))
                head_sq[at] = (gram_hidden * _matmul_fp32(delta_in, delta_in.transpose(1, 2))).sum((1, 2))
            if ctx.tied_ids is not None:
                ids = ctx.tied_ids[at]
                delta_at_ids = delta.gather(-1, ids.unsqueeze(1).expand(-1, tokens, -1))  # (b, T, L)
                for i in range(len(ids)):
                    ctx.norms.head_cross[start + i] = (delta_at_ids[i], block_hidden[i].float())
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


class _CheckpointedPairs:
    """Pairs the input and the output gradient of each module inside a gradient-checkpointed layer.

    Under non-reentrant checkpointing a layer's forward keeps none of its activations; the backward recomputes the
    layer just before it needs them. A module's input is therefore taken from the recompute, not kept from the
    forward, and its output gradient is hooked on the forward's output (the recomputed graph is never differentiated).
    The two meet in either order: the gradient of a layer's last module reaches its output before anything of the
    layer is recomputed (a residual sum keeps nothing to recompute), the others after; whichever comes second adds
    the module's term. Pairing by module needs one call per module and forward, which the first call checks.
    """

    def __init__(self, layers: Iterable[nn.Module], hooked: list[nn.Module], add_sq):
        inside = {id(m) for layer in layers for m in layer.modules()}
        self.modules = {m for m in hooked if id(m) in inside}
        self.add_sq = add_sq  # (module, inputs, output gradient) -> adds the module's per-row term
        self.in_backward = False
        self.called: set[nn.Module] = set()
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.grads: dict[nn.Module, torch.Tensor] = {}

    def __contains__(self, module: nn.Module) -> bool:
        return module in self.modules

    def before_call(self, module: nn.Module, inputs: torch.Tensor) -> None:
        """Before the module runs (a recompute may stop inside the layer's last module, once everything the backward
        needs is recomputed, so its input is taken before it runs): counts the forward's calls, takes the
        recompute's input."""
        if not self.in_backward:
            if module in self.called:
                raise NotImplementedError(
                    f"per-sample gradient norms under gradient checkpointing: {type(module).__name__} runs more than "
                    "once per forward."
                )
            self.called.add(module)
        elif module in self.grads:
            self.add_sq(module, inputs.detach(), self.grads.pop(module))
        else:
            self.inputs[module] = inputs.detach()

    def grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        if module in self.inputs:
            self.add_sq(module, self.inputs.pop(module), grad)
        else:
            self.grads[module] = grad

    def check_all_paired(self) -> None:
        """A gradient without a recompute means the layer did not checkpoint after all: never a silent omission."""
        if self.grads:
            names = sorted({type(m).__name__ for m in self.grads})
            raise RuntimeError(
                f"per-sample gradient norms: {len(self.grads)} modules ({', '.join(names)}) were named checkpointed "
                "but their layer was not recomputed in the backward (is the model in training mode?)."
            )


def log_likelihood_grad_sq_norms(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    token_scale: torch.Tensor,
    temperature: float = 1.0,
    checkpointed_layers: Iterable[nn.Module] = (),
) -> torch.Tensor:
    """‖∇_θ Σ_t s_t log p_θ(y_t)‖² for each row, over the trainable parameters, in one forward and backward.

    Args:
        model: a causal LM (a PEFT model's base model is used as is: its LoRA layers are part of it).
        input_ids, attention_mask: ``(B, L)`` prompt and completion tokens.
        logits_to_keep: the number of completion positions at the end of each row.
        token_scale: ``(B, logits_to_keep)`` weights s_t of the completion tokens (0 masks a token).
        temperature: the policy's sampling temperature (logits are divided by it).
        checkpointed_layers: the layers that run under non-reentrant gradient checkpointing in this pass (their
            forward is recomputed during the backward). A module inside one keeps no input from the forward: its
            input is taken when the backward recomputes it, so that the pass holds one layer's activations at a time,
            as checkpointed training does, instead of every layer's (`_CheckpointedPairs`).

    Returns:
        ``(B,)`` float32.
    """
    backbone, embedding, head, softcap = _model_parts(model)
    modules = _hooked_modules(model, embedding, head)
    norms = _Norms(input_ids.shape[0], input_ids.device)
    saved: dict[nn.Module, list[torch.Tensor]] = defaultdict(list)  # a module may run more than once per forward

    def add_sq(module, inputs, grad):
        if isinstance(module, nn.Linear):
            with record_function("ghost_norms.linear"):
                norms.add(_linear_sq(inputs, grad))
                if module.bias is not None and module.bias.requires_grad:
                    norms.add(grad.float().flatten(1, -2).sum(1).pow(2).sum(-1))
        else:
            with record_function("ghost_norms.rms_norm"):
                norms.add(_rms_norm_sq(module, inputs, grad))

    recomputed = _CheckpointedPairs(checkpointed_layers, modules, add_sq)

    # every hook the pass registers, its gradient hooks on module outputs included, is removed when it ends: a hook
    # left on a tensor the autograd graph outlives kept `norms` and the head's saved states alive (5 MB a step on the
    # CPU preset)
    def on_forward(module, args, output):
        if module is embedding:
            return  # its gradient is the one requested from the backward, handled after it
        if not args or not torch.is_tensor(output):
            raise NotImplementedError(f"per-sample gradient norms: unexpected call of {type(module).__name__}.")
        if module in recomputed:
            if not recomputed.in_backward:  # the recompute's output is never differentiated
                handles.append(output.register_hook(lambda grad, module=module: recomputed.grad(module, grad)))
            return
        saved[module].append(args[0].detach())
        handles.append(output.register_hook(lambda grad, module=module: add_sq(module, saved[module].pop(), grad)))

    handles = [m.register_forward_hook(on_forward) for m in modules]
    handles += [
        m.register_forward_pre_hook(lambda module, args: recomputed.before_call(module, args[0]))
        for m in recomputed.modules
    ]
    tied = embedding.weight is head.weight and head.weight.requires_grad
    try:
        with torch.enable_grad():
            embeddings = embedding(input_ids).detach().requires_grad_(True)
            with record_function("ghost_norms.backbone_forward"):
                hidden = backbone(inputs_embeds=embeddings, attention_mask=attention_mask, use_cache=False).last_hidden_state
            completion_hidden = hidden[:, -logits_to_keep - 1 : -1]
            objective = _LogLikelihoodHead.apply(
                completion_hidden, head.weight, input_ids[:, -logits_to_keep:], token_scale.to(hidden.dtype),
                temperature, norms, head.weight.requires_grad, input_ids if tied else None, softcap,
            )
            with record_function("ghost_norms.backward"):
                recomputed.in_backward = True
                (embedding_grad,) = torch.autograd.grad(objective.sum(), embeddings)
        recomputed.check_all_paired()
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
        with record_function("ghost_norms.embedding"):
            norms.add(_embedding_sq(input_ids, embedding_grad, embedding.num_embeddings))
    if tied:  # outside the graph: the norms are weights of the loss, never a path for its gradient
        with torch.no_grad(), record_function("ghost_norms.tied_cross"):
            cross = torch.stack(
                [
                    (delta_at_ids * (row_hidden @ embedding_grad[i].float().T)).sum()
                    for i, (delta_at_ids, row_hidden) in sorted(norms.head_cross.items())
                ]
            )
            norms.add(2 * cross)
    return norms.sq.detach()
