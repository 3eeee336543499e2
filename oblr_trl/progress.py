"""A concise console for `oblr-trl train`: the Trainer's progress bar carries the few numbers worth watching.

transformers' `ProgressCallback` prints the whole metrics dict (40+ entries with OBLR-PO's) on every logging step.
Here the bar's postfix shows the reward, the accuracy reward when there is one, the SNR factor and the learning rate
actually used; the full dict still goes to `trainer_state.json` and to every `report_to` integration.
"""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback

from .training.model_card import TOTAL_RUNTIME_KEY, counted

__all__ = ["ConciseProgressCallback", "training_summary"]

# (what the bar calls it, the logged keys to take it from, in order of preference)
SHOWN = (
    ("reward", ("reward",)),
    ("acc", ("rewards/accuracy_reward/mean",)),
    ("f", ("snr/lr_factor",)),
    ("lr", ("oblr/lr", "learning_rate")),  # a run without a factor uses the scheduled rate
)


def summary(logs: dict) -> dict[str, str]:
    """The bar's postfix for one logging step: the entries of `SHOWN` that this step logged."""
    shown = {}
    for label, keys in SHOWN:
        value = next((logs[key] for key in keys if isinstance(logs.get(key), (int, float))), None)
        if value is not None:
            shown[label] = f"{value:.2e}" if label == "lr" else f"{value:.3f}"
    return shown


def training_summary(steps: int, logs: dict) -> str:
    """'trained 6 steps in 45 s (0.133 steps/s)', with the last segment's seconds when the run was resumed."""
    total, segment = logs.get(TOTAL_RUNTIME_KEY, logs["train_runtime"]), logs["train_runtime"]
    line = (f"trained {counted(steps, 'step')} in {_seconds(total)} "
            f"({steps / total if total > 0 else float('nan'):.3f} steps/s)")
    return line + (f"; this segment {_seconds(segment)}" if total > segment else "")  # resumed: earlier segments


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


class ConciseProgressCallback(ProgressCallback):
    """`ProgressCallback` whose training logs update the bar's postfix instead of printing a dict per step."""

    @classmethod
    def replace_default(cls, trainer) -> None:
        """Swap the Trainer's own progress callback for this one (nothing to swap when the bar is disabled)."""
        if trainer.pop_callback(ProgressCallback) is not None:
            trainer.add_callback(cls())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "train_runtime" in logs:  # the end-of-training summary: one line, over every segment of a resumed run
            self.training_bar.write(training_summary(state.global_step, logs))
        elif "reward" in logs or "loss" in logs:
            self.training_bar.set_postfix(summary(logs))
        else:  # evaluation and anything else keeps the default output
            super().on_log(args, state, control, logs=logs, **kwargs)
