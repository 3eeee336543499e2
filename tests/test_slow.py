"""Slow checks, opt-in with `python -m pytest -m slow` (about a minute on 2 CPU cores)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_default_learns_level_with_grpo_on_the_synthetic_testbed(tmp_path):
    """Issue 13's bar at full power: each method at its own best rate, 100 paired seeds; the default OBLR-PO's area
    under the held-out curve is at least level with GRPO's (the 95 % interval of the difference reaches 0 or above)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.synthetic_learning", "--methods", "grpo", "oblrpo",
         "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    oblrpo = json.loads((tmp_path / "summary.json").read_text())["methods"]["oblrpo"]
    assert oblrpo["auc_minus_grpo_ci"][1] >= 0.0, oblrpo
    assert 0.5 <= oblrpo["mean_lr_factor"] <= 2.0 and oblrpo["lr_factor_range"][1] > 1.0  # it moves, within bounds
