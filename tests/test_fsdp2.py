"""FSDP2 equivalence for every option set: 2 CPU processes with the policy sharded by FSDP2 (gloo) against 1 unsharded
process.

The same deterministic generation batches as `test_multiprocess.py` (groups of 8 completions spanning both ranks,
gradient accumulation on each rank: FSDP2 accumulates without sync and reduce-scatters on the last micro-batch). The
model is wrapped by accelerate's own `fsdp2_prepare_model`; accelerate keeps DDP on a CPU, so the worker lifts that
one refusal (`oblr_trl.testing.allow_fsdp_on_cpu`). The GPU path through `accelerate launch` is
`tests/test_gpu.py::test_fsdp2_accelerate_launch`.

The matrix (`BACKEND_MATRIX` in conftest): weights {logit, exact} × SNR estimator {cross_step, per_sample} ×
`num_iterations` {1, 2} × tied and untied embeddings × with and without clipping, each with the rate rule as it ships
(the trust region's peak form measured on steps 1, 2 and 4 of 4, the calibrated SNR factor held at 1 while f_t is
measured), and the cases that change one thing from it, every case in one launch of each layout. What must agree:
weights, advantages, ‖μ‖², tr Σ, f_t, the calibration and the SNR factor, the step KL and the steps it was measured
on, the trust-region factor, the gradient norm and the trained parameters. The `exact` and `per_sample` cases with
`num_iterations=1` fail without `initialise_fsdp2_root`: nothing runs the whole model before the first per-sample
norms there.
"""

import pytest
from conftest import BACKEND_MATRIX, backend_case_id
from test_multiprocess import assert_runs_match, launch, launch_cases


@pytest.fixture(scope="module")
def fsdp2_matrix(tmp_path_factory):
    return launch_cases(tmp_path_factory.mktemp("fsdp2"), 2, 2, [{**case, "fsdp2": True} for case in BACKEND_MATRIX])


@pytest.mark.parametrize("index", range(len(BACKEND_MATRIX)), ids=[backend_case_id(c) for c in BACKEND_MATRIX])
def test_fsdp2_on_two_processes_matches_one_unsharded_process(single_process_matrix, fsdp2_matrix, index):
    sharded = fsdp2_matrix[index]
    assert sharded["distributed_type"] == "DistributedType.FSDP" and sharded["processes"] == 2
    assert_runs_match(single_process_matrix[index], sharded, BACKEND_MATRIX[index])


def test_one_shard_alone_does_not_give_the_step_gradient(tmp_path, single_process_matrix):
    """The cross-step estimator with only rank 0's rows sketched: the estimates move, so the matrix would fail if the
    sum over shards were dropped."""
    index = BACKEND_MATRIX.index({"baseline_weights": "logit", "snr_estimator": "cross_step", "num_iterations": 1,
                                  "tie_word_embeddings": False, "max_grad_norm": 0.0})
    single = single_process_matrix[index]
    partial = launch(tmp_path / "partial", 2, 2,
                     {**BACKEND_MATRIX[index], "fsdp2": True, "sketch_first_shard_only": True})
    differs = [
        one[key] != pytest.approx(two[key], rel=1e-2)
        for one, two in zip(single["steps"][1:], partial["steps"][1:], strict=True)  # step 1 has no pair
        for key in ("snr/grad_sq_norm", "snr/trace_cov")
    ]
    assert any(differs)


def test_a_gradient_that_is_not_one_shard_of_rows_per_process_is_refused(tmp_path):
    """HSDP / tensor-parallel placements and parameters FSDP2 does not shard: named, never sketched as if whole."""
    import subprocess
    import sys

    import torch

    from oblr_trl.estimators.sketch import GradientSketch
    from oblr_trl.training.optim_hooks import sketch_step_gradients

    plain = torch.nn.Parameter(torch.ones(4, 3))
    plain.grad = torch.ones(4, 3)
    with pytest.raises(NotImplementedError, match=r"parameter 0 \(shape \(4, 3\)\).*not a sharded DTensor"):
        sketch_step_gradients([plain], GradientSketch([plain.shape]), sharded=True)

    script = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from oblr_trl.training.optim_hooks import sketch_step_gradients
from oblr_trl.estimators.sketch import GradientSketch
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
