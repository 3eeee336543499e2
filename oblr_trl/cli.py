"""Command line: ``oblr-trl`` or ``python -m oblr_trl`` (also under ``accelerate launch -m oblr_trl``).

* ``train [--config recipe.yaml] [--any_field value ...]``: OBLR-PO from a trl-style YAML recipe; without
  ``--config``, the embedded quickstart (SmolLM2-135M-Instruct on one-digit arithmetic, CPU).
* ``eval --model PATH_OR_ID --task TASK``: pass@1 / pass@n, JSON + markdown.
* ``plot RUN_DIR``: PNG of the training curves.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from . import __version__
from .arguments import (
    TaskArguments,
    UsageError,
    embedded_recipe,
    make_train_parser,
    parse_eval_args,
    parse_train_args,
    reject_unknown_arguments,
    task_options,
    train_help,
)
from .training.model_card import counted

__all__ = ["TaskArguments", "UsageError", "embedded_recipe", "main", "make_train_parser", "parse_train_args"]


DEBUG_ENV = "OBLR_TRL_DEBUG"
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
OFFLINE_TASK_FOR_HUB_TASKS = "arithmetic"  # what the CPU hint of a GPU recipe on a Hub task trains on instead


@contextmanager
def reported_as_usage_errors():
    """What goes wrong before training starts is the user's to fix (a value, a file, a name, the network): one line.
    Errors once training runs keep their traceback."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, FileNotFoundError, ImportError) as error:
        raise UsageError(" ".join(str(error).split())) from error


def check_gpu_needs(values: argparse.Namespace, config_path: Path) -> None:
    """A GPU recipe (bf16, vLLM) on a machine without a GPU: say so in one line, and how to try it on a CPU, instead of
    transformers' "assign use_cpu" when TrainingArguments is built (the Hub model would not fit a CPU run anyway)."""
    needs = [name for name in ("bf16", "use_vllm") if getattr(values, name) is True]
    if not needs or values.use_cpu is True:
        return
    import torch

    if torch.cuda.is_available():
        return
    from .tasks import LOCAL_TASKS

    flags = [f"--{name} false" for name in needs] + ["--use_cpu true", "--model_name_or_path", DEFAULT_MODEL]
    if values.task not in LOCAL_TASKS:  # a Hub dataset: offline, the CPU try would fail on it after minutes of retries
        flags += ["--task", OFFLINE_TASK_FOR_HUB_TASKS]
    raise UsageError(
        f"{config_path} needs a GPU ({', '.join(f'{name}: true' for name in needs)}) and this machine has none. "
        f"On a CPU, try it offline with: oblr-trl train --config {config_path} {' '.join(flags)} --max_steps 5 "
        "(a small built-in model" + (f", and the generated arithmetic task instead of the Hub's {values.task}"
                                     if values.task not in LOCAL_TASKS else "") + "), or run `oblr-trl train` for the "
        "CPU quickstart."
    )


def _previous_run(output_dir: str) -> tuple[list[Path], Path]:
    folder = Path(output_dir)
    return (sorted(folder.glob("checkpoint-*")) if folder.is_dir() else []), folder / "trainer_state.json"


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """Refuse to train into a folder that holds another run, unless told to overwrite it or to resume it.

    Reusing one silently would rewrite the finished run's model card, rotate its checkpoints away and leave the highest
    checkpoint number to an older run.
    """
    previous, state = _previous_run(output_dir)
    if overwrite or resuming or not (previous or state.exists()):
        return
    found = [counted(len(previous), "checkpoint")] if previous else []
    found += ["trainer_state.json"] if state.exists() else []
    raise UsageError(
        f"{output_dir} holds another run ({', '.join(found)}). Allowed: a new --output_dir, "
        "--resume_from_checkpoint CHECKPOINT to continue that run, or --overwrite_output_dir true to replace it."
    )


def prepare_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """`check_output_dir`, then, with ``overwrite``, remove the old run's checkpoints and trainer state."""
    import shutil

    check_output_dir(output_dir, overwrite, resuming)
    if resuming:
        return
    previous, state = _previous_run(output_dir)
    for checkpoint in previous:
        shutil.rmtree(checkpoint)
    state.unlink(missing_ok=True)


def train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(train_help())
        return 0
    if "--help-all" in argv:
        make_train_parser().print_help()
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # TRL 1.16 reads transformers 5's deprecated `is_gradient_checkpointing` around every generation: nothing the user
    # can change (GRPOTrainer prints it too), so the console leaves it out
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    with reported_as_usage_errors():
        task_args, training_args, model_args, recipe = parse_train_args(argv, check_values=check_gpu_needs)
        resuming = training_args.resume_from_checkpoint is not None
        # before the dataset downloads; `prepare_output_dir` acts on it last
        check_output_dir(training_args.output_dir, task_args.overwrite_output_dir, resuming)
        from .rewards import get_reward_funcs
        from .tasks import load_task, task_source
        from .training import models
        from .training.guards import end_distributed_training
        from .training.vllm_colocate import close_colocated_vllm

        model_name = model_args.model_name_or_path or DEFAULT_MODEL
        models.check_model_available(model_name)
        reward_funcs = get_reward_funcs(task_args.reward_funcs)
        train_dataset = load_task(task_args.task, "train", task_args.options())
        if training_args.process_index == 0:  # last: a mistake found above leaves an earlier run untouched
            prepare_output_dir(training_args.output_dir, task_args.overwrite_output_dir, resuming)

        from trl import get_peft_config

        from .progress import ConciseProgressCallback
        from .training.trainer import OBLRPOTrainer

        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype or "float32",
            **(training_args.model_init_kwargs or {}),
        }
        dataset_id, dataset_description = task_source(task_args.task, task_args.options())
        trainer = OBLRPOTrainer(
            model=model_name,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            peft_config=get_peft_config(model_args),
            recipe=recipe,
            dataset_id=dataset_id,
            dataset_description=dataset_description,
        )
    ConciseProgressCallback.replace_default(trainer)
    try:
        return _train_and_publish(trainer, argv, training_args, task_args, dataset_id)
    finally:
        accelerator = trainer.accelerator
        close_colocated_vllm(trainer)  # its teardown needs the process group destroyed below
        del trainer  # the last reference outside the trainer's own cycles: end_distributed_training collects them
        end_distributed_training(accelerator)


def _train_and_publish(trainer, argv: list[str], training_args, task_args, dataset_id: str | None) -> int:
    """Train, then save, plot, card and push on the processes that should; the exit code."""
    from .training.guards import TrainingPreempted

    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except TrainingPreempted as stopped:
        return _report_preemption(trainer, argv, stopped)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if trainer.is_world_process_zero() and task_args.plot:
        from .plotting import plot_run

        print(f"training curves: {plot_run(training_args.output_dir)}")
    trainer.create_model_card(model_name=Path(training_args.output_dir).name, dataset_name=dataset_id)
    if trainer.is_world_process_zero():
        _print_reward_change(trainer.state.log_history)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_id)
    return 0


def _report_preemption(trainer, argv: list[str], stopped) -> int:
    """Stopped by SIGTERM/SIGINT after saving a checkpoint: say where, how to resume, and exit 128 + signal."""
    signum = stopped.signal if stopped.signal is not None else signal.SIGTERM  # another process was signalled
    if trainer.is_world_process_zero():
        command = " ".join(["oblr-trl", "train", *without_option(argv, "--resume_from_checkpoint"),
                            "--resume_from_checkpoint", str(stopped.checkpoint)])
        print(f"stopped by {signal.Signals(signum).name} after step {stopped.step}; checkpoint: {stopped.checkpoint}\n"
              f"resume with: {command}")
    return 128 + signum


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` and ``option=VALUE`` (a resumed run's command names its checkpoint once)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            kept.append(item)
    return kept


def _print_reward_change(history: list[dict]) -> None:
    rewards = [entry["reward"] for entry in history if "reward" in entry and "loss" in entry]
    if len(rewards) >= 2:
        window = max(1, len(rewards) // 5)
        first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        steps = counted(window, "logged step")
        print(f"mean reward: first {steps} {first:.3f} -> last {steps} {last:.3f}")


def eval_output_dir(model: str) -> str:
    """MODEL/eval for a local model; otherwise runs/eval/<the model's name>, one folder per model."""
    if os.path.isdir(model):
        return os.path.join(model, "eval")
    return os.path.join("runs", "eval", re.sub(r"[^A-Za-z0-9._-]+", "--", model).strip("-"))


def evaluate_command(argv: list[str]) -> int:
    from .evaluation import check_sampling, evaluate, write_eval_report
    from .tasks import load_task
    from .training.models import check_model_available

    args, task_args = parse_eval_args(argv)
    options = task_options(task_args, args.limit)
    with reported_as_usage_errors():  # everything evaluate() would refuse, before the model loads
        check_sampling(args.n, args.temperature, args.backend)
        check_model_available(args.model, option="--model")
        problems = load_task(args.task, "test", options)
    result = evaluate(
        args.model,
        args.task,
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        backend=args.backend,
        seed=args.seed,
        options=options,
        dataset=problems,
    )
    output_dir = args.output_dir or eval_output_dir(args.model)
    json_path, md_path = write_eval_report(result, output_dir)
    print(md_path.read_text())
    print(f"details: {json_path}")
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from .plotting import plot_run

    with reported_as_usage_errors():
        print(plot_run(args.run_dir, args.output))
    return 0


def tasks_command(args: argparse.Namespace) -> int:
    from .tasks import TASKS

    for name, description in TASKS.items():
        print(f"{name:16s} {description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [argument for argument in argv if argument != "--debug"]
    try:
        return run_command(argv)
    except UsageError as error:
        if debug:
            raise
        print(f"oblr-trl: error: {error}", file=sys.stderr)
        return 2


def run_command(argv: list[str]) -> int:
    if argv[:1] == ["train"]:  # TrlParser owns the whole command line of `train` and `eval`
        return train(argv[1:])
    if argv[:1] == ["eval"]:
        return evaluate_command(argv[1:])
    # no prefix matching anywhere: `--out` must not silently mean `--output`
    parser = argparse.ArgumentParser(
        prog="oblr-trl", description="OBLR-PO for TRL users.", allow_abbrev=False,
        epilog="--debug (any command): show the traceback of an error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train from a YAML recipe (default: the embedded quickstart); --help for fields")
    commands.add_parser("eval", help="pass@1 / pass@n of a model on a task; --help for flags")
    plot_parser = commands.add_parser("plot", help="PNG of a run's training curves", allow_abbrev=False)
    plot_parser.add_argument("run_dir")
    plot_parser.add_argument("--output", default=None, help="default: RUN_DIR/training_curves.png")
    plot_parser.set_defaults(handler=plot_command)

    commands.add_parser("tasks", help="list the tasks").set_defaults(handler=tasks_command)
    if not argv:  # what there is to do, instead of argparse's one-line complaint
        parser.print_help()
        return 2
    args, unknown = parser.parse_known_args(argv)
    command = commands.choices[args.command]
    reject_unknown_arguments(unknown, {option for action in command._actions for option in action.option_strings},
                             f"oblr-trl {args.command}")
    return args.handler(args)
