"""The CPU twin of `test_gpu.py::test_learning_rate_factor_reaches_the_backend_optimizer`: the same worker and the same
assertions, on 2 CPU processes (torchrun, gloo, as the equivalence matrix launches them) under DDP and FSDP2 (the
worker then asks the Trainer for FSDP2 itself: `accelerate launch` keeps a CPU run on DDP whatever its config says).
A change of defaults that breaks what the GPU test asserts breaks this one first, in CI.

What both check, for every optimizer step of a 4-step run with the defaults (the trust region's peak form per unit of
Adam's update included; the worker names what it changes): the rate the torch optimizer used is the scheduled rate ×
the SNR factor × the trust-region factor; each factor stays in its own bounds (SNR, read as 'absolute':
[snr_lr_floor, 1]; the trust region: [lr_trust_region_min_ratio, lr_trust_region_max_ratio]); the first step is the
trust region's probe; both factors acted; the parameters changed and stayed finite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/backend_worker.py"
BACKENDS = {
    "ddp": [],
    "zero2": ["--config_file", str(ROOT / "recipes/accelerate_configs/zero2.yaml")],
    "zero3": ["--config_file", str(ROOT / "recipes/accelerate_configs/zero3.yaml")],
    "fsdp2": ["--config_file", str(ROOT / "recipes/accelerate_configs/fsdp.yaml")],
}


def launch_backend_worker(tmp_path: Path, backend: str, weights: str, processes: int, cpu: bool):
    """The worker under ``backend``: through `accelerate launch` and the shipped config on a GPU, through torchrun
    on CPU processes. The finished process and the path of its JSON result."""
    out = tmp_path / "result.json"
    env = {**os.environ, "WEIGHTS": weights,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port = str(_free_port())
    if cpu:
        env["FSDP2"] = "1" if backend == "fsdp2" else ""
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_addr", "127.0.0.1", "--master_port", port, str(WORKER), str(out)]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", *BACKENDS[backend], "--num_processes",
                   str(processes), "--mixed_precision", "bf16", "--main_process_port", port, str(WORKER), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    return done, out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_logged_factors_in_bounds(trainer, steps: int) -> None:
    """Each logged factor of a run with the defaults in its own bounds: the calibrated SNR factor in
    [snr_lr_min_ratio, snr_lr_max_ratio], the trust region's in [lr_trust_region_min_ratio, lr_trust_region_max_ratio],
    the first step the probe."""
    tuning, history = trainer.rate_tuning, [log for log in trainer.state.log_history if "snr/lr_factor" in log]
    assert len(history) == steps
    ceiling = tuning.lr_trust_region_max_ratio
    for log in history:
        assert tuning.snr_lr_min_ratio <= log["snr/lr_factor"] <= tuning.snr_lr_max_ratio
        assert tuning.lr_trust_region_min_ratio <= log["oblr/trust_region_factor"] <= ceiling
    assert history[0]["oblr/trust_region_factor"] == pytest.approx(tuning.lr_trust_region_min_ratio)


def assert_rates_reach_the_optimizer(result: dict) -> None:
    """The rate each optimizer step used is scheduled × SNR factor × trust-region factor, each factor in its bounds."""
    logged, trust = result["logged"], result["trust_region"]
    # one entry per call of the torch optimizer's step: 4 steps, × the param groups under ZeRO
    assert len(result["used_lrs"]) == len(logged) and len(logged) % 4 == 0
    assert trust["kl"] is not None  # the default: the trust region on
    for used, (scheduled, factor, snr_part, trust_part) in zip(result["used_lrs"], logged, strict=True):
        assert factor == pytest.approx(snr_part * trust_part, rel=1e-9)
        assert used == pytest.approx(scheduled * snr_part * trust_part, rel=1e-6)
        assert result["floor"] <= snr_part <= 1.0  # 'absolute': the paper's f_t with its floor
        assert trust["min_ratio"] <= trust_part <= trust["max_ratio"]
    groups = len(logged) // 4
    assert logged[0][3] == pytest.approx(trust["min_ratio"])  # the first step is the probe
    assert any(snr_part < 1.0 for _, _, snr_part, _ in logged)  # the SNR factor was measured, not left at 1
    assert any(trust_part > trust["min_ratio"] for _, _, _, trust_part in logged[groups:])  # sized after the probe
    assert result["params_changed"] and result["params_finite"]
    # a step without an independent pair of gradients is unresolved: NaN, which TRL's log writes as None
    snr = [log["snr/snr"] for log in result["log_history"] if log.get("snr/snr") is not None]
    assert snr and all(s == s and s >= 0 for s in snr)
    # the KL measured on the first step with a gradient (the probe) and the next one (whose reading replaces the
    # probe's in the peak form), then 2, 4, 8, … steps with a gradient apart up to every k-th (per update), on every
    # backend alike; a zero-gradient step is never measured when k > 1; with no warm-up the probe moves the policy,
    # so the measuring until one has (`StepRateRule._kl_due`) ends there
    steps = [log for log in result["log_history"] if "loss" in log]
    every = trust["measure_steps"]
    with_gradient = [i for i, log in enumerate(steps) if every == 1 or log["grad_norm"] > 0]
    places, gap = [0, 1], min(2, every)
    while places[-1] + gap < len(with_gradient):
        places.append(places[-1] + gap)
        gap = min(2 * gap, every)
    measured = [i for i, log in enumerate(steps) if log.get("oblr/step_kl") is not None]
    assert measured == [with_gradient[p] for p in places if p < len(with_gradient)]
    assert all(steps[i]["oblr/step_kl"] >= 0 for i in measured)


@pytest.mark.parametrize("weights", ["logit", "exact"])
def test_training_with_the_defaults_logs_each_factor_in_its_bounds(make_trainer, weights):
    """The CPU twin of `test_gpu.py::test_training_on_cuda_in_bf16`'s factor checks."""
    trainer = make_trainer(baseline_weights=weights, max_steps=3)
    trainer.train()
    assert_logged_factors_in_bounds(trainer, steps=3)


@pytest.mark.parametrize("weights", ["logit", "exact"])
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_learning_rate_factor_reaches_the_optimizer_on_two_cpu_processes(tmp_path, backend, weights):
    done, out = launch_backend_worker(tmp_path, backend, weights, processes=2, cpu=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["distributed_type"] == ("DistributedType.FSDP" if backend == "fsdp2" else "DistributedType.MULTI_CPU")
    assert_rates_reach_the_optimizer(result)
