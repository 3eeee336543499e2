"""Training curves of a run, from its own logs (`trainer_state.json`), as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["load_log_history", "plot_run"]

PANELS = (
    ("reward", "reward (all functions, weighted)"),
    ("accuracy", "accuracy reward"),
    ("completions/mean_length", "completion length (tokens)"),
    ("snr/snr", "gradient SNR (smoothed)"),
    ("snr/lr_factor", "SNR learning-rate factor f_t"),
    ("oblr/lr", "learning rate used"),
    ("oblr/step_kl", "policy KL of each step (π_t ‖ π_t+1), and aimed at"),
    ("oblr/trust_region_factor", "trust-region factor"),
    ("oblr/noise_scale", "gradient noise scale B_noise (completions)"),
)


def find_trainer_state(run_dir: str | Path) -> Path:
    """``run_dir/trainer_state.json``, else the one of its latest checkpoint."""
    run_dir = Path(run_dir)
    if (run_dir / "trainer_state.json").exists():
        return run_dir / "trainer_state.json"
    checkpoints = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
    if not checkpoints:
        raise FileNotFoundError(f"no trainer_state.json in {run_dir} or its checkpoints")
    return checkpoints[-1]


def load_log_history(run_dir: str | Path) -> list[dict]:
    """The training log entries (those with a loss) of a run, step by step."""
    history = json.loads(find_trainer_state(run_dir).read_text())["log_history"]
    return [entry for entry in history if "loss" in entry and "step" in entry]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    if key == "accuracy":
        key = next((k for entry in history for k in entry if k.startswith("rewards/") and "accuracy" in k and k.endswith("/mean")), key)
    if key == "oblr/lr" and not any(key in entry for entry in history):
        key = "learning_rate"  # a run without the SNR factor or trust region uses the scheduled rate
    points = [(e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Plot reward, accuracy, completion length, SNR, f_t, the effective learning rate, the step KL, the trust-region
    factor and the gradient noise scale (beside the completions a step) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = load_log_history(run_dir)
    figure, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    for axis, (key, title) in zip(axes.flat, PANELS, strict=True):
        steps, values = _series(history, key)
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if values:
            axis.plot(steps, values, marker="." if len(values) < 50 else None)
            if key in ("snr/snr", "oblr/step_kl", "oblr/noise_scale") and min(values) > 0:
                axis.set_yscale("log")
            if key == "oblr/step_kl":
                aimed_steps, aimed = _series(history, "oblr/step_kl_target")
                if aimed:
                    axis.plot(aimed_steps, aimed, ls="--", color="gray", label="aimed at")
                    axis.legend()
            if key == "oblr/noise_scale":  # more completions a step than B_noise stop shortening training
                used_steps, used = _series(history, "oblr/completions_per_step")
                if used:
                    axis.plot(used_steps, used, ls="--", color="gray", label="completions a step")
                    axis.legend()
        else:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{Path(run_dir).resolve().name}")
    output = Path(output) if output is not None else Path(run_dir) / "training_curves.png"
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output
