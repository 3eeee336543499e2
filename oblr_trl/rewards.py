"""Verifiable rewards for math tasks, graded offline with `math-verify`, selectable by name.

Every reward function takes TRL's arguments (``completions`` as strings or as single-message conversations, plus the
dataset's columns as keyword lists) and returns one float per completion, or ``None`` where it cannot judge.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

__all__ = [
    "GRADER_VERSION", "REWARD_FUNCS", "accuracy_reward", "completion_text", "format_reward", "get_reward_funcs",
    "is_correct",
]

# Bumped whenever `is_correct` grades differently: benchmarks record it with every run and never mix versions in a
# table. 1: math-verify alone (it credited an unevaluated expression); 2: a numeric gold needs a number as written.
GRADER_VERSION = 2

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*(.+)")


def completion_text(completion) -> str:
    """The text of a completion, standard (a string) or conversational (a list with one assistant message)."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") or "" for message in completion if isinstance(message, dict))


def _timeouts() -> tuple[int | None, int | None]:
    # math-verify enforces timeouts with signal.alarm, which only works in the main thread; TRL may call reward
    # functions from a worker thread (async rewards), so timeouts are disabled there.
    if threading.current_thread() is threading.main_thread():
        return 5, 5
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return None, None


def _final_answer_span(text: str) -> str:
    """GSM8K-style '#### 42' marks the final answer; elsewhere the whole text is searched."""
    marked = _HASHES.findall(text)
    return marked[-1] if marked else text


def _is_written_number(expr) -> bool:
    """Whether a parsed answer is a number as written — a literal, a fraction of literals or a percentage, either
    negated — rather than a computation left to the grader, like ``5 * 16`` or ``9 - 4``."""
    import sympy

    if getattr(expr, "is_Number", False):
        return True
    if not isinstance(expr, sympy.Mul):
        return False
    literals = [f for f in expr.args if f.is_Number and f != -1]
    rest = [f for f in expr.args if not f.is_Number]
    reciprocals = [f for f in rest if isinstance(f, sympy.Pow) and f.base.is_Number and f.exp == -1]
    percents = [f for f in rest if isinstance(f, sympy.UnevaluatedExpr) and f.args[0] == sympy.Rational(1, 100)]
    return len(literals) <= 1 and len(reciprocals) <= 1 and len(percents) <= 1 and len(rest) == len(
        reciprocals
    ) + len(percents)


def is_correct(prediction: str, gold: str) -> bool | None:
    """Whether ``prediction`` states the same answer as ``gold``; ``None`` if ``gold`` itself cannot be parsed.

    Both sides go through math-verify (LaTeX incl. ``\\boxed{}``, plain expressions and numbers, units and thousands
    separators), so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` match, and "$18" matches "18 dollars". Where the gold is a
    number, the prediction's answer must be a number too (a literal, a fraction or a percentage): math-verify keeps an
    expression unevaluated and would credit "5 * 16" for 80, so a policy that restates an arithmetic question earns the
    full reward — SmolLM2 trained on a × b learned exactly that ("19 * 20 is a legendary and iconic Japanese martial
    arts film franchise", graded correct).
    """
    from math_verify import parse, verify

    parsing_timeout, verify_timeout = _timeouts()
    gold = _final_answer_span(gold).strip()
    # A bare gold answer ("2\\sqrt{3}", "(1,2)", as in MATH-500) has no LaTeX delimiters for math-verify to find:
    # read it as the boxed answer it is. Full solutions that box their answer are parsed as they are.
    if gold and "\\boxed" not in gold and "$" not in gold:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=parsing_timeout) or parse(
            gold, parsing_timeout=parsing_timeout
        )
    else:
        gold_parsed = parse(gold, parsing_timeout=parsing_timeout)
    if not gold_parsed:
        return None
    predicted = parse(_final_answer_span(prediction), parsing_timeout=parsing_timeout)
    if not predicted or (_is_written_number(gold_parsed[0]) and not _is_written_number(predicted[0])):
        return False
    return bool(verify(gold_parsed, predicted, timeout_seconds=verify_timeout))


def accuracy_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 if the completion's final answer equals the ``answer`` column, else 0.0 (None if the gold is unparsable,
    which TRL then leaves out of the reward)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        correct = is_correct(completion_text(completion), str(gold))
        rewards.append(None if correct is None else float(correct))
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 if the completion marks a final answer (``\\boxed{...}`` or ``#### ...``), else 0.0."""
    return [
        float(bool(_BOXED.search(text) or _HASHES.search(text)))
        for text in (completion_text(c) for c in completions)
    ]


REWARD_FUNCS: dict[str, Callable] = {"accuracy": accuracy_reward, "format": format_reward}


def get_reward_funcs(names: list[str]) -> list[Callable]:
    """Reward functions by name (see `REWARD_FUNCS`) or by dotted import path ``package.module.function``."""
    import importlib

    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif "." in name:
            module, attribute = name.rsplit(".", 1)
            try:
                funcs.append(getattr(importlib.import_module(module), attribute))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"Invalid value for `reward_funcs`: {name!r} cannot be imported ({error}).") from error
        else:
            raise ValueError(
                f"Invalid value for `reward_funcs`: {name!r}. Allowed values: {', '.join(map(repr, REWARD_FUNCS))} "
                "or a dotted import path like 'my_package.rewards.my_reward'."
            )
    return funcs
