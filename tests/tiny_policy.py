"""A tiny transformer policy with exact per-completion gradients, shared by the estimator tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oblr_trl.estimators.weights import log_sum_sq_probs, logit_proxy_weights


@dataclass
class CompletionPool:
    """Completions of one prompt with their exact ∇_θ log π(o|q) (flattened, float64) and logit-proxy weights."""

    completions: list[torch.Tensor]
    gradients: torch.Tensor
    logit_weights: torch.Tensor

    @property
    def exact_weights(self) -> torch.Tensor:
        return self.gradients.pow(2).sum(1)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([float(len(c)) for c in self.completions], dtype=torch.float64)


def peaked_tiny_policy(tokenizer):
    """A 1-layer tiny model with a peaked next-token distribution and some EOS mass (completions of varied length)."""
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.lm_head.weight.mean(0)
    return model


def sample_pool(model, tokenizer, prompt_ids, count, max_new_tokens, seed) -> CompletionPool:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            prompt_ids.expand(count, -1),
            attention_mask=torch.ones(count, prompt_ids.size(1), dtype=torch.long),
            do_sample=True,
            max_new_tokens=max_new_tokens,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    completions = []
    for row in out[:, prompt_ids.size(1) :].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        completions.append(torch.tensor(row))

    params = list(model.parameters())
    gradients, proxies = [], []
    for completion in completions:
        ids = torch.cat([prompt_ids[0], completion]).unsqueeze(0)
        logits = model(ids).logits[0, prompt_ids.size(1) - 1 : -1].float()
        log_probs = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        grads = torch.autograd.grad(log_probs.sum(), params)
        gradients.append(torch.cat([g.reshape(-1) for g in grads]).double())
        proxies.append(
            logit_proxy_weights(
                log_probs.detach()[None], log_sum_sq_probs(logits.detach())[None], torch.ones(1, len(completion))
            ).double()
        )
    return CompletionPool(completions, torch.stack(gradients), torch.cat(proxies))
