"""The command line: recipes and flags parse with TRL's TrlParser alone (no model load), unknown keys fail loudly with
the nearest known name, `train` runs a recipe end to end on a tiny local model, `eval` and `plot` write their
outputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oblr_trl.cli import UsageError, embedded_recipe, main, parse_train_args

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


def test_unknown_keys_fail_loudly_with_the_nearest_field_of_the_parser(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("task: arithmetic\nnot_a_field: 3\nbf16: false\n")
    with pytest.raises(UsageError, match="Unknown fields in the recipe: not_a_field"):
        parse_train_args(["--config", str(recipe)])
    # the known names are the real parser's: a ModelConfig field, an OBLR-PO option, a task field
    recipe.write_text("lora_rr: 8\nlr_trust_region_k: 0.01\ntask_digit: 2\n")
    with pytest.raises(UsageError, match=r"lora_rr \(did you mean lora_r\?\), lr_trust_region_k \(did you mean "
                                         r"lr_trust_region_kl\?\), task_digit \(did you mean task_digits\?\)"):
        parse_train_args(["--config", str(recipe)])
    recipe.write_text("task: arithmetic\ngradient_accumulation_steps: 2\nbf16: false\nenv:\n  OBLR_TRL_TEST_ENV: 1\n")
    with pytest.raises(UsageError, match="unknown flag --also_not_a_field"):
        parse_train_args(["--config", str(recipe), "--also_not_a_field", "1"])
    with pytest.raises(UsageError, match="unexpected arguments: stray"):
        parse_train_args(["--config", str(recipe), "--task", "arithmetic", "stray"])
    assert parse_train_args(["--config", str(recipe), "--lora_r", "8"])[2].lora_r == 8  # `env` is TRL's own key


def test_the_common_fields_of_the_short_help_are_fields_of_the_parser():
    from oblr_trl.arguments import COMMON_FIELDS
    from oblr_trl.cli import make_train_parser

    assert set(COMMON_FIELDS) <= {action.dest for action in make_train_parser()._actions}


class TrainerBuilt(Exception):
    """Raised in place of building the trainer: the test reads what `train` would have built it with."""


@pytest.fixture
def trainer_arguments(monkeypatch):
    """What `oblr-trl train` passes to OBLRPOTrainer, everything before it run as in a real run (no model loads)."""
    import oblr_trl.training.trainer

    built = {}

    def record(**kwargs):
        built.update(kwargs)
        raise TrainerBuilt

    monkeypatch.setattr(oblr_trl.training.trainer, "OBLRPOTrainer", record)
    return built


@pytest.mark.parametrize("spelling", ["None", "none", "null"])
def test_an_optional_field_takes_none_from_the_command_line_as_trl_reads_it(spelling, tmp_path, trainer_arguments):
    """README: `--lr_trust_region_kl None` turns the trust region off (TRL's parser reads none/null, any case, as None
    for an Optional number)."""
    with pytest.raises(TrainerBuilt):
        main(["train", "--lr_trust_region_kl", spelling, "--per_sample_batch_size", spelling,
              "--output_dir", str(tmp_path / "run")])
    args = trainer_arguments["args"]
    assert args.lr_trust_region_kl is None and args.per_sample_batch_size is None


def test_a_recipe_turns_the_trust_region_off_with_null(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(embedded_recipe().read_text() + "\nlr_trust_region_kl: null\n")
    assert parse_train_args(["--config", str(recipe)])[1].lr_trust_region_kl is None
    assert parse_train_args(["--config", str(recipe), "--lr_trust_region_kl", "0.01"])[1].lr_trust_region_kl == 0.01


def test_a_list_field_takes_several_values(tmp_path, trainer_arguments):
    with pytest.raises(TrainerBuilt):
        main(["train", "--reward_funcs", "accuracy", "format", "--output_dir", str(tmp_path / "run")])
    assert [f.__name__ for f in trainer_arguments["reward_funcs"]] == ["accuracy_reward", "format_reward"]
    task_args = parse_train_args(["--reward_funcs", "accuracy", "format", "--max_steps", "2"])[0]
    assert task_args.reward_funcs == ["accuracy", "format"]


def test_booleans_read_as_trl_reads_them():
    _, training_args, _, _ = parse_train_args(["--use_snr_lr", "no", "--leave_one_out", "0", "--log_step_kl",
                                               "--no_skip_nonfinite_steps", "--save_on_preemption", "F"])
    assert (training_args.use_snr_lr, training_args.leave_one_out, training_args.log_step_kl) == (False, False, True)
    assert (training_args.skip_nonfinite_steps, training_args.save_on_preemption) == (False, False)
    with pytest.raises(UsageError, match="argument --use_snr_lr.*Truthy value expected: got maybe"):
        parse_train_args(["--use_snr_lr", "maybe"])


def test_bad_values_fail_before_any_model_loads(tmp_path):
    with pytest.raises(UsageError, match=r"argument --baseline_weights.*: invalid choice: 'gradient' \(choose from "
                                         r"'logit', 'length', 'exact', 'uniform'\)"):
        parse_train_args(["--baseline_weights", "gradient"])  # a flag: argparse's choices, without its usage wall
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("gradient_accumulation_steps: 2\nbf16: false\nbaseline_weights: gradient\n")
    with pytest.raises(ValueError, match="`baseline_weights`: 'gradient'. Allowed values: 'logit'"):  # a recipe
        parse_train_args(["--config", str(recipe)])


def test_train_eval_plot_end_to_end(tmp_path, saved_tiny_model, capsys, monkeypatch):
    """The built-in model on the generated task, as the quickstart runs it (the built-in id resolves to a tiny model
    here): trains, writes a model card that names the real base model and no Hub dataset, then eval and plot."""
    import oblr_trl.training.models

    monkeypatch.setattr(oblr_trl.training.models, "resolve_model", lambda name, **kwargs: str(saved_tiny_model))
    run = tmp_path / "run"
    assert main([
        "train", "--model_name_or_path", "builtin:smollm2-135m-instruct", "--output_dir", str(run), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "6",
        "--save_strategy", "steps", "--save_steps", "1", "--task_num_problems", "20", "--learning_rate", "2e-5",
    ]) == 0
    assert (run / "model.safetensors").exists() and (run / "checkpoint-2" / "oblr_state.json").exists()
    card = (run / "README.md").read_text()
    smollm2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert f"fine-tuned version of [{smollm2}](https://huggingface.co/{smollm2})" in card
    assert f"base_model: {smollm2}" in card and "None" not in card
    assert "generated `arithmetic` task: 20 problems" in card and "huggingface.co/datasets" not in card
    assert f'model="{run}"' in card  # the quick start loads this run's folder
    assert "| learning rate | 2e-05, `constant_with_warmup`" in card
    assert "| baseline | `logit` weights, `pooled_slope` estimate, leave-one-out; scale_rewards `group` |" in card
    assert "| completions per step | 8 (2 prompts × 4) |" in card  # the quickstart's 4 × 2 micro-batches
    assert "| mean reward |" in card and "| optimizer steps | 2 |" in card
    assert "![training curves](training_curves.png)" in card
    assert "## Training recipe" in card and "task: arithmetic" in card and "huang2025oblrpo" in card
    assert (run / "training_curves.png").stat().st_size > 10_000
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    assert any("snr/lr_factor" in entry for entry in history)
    out = capsys.readouterr()
    assert "mean reward" in out.out and "'loss'" not in out.out + out.err  # the bar, not a dict per step

    assert main(["eval", "--model", str(run), "--task", "arithmetic", "--limit", "4", "--max_new_tokens", "4"]) == 0
    report = json.loads((run / "eval" / "arithmetic.json").read_text())
    assert report["num_problems"] == 4 and 0.0 <= report["pass_at_1"] <= 1.0 and len(report["samples"]) == 4
    assert "| arithmetic | 4 |" in (run / "eval" / "arithmetic.md").read_text()

    assert main(["plot", str(run), "--output", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").exists()


def test_train_frees_the_trainer_and_destroys_the_process_group_before_it_returns(tmp_path, saved_tiny_model):
    """Left to interpreter exit, gloo's worker threads can outlive Python and abort a launch whose training succeeded
    (SIGABRT, exit -6, seen twice in CI): `train` destroys the group, and first collects the trainer, whose DDP wrapper
    would otherwise keep the group alive in a reference cycle until exit. A world of one process stands for the
    launch."""
    import gc

    import torch.distributed as dist

    from oblr_trl import OBLRPOTrainer

    gc.collect()
    gc.disable()  # what `train` left behind is seen as it left it, not after an automatic collection

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert main(["train", "--model_name_or_path", str(saved_tiny_model), "--output_dir", str(tmp_path / "run"),
                     "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
                     "--max_completion_length", "4", "--task_num_problems", "8", "--plot", "false"]) == 0
        assert not dist.is_initialized()
        assert not [o for o in gc.get_objects() if isinstance(o, OBLRPOTrainer)]
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_model_card_of_a_local_model_on_a_hub_dataset():
    from oblr_trl.training.model_card import ModelCardFacts, model_card_text

    facts = ModelCardFacts(
        model_name="run", base_model=None, base_model_path="/models/mine", hub_model_id="me/run", output_dir="out",
        dataset_id="openai/gsm8k", dataset_description=None, settings={"learning rate": "1e-06"},
        log_history=[{"reward": 0.2, "step": 1}, {"reward": 0.6, "step": 2}, {"train_runtime": 12.0, "step": 2}],
        tags=["oblr-po", "trl"], paper={"title": "OBLR-PO", "id": "2511.23310", "citation": "@article{x}"},
    )
    card = model_card_text(facts)
    assert "fine-tuned version of the local model `/models/mine`, trained with OBLR-PO" in card
    assert "on [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k)." in card
    assert "base_model" not in card and "datasets:\n- openai/gsm8k" in card and 'model="me/run"' in card
    assert "| mean reward | 0.200 (first 1 logged step) → 0.600 (last 1) |" in card and "| training time | 12 s |" in card
    assert "noise scale" not in card  # not logged: not stated


def test_model_card_states_the_gradient_noise_scale_beside_the_completions_a_step():
    from oblr_trl.training.model_card import ModelCardFacts, model_card_text

    history = [{"step": s, "reward": 0.5, "oblr/noise_scale": scale, "oblr/completions_per_step": 64.0}
               for s, scale in enumerate([float("nan"), 900.0, 300.0, 500.0, 400.0, 420.0, 380.0], 1)]
    facts = ModelCardFacts(
        model_name="run", base_model=None, base_model_path="/m", hub_model_id=None, output_dir="out", dataset_id=None,
        dataset_description=None, settings={}, log_history=history, tags=[], paper={"title": "t", "id": "i",
                                                                                   "citation": "c"},
    )
    card = model_card_text(facts)
    # the last fifth of the 6 measured steps (1 step), NaN skipped
    assert ("| gradient noise scale | ~380 completions (B_noise = tr Σ/‖μ‖², median of the last 1 measured step); "
            "this run used 64 a step |") in card


def test_eval_results_of_non_local_models_go_to_a_folder_per_model():
    from oblr_trl.cli import eval_output_dir

    assert Path(eval_output_dir("builtin:smollm2-135m-instruct")) == Path("runs/eval/builtin--smollm2-135m-instruct")
    assert Path(eval_output_dir("Qwen/Qwen3-4B-Base")) == Path("runs/eval/Qwen--Qwen3-4B-Base")
    assert Path(eval_output_dir(".")) == Path("eval")


def test_eval_sampling_reports_pass_at_n(tmp_path, saved_tiny_model):
    from oblr_trl.evaluation import evaluate
    from oblr_trl.tasks import TaskOptions, load_task

    result = evaluate(str(saved_tiny_model), "arithmetic", n=3, temperature=1.0, max_new_tokens=3,
                      options=TaskOptions(limit=5), progress=False)
    assert result.n == 3 and all(len(s["completions"]) == 3 for s in result.samples)
    assert result.pass_at_1 <= result.pass_at_n
    with pytest.raises(ValueError, match="`n`"):
        evaluate(str(saved_tiny_model), "arithmetic", n=2, temperature=0.0)
    loaded = load_task("arithmetic", "test", TaskOptions(limit=2))  # the CLI passes the split it checked
    assert evaluate(str(saved_tiny_model), "arithmetic", max_new_tokens=2, dataset=loaded, progress=False).num_problems == 2


def test_eval_pads_prompts_with_eos_when_the_tokenizer_has_no_pad_token():
    from oblr_trl.evaluation import generate_completions
    from oblr_trl.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    prompts = [[{"role": "user", "content": "1+1"}], [{"role": "user", "content": "a much longer prompt"}]]
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens=2, progress=False)
    assert len(completions) == 2 and all(len(c) == 1 for c in completions)
    assert tokenizer.pad_token is None and tokenizer.padding_side == "right"  # handed back as it came


def test_tasks_command_lists_every_task(capsys):
    from oblr_trl.tasks import TASKS

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in TASKS)


def test_a_folder_holding_another_run_is_refused_before_any_model_loads(tmp_path, no_model_load, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-60").mkdir(parents=True)
    (run / "trainer_state.json").write_text("{}")
    assert main(["train", "--output_dir", str(run), "--max_steps", "1"]) == 2
    message = capsys.readouterr().err
    assert str(run) in message and "--overwrite_output_dir" in message and "--resume_from_checkpoint" in message
    assert "(1 checkpoint, trainer_state.json)" in message
    (run / "checkpoint-60").rmdir()
    assert main(["train", "--output_dir", str(run), "--max_steps", "1"]) == 2
    assert "(trainer_state.json)" in capsys.readouterr().err  # not "0 checkpoints"
    (run / "checkpoint-60").mkdir()

    from oblr_trl.cli import prepare_output_dir

    prepare_output_dir(str(run), overwrite=False, resuming=True)  # continuing that run: allowed, nothing removed
    assert (run / "checkpoint-60").exists()
    prepare_output_dir(str(run), overwrite=True, resuming=False)  # replacing it: its checkpoints and state go
    assert not (run / "checkpoint-60").exists() and not (run / "trainer_state.json").exists()
    prepare_output_dir(str(tmp_path / "fresh"), overwrite=False, resuming=False)  # a new folder: nothing to say


def test_flags_are_not_prefix_matched():
    with pytest.raises(UsageError, match=r"unknown flag --learning_rat \(did you mean --learning_rate\?\)"):
        parse_train_args(["--learning_rat", "1e-5"])  # was silently taken as --learning_rate
    assert parse_train_args(["--learning_rate", "1e-5"])[1].learning_rate == 1e-5


def test_resume_command_names_the_checkpoint_this_run_saved_once(tmp_path, capsys):
    from types import SimpleNamespace

    from oblr_trl import TrainingPreempted
    from oblr_trl.cli import _report_preemption

    (tmp_path / "checkpoint-60").mkdir()  # an earlier run's, higher-numbered
    (tmp_path / "checkpoint-1").mkdir()
    trainer = SimpleNamespace(is_world_process_zero=lambda: True)
    stopped = TrainingPreempted(15, 1, str(tmp_path / "checkpoint-1"))
    # a run that was itself resumed, in both spellings of the flag: the new command names only the new checkpoint
    for argv in (["--max_steps", "5", "--resume_from_checkpoint", "old/checkpoint-3"],
                 ["--resume_from_checkpoint=old/checkpoint-3", "--max_steps", "5"]):
        assert _report_preemption(trainer, argv, stopped) == 128 + 15
        out = capsys.readouterr().out
        assert f"--resume_from_checkpoint {tmp_path / 'checkpoint-1'}" in out and "checkpoint-60" not in out
        assert out.count("--resume_from_checkpoint") == 1 and "old/checkpoint-3" not in out and "--max_steps 5" in out
        assert "stopped by SIGTERM after step 1" in out


def test_overwrite_output_dir_reaches_the_folder_check(tmp_path, monkeypatch):
    """`--overwrite_output_dir true` on the command line replaces the earlier run's checkpoints before the model
    loads (the model load is stopped here)."""
    import oblr_trl.training.models

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(oblr_trl.training.models, "resolve_model", stop)
    run = tmp_path / "run"
    (run / "checkpoint-60").mkdir(parents=True)
    with pytest.raises(Stop):
        main(["train", "--output_dir", str(run), "--max_steps", "1", "--overwrite_output_dir", "true"])
    assert not (run / "checkpoint-60").exists()


# ----------------------------------------------------------------------------------------------------------------
# A newcomer's mistakes: one line on stderr, exit status 2, before any model loads
# ----------------------------------------------------------------------------------------------------------------


def _local_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"q": "1 + 1", "a": "2"}\n')
    return str(path)


def _recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


MISTAKES = {
    "missing --config file": (lambda tmp: ["train", "--config", str(tmp / "nope.yaml")], "nope.yaml: no such file"),
    "YAML syntax": (lambda tmp: ["train", "--config", _recipe(tmp, "task: arithmetic\n  bad: [\n")],
                    "is not valid YAML at line 2"),
    "YAML field typo": (lambda tmp: ["train", "--config", _recipe(tmp, "lerning_rate: 1.0e-5\n")],
                        "Unknown fields in", "lerning_rate (did you mean learning_rate?)"),
    "flag typo": (lambda tmp: ["train", "--learning_rat", "1e-5"], "unknown flag --learning_rat (did you mean --learning_rate?)"),
    "bad choice": (lambda tmp: ["train", "--lr_scheduler_type", "magic"], "invalid choice: 'magic'"),
    "bad OBLR-PO choice": (lambda tmp: ["train", "--snr_estimator", "magic"],
                           "argument --snr_estimator",
                           "invalid choice: 'magic' (choose from 'cross_step', 'two_batch'"),
    "bad OBLR-PO value": (lambda tmp: ["train", "--lr_trust_region_kl", "0"],
                          "Invalid value for `lr_trust_region_kl`: 0.0. Allowed values: None or a finite float > 0."),
    "not a number": (lambda tmp: ["train", "--lr_trust_region_kl", "small"],
                     "argument --lr_trust_region_kl", "invalid float value: 'small'"),
    "unknown task": (lambda tmp: ["train", "--task", "nosuchtask"], "Invalid value for `task`: 'nosuchtask'. Allowed values:"),
    "negative learning rate": (lambda tmp: ["train", "--learning_rate", "-1"],
                               "Invalid value for `learning_rate`: -1.0. Allowed values: a finite float >= 0."),
    "zero batch": (lambda tmp: ["train", "--per_device_train_batch_size", "0"], "`per_device_train_batch_size`: 0"),
    "missing local file": (lambda tmp: ["train", "--task", "local", "--task_path", str(tmp / "none.jsonl")],
                           "`task_path`", "no such file"),
    "wrong question field": (lambda tmp: ["train", "--task", "local", "--task_path", _local_file(tmp),
                                          "--task_question_field", "question"],
                             "Invalid value for `task_question_field`: 'question'. Allowed values: a column of the file: 'q', 'a'."),
    "no default field": (lambda tmp: ["train", "--task", "local", "--task_path", _local_file(tmp)],
                         "`task_question_field`: None (unset, and none of ['question', 'problem', 'prompt'] is a column)"),
    "unknown reward": (lambda tmp: ["train", "--reward_funcs", "no_such_package.reward"],
                       "`reward_funcs`: 'no_such_package.reward' cannot be imported"),
    "unknown built-in model": (lambda tmp: ["train", "--model_name_or_path", "builtin:gpt5"],
                               "`model_name_or_path`: 'builtin:gpt5'. Allowed values: a local model folder"),
    "model folder without a model": (lambda tmp: ["train", "--model_name_or_path", str(tmp)], "is a folder without config.json"),
    "no such model folder": (lambda tmp: ["train", "--model_name_or_path", "./models/mine"], "no such folder"),
    "Hub model while offline": (lambda tmp: ["train", "--model_name_or_path", "nosuchmodel"],
                                "'nosuchmodel' is not a local folder nor in the Hub cache, and HF_HUB_OFFLINE is set"),
    "eval: Hub model while offline": (lambda tmp: ["eval", "--model", "nosuchorg/nosuchmodel", "--task", "arithmetic"],
                                      "HF_HUB_OFFLINE is set"),
    "eval: unknown task": (lambda tmp: ["eval", "--model", "builtin:smollm2-135m-instruct", "--task", "gsm9k"],
                           "Invalid value for `task`: 'gsm9k'"),
    "eval: sampling": (lambda tmp: ["eval", "--model", "builtin:smollm2-135m-instruct", "--task", "arithmetic", "--n", "4"],
                       "Allowed values with temperature 0 (greedy): 1"),
    "plot: no run": (lambda tmp: ["plot", str(tmp / "nothing")], "no trainer_state.json"),
    "eval: interrupted run": (lambda tmp: ["eval", "--model", _interrupted_run(tmp), "--task", "arithmetic"],
                              "Invalid value for --model:", "holds no final model", "checkpoint-12: give that folder"),
    "output folder of another run": (lambda tmp: ["train", "--output_dir", _finished_run(tmp), "--max_steps", "1"],
                                     "holds another run (trainer_state.json)"),
}


def _finished_run(tmp_path) -> str:
    (tmp_path / "finished").mkdir(exist_ok=True)
    (tmp_path / "finished" / "trainer_state.json").write_text("{}")
    return str(tmp_path / "finished")


def _interrupted_run(tmp_path) -> str:
    for step in (3, 12):  # numeric order, not text order: checkpoint-12 is the newest
        (tmp_path / "interrupted" / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
    return str(tmp_path / "interrupted")


def test_a_bad_value_is_one_line_from_the_installed_command():
    """`python -m oblr_trl`, as a user runs it: nothing that importing torch, transformers and TRL prints comes
    before the one line."""
    done = subprocess.run([sys.executable, "-m", "oblr_trl", "train", "--lr_trust_region_kl", "-1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [
        "oblr-trl: error: Invalid value for `lr_trust_region_kl`: -1.0. Allowed values: None or a finite float > 0."
    ], done.stderr[-2000:]


@pytest.mark.parametrize("command", [["eval", "--model", "m", "--task", "arithmetic", "--max_new_token", "4"],
                                     ["plot", "runs/x", "--out", "x.png"]])
def test_eval_and_plot_name_an_unknown_flag_with_the_nearest_one(command, capsys):
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    nearest = {"eval": "--max_new_tokens", "plot": "--output"}[command[0]]
    assert err == (f"oblr-trl: error: unknown flag {command[-2]} (did you mean {nearest}?); "
                   f"see `oblr-trl {command[0]} --help`")


def test_eval_flags_their_defaults_and_the_task_flags_shared_with_training():
    from dataclasses import fields

    from oblr_trl.arguments import parse_eval_args
    from oblr_trl.cli import TaskArguments

    args, task_args = parse_eval_args(["--model", "m", "--task", "arithmetic"])
    assert vars(args) == {"model": "m", "task": "arithmetic", "n": 1, "temperature": 0.0, "top_p": 1.0,
                          "max_new_tokens": 256, "batch_size": 16, "limit": None, "backend": "auto",
                          "output_dir": None, "seed": 0}
    shared = {item.name: item.default for item in fields(TaskArguments)
              if item.name.startswith("task_") and item.name != "task_limit"}
    assert vars(task_args) == shared  # the prompt and problems exactly as in training, with training's defaults
    args, task_args = parse_eval_args([
        "--model", "m", "--task", "local", "--n", "4", "--temperature", "0.7", "--top_p", "0.9",
        "--max_new_tokens", "8", "--batch_size", "2", "--limit", "5", "--backend", "transformers", "--output_dir", "out",
        "--seed", "3",
        "--task_path", "p.jsonl", "--task_question_field", "q", "--task_digits", "2",
    ])
    assert (args.n, args.temperature, args.top_p, args.max_new_tokens, args.batch_size, args.limit, args.backend,
            args.output_dir, args.seed) == (4, 0.7, 0.9, 8, 2, 5, "transformers", "out", 3)
    assert (task_args.task_path, task_args.task_question_field, task_args.task_digits) == ("p.jsonl", "q", 2)
    for argv, message in [
        ([], "the following arguments are required: --model, --task"),
        (["--backend", "magic"], "invalid choice: 'magic' (choose from 'auto', 'transformers', 'vllm')"),
        (["--temperatur", "0.5"], "unknown flag --temperatur (did you mean --temperature?)"),  # no prefix matching
        (["--task_limit", "3"], "unknown flag --task_limit"),  # eval's is --limit
    ]:
        with pytest.raises(UsageError) as refused:
            parse_eval_args([*(["--model", "m", "--task", "arithmetic"] if argv else []), *argv])
        assert message in str(refused.value) and "`oblr-trl eval --help`" in str(refused.value)


def test_version_and_the_bare_command(capsys):
    from oblr_trl import __version__

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.strip().endswith(__version__)
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: oblr-trl" in out and all(command in out for command in ("train", "eval", "plot", "tasks"))


def test_a_gpu_recipe_on_a_cpu_says_so_in_one_line(tmp_path, no_model_load, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = ROOT / "recipes" / "Qwen3-4B-Base" / "oblrpo" / "config_gsm8k_lora.yaml"
    assert main(["train", "--config", str(recipe), "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a GPU (bf16: true, use_vllm: true)" in err
    assert "--bf16 false --use_vllm false --use_cpu true" in err and "use_cpu` if" not in err
    # the hint is a command that runs offline: the recipe's task is gsm8k from the Hub, so it names a shipped one
    hinted = err.split("try it offline with: oblr-trl train ")[1].split(" (")[0].split()
    assert hinted[hinted.index("--task") + 1] == "arithmetic" and "builtin:smollm2-135m-instruct" in hinted
    task_args, training_args, model_args, _ = parse_train_args(hinted)
    assert (training_args.bf16, training_args.use_vllm, training_args.use_cpu) == (False, False, True)
    from oblr_trl.tasks import load_task

    assert len(load_task(task_args.task, "train", task_args.options())) > 0  # no Hub
    assert main(["train", "--config", str(recipe), "--bf16", "false", "--use_vllm", "false", "--task", "nosuch",
                 "--output_dir", str(tmp_path / "run")]) == 2  # with both turned off it goes on to the next check
    assert "`task`: 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_gives_one_line_and_exit_2_before_any_model_loads(mistake, tmp_path, no_model_load, monkeypatch,
                                                                       capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never the network in tests
    argv, *expected = MISTAKES[mistake]
    command = argv(tmp_path)
    output_dir = ["--output_dir", str(tmp_path / "run")] if command[0] == "train" and "--output_dir" not in command else []
    assert main([*argv(tmp_path), *output_dir]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and "Generating train split" not in line]
    assert len(lines) == 1 and lines[0].startswith("oblr-trl: error: "), err
    assert all(text in lines[0] for text in expected), lines[0]
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()


def test_a_misspelt_hub_model_is_named_as_such(tmp_path, no_model_load, monkeypatch, capsys):
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(self, repo_id, **kwargs):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # as raised for a 404, without an HTTP reply
        Exception.__init__(error, f"404 {repo_id}")
        raise error

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", not_found)
    assert main(["train", "--model_name_or_path", "Qwen/Qwen3-4B-Bsae", "--output_dir", str(tmp_path / "run")]) == 2
    assert "no model 'Qwen/Qwen3-4B-Bsae' on the Hub (check the spelling" in capsys.readouterr().err


def test_an_unreachable_hub_dataset_is_named_with_what_to_try(tmp_path, no_model_load, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["train", "--task", "gsm8k", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Cannot load the Hub dataset 'openai/gsm8k' of task 'gsm8k'" in err and "arithmetic, gsm8k-100, local" in err


def test_debug_shows_the_traceback(tmp_path, no_model_load, monkeypatch):
    with pytest.raises(UsageError) as raised:
        main(["train", "--learning_rate", "-1", "--output_dir", str(tmp_path / "run"), "--debug"])
    assert isinstance(raised.value.__cause__, ValueError)  # the original error, with its traceback
    monkeypatch.setenv("OBLR_TRL_DEBUG", "1")
    with pytest.raises(UsageError):
        main(["train", "--learning_rate", "-1", "--output_dir", str(tmp_path / "run")])


@pytest.mark.parametrize("argv", [["--help"], ["tasks"], ["train", "--help"]], ids=" ".join)
def test_help_and_tasks_start_without_torch(argv):
    """`--help`, `tasks` and `train --help` must answer at once: they may not import torch, transformers or TRL."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom oblr_trl.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_train_help_is_short_and_grouped(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) < 150 and lines[0].startswith("usage: oblr-trl train [--config RECIPE.yaml]")
    sections = [text.index(title) for title in ("--config RECIPE.yaml", "OBLR-PO options", "Task options", "--help-all")]
    assert sections[:3] == sorted(sections[:3])
    from dataclasses import fields

    from oblr_trl.cli import TaskArguments
    from oblr_trl.training.options import OBLRPOOptions

    assert all(f"--{item.name} " in text for item in [*fields(OBLRPOOptions), *fields(TaskArguments)])


def test_the_progress_bar_shows_reward_accuracy_factor_and_the_rate_used():
    from oblr_trl.progress import summary

    logs = {"loss": 0.1, "reward": 0.5, "rewards/accuracy_reward/mean": 0.625, "snr/lr_factor": 1.25,
            "oblr/lr": 3.75e-5, "learning_rate": 3e-5, "snr/snr": 0.01, "completions/mean_length": 9.0}
    assert summary(logs) == {"reward": "0.500", "acc": "0.625", "f": "1.250", "lr": "3.75e-05"}
    assert summary({"loss": 0.1, "reward": 0.5, "learning_rate": 3e-5}) == {"reward": "0.500", "lr": "3.00e-05"}  # GRPO


def test_a_mistake_leaves_the_run_it_would_overwrite_untouched(tmp_path, no_model_load):
    run = tmp_path / "run"
    (run / "checkpoint-60").mkdir(parents=True)
    assert main(["train", "--output_dir", str(run), "--overwrite_output_dir", "true", "--task", "nosuchtask"]) == 2
    assert (run / "checkpoint-60").exists()


def test_help_all_lists_every_field(capsys):
    assert main(["train", "--help-all"]) == 0
    text = capsys.readouterr().out
    assert all(f"--{name}" in text for name in ("gradient_accumulation_steps", "lora_r", "baseline_estimator", "task_path"))
    assert len(text.splitlines()) > 500  # the short --help is ~110 lines


def test_model_card_names_the_hub_id_a_local_folder_came_from(tmp_path):
    from oblr_trl.training.models import model_card_id

    (tmp_path / "config.json").write_text('{"_name_or_path": "Qwen/Qwen3-4B-Base"}')
    assert model_card_id(str(tmp_path)) == "Qwen/Qwen3-4B-Base"
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))  # a path: no Hub id to name
    assert model_card_id(str(tmp_path)) is None
    assert model_card_id("builtin:smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_card_id("Qwen/Qwen3-8B-Base") == "Qwen/Qwen3-8B-Base"


def test_training_curves_label_whole_optimizer_steps(tmp_path, monkeypatch):
    import matplotlib.figure

    from oblr_trl.plotting import plot_run

    history = [{"step": step, "loss": 0.1, "reward": 0.1 * step, "oblr/noise_scale": 10.0 * step,
                "oblr/completions_per_step": 8} for step in (1, 2, 3)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    ticks, save = [], matplotlib.figure.Figure.savefig

    def recording_save(figure, *args, **kwargs):
        figure.canvas.draw()
        ticks.extend(tick for axis in figure.axes for tick in axis.get_xticks())
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_save)
    plot_run(tmp_path)
    assert ticks and all(float(tick).is_integer() for tick in ticks)  # not 1.25, 1.5, …
    assert (tmp_path / "training_curves.png").exists()


def test_training_curves_draw_the_noise_scale_beside_the_completions_a_step(tmp_path, monkeypatch):
    import matplotlib.figure

    from oblr_trl.plotting import plot_run

    history = [{"step": step, "loss": 0.1, "oblr/noise_scale": 10.0 * step, "oblr/completions_per_step": 8}
               for step in (1, 2, 3)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    panels, save = {}, matplotlib.figure.Figure.savefig

    def recording_save(figure, *args, **kwargs):
        panels.update({axis.get_title(): [list(line.get_ydata()) for line in axis.get_lines()] for axis in figure.axes})
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_save)
    plot_run(tmp_path)
    assert panels["gradient noise scale B_noise (completions)"] == [[10.0, 20.0, 30.0], [8, 8, 8]]
