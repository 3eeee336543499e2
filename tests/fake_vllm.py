"""A test double for vLLM's `LLM` / `SamplingParams` (colocate mode) and TRL's `VLLMClient` (server mode).

It generates with a local transformers model, in the dtype it is built with (vLLM's `dtype`, "auto" the checkpoint's),
returns per-token log-probabilities in vLLM's format, and receives the trainer's weight syncs. Its sampling
distribution is deliberately a little off the trainer's (a logit bias), as vLLM's is in practice, so that
importance-sampling ratios differ from 1. What it does not do, and `tests/test_vllm.py` checks on vLLM itself: vLLM's
CPU build packs each linear layer's weight and drops the parameter, so that TRL's weight sync needs
`training.vllm_colocate.track_repacked_weights`; and vLLM's engine tears its process groups down at exit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

LOGIT_NOISE = 0.3  # size of the behaviour policy's deviation from the trained one


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion] = field(default_factory=list)


def sample_with_logprobs(model, prompt_ids, max_tokens, temperature, eos_token_id, generator):
    """Autoregressive sampling from softmax((z + bias)/T); returns tokens and their behaviour log-probabilities."""
    ids = torch.tensor([prompt_ids])
    bias = LOGIT_NOISE * torch.randn(model.config.vocab_size, generator=generator)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(ids).logits[0, -1].float() + bias
            log_probs = torch.log_softmax(logits / temperature, -1)
            token = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
            tokens.append(token)
            logprobs.append({token: FakeLogprob(float(log_probs[token]))})
            if token == eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


class FakeLLM:
    """`vllm.LLM` in colocate mode: generates with its own copy of the model, updated by `load_weights`."""

    instances: list[FakeLLM] = []

    def __init__(self, model, seed=0, **kwargs):
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=kwargs.get("dtype", "auto")).eval()
        self.kwargs = kwargs
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_syncs = 0
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self))),
            model_config=SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 512),
        )
        FakeLLM.instances.append(self)

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        self.weight_syncs += 1

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, sampling_params, use_tqdm=False):
        results = []
        for prompt in prompts:
            tokens, logprobs = sample_with_logprobs(
                self.model, prompt["prompt_token_ids"], sampling_params.max_tokens, sampling_params.temperature,
                self.model.config.eos_token_id, self.generator,
            )
            results.append(FakeRequestOutput(prompt["prompt_token_ids"], [FakeCompletion(tokens, logprobs)]))
        return results


class FakeVLLMClient:
    """TRL's `VLLMClient` at its boundary: what the trainer sends to a vLLM server and what it gets back."""

    instances: list[FakeVLLMClient] = []
    model_path: str = ""

    def __init__(self, base_url=None, group_port=None, connection_timeout=None, **kwargs):
        self.base_url = base_url
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path).eval()
        self.generator = torch.Generator().manual_seed(0)
        self.generate_calls, self.weight_updates = [], 0
        FakeVLLMClient.instances.append(self)

    def init_communicator(self, device=None):
        pass

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, named_params):
        params = dict(self.model.named_parameters())
        for name, tensor in named_params:
            params[name].data.copy_(tensor)
        self.weight_updates += 1

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, n=1, max_tokens=16, temperature=1.0, **kwargs):
        self.generate_calls.append({"prompts": prompts, "n": n, "max_tokens": max_tokens, **kwargs})
        completion_ids, logprobs = [], []
        for prompt in prompts:
            for _ in range(n):
                tokens, lps = sample_with_logprobs(
                    self.model, prompt, max_tokens, temperature, self.model.config.eos_token_id, self.generator
                )
                completion_ids.append(tokens)
                logprobs.append([[next(iter(lp.values())).logprob] for lp in lps])
        return {"prompt_ids": prompts, "completion_ids": completion_ids, "logprobs": logprobs}


def install(monkeypatch, model_path: str) -> None:
    """Make TRL's vLLM integration use the doubles."""
    import trl.generation.vllm_generation as vllm_generation

    # colocate mode writes RANK/WORLD_SIZE/MASTER_* into os.environ; have them put back after the test
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(variable, "")  # records the current state (absent, usually) for restoring
        monkeypatch.delenv(variable)
    FakeLLM.instances.clear()
    FakeVLLMClient.instances.clear()
    FakeVLLMClient.model_path = model_path
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_generation, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", FakeSamplingParams, raising=False)
    monkeypatch.setattr(vllm_generation, "VLLMClient", FakeVLLMClient)
