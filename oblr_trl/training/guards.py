"""Clear errors for bad input, and a graceful stop on SIGTERM/SIGINT (docs/robustness.md lists every case tried).

Glue, no math: checks that run before training starts, a wrapper that names a failing reward function, the signal
handling behind `save_on_preemption`, and the end of a multi-process run.
"""

from __future__ import annotations

import functools
import gc
import inspect
import signal
import threading
import warnings
from collections.abc import Callable

import torch

__all__ = ["PreemptionSignal", "TrainingPreempted", "check_prompt_lengths", "checked_reward_funcs",
           "end_distributed_training", "name_reward_errors", "validate_training_data"]

# What TRL passes to every reward function besides the dataset's own columns.
_TRL_REWARD_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
# Dataset columns TRL does not forward to reward functions (it passes them under the names above).
_NOT_FORWARDED = {"prompt", "completion", "completion_ids"}


def validate_training_data(dataset, reward_funcs: list, reward_names: list[str], requires_prompt: bool = True) -> None:
    """Refuse an empty dataset, one without a ``prompt`` column, and reward functions that need missing columns.

    ``requires_prompt=False`` where TRL accepts rows without one (an ``environment_factory`` or ``rollout_func`` that
    owns the prompts); the reward functions' columns are then not checked either, as the environment supplies them.
    """
    from datasets import Dataset

    if not isinstance(dataset, Dataset):  # streaming datasets: nothing to look at before training
        return
    if len(dataset) == 0:
        raise ValueError("Invalid value for `train_dataset`: it is empty. Allowed: a dataset with at least one row.")
    columns = set(dataset.column_names)
    if not requires_prompt:
        return
    if "prompt" not in columns:
        raise ValueError(
            f"Invalid value for `train_dataset`: no 'prompt' column (columns: {sorted(columns)}). Allowed: a dataset "
            "with a 'prompt' column of strings or of conversations (lists of {'role', 'content'} messages)."
        )
    available = (columns - _NOT_FORWARDED) | _TRL_REWARD_KWARGS
    for func, name in zip(reward_funcs, reward_names, strict=True):
        if not callable(func) or isinstance(func, torch.nn.Module):  # reward models are fed text, not columns
            continue
        missing = sorted(
            p.name
            for p in inspect.signature(func).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in available
        )
        if missing:
            raise ValueError(
                f"Reward function {name!r} needs the argument(s) {missing}, which the training dataset does not have "
                f"(columns: {sorted(columns)}). Allowed: add the column(s), or give the argument(s) a default."
            )


def checked_reward_funcs(reward_funcs, train_dataset, requires_prompt: bool = True) -> list:
    """Check the data against the reward functions before any model loads; name a reward function that fails."""
    from trl.trainer.utils import get_callable_name

    funcs = reward_funcs if isinstance(reward_funcs, list) else [] if reward_funcs is None else [reward_funcs]
    names = [f if isinstance(f, str) else get_callable_name(f) for f in funcs]
    validate_training_data(train_dataset, [f for f in funcs if not isinstance(f, str)],
                           [n for f, n in zip(funcs, names, strict=True) if not isinstance(f, str)], requires_prompt)
    return [
        f if isinstance(f, (str, torch.nn.Module)) else name_reward_errors(f, name)
        for f, name in zip(funcs, names, strict=True)
    ]


def check_prompt_lengths(prompt_ids: list, limit: int | None, max_completion_length: int, warn: bool) -> bool:
    """Refuse a prompt that fills the model's context (``limit`` tokens; None: unknown); with ``warn``, warn once
    where a prompt plus ``max_completion_length`` exceeds it (TRL generates anyway: rotary models run past
    max_position_embeddings, degraded). Returns whether it warned."""
    longest = max((len(ids) for ids in prompt_ids), default=0)
    if limit is not None and longest >= limit:
        raise ValueError(
            f"A prompt of {longest} tokens exceeds the model's context of {limit} tokens: nothing can be generated. "
            f"Allowed: prompts of fewer than {limit} tokens (filter or truncate the dataset)."
        )
    if warn and limit is not None and longest + max_completion_length > limit:
        warnings.warn(
            f"A prompt of {longest} tokens plus max_completion_length={max_completion_length} exceeds the "
            f"model's context of {limit} tokens; completions may be cut or degraded past it."
        )
        return True
    return False


def name_reward_errors(func: Callable, name: str) -> Callable:
    """Wrap a reward function so that an exception says which function failed, keeping its name and async-ness."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def wrapped_async(*args, **kwargs):
            try:
                return await func(*args, **kwargs)
            except Exception as error:
                raise RuntimeError(f"Reward function {name!r} raised {type(error).__name__}: {error}") from error

        return wrapped_async

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as error:
            raise RuntimeError(f"Reward function {name!r} raised {type(error).__name__}: {error}") from error

    return wrapped


class PreemptionSignal:
    """Records SIGTERM/SIGINT instead of dying, so that training can checkpoint at the end of the current step.

    A second SIGINT gets Python's default behaviour back (KeyboardInterrupt) for a user who really wants out now.
    Only the main thread can install signal handlers; elsewhere this does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = signum

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class TrainingPreempted(RuntimeError):
    """`train()` stopped early on SIGTERM/SIGINT after saving a resumable checkpoint (`save_on_preemption`).

    Raised instead of returning as if training had finished, so that the next line of a script (`push_to_hub`, an
    evaluation) never runs on a partly trained model. ``signal`` is None on a process that stopped because another
    process of the launch was signalled; ``checkpoint`` is None where no checkpoint could be saved.
    """

    def __init__(self, signal_number: int | None, step: int, checkpoint: str | None):
        self.signal, self.step, self.checkpoint = signal_number, step, checkpoint
        cause = signal.Signals(signal_number).name if signal_number is not None else "a signal to another process"
        where = (f"checkpoint saved to {checkpoint}; resume with trainer.train(resume_from_checkpoint={checkpoint!r})"
                 if checkpoint else "no checkpoint was saved")
        super().__init__(f"Training stopped by {cause} after optimizer step {step}: {where}.")


def end_distributed_training(accelerator=None) -> None:
    """Let go of everything that holds the process group, then destroy it, while the interpreter is still whole.

    ``destroy_process_group`` only drops torch.distributed's own references. A trainer lives in reference cycles, so
    after its last use it and its DDP wrapper (whose reducer holds the gloo group) wait for the garbage collector; if
    that first runs at interpreter exit, gloo's worker threads are torn down with Python and a run whose training
    succeeded aborts ("terminate called without an active exception", SIGABRT; seen in CI on 2026-11-26 after the
    group had been destroyed). The caller drops its own references to the trainer first. ``accelerator`` (optional)
    releases the prepared models and optimizers it keeps and finishes its trackers.
    """
    from accelerate import PartialState

    if accelerator is not None:
        accelerator.free_memory()  # it collects before it lets go of the prepared models: collected again below
    gc.collect()
    if accelerator is not None:
        accelerator.end_training()
    else:
        PartialState().destroy_process_group()
