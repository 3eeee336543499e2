"""Every command the docs show runs here as written: the fenced ```bash blocks and the inline `oblr-trl …`,
`python -m oblr_trl …`, `accelerate launch … -m oblr_trl …` and `python -m benchmarks.… …` spans of README.md
and docs/*.md, the commands in the recipes' comments, the notebooks' shell cells and markdown, and the flags the prose
shows (`--lr_trust_region_kl None`) as `oblr-trl train FLAG`. One test id per command: the file and line it is on.

How each is checked:
* through the running interpreter (`oblr-trl X` is `python -m oblr_trl X`; nothing is looked up on PATH), in a
  scratch folder where `recipes/` and `benchmarks/` resolve and the runs the commands write land;
* `train` on the CPU, offline (a built-in model and a local task): run with `--max_steps 1` appended, exit 0; commands
  that differ only in `--output_dir` and `--max_steps` run once;
* `train` that needs a GPU (bf16, vLLM), the Hub (a Hub model or dataset) or several processes (`accelerate launch`),
  a flag shown in prose, and `eval` of a Hub model or task: the CLI itself, in this process, up to where it turns to
  the data (every flag and recipe field parsed, the configs built and validated, the model's name checked where that
  needs no network); the reason is in the test id. Without a GPU, a GPU command is first refused in one line, as the
  docs say, then checked with `--use_cpu true` appended (transformers refuses bf16 without a GPU otherwise);
* `eval` of a built-in model or of a run a doc command trains, on a local task, with short answers (at most
  `EVAL_RUN_MAX_NEW_TOKENS`): run on its first 2 problems (`--limit 2` appended); `plot`, `tasks` and `--help` run
  as written; `plot` and `eval` of a run on the run the doc's training command writes (`runs/quickstart`: the
  quickstart's one-step run). A command the docs show twice runs once;
* a mistake the docs show (`--learning_rate -1`) is refused in one line naming the field;
* `python -m benchmarks.X ARGS`: the benchmark's own argparse parses ARGS, then it stops (a benchmark runs for hours).

Not run: `pip install …` (CI installs the package that way), `python -m pytest …` (the suite itself) and `bash .ci/…`
(CI's install scripts). Templates (`<recipe>`, `RECIPE.yaml`, `CHECKPOINT`, `…`, `{a,b}`, `a | b`) are not commands,
nor is a bare name in prose (`oblr-trl plot`, `accelerate launch`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ("python", "python3")
NOT_RUN = (
    ("pip", "install"),  # CI installs the package that way
    ("python", "-m", "pytest"),  # the test suite itself
    ("bash", ".ci/install-vllm"),  # CI's install script
)
HELP = {"-h", "--help", "--help-all", "--version"}
# a placeholder in a word makes the command a template; so does a metavariable (CHECKPOINT, RECIPE.yaml)
PLACEHOLDER = re.compile(r"[<>{}…|]|^[A-Z][A-Z_]+(\.[a-z]+)?$")
# the mistakes the docs show, each with the field the one-line refusal names
DOCUMENTED_MISTAKES = {("--learning_rate", "-1"): "learning_rate"}
# longer answers take minutes on a CPU (gsm8k-100 at 256 new tokens: 4½ CPU-minutes for 2 problems): parsed only
EVAL_RUN_MAX_NEW_TOKENS = 32
TIMEOUT = 1800  # a step of the real model on a busy 2-core machine takes minutes


@dataclass(frozen=True)
class DocCommand:
    where: str  # "README.md:86"
    words: tuple[str, ...]  # as written: continuations joined, the comment dropped, one link of an `&&` chain
    in_prose: bool = False  # an inline span, not a shell block or a recipe's launch line
    flag: bool = False  # a flag the prose shows: checked as `oblr-trl train FLAG`

    @property
    def kind(self) -> str:
        """cli, launch, benchmark, not run, or unknown."""
        words = ("python", *self.words[1:]) if self.words[0] in PYTHONS else self.words
        if self.flag or words[0] == "oblr-trl" or words[:3] == ("python", "-m", "oblr_trl"):
            return "cli"
        if words[:2] == ("accelerate", "launch"):
            return "launch" if self._module_position() is not None else "unknown"
        if words[:2] == ("python", "-m") and len(words) > 2 and words[2].startswith("benchmarks."):
            return "benchmark"
        if any(words[:len(prefix)] == prefix for prefix in NOT_RUN):
            return "not run"
        return "unknown"

    def _module_position(self) -> int | None:
        for position in range(len(self.words) - 1):
            if self.words[position:position + 2] == ("-m", "oblr_trl"):
                return position
        return None

    @property
    def cli_args(self) -> list[str]:
        """What follows `oblr-trl` (under `accelerate launch`: what follows `-m oblr_trl`)."""
        if self.flag:
            return ["train", *self.words]
        if self.kind == "launch":
            return list(self.words[self._module_position() + 2:])
        return list(self.words[1:] if self.words[0] == "oblr-trl" else self.words[3:])

    @property
    def template(self) -> bool:
        return any(PLACEHOLDER.search(word) for word in self.words)

    @property
    def bare_name(self) -> bool:
        """A name in prose (`oblr-trl plot`, `accelerate launch -m oblr_trl`), not a command to run."""
        if not self.in_prose or self.flag:
            return False
        if self.kind == "unknown":  # `accelerate launch` without a module
            return True
        args = self.cli_args if self.kind in ("cli", "launch") else list(self.words[3:])
        return len(args) == 0 or (len(args) == 1 and not args[0].startswith("-"))


def shell_commands(lines: list[str], first_line: int) -> list[tuple[int, list[str]]]:
    """(the line it starts on, its words) of each command in shell lines: a `\\` at a line's end joins the next line,
    a `# comment` is dropped, an `&&` chain is split into its commands."""
    commands, pending, start = [], "", None
    for number, line in enumerate(lines, first_line):
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        chain: list[list[str]] = [[]]
        for word in shlex.split(pending + line, comments=True):
            if word == "&&":
                chain.append([])
            else:
                chain[-1].append(word)
        commands += [(start, words) for words in chain if words]
        pending, start = "", None
    return commands


def inline_commands(prose: str) -> list[tuple[int, list[str], bool]]:
    """(line, words, is a flag) of the `code spans` of prose that show a command or a flag with its value."""
    found = []
    for match in re.finditer(r"`([^`]+)`", prose):
        if "\n\n" in match.group(1):
            continue
        span, line = " ".join(match.group(1).split()), prose.count("\n", 0, match.start()) + 1
        if span.startswith("--"):
            words = shlex.split(span)
            if len(words) >= 2:
                found.append((line, words, True))
        elif span.split(" ", 1)[0] in ("oblr-trl", "accelerate", *PYTHONS):
            found += [(line, words, False) for _, words in shell_commands([span], line)]
    return found


def markdown_commands(text: str) -> list[tuple[int, list[str], bool, bool]]:
    """(line, words, in prose, is a flag) of a markdown text's shell blocks and inline spans."""
    shell, prose, fence = [], [], None  # fence: (is a shell block, its first line, its lines)
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*```(\w*)", line)
        if fence is not None and opening:
            if fence[0]:
                shell += shell_commands(fence[2], fence[1])
            fence = None
        elif fence is not None:
            fence[2].append(line)
        elif opening:
            fence = (opening.group(1) in ("bash", "sh", "shell", "console"), number + 1, [])
        prose.append("" if fence is not None or opening else line)
    return ([(line, words, False, False) for line, words in shell]
            + [(line, words, True, flag) for line, words, flag in inline_commands("\n".join(prose))])


def recipe_commands(text: str) -> list[tuple[int, list[str], bool, bool]]:
    """The commands a recipe's comment lines show: the inline spans, and a line that is a command (after `Launch:`),
    continued by the next comment line after a `\\`."""
    comments = {number: line.split("#", 1)[1].strip() for number, line in enumerate(text.splitlines(), 1)
                if line.lstrip().startswith("#")}
    found, continued = [], set()
    for number, comment in comments.items():
        if number in continued:
            continue
        if "`" in comment:
            found += [(number, words, True, flag) for _, words, flag in inline_commands(comment)]
            continue
        command = comment.removeprefix("Launch:").strip()
        if command.split(" ", 1)[0] not in ("oblr-trl", "accelerate", *PYTHONS):
            continue
        lines, following = [command], number
        while lines[-1].endswith("\\") and following + 1 in comments:
            following += 1
            lines.append(comments[following])
            continued.add(following)
        found += [(line, words, False, False) for line, words in shell_commands(lines, number)]
    return found


def notebook_commands(notebook: dict) -> list[tuple[str, list[str], bool, bool]]:
    """("cellN:line", words, in prose, is a flag) of a notebook's shell cells (`!command`, `%%bash`) and markdown."""
    found = []
    for index, cell in enumerate(notebook["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        lines = source.splitlines()
        if cell["cell_type"] == "markdown":
            items = markdown_commands(source)
        elif lines[:1] and lines[0].strip() == "%%bash":
            items = [(line, words, False, False) for line, words in shell_commands(lines[1:], 2)]
        else:
            items = [(line, words, False, False) for number, text in enumerate(lines, 1)
                     if text.lstrip().startswith("!") for line, words in shell_commands([text.lstrip()[1:]], number)]
        found += [(f"cell{index}:{line}", words, prose, flag) for line, words, prose, flag in items]
    return found


def doc_commands() -> list[DocCommand]:
    """Every command the docs show, templates and bare names included, in the order of the files."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found += [(page, str(line), *rest) for line, *rest in markdown_commands(page.read_text())]
    for recipe in sorted((ROOT / "recipes").rglob("*.yaml")):
        found += [(recipe, str(line), *rest) for line, *rest in recipe_commands(recipe.read_text())]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found += [(notebook, *item) for item in notebook_commands(json.loads(notebook.read_text()))]
    return [DocCommand(f"{path.relative_to(ROOT)}:{line}", tuple(words), prose, flag)
            for path, line, words, prose, flag in found]


COMMANDS = [command for command in doc_commands() if not command.template and not command.bare_name]
CHECKED = [command for command in COMMANDS if command.kind in ("cli", "launch", "benchmark")]


def flag_values(args: list[str]) -> dict[str, object]:
    """``--name value`` (or a bare ``--name``: true) as YAML types them, the first value of a list."""
    values: dict[str, object] = {}
    for position, word in enumerate(args):
        if word.startswith("--"):
            following = args[position + 1] if position + 1 < len(args) else "--"
            values[word[2:]] = True if following.startswith("--") else yaml.safe_load(following)
    return values


def train_values(args: list[str]) -> dict[str, object]:
    """The fields a `train` command line sets: its recipe (the quickstart without --config), then its flags."""
    from oblr_trl.cli import embedded_recipe

    flags = flag_values(args)
    recipe = ROOT / str(flags.pop("config")) if "config" in flags else embedded_recipe()
    return {**yaml.safe_load(recipe.read_text()), **flags}


def model_and_task(command: DocCommand) -> tuple[str, str]:
    """The model and the task a `train` or `eval` command names, as its recipe and flags say."""
    args = command.cli_args
    if args[0] == "eval":
        values = flag_values(args[1:])
        return str(values["model"]), str(values["task"])
    from oblr_trl.cli import DEFAULT_MODEL

    values = train_values(args[1:])
    return str(values.get("model_name_or_path", DEFAULT_MODEL)), str(values.get("task", "arithmetic"))


def gpu_fields(command: DocCommand) -> list[str]:
    args = command.cli_args
    values = train_values(args[1:]) if args[0] == "train" else {}
    return [name for name in ("bf16", "use_vllm") if values.get(name) is True]


@functools.cache
def trained_runs() -> dict[str, tuple[str, ...]]:
    """The run folder each training group writes -> the group: its first command's (the others do not run)."""
    first_commands = {}
    for command in CHECKED:
        if (command.kind == "cli" and command.cli_args[0] == "train" and not HELP & set(command.cli_args)
                and not parse_only_reasons(command)):
            first_commands.setdefault(training_group(command), command)
    return {str(train_values(command.cli_args[1:])["output_dir"]): group for group, command in first_commands.items()}


def parse_only_reasons(command: DocCommand) -> list[str]:
    """Why a command is parsed and validated only, not run (none: it runs)."""
    reasons = ["accelerate launch: several processes"] if command.kind == "launch" else []
    args = command.cli_args
    if command.kind not in ("cli", "launch") or args[:1] not in (["train"], ["eval"]) or HELP & set(args):
        return reasons
    from oblr_trl.tasks import LOCAL_TASKS

    model, task = model_and_task(command)
    if gpu_fields(command):
        reasons.append(f"GPU: {', '.join(gpu_fields(command))}")
    # eval's --model is local where a doc command trains that run folder; train's model comes from a recipe
    if not model.startswith("builtin:") and (args[0] == "train" or model not in trained_runs()):
        reasons.append(f"Hub model {model}")
    if task not in LOCAL_TASKS:
        reasons.append(f"Hub dataset {task}")
    if command.flag:
        reasons.append("a flag in prose")
    tokens = flag_values(args[1:]).get("max_new_tokens")
    if args[0] == "eval" and not (isinstance(tokens, int) and tokens <= EVAL_RUN_MAX_NEW_TOKENS):
        reasons.append(f"--max_new_tokens {tokens or 'default'}: minutes on a CPU")
    return reasons


def training_group(command: DocCommand) -> tuple[str, ...]:
    """A `train` command's arguments without its output folder and its step count: one run per group."""
    args, kept, skip = command.cli_args, [], False
    for word in args:
        if skip:
            skip = False
        elif word in ("--output_dir", "--max_steps"):
            skip = True
        elif not word.startswith(("--output_dir=", "--max_steps=")):
            kept.append(word)
    return tuple(kept)


def documented_mistake(command: DocCommand) -> str | None:
    return DOCUMENTED_MISTAKES.get(command.words) if command.flag else None


RUN = [c for c in CHECKED if c.kind == "cli" and not documented_mistake(c) and not parse_only_reasons(c)]
PARSED = [c for c in CHECKED if c.kind in ("cli", "launch") and not documented_mistake(c) and parse_only_reasons(c)]
MISTAKES = [c for c in CHECKED if documented_mistake(c)]
BENCHMARKS = [c for c in CHECKED if c.kind == "benchmark"]


def scratch_folder(factory: pytest.TempPathFactory) -> Path:
    """A folder to run in: the repository's `recipes/` and `benchmarks/` resolve, the runs land in it."""
    folder = factory.mktemp("docs")
    for name in ("recipes", "benchmarks"):
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)
    return folder


def run_cli(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oblr_trl", *args], cwd=folder, capture_output=True, text=True,
                          timeout=TIMEOUT)


class DocRuns:
    """Each distinct command run once, when first asked for: one `--max_steps 1` run per training group, each in a
    folder of its own; a command the docs show twice (README.md and docs/usage.md) runs once."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory, self.trained, self.done = factory, {}, {}

    def train(self, group: tuple[str, ...]) -> tuple[Path, subprocess.CompletedProcess]:
        if group not in self.trained:
            first = next(command for command in RUN
                         if command.cli_args[0] == "train" and training_group(command) == group)
            folder = scratch_folder(self.factory)
            self.trained[group] = folder, run_cli([*first.cli_args, "--max_steps", "1"], folder)
        return self.trained[group]

    def run(self, args: list[str], folder: Path | None = None) -> tuple[Path, subprocess.CompletedProcess]:
        """``oblr-trl ARGS`` in ``folder`` (a new scratch folder by default)."""
        if tuple(args) not in self.done:
            folder = folder or scratch_folder(self.factory)
            self.done[tuple(args)] = folder, run_cli(args, folder)
        return self.done[tuple(args)]

    def run_folder(self, run: str) -> Path:
        """The folder in which `run` (a run folder a doc command trains) holds a finished run."""
        group = trained_runs().get(run)
        assert group is not None, f"no training command in the docs writes {run}"
        folder, done = self.train(group)
        assert done.returncode == 0, f"the training command that writes {run} failed: {done.stderr[-3000:]}"
        return folder


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    return DocRuns(tmp_path_factory)


class DataReached(Exception):
    """Raised where the CLI turns to the data: every flag and recipe field is parsed, the configs are built and
    validated, the model's name is checked."""

    def __init__(self, model: str | None, task: str):
        super().__init__(model, task)
        self.model, self.task = model, task


def cli_until_the_data(args: list[str], folder: Path, monkeypatch, capsys) -> DataReached | tuple[int, str]:
    """`oblr-trl ARGS` in this process, up to where it would load the task's data (and then the model): what it
    reached, or its exit status and stderr."""
    from oblr_trl import cli, tasks
    from oblr_trl.training import models

    checked_models = []
    check_model_available = models.check_model_available

    def check_model(name, *args, **kwargs):
        checked_models.append(name)
        if name.startswith("builtin:") or Path(name).exists():  # a Hub id's check asks the Hub
            check_model_available(name, *args, **kwargs)

    def stop(task, *args, **kwargs):
        raise DataReached(checked_models[-1] if checked_models else None, task)

    monkeypatch.setattr(models, "check_model_available", check_model)
    monkeypatch.setattr(tasks, "load_task", stop)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))  # train sets it
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except DataReached as reached:
        return reached
    return code, capsys.readouterr().err


def ids(commands: list[DocCommand], reasons=None) -> list[str]:
    return [command.where + (f" ({'; '.join(reasons(command))})" if reasons else "") for command in commands]


def test_the_docs_show_commands_of_every_kind_and_no_unknown_one():
    shown = [command for command in COMMANDS if not command.in_prose]
    assert not [c.where + " " + " ".join(c.words) for c in shown if c.kind == "unknown"], (
        "a shell block or a recipe shows a command this file does not know how to check: teach it (run it, parse it, "
        "or add it to NOT_RUN with a comment saying why it is not run)")
    # the set-up's chain (pip install … && oblr-trl train) and the command line's quickstart
    assert len([c for c in RUN if c.where.startswith("README.md:") and c.cli_args == ["train"]]) == 2
    assert any(c.flag and c.words == ("--lr_trust_region_kl", "None") for c in PARSED)
    assert any(c.kind == "launch" for c in PARSED) and MISTAKES and BENCHMARKS
    assert "runs/quickstart" in trained_runs()


def test_the_collector_reads_continuations_chains_comments_and_spans():
    markdown = ("Run `oblr-trl train --max_steps 2` or `oblr-trl plot`; set `--seed 3`, not `--help-all`.\n"
                "```bash\n"
                "pip install x && oblr-trl train   # the quickstart\n"
                "accelerate launch --config_file a.yaml \\\n"
                "    -m oblr_trl train --config b.yaml\n"
                "```\n"
                "```python\noblr-trl not_a_shell_block\n```\n"
                "`oblr-trl train --config <recipe>` and `oblr-trl train | eval`\n")
    found = [(line, words, prose, flag) for line, words, prose, flag in markdown_commands(markdown)]
    assert found == [
        (3, ["pip", "install", "x"], False, False), (3, ["oblr-trl", "train"], False, False),
        (4, ["accelerate", "launch", "--config_file", "a.yaml", "-m", "oblr_trl", "train", "--config", "b.yaml"],
         False, False),
        (1, ["oblr-trl", "train", "--max_steps", "2"], True, False), (1, ["oblr-trl", "plot"], True, False),
        (1, ["--seed", "3"], True, True),
        (10, ["oblr-trl", "train", "--config", "<recipe>"], True, False),
        (10, ["oblr-trl", "train", "|", "eval"], True, False),
    ]
    commands = [DocCommand("x", tuple(words), prose, flag) for _, words, prose, flag in found]
    assert [c.kind for c in commands] == ["not run", "cli", "launch", "cli", "cli", "cli", "cli", "cli"]
    assert [c.bare_name for c in commands] == [False, False, False, False, True, False, False, False]
    assert [c.template for c in commands] == [False] * 6 + [True, True]
    assert commands[2].cli_args == ["train", "--config", "b.yaml"] and commands[5].cli_args == ["train", "--seed", "3"]
    recipe = ("# Launch: accelerate launch --config_file z.yaml \\\n#     -m oblr_trl train --config r.yaml\n"
              "# e.g. `oblr-trl train --max_steps 10`\nkey: 1  # oblr-trl train\n")
    assert recipe_commands(recipe) == [
        (1, ["accelerate", "launch", "--config_file", "z.yaml", "-m", "oblr_trl", "train", "--config", "r.yaml"],
         False, False),
        (3, ["oblr-trl", "train", "--max_steps", "10"], True, False),
    ]
    notebook = {"cells": [{"cell_type": "code", "source": ["x = 1\n", "!oblr-trl tasks"]},
                          {"cell_type": "code", "source": "%%bash\noblr-trl plot runs/a \\\n  --output b.png"}]}
    assert notebook_commands(notebook) == [("cell0:2", ["oblr-trl", "tasks"], False, False),
                                           ("cell1:2", ["oblr-trl", "plot", "runs/a", "--output", "b.png"], False,
                                            False)]


@pytest.mark.parametrize("command", RUN, ids=ids(RUN))
def test_the_command_runs_as_written(command, doc_runs):
    args = command.cli_args
    if args[0] == "train" and not HELP & set(args):  # the same run for the commands of one group
        _, done = doc_runs.train(training_group(command))
    elif args[0] == "eval":  # the first 2 problems (a flag given twice: the last one counts)
        model = str(flag_values(args[1:])["model"])
        folder, done = doc_runs.run([*args, "--limit", "2"],
                                    doc_runs.run_folder(model) if model in trained_runs() else None)
        assert done.returncode == 0, done.stderr[-3000:]
        report = re.search(r"details: (\S+)", done.stdout)
        assert report and json.loads((folder / report.group(1)).read_text())["num_problems"] == 2, done.stdout
    elif args[0] == "plot":
        folder, done = doc_runs.run(args, doc_runs.run_folder(args[1]))
        assert done.returncode == 0 and (folder / done.stdout.strip().splitlines()[-1]).is_file(), done.stdout
    else:
        _, done = doc_runs.run(args)
        assert done.stdout.strip(), done.stderr[-3000:]
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-5000:]


@pytest.mark.parametrize("command", PARSED, ids=ids(PARSED, parse_only_reasons))
def test_the_command_parses_and_validates(command, monkeypatch, capsys, tmp_path_factory):
    """Up to where `oblr-trl` turns to the data and the model: all but the download and the hardware."""
    import torch

    folder, args = scratch_folder(tmp_path_factory), command.cli_args
    if command.kind == "launch":
        from accelerate.commands.launch import launch_command_parser

        launch = launch_command_parser().parse_args(list(command.words[2:]))
        assert launch.module and launch.training_script == "oblr_trl"
        assert launch.config_file is None or (ROOT / launch.config_file).is_file(), launch.config_file
    if gpu_fields(command) and not torch.cuda.is_available():
        code, stderr = cli_until_the_data(args, folder, monkeypatch, capsys)
        assert code == 2 and [line for line in stderr.splitlines() if "needs a GPU" in line], stderr
        args = [*args, "--use_cpu", "true"]
    reached = cli_until_the_data(args, folder, monkeypatch, capsys)
    assert isinstance(reached, DataReached), f"oblr-trl {' '.join(args)}: exit {reached[0]}: {reached[1]}"
    assert (reached.model, reached.task) == model_and_task(command)


@pytest.mark.parametrize("command", MISTAKES, ids=ids(MISTAKES))
def test_a_mistake_the_docs_show_is_refused_in_one_line(command, monkeypatch, capsys, tmp_path_factory):
    outcome = cli_until_the_data(command.cli_args, scratch_folder(tmp_path_factory), monkeypatch, capsys)
    assert not isinstance(outcome, DataReached), f"{' '.join(command.words)} was accepted"
    code, stderr = outcome
    errors = [line for line in stderr.splitlines() if line.startswith("oblr-trl: error: ")]
    assert code == 2 and len(errors) == 1, stderr
    assert documented_mistake(command) in errors[0] and command.words[-1] in errors[0], stderr


# the script's own argparse parses the arguments, then it stops: nothing of the benchmark runs
PARSE_AND_STOP = """import argparse, runpy, sys
parse_known_args = argparse.ArgumentParser.parse_known_args
def parse_and_stop(self, args=None, namespace=None):
    namespace, unknown = parse_known_args(self, args, namespace)
    if unknown:
        self.error("unrecognized arguments: " + " ".join(unknown))
    print("parsed:", namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_known_args = parse_and_stop
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", BENCHMARKS, ids=ids(BENCHMARKS))
def test_the_benchmark_command_parses(command, tmp_path_factory):
    done = subprocess.run([sys.executable, "-c", PARSE_AND_STOP, *command.words[2:]],
                          cwd=scratch_folder(tmp_path_factory), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "parsed:" in done.stdout, done.stderr[-3000:]
