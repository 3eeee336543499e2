"""`benchmarks/generation_throughput.py`: transformers' side end to end at a tiny size, the pairing on given runs (vLLM's
side runs in the vLLM environment: `benchmarks/results/overhead/generation_throughput.md`)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import generation_throughput  # noqa: E402


def test_help():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "generation_throughput.py"), "--help"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-3000:]


def test_transformers_generation_is_timed_at_each_fixed_length(tmp_path):
    assert generation_throughput.main(["--engines", "hf", "--lengths", "2", "5", "--repeats", "1", "--rounds", "2",
                                       "--output_dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "generation_throughput.json").read_text())
    (run,) = results["runs"]
    assert run["engine"] == "hf" and run["startup_seconds"] > 0
    for length in (2, 5):  # 2 prompts × 8 completions, every one held to the length
        timed = run["lengths"][str(length)]
        assert timed["tokens"] == 16 * length and len(timed["seconds"]) == 2
        assert timed["tokens_per_second"] == pytest.approx(timed["tokens"] / statistics.median(timed["seconds"]))
    assert [(row["length"], row["engine"]) for row in results["rows"]] == [(2, "hf"), (5, "hf")]
    assert (tmp_path / "generation_throughput.png").stat().st_size > 0
    assert "| 5 | hf |" in (tmp_path / "generation_throughput.md").read_text()


def fake_run(engine: str, repeat: int, tokens_per_second: float) -> dict:
    return {"engine": engine, "repeat": repeat, "startup_seconds": 1.0,
            "lengths": {"24": {"seconds": [1.0], "tokens": 384, "tokens_per_second": tokens_per_second}}}


def test_vllm_is_paired_with_transformers_by_repeat():
    """Repeat 0: 2×, repeat 1: 4× (the second repeat slower for both): the paired mean is 3×, where a ratio of the
    medians would say 2.5×."""
    runs = [fake_run("hf", 0, 100.0), fake_run("vllm", 0, 200.0), fake_run("vllm", 1, 240.0), fake_run("hf", 1, 60.0)]
    hf, vllm = generation_throughput.summarise(runs, ["hf", "vllm"], [24])
    assert "ratio_to_hf_mean" not in hf and hf["tokens_per_second"] == 80.0
    assert vllm["ratio_to_hf_mean"] == pytest.approx(3.0)
    assert (vllm["ratio_to_hf_min"], vllm["ratio_to_hf_max"]) == (pytest.approx(2.0), pytest.approx(4.0))
    assert 2.0 <= vllm["ratio_to_hf_ci"][0] <= 3.0 <= vllm["ratio_to_hf_ci"][1] <= 4.0
