"""Multi-process equivalence: 2 CPU processes (torchrun, gloo, DDP) against 1 process on the same generation batches.

Groups of 8 completions span both ranks (4 completions per rank and generation batch) and two micro-batches on each
rank; the 1-process run uses the same micro-batches (2 completions each) through gradient accumulation. The
advantages, weights, SNR estimates, learning-rate factors and gradient norms must agree within float tolerance.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, processes, gradient_accumulation_steps, options):
    output = tmp_path / f"world{processes}" / "result.json"
    output.parent.mkdir(parents=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
        "--output", str(output), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", str(gradient_accumulation_steps),
        *[item for key, value in options.items() for item in ((f"--{key}",) if value is True else (f"--{key}", str(value)))],
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(output.read_text())


@pytest.mark.parametrize(
    "options",
    [
        {"num_iterations": 1, "baseline_weights": "logit", "snr_estimator": "two_batch"},
        {"num_iterations": 2, "baseline_weights": "exact", "snr_estimator": "per_sample"},
        {"num_iterations": 1, "baseline_weights": "logit", "snr_estimator": "cross_step"},
    ],
    ids=["logit-two_batch", "exact-per_sample-num_iterations2", "logit-cross_step"],
)
def test_two_processes_match_one(tmp_path, options):
    single = launch(tmp_path, 1, 4, options)
    double = launch(tmp_path, 2, 2, options)
    assert (single["processes"], double["processes"]) == (1, 2)
    assert len(single["batches"]) == len(double["batches"]) >= 2
    for one, two in zip(single["batches"], double["batches"], strict=True):
        assert one["weights"] == pytest.approx(two["weights"], rel=1e-4, abs=1e-6)
        assert one["advantages"] == pytest.approx(two["advantages"], rel=1e-4, abs=1e-6)
        assert any(abs(a) > 0 for a in one["advantages"])
    assert len(single["steps"]) == len(double["steps"]) == 4
    if options["snr_estimator"] == "cross_step":  # step 1 has no previous step to pair with
        single["steps"], double["steps"] = single["steps"][1:], double["steps"][1:]
    for one, two in zip(single["steps"], double["steps"], strict=True):
        for key in ("snr/grad_sq_norm", "snr/trace_cov", "snr/lr_factor", "snr/effective_lr", "grad_norm"):
            assert one[key] == pytest.approx(two[key], rel=1e-3, abs=1e-7), (key, one[key], two[key])
    assert any(step["snr/lr_factor"] < 1.0 for step in single["steps"])
