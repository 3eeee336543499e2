"""FSDP2 equivalence: 2 CPU processes with the policy sharded by FSDP2 (gloo) against 1 unsharded process.

The same deterministic generation batches as `test_multiprocess.py` (groups of 8 completions spanning both ranks,
gradient accumulation on each rank: FSDP2 accumulates without sync and reduce-scatters on the last micro-batch). The
model is wrapped by accelerate's own `fsdp2_prepare_model`; accelerate keeps DDP on a CPU, so the worker lifts that
one refusal (`oblr_trl.testing.allow_fsdp_on_cpu`). The GPU path through `accelerate launch` is
`tests/test_gpu.py::test_fsdp2_accelerate_launch`.

What must agree: advantages, weights, ‖μ‖², tr Σ, the factor f_t, the gradient norm and the trained parameters.
"""

import pytest

from test_multiprocess import launch

CASES = {
    "defaults": {"num_iterations": 1, "baseline_weights": "logit", "snr_estimator": "cross_step"},
    "exact-per_sample": {"num_iterations": 2, "baseline_weights": "exact", "snr_estimator": "per_sample"},
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
