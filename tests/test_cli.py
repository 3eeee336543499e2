"""The command line: recipes parse with the CLI's parser (no model load), unknown keys fail loudly, `train` runs a
recipe end to end on a tiny local model, `eval` and `plot` write their outputs."""

import json
from pathlib import Path

import pytest
import yaml

from oblr_trl.cli import embedded_recipe, main, parse_train_args

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate_configs" not in p.parts)


def test_there_are_recipes_for_both_models_both_tasks_and_both_algorithms():
    names = {str(p.relative_to(ROOT / "recipes")) for p in RECIPES}
    for model in ("Qwen3-4B-Base", "Qwen3-8B-Base"):
        for algo in ("oblrpo", "grpo"):
            for task in ("gsm8k", "math"):
                assert f"{model}/{algo}/config_{task}.yaml" in names
                assert f"{model}/{algo}/config_{task}_lora.yaml" in names
    assert "quickstart.yaml" in names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_recipe_parses_and_every_field_exists(recipe):
    # bf16 is refused on a CPU-only machine when the config is built; everything else is taken from the recipe
    overrides = ["--bf16", "false"] if yaml.safe_load(recipe.read_text()).get("bf16") else []
    task_args, training_args, model_args, text = parse_train_args(["--config", str(recipe), *overrides])
    values = yaml.safe_load(recipe.read_text())
    parsed = {**vars(task_args), **training_args.to_dict(), **vars(model_args)}
    for key, value in values.items():
        if key in ("bf16", "report_to"):
            continue
        assert key in parsed, key
        got = parsed[key]
        assert got == value or str(got) == str(value) or (isinstance(got, list) and got == [value]), (key, got, value)
    assert text.startswith(f"# {recipe.name}")


def test_accelerate_configs_are_valid_yaml_with_the_expected_backends():
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (ROOT / "recipes" / "accelerate_configs").glob("*.yaml")}
    assert {name: c["distributed_type"] for name, c in configs.items()} == {
        "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"
    }
    assert configs["zero3"]["deepspeed_config"]["zero_stage"] == 3
    assert configs["zero2"]["deepspeed_config"]["zero_stage"] == 2


def test_without_config_the_embedded_quickstart_is_used():
    task_args, training_args, model_args, text = parse_train_args(["--max_steps", "3"])
    assert model_args.model_name_or_path == "builtin:smollm2-135m-instruct"
    assert (task_args.task, training_args.max_steps) == ("arithmetic", 3)
    assert "command-line overrides: --max_steps 3" in text
    assert (ROOT / "recipes" / "quickstart.yaml").resolve() == embedded_recipe().resolve()


def test_unknown_keys_fail_loudly(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("task: arithmetic\nnot_a_field: 3\nbf16: false\n")
    with pytest.raises(ValueError, match="not_a_field"):
        parse_train_args(["--config", str(recipe)])
    recipe.write_text("task: arithmetic\ngradient_accumulation_steps: 2\nbf16: false\n")
    with pytest.raises(ValueError, match="also_not_a_field"):
        parse_train_args(["--config", str(recipe), "--also_not_a_field", "1"])


def test_bad_values_fail_before_any_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):  # a flag: argparse's choices
        parse_train_args(["--baseline_weights", "gradient"])
    assert "invalid choice: 'gradient' (choose from 'logit', 'length', 'exact', 'uniform')" in capsys.readouterr().err
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("gradient_accumulation_steps: 2\nbf16: false\nbaseline_weights: gradient\n")
    with pytest.raises(ValueError, match="`baseline_weights`: 'gradient'. Allowed values: 'logit'"):  # a recipe
        parse_train_args(["--config", str(recipe)])


def test_train_eval_plot_end_to_end(tmp_path, saved_tiny_model, capsys):
    run = tmp_path / "run"
    assert main([
        "train", "--model_name_or_path", str(saved_tiny_model), "--output_dir", str(run), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "6",
        "--save_strategy", "steps", "--save_steps", "1", "--task_num_problems", "20",
    ]) == 0
    assert (run / "model.safetensors").exists() and (run / "checkpoint-2" / "oblr_state.json").exists()
    card = (run / "README.md").read_text()
    assert "OBLR-PO" in card and "## Training recipe" in card and "task: arithmetic" in card
    assert (run / "training_curves.png").stat().st_size > 10_000
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    assert any("snr/lr_factor" in entry for entry in history)
    assert "mean reward" in capsys.readouterr().out

    assert main(["eval", "--model", str(run), "--task", "arithmetic", "--limit", "4", "--max_new_tokens", "4"]) == 0
    report = json.loads((run / "eval" / "arithmetic.json").read_text())
    assert report["num_problems"] == 4 and 0.0 <= report["pass_at_1"] <= 1.0 and len(report["samples"]) == 4
    assert "| arithmetic | 4 |" in (run / "eval" / "arithmetic.md").read_text()

    assert main(["plot", str(run), "--output", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").exists()


def test_eval_sampling_reports_pass_at_n(tmp_path, saved_tiny_model):
    from oblr_trl.evaluation import evaluate
    from oblr_trl.tasks import TaskOptions

    result = evaluate(str(saved_tiny_model), "arithmetic", n=3, temperature=1.0, max_new_tokens=3,
                      options=TaskOptions(limit=5), progress=False)
    assert result.n == 3 and all(len(s["completions"]) == 3 for s in result.samples)
    assert result.pass_at_1 <= result.pass_at_n
    with pytest.raises(ValueError, match="`n`"):
        evaluate(str(saved_tiny_model), "arithmetic", n=2, temperature=0.0)


def test_tasks_command_lists_every_task(capsys):
    from oblr_trl.tasks import TASKS

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in TASKS)


def test_a_folder_holding_another_run_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import oblr_trl.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(oblr_trl.models, "resolve_model", no_model)
    run = tmp_path / "run"
    (run / "checkpoint-60").mkdir(parents=True)
    (run / "trainer_state.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        main(["train", "--output_dir", str(run), "--max_steps", "1"])
    message = str(refused.value.code)
    assert str(run) in message and "--overwrite_output_dir" in message and "--resume_from_checkpoint" in message

    from oblr_trl.cli import prepare_output_dir

    prepare_output_dir(str(run), overwrite=False, resuming=True)  # continuing that run: allowed, nothing removed
    assert (run / "checkpoint-60").exists()
    prepare_output_dir(str(run), overwrite=True, resuming=False)  # replacing it: its checkpoints and state go
    assert not (run / "checkpoint-60").exists() and not (run / "trainer_state.json").exists()
    prepare_output_dir(str(tmp_path / "fresh"), overwrite=False, resuming=False)  # a new folder: nothing to say


def test_flags_are_not_prefix_matched():
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--learning_rat'"):
        parse_train_args(["--learning_rat", "1e-5"])  # was silently taken as --learning_rate
    assert parse_train_args(["--learning_rate", "1e-5"])[1].learning_rate == 1e-5


def test_resume_command_names_the_checkpoint_this_run_saved(tmp_path, capsys):
    from types import SimpleNamespace

    from oblr_trl.cli import _report_preemption

    (tmp_path / "checkpoint-60").mkdir()  # an earlier run's, higher-numbered
    (tmp_path / "checkpoint-1").mkdir()
    trainer = SimpleNamespace(
        preemption=SimpleNamespace(received=15), args=SimpleNamespace(output_dir=str(tmp_path)),
        state=SimpleNamespace(global_step=1), is_world_process_zero=lambda: True,
    )
    assert _report_preemption(trainer, ["--max_steps", "5"]) == 128 + 15
    out = capsys.readouterr().out
    assert f"--resume_from_checkpoint {tmp_path / 'checkpoint-1'}" in out and "checkpoint-60" not in out


def test_overwrite_output_dir_reaches_the_folder_check(tmp_path, monkeypatch):
    """`--overwrite_output_dir true` on the command line replaces the earlier run's checkpoints before the model
    loads (the model load is stopped here)."""
    import oblr_trl.models

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(oblr_trl.models, "resolve_model", stop)
    run = tmp_path / "run"
    (run / "checkpoint-60").mkdir(parents=True)
    with pytest.raises(Stop):
        main(["train", "--output_dir", str(run), "--max_steps", "1", "--overwrite_output_dir", "true"])
    assert not (run / "checkpoint-60").exists()
