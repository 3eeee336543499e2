"""Command line: ``oblr-trl`` or ``python -m oblr_trl`` (also under ``accelerate launch -m oblr_trl``).

* ``train [--config recipe.yaml] [--any_field value ...]``: OBLR-PO from a trl-style YAML recipe; without
  ``--config``, the embedded quickstart (SmolLM2-135M-Instruct on one-digit arithmetic, CPU).
* ``eval --model PATH_OR_ID --task TASK``: pass@1 / pass@n, JSON + markdown.
* ``plot RUN_DIR``: PNG of the training curves.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from . import __version__
from .training.model_card import counted

__all__ = ["TaskArguments", "main", "make_train_parser"]


def embedded_recipe(name: str = "quickstart.yaml") -> Path:
    return Path(str(resources.files("oblr_trl") / "recipes" / name))


@dataclass
class TaskArguments:
    """What to train on and how it is graded (the `script` part of a recipe)."""

    task: str = field(
        default="arithmetic",
        metadata={"help": "Task to train on: gsm8k, math, math500, aime25, amc23, olympiadbench, dapo-math-17k, "
                  "arithmetic, gsm8k-100 or local (see `oblr-trl tasks`)."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy"],
        metadata={"help": "Reward functions by name ('accuracy', 'format') or dotted import path."},
    )
    task_limit: int | None = field(default=None, metadata={"help": "Use only the first N problems of the split."})
    task_prompt_template: str | None = field(
        default=None, metadata={"help": "User-message template with a '{question}' placeholder (task default if unset)."}
    )
    task_system_prompt: str | None = field(default=None, metadata={"help": "Optional system message."})
    task_digits: int = field(default=1, metadata={"help": "arithmetic: digits per operand."})
    task_operators: str = field(default="+", metadata={"help": "arithmetic: operators to draw from, over '+-*'."})
    task_num_problems: int = field(default=1000, metadata={"help": "arithmetic: problems generated per split."})
    task_path: str | None = field(default=None, metadata={"help": "local: a .jsonl/.json or .parquet file."})
    task_question_field: str | None = field(default=None, metadata={"help": "local: question column."})
    task_answer_field: str | None = field(default=None, metadata={"help": "local: gold-answer column."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png into output_dir after training."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds another run, removing its checkpoints and state "
                  "(without it, such a folder is refused unless --resume_from_checkpoint continues that run)."},
    )

    def options(self):
        return task_options(self)


def task_options(source):
    """`TaskOptions` from the ``task_*`` attributes of a `TaskArguments` or of `eval`'s parsed flags."""
    from .tasks import TaskOptions

    return TaskOptions(
        limit=source.task_limit,
        prompt_template=source.task_prompt_template,
        system_prompt=source.task_system_prompt,
        digits=source.task_digits,
        operators=source.task_operators,
        num_problems=source.task_num_problems,
        path=source.task_path,
        question_field=source.task_question_field,
        answer_field=source.task_answer_field,
    )


class UsageError(Exception):
    """A mistake in the command line, the recipe or the environment: reported in one line, exit status 2."""


DEBUG_ENV = "OBLR_TRL_DEBUG"
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
OFFLINE_TASK_FOR_HUB_TASKS = "arithmetic"  # what the CPU hint of a GPU recipe on a Hub task trains on instead
# the GRPOConfig / TrainingArguments / ModelConfig fields a recipe sets most often, named in the short help
COMMON_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations", "per_device_train_batch_size",
    "gradient_accumulation_steps", "max_completion_length", "temperature", "beta", "loss_type", "scale_rewards",
    "use_vllm", "vllm_mode", "use_peft", "bf16", "use_cpu", "save_strategy", "report_to", "push_to_hub",
    "resume_from_checkpoint", "seed",
)


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


def make_train_parser():
    from trl import ModelConfig, TrlParser

    from .training.config import OBLRPOConfig

    class TrainParser(TrlParser):
        def error(self, message):  # argparse would print the 250-flag usage line first
            raise UsageError(f"{message} (see `oblr-trl train --help`)")

    # no prefix matching: `--learning_rat` must not silently mean `--learning_rate` (a YAML typo is refused too)
    return TrainParser((TaskArguments, OBLRPOConfig, ModelConfig), prog="oblr-trl train", allow_abbrev=False)


def installed_trainer_fields() -> set[str]:
    """The names the real parser of `oblr-trl train` accepts, less the ones oblr-trl defines itself (imports TRL):
    what `oblr_trl/trainer_fields.txt` records."""
    from .training.options import OBLRPOOptions

    own = {f.name for f in fields(TaskArguments)} | {f.name for f in fields(OBLRPOOptions)}
    return {action.dest for action in make_train_parser()._actions} - own


def split_config(argv: list[str]) -> tuple[Path, list[str]]:
    """(the recipe, the flags that override it) of a `train` command line; the quickstart without ``--config``."""
    argv = list(argv)
    if "--config" not in argv:
        argv = ["--config", str(embedded_recipe()), *argv]
    position = argv.index("--config")
    if position + 1 == len(argv) or argv[position + 1].startswith("--"):
        raise UsageError("--config needs a recipe file: --config RECIPE.yaml (see recipes/)")
    config_path = Path(argv[position + 1])
    if not config_path.is_file():
        raise UsageError(f"--config {config_path}: no such file (recipes: recipes/*.yaml, or no --config for the quickstart)")
    return config_path, argv[:position] + argv[position + 2:]


def check_train_args_early(argv: list[str]) -> tuple[Path, dict[str, object]]:
    """The mistakes of a `train` command line found without importing torch, transformers or TRL: the recipe file and
    its YAML, unknown fields and flags (where the recorded field names match the installed versions), the task, and
    the values that `OBLRPOConfig` refuses (OBLR-PO's options, and the Trainer's numbers). Returns the recipe's path
    and its raw values with the flags applied."""
    from .tasks import check_task_name
    from .trainer_fields import known_trainer_fields
    from .training.options import TRAINER_VALUE_RULES, OBLRPOOptions, invalid_value

    config_path, overrides = split_config(argv)
    recipe = read_recipe(config_path)
    values = {**recipe, **flag_values(overrides)}
    trainer_fields = known_trainer_fields()
    if trainer_fields is not None:
        known = trainer_fields | {f.name for f in fields(TaskArguments)} | {f.name for f in fields(OBLRPOOptions)} | {"env"}
        _reject_unknown_fields(known, config_path, recipe)
        _reject_unknown_flags(known, overrides)
    check_task_name(str(values.get("task", TaskArguments.task)))
    for name, allowed, valid in TRAINER_VALUE_RULES:
        if name in values:
            value = _typed(values[name])
            if isinstance(value, bool) or not valid(value):
                raise invalid_value(name, value, allowed)
    option_names = {f.name for f in fields(OBLRPOOptions)}
    OBLRPOOptions(**{name: _typed(value) for name, value in values.items() if name in option_names}).validate_options()
    if values.get("output_dir") is not None:  # the refusal of a folder holding another run, before torch loads
        check_output_dir(str(values["output_dir"]), _typed(values.get("overwrite_output_dir")) is True,
                         values.get("resume_from_checkpoint") not in (None, "None"))
    return config_path, values


def check_gpu_needs(values: dict[str, object], config_path: Path) -> None:
    """A GPU recipe (bf16, vLLM) on a machine without a GPU: say so in one line, and how to try it on a CPU, instead of
    transformers' "assign use_cpu" (after which the Hub model would not fit a CPU run anyway)."""
    needs = [name for name in ("bf16", "use_vllm") if _typed(values.get(name)) is True]
    if not needs or _typed(values.get("use_cpu")) is True:
        return
    import torch

    if torch.cuda.is_available():
        return
    from .tasks import LOCAL_TASKS

    flags = [f"--{name} false" for name in needs] + ["--use_cpu true", "--model_name_or_path", DEFAULT_MODEL]
    task = str(values.get("task", TaskArguments.task))
    if task not in LOCAL_TASKS:  # a Hub dataset: offline, the CPU try would fail on it after minutes of retries
        flags += ["--task", OFFLINE_TASK_FOR_HUB_TASKS]
    raise UsageError(
        f"{config_path} needs a GPU ({', '.join(f'{name}: true' for name in needs)}) and this machine has none. "
        f"On a CPU, try it offline with: oblr-trl train --config {config_path} {' '.join(flags)} --max_steps 5 "
        "(a small built-in model" + (f", and the generated arithmetic task instead of the Hub's {task}" if task not in
                                     LOCAL_TASKS else "") + "), or run `oblr-trl train` for the CPU quickstart."
    )


def flag_values(overrides: list[str]) -> dict[str, object]:
    """``--field value``, ``--field=value`` and a bare ``--flag`` (True) as a dict of raw values."""
    values: dict[str, object] = {}
    for index, argument in enumerate(overrides):
        if not argument.startswith("--"):
            continue
        name, separator, value = argument[2:].partition("=")
        if not separator:
            following = overrides[index + 1] if index + 1 < len(overrides) else None
            value = True if following is None or following.startswith("--") else following
        values[name.replace("-", "_")] = value
    return values


def _typed(value):
    """A flag's text as the number or boolean it spells (YAML already typed a recipe's values)."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_train_args(argv: list[str]):
    """(task_args, training_args, model_args, recipe_text) from ``--config`` (or the quickstart) and flags."""
    config_path, overrides = split_config(argv)
    parser = make_train_parser()
    known = {action.dest for action in parser._actions} | {"env"}
    _reject_unknown_fields(known, config_path, read_recipe(config_path))
    _reject_unknown_flags(known, overrides)
    task_args, training_args, model_args = parser.parse_args_and_config(["--config", str(config_path), *overrides])
    recipe = f"# {config_path.name}\n{config_path.read_text()}"
    if overrides:
        recipe += f"\n# command-line overrides: {' '.join(overrides)}\n"
    return task_args, training_args, model_args, recipe


def _did_you_mean(name: str, known: set[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def read_recipe(config_path: Path) -> dict:
    """The recipe's YAML mapping; a syntax error is reported with its line."""
    import yaml

    try:
        recipe = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{config_path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from error
    if not isinstance(recipe, dict):
        raise UsageError(f"{config_path} must contain a YAML mapping of field: value.")
    return recipe


def _reject_unknown_fields(known: set[str], config_path: Path, recipe: dict) -> None:
    """Unknown recipe keys fail before any configuration is built (TrlParser only checks them afterwards)."""
    unknown = sorted(set(recipe) - known)
    if unknown:
        raise ValueError(
            f"Unknown fields in {config_path}: "
            + ", ".join(f"{name}{_did_you_mean(name, known)}" for name in unknown)
            + ". Allowed: the fields of TaskArguments, OBLRPOConfig (every GRPOConfig field included) and "
            "trl.ModelConfig; see `oblr-trl train --help`."
        )


def _reject_unknown_flags(known: set[str], overrides: list[str]) -> None:
    for argument in overrides:
        if argument.startswith("--"):
            name = argument[2:].split("=", 1)[0]
            if name not in known and name.replace("-", "_") not in known:
                raise UsageError(f"unknown flag --{name}{_did_you_mean(name, known, '--')}; see `oblr-trl train --help`")


def train_help() -> str:
    """`oblr-trl train --help`: OBLR-PO options, then the task's, then where the other ~250 fields are; no torch."""
    from .training.options import OBLRPOOptions

    def describe(dataclass_fields) -> list[str]:
        lines = []
        for item in dataclass_fields:
            default = item.default_factory() if callable(item.default_factory) else item.default
            choices = item.metadata.get("choices")
            value = "{" + ",".join(choices) + "}" if choices else "VALUE"
            lines.append(f"  --{item.name} {value}  (default: {default})")
            lines += textwrap.wrap(item.metadata.get("help", ""), width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
        return lines

    return "\n".join([
        "usage: oblr-trl train [--config RECIPE.yaml] [--FIELD VALUE ...] [--debug]",
        "",
        "Train with OBLR-PO from a trl-style YAML recipe; flags override the recipe's fields. Without --config: the",
        "embedded quickstart (SmolLM2-135M-Instruct on one-digit addition, CPU, offline).",
        "",
        "  --config RECIPE.yaml  the recipe (see recipes/); every field below can be set in it",
        "  --debug               show the traceback of an error (or set OBLR_TRL_DEBUG=1)",
        "  --help-all            every field with its help (long)",
        "",
        "OBLR-PO options (OBLRPOConfig):",
        *describe(fields(OBLRPOOptions)),
        "",
        "Task options:",
        *describe(fields(TaskArguments)),
        "",
        "Every field of TRL's GRPOConfig, transformers' TrainingArguments and trl.ModelConfig is accepted too, e.g.",
        *textwrap.wrap(", ".join(f"--{name}" for name in COMMON_FIELDS), width=110, initial_indent="  ",
                       subsequent_indent="  "),
        "All of them: `oblr-trl train --help-all`, or",
        "https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig.",
    ])


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
    found = ([counted(len(previous), "checkpoint")] if previous else []) + (["trainer_state.json"] if state.exists() else [])
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
        config_path, values = check_train_args_early(argv)  # before torch, transformers and TRL load (seconds)
        check_gpu_needs(values, config_path)
        task_args, training_args, model_args, recipe = parse_train_args(argv)
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
            prepare_output_dir(training_args.output_dir, task_args.overwrite_output_dir,
                               training_args.resume_from_checkpoint is not None)

        from trl import get_peft_config

        from .progress import ConciseProgressCallback
        from .training.trainer import OBLRPOTrainer

        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype or "float32",
            **(training_args.model_init_kwargs or {}),
        }
        trainer = OBLRPOTrainer(
            model=models.resolve_model(model_name),
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            peft_config=get_peft_config(model_args),
        )
    ConciseProgressCallback.replace_default(trainer)
    trainer.recipe = recipe
    trainer.base_model_id = models.model_card_id(model_name)
    dataset_id, trainer.dataset_description = task_source(task_args.task, task_args.options())
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


def evaluate_command(args: argparse.Namespace) -> int:
    from .evaluation import check_sampling, evaluate, write_eval_report
    from .tasks import load_task
    from .training.models import check_model_available

    with reported_as_usage_errors():  # everything evaluate() would refuse, before the model loads
        check_sampling(args.n, args.temperature, args.backend)
        check_model_available(args.model, option="--model")
        problems = load_task(args.task, "test", task_options(args))
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
        options=task_options(args),
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
    if argv[:1] == ["train"]:  # TrlParser owns the whole command line of `train`
        return train(argv[1:])
    # no prefix matching anywhere: `--max_new_token` must not silently mean `--max_new_tokens`
    parser = argparse.ArgumentParser(
        prog="oblr-trl", description="OBLR-PO for TRL users.", epilog="--debug (any command): show the traceback of an error.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train from a YAML recipe (default: the embedded quickstart); --help for fields")

    eval_parser = commands.add_parser("eval", help="pass@1 / pass@n of a model on a task", allow_abbrev=False)
    eval_parser.add_argument("--model", required=True, help="Hub id, local path or builtin:smollm2-135m-instruct")
    eval_parser.add_argument("--task", required=True, help="task name (see `oblr-trl tasks`)")
    eval_parser.add_argument("--n", type=int, default=1, help="samples per problem")
    eval_parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    eval_parser.add_argument("--top_p", type=float, default=1.0)
    eval_parser.add_argument("--max_new_tokens", type=int, default=256)
    eval_parser.add_argument("--batch_size", type=int, default=16)
    eval_parser.add_argument("--limit", dest="task_limit", type=int, default=None, help="first N problems only")
    eval_parser.add_argument("--backend", default="auto", choices=["auto", "transformers", "vllm"])
    eval_parser.add_argument("--output_dir", default=None,
                             help="default: MODEL/eval for a local model, else runs/eval/<model id>")
    eval_parser.add_argument("--seed", type=int, default=0, help="sampling seed (the problems do not depend on it)")
    for task_field in fields(TaskArguments):  # the prompt and problems of the task, exactly as in training
        if task_field.name.startswith("task_") and task_field.name != "task_limit":
            eval_parser.add_argument(
                f"--{task_field.name}", type=int if isinstance(task_field.default, int) else str,
                default=task_field.default,
                help=task_field.metadata["help"],
            )
    eval_parser.set_defaults(handler=evaluate_command)

    plot_parser = commands.add_parser("plot", help="PNG of a run's training curves", allow_abbrev=False)
    plot_parser.add_argument("run_dir")
    plot_parser.add_argument("--output", default=None, help="default: RUN_DIR/training_curves.png")
    plot_parser.set_defaults(handler=plot_command)

    commands.add_parser("tasks", help="list the tasks").set_defaults(handler=tasks_command)
    if not argv:  # what there is to do, instead of argparse's one-line complaint
        parser.print_help()
        return 2
    args, unknown = parser.parse_known_args(argv)
    flags = [item.split("=", 1)[0] for item in unknown if item.startswith("--")]
    if flags:  # named, with the nearest known flag, as `train` does
        command = commands.choices[args.command]
        known = {option for action in command._actions for option in action.option_strings}
        raise UsageError(f"unknown flag {flags[0]}{_did_you_mean(flags[0], known)}; see `oblr-trl {args.command} "
                         "--help`")
    if unknown:
        raise UsageError(f"unexpected arguments: {' '.join(unknown)}; see `oblr-trl {args.command} --help`")
    return args.handler(args)
