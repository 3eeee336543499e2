"""Tasks: generated arithmetic, the offline GSM8K subset, local files and Hub specs (the Hub mocked)."""

import json

import pytest
from datasets import Dataset

from oblr_trl import tasks
from oblr_trl.tasks import HUB_TASKS, TaskOptions, load_task


def test_arithmetic_is_seeded_correct_and_split_apart():
    options = TaskOptions(num_problems=50, digits=2, operators="+-*", seed=3)
    train, again, test = load_task("arithmetic", "train", options), load_task("arithmetic", "train", options), None
    test = load_task("arithmetic", "test", options)
    assert train["question"] == again["question"] and train["question"] != test["question"]
    for row in train:
        a, op, b = row["question"].split()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and op in "+-*"
        assert row["answer"] == str(eval(row["question"]))
    assert train[0]["prompt"] == [{"role": "user", "content": f"What is {train[0]['question']}? Answer with just the number."}]
    assert {op for q in train["question"] for op in q.split()[1]} == {"+", "-", "*"}


@pytest.mark.parametrize(("options", "field"), [({"digits": 0}, "task_digits"), ({"operators": "/"}, "task_operators")])
def test_arithmetic_rejects_bad_knobs(options, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        load_task("arithmetic", "train", TaskOptions(**options))


def test_prompt_template_system_prompt_and_limit():
    options = TaskOptions(num_problems=10, limit=3, prompt_template="Q: {question} =", system_prompt="Be brief.")
    dataset = load_task("arithmetic", "test", options)
    assert len(dataset) == 3
    assert dataset[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert dataset[0]["prompt"][1]["content"] == f"Q: {dataset[0]['question']} ="
    with pytest.raises(ValueError, match="`prompt_template`"):
        load_task("arithmetic", "test", TaskOptions(prompt_template="no placeholder"))


def test_gsm8k_100_is_real_gsm8k_offline():
    dataset = load_task("gsm8k-100", "test")
    assert len(dataset) == 100
    assert dataset[0]["question"].startswith("Benny saw a 10-foot shark")
    assert dataset[0]["answer"] == "10"
    assert all(answer.lstrip("-").replace(".", "", 1).isdigit() for answer in dataset["answer"])
    assert "\\boxed{}" in dataset[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="'test'"):
        load_task("gsm8k-100", "train")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_local_files(tmp_path, suffix):
    rows = [{"problem": "1+1?", "final": 2}, {"problem": "2+2?", "final": 4}]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    dataset = load_task("local", "train", TaskOptions(path=str(path), answer_field="final"))
    assert dataset["question"] == ["1+1?", "2+2?"] and dataset["answer"] == ["2", "4"]
    with pytest.raises(ValueError, match="`task_path`"):
        load_task("local", "train", TaskOptions(path=str(tmp_path / "data.csv")))


def test_unknown_task_and_split():
    with pytest.raises(ValueError, match="`task`.*'gsm8k'"):
        load_task("gsm9k")
    with pytest.raises(ValueError, match="`split`"):
        load_task("arithmetic", "validation")
    with pytest.raises(ValueError, match="Allowed values for math500: 'test'"):
        load_task("math500", "train")


HUB_ROWS = {
    "gsm8k": {"question": "Q?", "answer": "Reasoning <<1+1=2>>2\n#### 1,234"},
    "math": {"problem": "P?", "solution": "So \\boxed{\\frac{1}{2}}.", "level": "Level 1"},
    "math500": {"problem": "P?", "answer": "\\frac{1}{2}", "solution": "long"},
    "olympiadbench": {"question": "Q?", "final_answer": ["$3$"]},
    "dapo-math-17k": {"prompt": "Solve... Answer: $Answer", "solution": "34"},
}
EXPECTED_ANSWER = {"gsm8k": "1234", "math": "So \\boxed{\\frac{1}{2}}.", "math500": "\\frac{1}{2}", "olympiadbench": "$3$",
                   "dapo-math-17k": "34"}


@pytest.mark.parametrize("name", sorted(HUB_ROWS))
def test_hub_tasks_map_their_columns(monkeypatch, name):
    calls = []

    def fake_load_dataset(path, config=None, split=None):
        calls.append((path, config, split))
        return Dataset.from_list([HUB_ROWS[name]])

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    split = "train" if "train" in HUB_TASKS[name].splits else "test"
    dataset = load_task(name, split)
    spec = HUB_TASKS[name]
    assert calls == [(spec.path, spec.config, spec.splits[split])]
    assert dataset[0]["answer"] == EXPECTED_ANSWER[name]
    content = dataset[0]["prompt"][0]["content"]
    assert content.startswith(dataset[0]["question"])
    assert ("\\boxed{}" in content) == (name != "dapo-math-17k")


def test_every_task_is_listed():
    assert set(tasks.TASKS) == set(HUB_TASKS) | {"arithmetic", "gsm8k-100", "local"}
