"""What an OBLR-PO run leaves on disk beside the Trainer's own files, and how it stops on a signal.

[`RunRecords`] is the trainer's collaborator for everything that outlives a process:

* **checkpoints** carry OBLR-PO's state (`oblr_state.json`: the baseline's pooled slope, the SNR averages and
  calibration, the seconds trained so far; `oblr_gradient_sketch.pt`: the last step's gradient sketch) and
  `resume_from_checkpoint` restores it;
* **preemption**: SIGTERM/SIGINT finishes the step, saves one checkpoint (only the newest preemption checkpoint of a
  run is kept unless `save_total_limit` is set) and `train()` raises `TrainingPreempted`; a resumed run that finishes
  removes the preemption checkpoint it resumed from (the finished run supersedes it, and it is a full checkpoint with
  the optimizer's state, 1.6 GB for a 135M model);
* **the model card** (`training.model_card`), rewritten wherever the model is saved: checkpoints, `save_model`, the
  end of training, `push_to_hub`;
* **time over segments**: a resumed run's summaries and card count the seconds of every segment, not the last one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..estimators.step_rate import StepRateRule
from .guards import PreemptionSignal, TrainingPreempted
from .model_card import TOTAL_RUNTIME_KEY, ModelCardFacts, counted, model_card_text

__all__ = ["PREEMPTION_MARKER", "RunDescription", "RunRecords", "SKETCH_FILE", "STATE_FILE"]

logger = logging.get_logger(__name__)

STATE_FILE = "oblr_state.json"
PREEMPTION_MARKER = "oblr_preemption.json"  # in a checkpoint saved on SIGTERM/SIGINT: only the newest is kept
SKETCH_FILE = "oblr_gradient_sketch.pt"  # the last step's gradient sketch, for the cross-step SNR estimator


@dataclass(frozen=True)
class RunDescription:
    """What the model card says about a run that neither its arguments nor its log hold, as the trainer knows it when
    the card is written."""

    model_source: str  # the model's config id: a Hub id or a local folder
    base_model_id: str | None  # the Hub id of the base model where the source is a local export of it
    hub_model_id: str | None
    dataset_id: str | None
    dataset_description: str | None
    recipe: str | None  # the YAML recipe of `oblr-trl train`
    tags: tuple[str, ...]
    paper: dict[str, str]
    num_generations: int
    reward_func_names: tuple[str, ...]


class RunRecords:
    """Checkpoint state, preemption, the model card and the time of every segment of one run (module docstring).

    It never sees the trainer: the trainer hands it what it records (`OBLRPOTrainer.__init__`).

    Args:
        args: the run's `OBLRPOConfig`.
        accelerator: the run's `Accelerator` (processes, device).
        state: returns the Trainer's current `TrainerState` (a new one each `train()`).
        describe: returns the run's `RunDescription` for the model card.
        pooled_slope: the baseline's pooled slope (`PooledSlope`), saved with each checkpoint.
        step_rate: the rate rule (`StepRateRule`: what the SNR factor and the trust region measured), saved likewise.
        kl_recorder, snr_recorder: the step-KL and step-noise recorders (None where off), saved likewise.
    """

    def __init__(self, args, accelerator, state: Callable[[], Any], describe: Callable[[], RunDescription],
                 pooled_slope, step_rate, kl_recorder=None, snr_recorder=None):
        self.args, self.accelerator, self.state, self.describe = args, accelerator, state, describe
        self.pooled_slope, self.step_rate = pooled_slope, step_rate
        self.kl_recorder, self.snr_recorder = kl_recorder, snr_recorder
        self.preemption = PreemptionSignal()
        self.preempted_at_step: int | None = None
        self.preemption_checkpoint: str | None = None
        self.resumed_from: str | None = None
        self.seconds_before = 0.0  # trained in the segments before this one (from the checkpoint resumed)
        self._segment_start: float | None = None
        self._segment_end: float | None = None

    # The run's segments ----------------------------------------------------------------------------------------------

    def begin(self) -> None:
        """`train()` starts (or resumes)."""
        self.preempted_at_step = self.preemption_checkpoint = None
        self.resumed_from, self.seconds_before = None, 0.0
        self._segment_start, self._segment_end = time.monotonic(), None

    def training_seconds(self) -> float:
        """Seconds trained over every segment of the run so far."""
        if self._segment_start is None:
            return self.seconds_before
        current = (self._segment_end or time.monotonic()) - self._segment_start
        return self.seconds_before + current

    def with_all_segments(self, logs: dict[str, float]) -> dict[str, float]:
        """The end-of-training summary with the seconds of every segment added (`train_runtime_all_segments`)."""
        return {**logs, TOTAL_RUNTIME_KEY: self.seconds_before + float(logs["train_runtime"])}

    def end(self) -> None:
        """`train()` returned: raise `TrainingPreempted` after a signal, else drop the preemption checkpoint resumed
        from (kept only under `save_total_limit`, whose rotation decides instead)."""
        self._segment_end = time.monotonic()
        if self.preempted_at_step is not None:
            # its message says how to resume from Python; the CLI prints its own command instead
            raise TrainingPreempted(self.preemption.received, self.preempted_at_step, self.preemption_checkpoint)
        resumed = Path(self.resumed_from) if self.resumed_from else None
        args = self.args
        if (resumed is not None and (resumed / PREEMPTION_MARKER).exists() and args.save_total_limit is None
                and args.should_save):
            shutil.rmtree(resumed, ignore_errors=True)
            logger.warning(f"Removed {resumed}: the preemption checkpoint this run resumed from (the run has finished).")

    # Preemption ------------------------------------------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """Every process agrees to stop, even if only some of them got the signal."""
        accelerator = self.accelerator
        requested = torch.tensor(self.preemption.received is not None, device=accelerator.device)
        if accelerator.num_processes > 1:
            requested = accelerator.gather(requested.reshape(1)).any()
        return bool(requested)

    def _keep_one_preemption_checkpoint(self, newest: Path) -> None:
        """Mark ``newest`` as saved on preemption and delete the run's earlier preemption checkpoints: each interruption
        would otherwise leave a full checkpoint behind. With `save_total_limit` set, the Trainer's rotation decides."""
        (newest / PREEMPTION_MARKER).write_text(json.dumps({"signal": self.preemption.received,
                                                            "step": self.state().global_step}))
        if self.args.save_total_limit is not None:
            return
        for folder in newest.parent.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            if folder != newest and (folder / PREEMPTION_MARKER).exists():
                shutil.rmtree(folder, ignore_errors=True)

    # Checkpoints -----------------------------------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """After the Trainer saved checkpoint ``folder``: OBLR-PO's state beside it."""
        if self.preempted_at_step is not None:
            self.preemption_checkpoint = str(folder)
        if not self.args.should_save:
            return
        if self.preempted_at_step is not None:
            self._keep_one_preemption_checkpoint(folder)
        state: dict[str, Any] = {"pooled_slope": self.pooled_slope.state_dict(),
                                 "step_rate": self.step_rate.state_dict(),
                                 "training_seconds": self.training_seconds()}
        if self.kl_recorder is not None:
            state["step_kl"] = self.kl_recorder.state_dict()
        if self.snr_recorder is not None:
            state |= self.snr_recorder.state_dict()
            previous_sketch = self.snr_recorder.previous_sketch_state()
            if previous_sketch is not None:
                torch.save(previous_sketch, folder / SKETCH_FILE)
        (folder / STATE_FILE).write_text(json.dumps(state, indent=2))

    def load(self, checkpoint: str) -> None:
        """Resuming from ``checkpoint``: OBLR-PO's state as it was saved."""
        self.resumed_from = checkpoint
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"{checkpoint} has no {STATE_FILE} (saved by an older version): the SNR averages and the baseline's "
                "pooled slope restart from scratch, with a new warm-up."
            )
            return
        state = json.loads(Path(path).read_text())
        self.seconds_before = float(state.get("training_seconds", 0.0))
        if "pooled_slope" in state:
            self.pooled_slope.load_state_dict(state["pooled_slope"])
        if "step_rate" in state:
            self.step_rate.load_state_dict(state["step_rate"])
        elif self.step_rate.scales_rate:
            warnings.warn(
                f"{checkpoint}'s {STATE_FILE} has no `step_rate` (saved by an older version): the SNR averages and the "
                "trust region's curvature restart from scratch, with a new probe."
            )
        if self.kl_recorder is not None:
            self.kl_recorder.load_state_dict(state.get("step_kl", {}))
        if self.snr_recorder is None:
            return
        self.snr_recorder.load_state_dict(state)
        sketch_path = os.path.join(checkpoint, SKETCH_FILE)
        if os.path.exists(sketch_path):
            self.snr_recorder.load_previous_sketch_state(torch.load(sketch_path, weights_only=True),
                                                         self.accelerator.device)

    # The model card --------------------------------------------------------------------------------------------------

    def write_card(self, folder: str, model_name: str | None, dataset_name: str | None, tags) -> None:
        """README.md in ``folder``: base model, problems, settings and results of this run, never failing a save."""
        try:
            (Path(folder) / "README.md").write_text(model_card_text(self._card_facts(folder, model_name, dataset_name,
                                                                                     tags)))
        except Exception as error:  # noqa: BLE001 - TRL writes the card before every checkpoint: never lose one to it
            warnings.warn(f"The model card was not written ({type(error).__name__}: {error}); training goes on.")

    def _card_facts(self, folder: str, model_name: str | None, dataset_name: str | None, tags) -> ModelCardFacts:
        args, run, state = self.args, self.describe(), self.state()
        source = run.model_source
        on_disk = os.path.isdir(source)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        curves = Path(folder) / "training_curves.png"
        hub_id = args.hub_model_id if args.push_to_hub or args.hub_model_id else None
        return ModelCardFacts(
            model_name=model_name or (hub_id or Path(args.output_dir).name).split("/")[-1],
            base_model=run.base_model_id or (None if on_disk else source or None),
            base_model_path=source if on_disk else None,
            hub_model_id=run.hub_model_id or hub_id,
            output_dir=folder,
            dataset_id=dataset_name or run.dataset_id,
            dataset_description=run.dataset_description,
            settings=card_settings(args, self.step_rate, state.max_steps, run.num_generations, run.reward_func_names),
            log_history=state.log_history,
            tags=sorted({*run.tags, *tags}),
            curves=curves.name if curves.exists() else None,
            tracker_urls=_tracker_urls(),
            recipe=run.recipe,
            paper=run.paper,
            training_seconds=self.training_seconds(),
        )


def rate_rule_description(rule: StepRateRule, snr_estimator: str) -> str:
    """The learning-rate factor of a run in a sentence, read off the rule the run used."""
    snr, trust = rule.snr, rule.trust_region
    if snr is None:
        description = "off (the scheduled rate)"
    elif snr.reference == "calibrated":
        description = f"calibrated SNR factor in [{snr.min_ratio:g}, {snr.max_ratio:g}] (`{snr_estimator}` estimator)"
    else:
        description = f"absolute SNR factor, floor {snr.floor:g} (`{snr_estimator}` estimator)"
    if trust is not None:
        gaps = " after gaps of 1, 2, 4, …" if rule.short_early_gaps else ""
        description += (f"; trust region δ = {trust.target_kl:g} per token at the schedule's peak (factor in "
                        f"[{trust.min_ratio:g}, {trust.max_ratio:g}], curvature per unit of Adam's update"
                        + (f", measured every {rule.measure_every} steps{gaps})" if rule.measure_every > 1 else ")"))
    return description


def card_settings(args, rule: StepRateRule, max_steps: int, num_generations: int, reward_func_names) -> dict[str, str]:
    """The settings table of the card: what a reader needs to reproduce the run (``max_steps``: the Trainer's, ≤ 0
    before training computed it)."""
    steps = max_steps if max_steps > 0 else max(args.max_steps, 1)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    rate_rule = rate_rule_description(rule, args.snr_estimator)
    prompts = per_step // num_generations
    return {
        "learning rate": f"{args.learning_rate:g}, `{_plain(args.lr_scheduler_type)}`, "
                         f"{counted(args.get_warmup_steps(steps), 'warm-up step')}",
        "learning-rate factor": rate_rule,
        "baseline": (f"`{args.baseline_weights}` weights, `{args.baseline_estimator}` estimate"
                     f"{', leave-one-out' if args.leave_one_out else ''}; scale_rewards `{args.scale_rewards}`"),
        "completions per step": f"{per_step} ({counted(prompts, 'prompt')} × {num_generations})",
        "max completion length": str(args.max_completion_length),
        "loss type, KL β": f"`{args.loss_type}`, {args.beta:g}",
        "optimizer, max grad norm": f"`{_plain(args.optim)}`, {args.max_grad_norm:g}",
        "reward functions": ", ".join(f"`{name}`" for name in reward_func_names),
        "training seed": str(args.seed),
    }


def _plain(value) -> str:
    """An enum's value ('constant_with_warmup'), anything else as is."""
    return str(getattr(value, "value", value))


def _tracker_urls() -> list[str]:
    """Where this run is tracked (Weights & Biases, Trackio, Comet), found the way TRL's own model card finds them."""
    from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

    wandb = sys.modules.get("wandb")  # open runs only: never imported for this
    urls = [getattr(getattr(wandb, "run", None), "url", None), get_trackio_space_url(), get_comet_experiment_url()]
    return [url for url in urls if url]
