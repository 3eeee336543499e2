"""What the `oblr-trl` commands read, and how: `TaskArguments` and `EvalArguments`, parsed by TRL's `TrlParser`
(`train`: with TRL's `--config` recipe and every field of `OBLRPOConfig` and `trl.ModelConfig`).

A mistake in a command line or a recipe is a `UsageError`, one line: argparse's message for a value the field's type
or choices refuse, the field's own ValueError from its dataclass's ``__post_init__``, or an unknown flag or recipe key
named with the nearest known one. Nothing here imports torch, transformers or TRL until a parser is built, so that
`oblr-trl --help` and `oblr-trl train --help` answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, get_type_hints

__all__ = ["COMMON_FIELDS", "EvalArguments", "EvalTaskArguments", "TaskArguments", "UsageError", "embedded_recipe",
           "make_train_parser", "parse_eval_args", "parse_train_args", "reject_unknown_arguments", "split_config",
           "task_options", "train_help"]


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
        default=None,
        metadata={"help": "User-message template with a '{question}' placeholder (task default if unset)."},
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

    def __post_init__(self):
        from .tasks import check_task_name

        check_task_name(self.task)

    def options(self):
        return task_options(self, self.task_limit)


@dataclass
class EvalArguments:
    """`oblr-trl eval`'s flags, besides the task_* ones it shares with `TaskArguments` (`EvalTaskArguments`)."""

    model: str = field(metadata={"help": "Hub id, local path or builtin:smollm2-135m-instruct"})
    task: str = field(metadata={"help": "task name (see `oblr-trl tasks`)"})
    n: int = field(default=1, metadata={"help": "samples per problem"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int = 16
    limit: int | None = field(default=None, metadata={"help": "first N problems only"})
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    output_dir: str | None = field(
        default=None, metadata={"help": "default: MODEL/eval for a local model, else runs/eval/<model id>"}
    )
    seed: int = field(default=0, metadata={"help": "sampling seed (the problems do not depend on it)"})


# the prompt and problems of the task exactly as in training: TaskArguments' own task_* fields (--limit is task_limit)
EvalTaskArguments = make_dataclass("EvalTaskArguments", [
    (item.name, get_type_hints(TaskArguments)[item.name], field(default=item.default, metadata=item.metadata))
    for item in fields(TaskArguments) if item.name.startswith("task_") and item.name != "task_limit"
])


def task_options(source, limit: int | None):
    """`TaskOptions` from the ``task_*`` attributes of a `TaskArguments` or an `EvalTaskArguments`."""
    from .tasks import TaskOptions

    return TaskOptions(
        limit=limit,
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


# the GRPOConfig / TrainingArguments / ModelConfig fields a recipe sets most often, named in the short help
COMMON_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations", "per_device_train_batch_size",
    "gradient_accumulation_steps", "max_completion_length", "temperature", "beta", "loss_type", "scale_rewards",
    "use_vllm", "vllm_mode", "use_peft", "bf16", "use_cpu", "save_strategy", "report_to", "push_to_hub",
    "resume_from_checkpoint", "seed",
)


def _command_parser(dataclass_types, prog: str, check_values: Callable | None = None):
    """TRL's TrlParser over ``dataclass_types``, a mistake in one line (`UsageError`): an unknown flag or recipe key
    with the nearest known one, no prefix matching (`--learning_rat` must not silently mean `--learning_rate`).
    ``check_values`` sees the parsed values (an argparse Namespace) before the dataclasses are built from them."""
    from trl import TrlParser

    class CommandParser(TrlParser):
        def error(self, message):  # argparse would print the 250-flag usage line first
            raise UsageError(f"{message} (see `{prog} --help`)")

        def set_defaults_with_config(self, **recipe):
            unknown = super().set_defaults_with_config(**recipe)  # "--key", "value" of each key no field takes
            if unknown:  # named before the configs are built (TRL only complains afterwards)
                known = {action.dest for action in self._actions}
                names = [key[2:] for key in unknown[::2]]
                raise UsageError("Unknown fields in the recipe: " + ", ".join(name + _did_you_mean(name, known)
                                                                              for name in names)
                                 + f"; see `{prog} --help-all`")
            return unknown

        def parse_known_args(self, args=None, namespace=None):
            values, unknown = super().parse_known_args(args, namespace)
            reject_unknown_arguments(unknown, {option for action in self._actions for option in action.option_strings},
                                     prog)
            if check_values is not None:
                check_values(values)
            return values, unknown

    return CommandParser(dataclass_types, prog=prog, allow_abbrev=False)


def reject_unknown_arguments(unknown: list[str], options: set[str], prog: str) -> None:
    """What a parser left over: an unknown flag named with the nearest known one, or the stray values."""
    flags = [item.split("=", 1)[0] for item in unknown if item.startswith("-")]
    if flags:
        raise UsageError(f"unknown flag {flags[0]}{_did_you_mean(flags[0], options)}; see `{prog} --help`")
    if unknown:
        raise UsageError(f"unexpected arguments: {' '.join(unknown)}; see `{prog} --help`")


def make_train_parser(check_values: Callable | None = None):
    from trl import ModelConfig

    from .training.config import OBLRPOConfig

    return _command_parser((TaskArguments, OBLRPOConfig, ModelConfig), "oblr-trl train", check_values)


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
        raise UsageError(f"--config {config_path}: no such file (recipes: recipes/*.yaml, or no --config for the "
                         "quickstart)")
    return config_path, argv[:position] + argv[position + 2:]


def parse_train_args(argv: list[str], check_values: Callable | None = None):
    """(task_args, training_args, model_args, recipe_text) from ``--config`` (or the quickstart) and flags, as TRL's
    TrlParser reads them; ``check_values(values, config_path)`` sees the parsed values before the configs are built."""
    import yaml

    config_path, overrides = split_config(argv)
    parser = make_train_parser(None if check_values is None else lambda values: check_values(values, config_path))
    try:
        task_args, training_args, model_args = parser.parse_args_and_config(["--config", str(config_path), *overrides])
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{config_path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from error
    recipe = f"# {config_path.name}\n{config_path.read_text()}"
    if overrides:
        recipe += f"\n# command-line overrides: {' '.join(overrides)}\n"
    return task_args, training_args, model_args, recipe


def _did_you_mean(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


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
            lines += textwrap.wrap(item.metadata.get("help", ""), width=100, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
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


def parse_eval_args(argv: list[str]) -> tuple[EvalArguments, EvalTaskArguments]:
    return _command_parser((EvalArguments, EvalTaskArguments), "oblr-trl eval").parse_args_into_dataclasses(argv)
