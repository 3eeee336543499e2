"""vLLM itself, colocated, on SmolLM2-135M (`pytest -m vllm`; collected only where `vllm` imports: the environment of
`.ci/constraints-vllm.txt`). Each run is a fresh process of a few steps (`vllm_worker.py`, or the CLI)."""

from __future__ import annotations

import json
import math
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
    steps, stderr, _ = run_worker(tmp_path, name, *options)
    return steps, stderr


def run_worker(tmp_path: Path, name: str, *options: str) -> tuple[list[dict], str, dict]:
    """The run's logged optimizer steps, its stderr and its record (how it ended)."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(WORKER), str(out), *options], capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    record = json.loads(out.read_text())
    return [h for h in record["log_history"] if "loss" in h], done.stderr, record


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
    # the running interpreter's CLI: `oblr-trl` on PATH is another environment's, or none where it is not activated
    done = subprocess.run([sys.executable, "-m", "oblr_trl", "train", "--max_steps", "2", "--use_vllm", "true",
                           "--vllm_mode", "colocate", "--vllm_max_model_length", "256", "--output_dir",
                           str(tmp_path / "cli"), "--report_to", "none"], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-5000:]
    state = json.loads((tmp_path / "cli" / "trainer_state.json").read_text())
    assert sum("loss" in h for h in state["log_history"]) == 2
    # TRL's GRPO step for step (TRL's own GRPOTrainer cannot sync its weights into vLLM's CPU build: docs/scaling.md)
    grpo, stderr = train(tmp_path, "grpo", "--set", "max_steps=2", *GRPO_STEP)
    assert len(grpo) == 2 and "Traceback" not in stderr
    assert not any(key.startswith(("snr/", "oblr/trust")) for h in grpo for key in h)


def test_a_lora_adapter_merged_into_vllm_keeps_it_sampling_the_policy(tmp_path):
    """TRL merges the adapter into the base weights for each sync: after steps that move the policy, vLLM still
    samples it (a LoRA's first update is small: a rate that moves it by far more than float precision)."""
    lora, _ = train(tmp_path, "lora", "--lora", *MOVING, "--set", "learning_rate=2.0e-3")
    assert all(h["oblr/step_kl"] > 1e-4 for h in lora[:-1]), [h["oblr/step_kl"] for h in lora]
    assert all(d < 0.005 for d in logp_difference(lora)), logp_difference(lora)


def test_exact_weights_two_iterations_and_the_trust_region_on_vllm_samples(tmp_path):
    """`exact` weights (per-completion gradient norms), two optimizer passes per generation (TRL's importance ratio
    then moves off 1 within a batch) and the defaults' trust region measuring the step's KL on vLLM's completions."""
    steps, _ = train(tmp_path, "exact", "--set", "baseline_weights=exact", "--set", "num_iterations=2",
                     "--set", "max_steps=4", "--set", "learning_rate=1.0e-4")
    assert len(steps) == 4 and all(math.isfinite(h["loss"]) for h in steps)
    generated = steps[::2]  # steps 1 and 3 generate; 2 and 4 reuse their completions
    assert all(h["oblr/weights/measured_frac"] > 0 for h in generated)
    assert not any("sampling/sampling_logp_difference/mean" in h for h in steps[1::2])
    measured = [h["oblr/step_kl"] for h in steps if "oblr/step_kl" in h]
    assert measured and all(math.isfinite(kl) and kl >= 0 for kl in measured)  # the probe step, on vLLM's samples
    assert all(d < 0.005 for d in logp_difference(generated)), logp_difference(generated)


def test_preempted_with_vllm_resumes_and_the_checkpoints_weights_reach_the_new_engine(tmp_path):
    """SIGTERM at the end of step 2 saves a checkpoint and stops; a new process resumes it, and its fresh engine
    (loaded from the base model) samples the checkpoint's policy, not the base model's."""
    first, _, ended = run_worker(tmp_path, "preempted", *MOVING, "--set", "max_steps=3", "--preempt_at", "2")
    assert not ended["finished"] and ended["checkpoint"].endswith("checkpoint-2") and len(first) == 2
    resumed, _, ended = run_worker(tmp_path, "resumed", *MOVING, "--set", "max_steps=3", "--resume",
                                   ended["checkpoint"])
    assert ended["finished"] and [h["step"] for h in resumed] == [1, 2, 3]  # the checkpoint's history, then step 3
    assert resumed[:2] == first
    assert logp_difference(resumed)[-1] < 0.005, logp_difference(resumed)


def test_vllm_and_hf_generate_stop_alike(tmp_path):
    """With the policy held still (rate 0), the share of completions cut at the length limit is the same, within
    its noise, whether vLLM or HF `generate` samples them (the same prompts, seed and sampling settings)."""
    still = ["--set", "learning_rate=0.0", "--set", "max_steps=4", "--set", "per_device_train_batch_size=8",
             "--set", "gradient_accumulation_steps=4", "--set", "use_snr_lr=false", "--set", "lr_trust_region_kl=null"]
    shares = {}
    for name, use_vllm in (("vllm", "true"), ("hf", "false")):
        steps, _ = train(tmp_path, name, *still, "--set", f"use_vllm={use_vllm}")
        shares[name] = sum(h["completions/clipped_ratio"] for h in steps) / len(steps)
    completions = 4 * 32
    pooled = (shares["vllm"] + shares["hf"]) / 2
    noise = math.sqrt(2 * pooled * (1 - pooled) / completions)
    assert abs(shares["vllm"] - shares["hf"]) <= 3 * noise + 1e-9, shares
