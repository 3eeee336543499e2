"""FSDP2 equivalence: 2 CPU processes with the policy sharded by FSDP2 (gloo) against 1 unsharded process.

The same deterministic generation batches as `test_multiprocess.py` (groups of 8 completions spanning both ranks,
gradient accumulation on each rank: FSDP2 accumulates without sync and reduce-scatters on the last micro-batch). The
model is wrapped by accelerate's own `fsdp2_prepare_model`; accelerate keeps DDP on a CPU, so the worker lifts that
one refusal (`oblr_trl.testing.allow_fsdp_on_cpu`). The GPU path through `accelerate launch` is
`tests/test_gpu.py::test_fsdp2_accelerate_launch`.

What must agree: advantages, weights, ‖μ‖², tr Σ, the factor f_t, the gradient norm and the trained parameters, for
the defaults (cross_step, logit weights, pooled_slope; the factor read as 'absolute' so that it moves within 4 steps
— the calibrated reference stays at 1 that early) and for `exact` weights with `per_sample` SNR.
"""

import pytest

from test_multiprocess import launch

CASES = {
    "defaults": {"num_iterations": 1, "baseline_weights": "logit", "snr_estimator": "cross_step"},
    # tied input/output embeddings (Qwen3-4B, SmolLM2): the ghost norms' LM-head and cross terms on a sharded root
    "exact-per_sample-tied": {"num_iterations": 2, "baseline_weights": "exact", "snr_estimator": "per_sample",
                              "tie_word_embeddings": True},
}
SNR_KEYS = ("snr/grad_sq_norm", "snr/trace_cov", "snr/lr_factor", "snr/effective_lr", "grad_norm")


def _steps(result, options):
    # cross_step: step 1 has no previous step to pair with
    return result["steps"][1:] if options["snr_estimator"] == "cross_step" else result["steps"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_on_two_processes_matches_one_unsharded_process(tmp_path, case):
    options = CASES[case]
    single = launch(tmp_path / "single", 1, 4, options)
    sharded = launch(tmp_path / "sharded", 2, 2, {**options, "fsdp2": True})
    assert sharded["distributed_type"] == "DistributedType.FSDP" and sharded["processes"] == 2
    assert len(single["batches"]) == len(sharded["batches"]) >= 2
    for one, two in zip(single["batches"], sharded["batches"], strict=True):
        assert one["weights"] == pytest.approx(two["weights"], rel=1e-4, abs=1e-6)
        assert one["advantages"] == pytest.approx(two["advantages"], rel=1e-4, abs=1e-6)
    assert len(single["steps"]) == len(sharded["steps"]) == 4
    for one, two in zip(_steps(single, options), _steps(sharded, options), strict=True):
        for key in SNR_KEYS:
            assert one[key] == pytest.approx(two[key], rel=1e-3, abs=1e-7), (key, one[key], two[key])
    assert any(step["snr/lr_factor"] < 1.0 for step in single["steps"])  # the factor acted on the updates compared
    for one, two in zip(single["parameters"], sharded["parameters"], strict=True):
        assert one == pytest.approx(two, rel=1e-4, abs=1e-5)


def test_one_shard_alone_does_not_give_the_step_gradient(tmp_path):
    """The same run with only rank 0's rows sketched: the cross-step estimates move, so the test above would fail if
    the sum over shards were dropped."""
    options = CASES["defaults"]
    single = launch(tmp_path / "single", 1, 4, options)
    partial = launch(tmp_path / "partial", 2, 2, {**options, "fsdp2": True, "sketch_first_shard_only": True})
    differs = [
        one[key] != pytest.approx(two[key], rel=1e-2)
        for one, two in zip(_steps(single, options), _steps(partial, options), strict=True)
        for key in ("snr/grad_sq_norm", "snr/trace_cov")
    ]
    assert any(differs)


def test_a_gradient_that_is_not_one_shard_of_rows_per_process_is_refused(tmp_path):
    """HSDP / tensor-parallel placements and parameters FSDP2 does not shard: named, never sketched as if whole."""
    import subprocess
    import sys

    import torch

    from oblr_trl.optim_hooks import sketch_step_gradients
    from oblr_trl.sketch import GradientSketch

    plain = torch.nn.Parameter(torch.ones(4, 3))
    plain.grad = torch.ones(4, 3)
    with pytest.raises(NotImplementedError, match=r"parameter 0 \(shape \(4, 3\)\).*not a sharded DTensor"):
        sketch_step_gradients([plain], GradientSketch([plain.shape]), sharded=True)

    script = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from oblr_trl.optim_hooks import sketch_step_gradients
from oblr_trl.sketch import GradientSketch
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]))
param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])
try:
    sketch_step_gradients([param], GradientSketch([param.shape]), sharded=True)
except NotImplementedError as error:
    print("REFUSED", error)
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REFUSED parameter 0 (shape (4, 3))" in done.stdout and "Replicate()" in done.stdout, done.stderr[-2000:]
