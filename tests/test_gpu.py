"""GPU smoke tests: run where CUDA is available (skipped elsewhere, so CI on CPU reports them as skipped).

    python -m pytest tests/test_gpu.py -rs        # on a GPU machine; DeepSpeed cases need `pip install deepspeed`
"""

import json

import pytest
import torch
from test_backend_rates import (
    BACKENDS,
    assert_logged_factors_in_bounds,
    assert_rates_reach_the_optimizer,
    launch_backend_worker,
)
from test_ghost_norms import oracle, padded_batch
from test_trust_region import assert_update_read_from_the_state

from oblr_trl.estimators.ghost_norms import log_likelihood_grad_sq_norms
from oblr_trl.testing import tiny_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_ghost_norms_match_the_per_row_loop_on_cuda(tokenizer, dtype, tolerance):
    model = tiny_causal_lm(tokenizer, "qwen3", hidden_size=64, tie_word_embeddings=True, seed=3).cuda()
    ids, mask, keep, scale = (t.cuda() if torch.is_tensor(t) else t for t in padded_batch(tokenizer))
    reference = oracle(model, ids, mask, keep, scale, 0.8)
    ghost = log_likelihood_grad_sq_norms(model.to(dtype), ids, mask, keep, scale, 0.8)
    assert ghost.dtype == torch.float32 and ghost.device.type == "cuda"
    assert ((ghost - reference).abs() / reference).max().item() < tolerance


@pytest.mark.parametrize("adam", [{}, {"fused": True}, {"capturable": True}], ids=["adam", "fused", "capturable"])
def test_adams_update_is_read_where_the_optimizer_keeps_its_step_count(adam):
    """The per-update curvature's reader with the step count on the GPU (fused, capturable) and on the host."""
    assert_update_read_from_the_state("cuda", **adam)


@pytest.mark.parametrize("weights", ["logit", "exact"])
def test_training_on_cuda_in_bf16(make_trainer, weights):
    trainer = make_trainer(baseline_weights=weights, bf16=True, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.model.device.type == "cuda"
    after = list(trainer.model.parameters())
    assert all(p.isfinite().all() for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after))
    assert_logged_factors_in_bounds(trainer, steps=3)


@pytest.mark.parametrize("weights", ["logit", "exact"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_learning_rate_factor_reaches_the_backend_optimizer(tmp_path, backend, weights):
    """Under DeepSpeed the optimizer steps inside `backward` on ZeRO's fp32 partitions: the rate that step uses must be
    the schedule × the SNR factor × the trust-region factor, each in its bounds, and the SNR inputs (micro-batch
    gradient hooks; FSDP2: the gradient shards) must see real gradients. `exact` weights are refused under ZeRO before
    training starts and run under FSDP2 (the shipped recipes/accelerate_configs/fsdp.yaml through `accelerate
    launch`). The same assertions run on CPU processes in CI (`test_backend_rates.py`)."""
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    done, out = launch_backend_worker(tmp_path, backend, weights, processes=1, cpu=False)
    if backend.startswith("zero") and weights == "exact":  # never verified with ZeRO's partitions: refused up front
        assert done.returncode != 0 and "not available under DeepSpeed" in done.stdout + done.stderr
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    if backend == "fsdp2":
        assert result["distributed_type"] == "DistributedType.FSDP"
    assert_rates_reach_the_optimizer(result)
