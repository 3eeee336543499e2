"""vLLM itself, colocated, on SmolLM2-135M (`pytest -m vllm`; collected only where `vllm` imports: the environment of
`.ci/constraints-vllm.txt`). Each run is a fresh process of a few steps (`vllm_worker.py`, or the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
# a rate that moves the policy in 2 steps by far more than float precision (the negative control must see it)
MOVING = ["--set", "learning_rate=1.0e-4", "--set", "lr_scheduler_type=constant", "--set", "use_snr_lr=false",
          "--set", "lr_trust_region_kl=null", "--set", "log_step_kl=true"]


GRPO_STEP = ["--set", "baseline_weights=uniform", "--set", "baseline_estimator=weighted", "--set",
             "leave_one_out=false", "--set", "use_snr_lr=false", "--set", "lr_trust_region_kl=null"]


def train(tmp_path: Path, name: str, *options: str) -> tuple[list[dict], str]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(WORKER), str(out), *options], capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-5000:]
    return [h for h in json.loads(out.read_text())["log_history"] if "loss" in h], done.stderr


def logp_difference(steps: list[dict]) -> list[float]:
    return [h["sampling/sampling_logp_difference/mean"] for h in steps]


def test_vllm_samples_in_the_policy_dtype_and_the_weights_reach_it(tmp_path):
    """At step 1 vLLM's sampling log-probabilities are the float32 policy's to float precision; after steps that
    move the policy they still are (the weights reach vLLM), and with the sync skipped they are not."""
    synced, stderr = train(tmp_path, "synced", *MOVING)
    assert "Traceback" not in stderr  # through Python: no teardown traceback at exit
    moved = [h["oblr/step_kl"] for h in synced[:-1]]
    assert all(kl > 1e-4 for kl in moved), moved
    assert all(d < 0.005 for d in logp_difference(synced)), logp_difference(synced)
    stale, _ = train(tmp_path, "stale", *MOVING, "--skip_sync")
    assert logp_difference(stale)[0] < 0.005  # the same engine at step 1
    assert logp_difference(stale)[-1] > 5 * max(logp_difference(synced)) and logp_difference(stale)[-1] > 0.005


def test_grpo_and_the_defaults_train_through_the_cli_and_exit_without_a_traceback(tmp_path):
    done = subprocess.run(["oblr-trl", "train", "--max_steps", "2", "--use_vllm", "true", "--vllm_mode", "colocate",
                           "--vllm_max_model_length", "256", "--output_dir", str(tmp_path / "cli"), "--report_to",
                           "none"], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-5000:]
    state = json.loads((tmp_path / "cli" / "trainer_state.json").read_text())
    assert sum("loss" in h for h in state["log_history"]) == 2
    # TRL's GRPO step for step (TRL's own GRPOTrainer cannot sync its weights into vLLM's CPU build: docs/scaling.md)
    grpo, stderr = train(tmp_path, "grpo", "--set", "max_steps=2", *GRPO_STEP)
    assert len(grpo) == 2 and "Traceback" not in stderr
    assert not any(key.startswith(("snr/", "oblr/trust")) for h in grpo for key in h)
