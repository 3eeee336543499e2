"""Acceptance (recipes issue) 4: reward grading, table-driven, on real answer formats."""

import threading

import pytest

from oblr_trl.rewards import accuracy_reward, completion_text, format_reward, get_reward_funcs, is_correct

GRADING = [
    # (completion, gold, expected)
    ("The answer is \\boxed{\\frac{1}{3}}.", "\\frac{1}{3}", True),
    ("So $x = \\boxed{2\\sqrt{3}}$", "2\\sqrt{3}", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),  # equivalent forms
    ("The answer is 0.5", "\\frac{1}{2}", True),
    ("\\boxed{\\frac12}", "0.5", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", True),  # GSM8K-style completion
    ("She sold 72 clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", True),  # GSM8K gold solution
    ("She pays $18 every day.", "18", True),  # currency
    ("It costs 18 dollars.", "18", True),  # units
    ("They have 1,000 apples.", "1000", True),  # thousands separator
    ("Answer: 42", "42", True),  # DAPO's answer format
    ("The answer is 3 + 4 = 7", "7", True),
    ("\\boxed{3}", "4", False),  # wrong
    ("The answer is 0.3333", "\\frac{1}{3}", False),  # rounded is not equal
    ("I do not know.", "5", False),  # no answer
    ("", "5", False),  # empty completion
    ("#### 71", "72", False),
    # a computation left to the grader is not an answer: math-verify keeps "5 * 16" unevaluated and would equate it
    # with 80, so a policy trained on arithmetic learned to restate the question (the second case is its output)
    ("5 * 16", "80", False),
    ("19 * 20 is a legendary and iconic Japanese martial arts film franchise", "380", False),
    ("9 - 4 = ", "5", False),
    ("\\boxed{2^3}", "8", False),
    ("4 * 16 = 64\n\nI'm ready to help", "64", True),  # the question restated, then answered
    ("7 - 16 = -9", "-9", True),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", True),  # fractions, negated or not, and percentages are numbers as written
    ("-3/4", "-0.75", True),
    ("It rose by 50%.", "50", True),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), GRADING)
def test_grading(completion, gold, expected):
    assert is_correct(completion, gold) is expected


def test_unparsable_gold_is_skipped_not_scored():
    assert is_correct("\\boxed{3}", "") is None
    assert accuracy_reward(["\\boxed{3}"], answer=[""]) == [None]


def test_accuracy_reward_reads_standard_and_conversational_completions():
    completions = ["\\boxed{4}", [{"role": "assistant", "content": "The answer is 5."}]]
    assert accuracy_reward(completions, answer=["4", "4"]) == [1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": None}]) == "a"


def test_accuracy_reward_works_from_a_worker_thread():
    """math-verify's timeouts use signals, which only work in the main thread (TRL may call rewards from another)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(accuracy_reward(["\\boxed{2}"], answer=["2"])))
    thread.start()
    thread.join()
    assert results == [[1.0]]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("\\boxed{3}", 1.0), ("so \\boxed {3}", 1.0), ("#### 3", 1.0), ("The answer is 3", 0.0), ("", 0.0)],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


def test_reward_funcs_by_name_and_import_path():
    assert get_reward_funcs(["accuracy", "format"]) == [accuracy_reward, format_reward]
    assert get_reward_funcs(["oblr_trl.rewards.format_reward"]) == [format_reward]
    with pytest.raises(ValueError, match="`reward_funcs`.*'accuracy', 'format'"):
        get_reward_funcs(["accuracy_reward"])
