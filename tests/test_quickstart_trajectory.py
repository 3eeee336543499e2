"""The quickstart's first 5 logged steps, as `oblr-trl train --max_steps 5` runs them, against the values recorded from
the 60-step quickstart at the commit named in `tests/data/quickstart_first_steps.json` (opt-in: `pytest -m slow`,
about 2 minutes on 2 CPU cores).

The quickstart's schedule (`constant_with_warmup`, 5 warm-up steps) and the rate rule's windows do not depend on
`max_steps`, so its first 5 steps are the same in a 5-step run. A change that moves the trajectory of the shipped
defaults on the real model fails here; tolerances as in tests/test_golden_trajectory.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_golden_trajectory import assert_close

RECORDED = Path(__file__).parent / "data" / "quickstart_first_steps.json"
COMPARED = ("loss", "grad_norm", "learning_rate", "oblr/lr", "reward", "oblr/step_kl", "oblr/trust_region_factor",
            "oblr/trust_region_rate", "oblr/update_rms", "snr/lr_factor", "completions/mean_length",
            "oblr/advantage_std", "oblr/weights/mean", "oblr/baseline_slope")


@pytest.mark.slow
def test_quickstart_first_steps_match_the_recorded_ones(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "oblr_trl", "train", "--max_steps", "5", "--output_dir", str(tmp_path / "run"),
         "--plot", "false"],
        capture_output=True, text=True, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    actual = [entry for entry in history if "loss" in entry]
    expected = json.loads(RECORDED.read_text())["steps"]
    assert len(actual) == len(expected) == 5
    for one, two in zip(expected, actual, strict=True):
        for key in COMPARED:
            if key in one:
                value = one[key] or 0.0  # None: logged as not a number
                scale = (2 * abs(value)) ** 0.5 if key == "oblr/step_kl" else abs(value)
                assert_close(two.get(key), one[key], max(scale, 1e-12), f"step {one['step']} {key}")
