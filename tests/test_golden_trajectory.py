"""A golden trajectory: the defaults (and the SNR factor acting early) for a few steps on the tiny model with a fixed
seed, compared with values recorded from the code named in `tests/data/golden_trajectory.json`.

A change of the code that changes a trajectory (the advantages, the weights, the rate of a step, its KL, the loss)
fails here; a restructure must leave it green. To record anew after an intended change of a trajectory, run
``OBLR_TRL_RECORD_GOLDEN=1 python -m pytest tests/test_golden_trajectory.py`` and say why in the commit.

Tolerances follow the numbers: the values are float32 results whose round-off depends on the CPU's vector kernels
(`ATEN_CPU_CAPABILITY`), so each is compared in the scale of the terms it is formed from; a changed sample or a
changed rule moves them by orders of magnitude more.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

import oblr_trl.training.trainer as trainer_module
from oblr_trl.testing import tiny_causal_lm

GOLDEN = Path(__file__).parent / "data" / "golden_trajectory.json"
RECORD = os.environ.get("OBLR_TRL_RECORD_GOLDEN", "") not in ("", "0")
REL = 1e-4  # float32 round-off of a short run, in the scale of each value's terms

CASES = {
    # the shipped defaults: the trust region's probe, its short early gaps and its peak rate; the SNR factor still 1
    "defaults": {},
    # the paper's SNR factor acting from its first estimates, on 3 groups of 4 a step
    "snr_absolute": {"snr_warmup_steps": 0, "snr_lr_reference": "absolute", "num_generations": 4,
                     "per_device_train_batch_size": 6, "gradient_accumulation_steps": 2},
    # exact weights (the ghost norms) and generations reused for two optimizer steps each
    "exact_two_iterations": {"baseline_weights": "exact", "num_iterations": 2},
}
STEPS = 8
LOGGED = ("loss", "grad_norm", "learning_rate", "oblr/lr", "oblr/step_kl", "oblr/step_kl_target", "oblr/update_rms",
          "oblr/trust_region_factor", "oblr/trust_region_rate", "snr/lr_factor", "snr/grad_sq_norm", "snr/trace_cov",
          "oblr/baseline_slope")


def run_case(make_trainer, monkeypatch, settings: dict) -> dict:
    batches = []
    original = trainer_module.gradient_weighted_advantages

    def recording(rewards, weights, *args, **kwargs):
        result = original(rewards, weights, *args, **kwargs)
        batches.append({"rewards": rewards.tolist(), "weights": weights.tolist(),
                        "advantages": result.advantages.tolist()})
        return result

    monkeypatch.setattr(trainer_module, "gradient_weighted_advantages", recording)
    trainer = make_trainer(max_steps=STEPS, learning_rate=1e-3, **{"snr_warmup_steps": 5, **settings})
    trainer.train()
    steps = [{key: entry[key] for key in LOGGED if key in entry} for entry in trainer.state.log_history
             if "loss" in entry]
    return {"batches": batches, "steps": steps}


def commit() -> str:
    root = Path(__file__).parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "oblr_trl"], cwd=root, capture_output=True,
                           text=True).stdout
    return head.strip() + ("-dirty" if dirty.strip() else "")


@pytest.fixture(scope="module")
def golden():
    if RECORD:
        return {"commit": commit(), "torch": torch.__version__, "cases": {}}
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module", autouse=True)
def write_golden(golden):
    yield
    if RECORD:
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


def assert_close(actual: float | None, expected: float | None, scale: float, what: str) -> None:
    if expected is None or actual is None or math.isnan(expected):  # NaN: a weight left unmeasured (`exact`)
        assert actual == expected or (math.isnan(expected) and math.isnan(actual)), f"{what}: {actual!r} != {expected!r}"
        return
    assert actual == pytest.approx(expected, abs=REL * scale), f"{what}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("case", CASES)
def test_trajectory_matches_the_recorded_one(case, make_trainer, monkeypatch, golden):
    actual = run_case(make_trainer, monkeypatch, CASES[case])
    if RECORD:
        golden["cases"][case] = actual
        return
    expected = golden["cases"][case]
    assert len(actual["batches"]) == len(expected["batches"])
    for index, (one, two) in enumerate(zip(expected["batches"], actual["batches"], strict=True)):
        assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6), f"batch {index}: another sample"
        weight_scale = max(abs(w) for w in one["weights"] if not math.isnan(w))
        advantage_scale = max(max(abs(a) for a in one["advantages"] if not math.isnan(a)), 1e-3)
        for name, scale in (("weights", weight_scale), ("advantages", advantage_scale)):
            for i, (e, a) in enumerate(zip(one[name], two[name], strict=True)):
                assert_close(a, e, scale, f"batch {index} {name}[{i}]")
    assert len(actual["steps"]) == len(expected["steps"]) == STEPS
    for step, (one, two) in enumerate(zip(expected["steps"], actual["steps"], strict=True), start=1):
        assert set(one) <= set(two), f"step {step}: {sorted(set(one) - set(two))} no longer logged"
        for key, value in one.items():
            if key == "oblr/step_kl" or key == "oblr/step_kl_target":
                scale = (2 * abs(value)) ** 0.5  # k3 = e^Δ − 1 − Δ from log-probability differences of ~sqrt(2 KL)
            elif key in ("snr/grad_sq_norm", "snr/trace_cov"):
                scale = abs(one.get("snr/grad_sq_norm", 0.0)) + abs(one.get("snr/trace_cov", 0.0))
            else:
                scale = abs(value)
            assert_close(two[key], value, max(scale, 1e-12), f"step {step} {key}")
