"""Acceptance 8: bad configuration values raise ValueError naming the field and the allowed values, before any model
is loaded; and the defaults that differ from GRPOConfig."""

import pytest
from trl import GRPOConfig

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.training.config import check_backend
from oblr_trl.training.options import OBLRPOOptions


def make(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), report_to=[], gradient_accumulation_steps=2, per_device_train_batch_size=4, bf16=False,
        num_generations=4,
    )
    return OBLRPOConfig(**{**defaults, **kwargs})


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("baseline_weights", "gradient", "'logit', 'length', 'exact', 'uniform'"),
        ("snr_estimator", "three_batch", "'cross_step', 'two_batch', 'per_sample'"),
        ("snr_lr_reference", "relative", "'calibrated', 'absolute'"),
        ("baseline_estimator", "median", "'pooled_slope', 'weighted'"),
        ("baseline_estimator", "shrunk", "'pooled_slope', 'weighted'"),  # retired 2026-12-02
        ("scale_rewards", "std", "'none', 'group', 'batch'"),
        ("multi_objective_aggregation", "max", "'sum_then_normalize', 'normalize_then_sum'"),
        ("per_sample_batch_size", 0, "None or an integer >= 1"),
        ("per_sample_batch_size", 2.5, "None or an integer >= 1"),
        ("lr_trust_region_kl", 0.0, "None or a finite float > 0"),
        ("lr_trust_region_kl", float("inf"), "None or a finite float > 0"),
        ("lr_trust_region_sample_size", 0, "None or an integer >= 1"),
        ("lr_trust_region_sample_size", 0.5, "None or an integer >= 1"),
    ],
)
def test_bad_values_name_field_and_allowed_values(tmp_path, field, value, allowed):
    with pytest.raises(ValueError) as error:
        make(tmp_path, **{field: value})
    message = str(error.value)
    assert f"`{field}`" in message and repr(value) in message and allowed in message


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("learning_rate", -1.0, "a finite float >= 0"),
        ("learning_rate", float("nan"), "a finite float >= 0"),
        ("weight_decay", -0.1, "a finite float >= 0"),
        ("adam_beta1", 1.0, "[0, 1)"),
        ("adam_beta2", -0.5, "[0, 1)"),
        ("adam_epsilon", -1e-8, "a finite float >= 0"),
        ("warmup_steps", float("nan"), "a finite number >= 0"),  # a negative one: TrainingArguments' own check
        ("max_steps", 0, "an integer >= 1, or a negative one (train num_train_epochs)"),
        ("max_steps", 2.5, "an integer >= 1, or a negative one (train num_train_epochs)"),
        ("max_completion_length", None, "an integer >= 1"),
        ("num_train_epochs", 0.0, "a finite float > 0"),
        ("per_device_train_batch_size", 0, "an integer >= 1"),
        ("gradient_accumulation_steps", 0, "an integer >= 1"),
        ("max_completion_length", 0, "an integer >= 1"),
        ("temperature", 0.0, "a finite float > 0"),
        ("top_p", 1.5, "(0, 1]"),
        ("beta", -0.01, "a finite float >= 0"),
    ],
)
def test_trainer_values_torch_would_refuse_after_the_model_loads_are_refused_first(tmp_path, field, value, allowed):
    with pytest.raises(ValueError) as error:
        make(tmp_path, **{field: value})
    message = str(error.value)
    assert f"`{field}`" in message and repr(value) in message and allowed in message


def test_gradient_checkpointing_keeps_trls_default_and_its_alias_without_a_deprecation_warning(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert make(tmp_path).gradient_checkpointing is True  # GRPOConfig's default
        for value in (False, True):
            config = make(tmp_path, gradient_checkpointing=value)
            assert config.gradient_checkpointing is value and config.activation_checkpointing is value
            assert make(tmp_path, activation_checkpointing=value).gradient_checkpointing is value


def test_fields_keep_grpo_configs_order_so_positional_output_dir_works(tmp_path):
    from dataclasses import fields

    grpo = [f.name for f in fields(GRPOConfig)]
    assert [f.name for f in fields(OBLRPOConfig)][: len(grpo)] == grpo
    assert OBLRPOConfig(str(tmp_path / "out"), bf16=False).output_dir == str(tmp_path / "out")


def test_one_observable_batch_size_is_refused_for_two_batch(tmp_path):
    """With one process and gradient_accumulation_steps=1 the two-batch estimator cannot measure anything: the
    configuration is refused (no silent no-op) and the message lists the ways out."""
    with pytest.raises(ValueError) as error:
        make(tmp_path, gradient_accumulation_steps=1, snr_estimator="two_batch")
    message = str(error.value)
    assert "`snr_estimator`" in message and "gradient_accumulation_steps" in message and "per_sample" in message
    # each way out is accepted
    make(tmp_path, gradient_accumulation_steps=1, snr_estimator="per_sample")
    make(tmp_path, gradient_accumulation_steps=1, snr_estimator="cross_step")
    make(tmp_path, gradient_accumulation_steps=1, snr_estimator="two_batch", use_snr_lr=False)
    make(tmp_path, gradient_accumulation_steps=2, snr_estimator="two_batch")


def test_the_default_config_accepts_trl_defaults_one_micro_batch_per_step(tmp_path):
    config = OBLRPOConfig(output_dir=str(tmp_path), bf16=False)  # GRPOConfig's batch layout, untouched
    assert config.gradient_accumulation_steps == 1 and config.snr_estimator == "cross_step"


def test_per_sample_needs_two_samples_per_step(tmp_path):
    with pytest.raises(ValueError, match="`snr_estimator`"):
        make(tmp_path, gradient_accumulation_steps=1, per_device_train_batch_size=1, num_generations=2,
             generation_batch_size=2, snr_estimator="per_sample")


def test_defaults_follow_the_theory(tmp_path):
    from oblr_trl.estimators.step_rate import RateRuleTuning

    config = make(tmp_path)
    assert config.scale_rewards == GRPOConfig.scale_rewards == "group"  # measured: more robust to the rate
    assert (config.baseline_weights, config.leave_one_out, config.use_snr_lr, config.snr_estimator) == (
        "logit", True, True, "cross_step"
    )
    assert config.snr_lr_reference == "calibrated"
    assert make(tmp_path, scale_rewards=True).scale_rewards == "group"
    tuning = RateRuleTuning()
    assert (tuning.snr_lr_min_ratio, tuning.snr_lr_max_ratio) == (1.0, 2.0) and tuning.lr_trust_region_short_early_gaps
    assert tuning.resolved_snr_calibration_steps == 20
    assert RateRuleTuning(snr_ema_decay=0.95).resolved_snr_calibration_steps == 40
    assert RateRuleTuning(snr_calibration_steps=7).resolved_snr_calibration_steps == 7


def test_bf16_default_resolves_to_what_the_machine_has(tmp_path, monkeypatch):
    """GRPOConfig's bf16=None becomes True, which transformers refuses on a CPU; OBLRPOConfig's becomes fp32 there
    and bf16 on a GPU that has it. An explicit bf16=True is refused on a CPU exactly as GRPOConfig refuses it."""
    import transformers.utils

    config = OBLRPOConfig(output_dir=str(tmp_path))
    assert config.bf16 is False and config.fp16 is False
    assert OBLRPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is False
    with pytest.raises(ValueError, match="doesn't support bf16") as ours:
        OBLRPOConfig(output_dir=str(tmp_path), bf16=True)
    with pytest.raises(ValueError, match="doesn't support bf16") as trls:
        GRPOConfig(output_dir=str(tmp_path))
    assert str(ours.value) == str(trls.value)
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: True)  # a GPU with bf16
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    assert OBLRPOConfig(output_dir=str(tmp_path)).bf16 is True
    assert OBLRPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is False


def test_trainer_refuses_a_plain_grpo_config(tmp_path, tokenizer):
    from oblr_trl.testing import tiny_causal_lm

    with pytest.raises(TypeError, match="OBLRPOConfig"):
        OBLRPOTrainer(
            model=tiny_causal_lm(tokenizer), reward_funcs=[], args=GRPOConfig(output_dir=str(tmp_path), bf16=False)
        )


def docstring_mismatches(doc: str) -> list[str]:
    """The OBLR-PO options whose text in ``doc`` (a docstring in TRL's format) is not their `help`."""
    import re
    from dataclasses import fields

    from oblr_trl.training.options import OBLRPOOptions

    documented = {}
    for block in re.split(r"\n(?=        \w+ \(`)", doc.split("Parameters:")[1].split("> [!NOTE]")[0]):
        name = re.match(r"\s*(\w+) \(`", block)
        if name:
            documented[name.group(1)] = " ".join(block.split("):", 1)[1].split("\n\n")[0].split())
    return [f.name for f in fields(OBLRPOOptions) if documented.get(f.name) != " ".join(f.metadata["help"].split())]


def test_oblrpo_adds_twelve_fields_each_with_one_text_of_trls_length():
    """The options a user holds: every one documented once, in its `help`, from which the docstring is written."""
    from dataclasses import fields

    new = {f.name for f in fields(OBLRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    assert new == {
        "baseline_weights", "baseline_estimator", "leave_one_out", "per_sample_batch_size", "use_snr_lr",
        "snr_lr_reference", "snr_estimator", "lr_trust_region_kl", "lr_trust_region_sample_size", "log_step_kl",
        "skip_nonfinite_steps", "save_on_preemption",
    }
    assert all(len(f.metadata["help"]) <= 400 for f in fields(OBLRPOConfig) if f.name in new)
    assert docstring_mismatches(OBLRPOConfig.__doc__) == []


def test_a_docstring_that_says_what_its_help_does_not_fails_the_check():
    doc = OBLRPOConfig.__doc__
    assert docstring_mismatches(doc.replace("RLOO's baseline", "GRPO's baseline")) == ["baseline_weights"]
    dropped = doc.replace("        log_step_kl (`bool`", "        ")
    assert "log_step_kl" in docstring_mismatches(dropped)


def test_retired_options_are_refused_by_name(tmp_path):
    for name, value in [("snr_lr_floor", 0.1), ("lr_trust_region_mode", "cap"), ("baseline_shrinkage", 0.5),
                        ("importance_weighted_baseline", False), ("lr_trust_region_measure_steps", 4)]:
        with pytest.raises(TypeError, match=name):
            make(tmp_path, **{name: value})


@pytest.mark.parametrize("field", ["lr_trust_region_mode", "lr_trust_region_curvature"])
def test_the_rate_rules_retired_constants_are_refused_by_name_where_an_ablation_sets_them(field):
    from oblr_trl.estimators.step_rate import RateRuleTuning

    with pytest.raises(TypeError, match=field):
        RateRuleTuning(**{field: "peak"})


@pytest.mark.parametrize(
    "options, backend, message",
    [
        ({}, {"fsdp_version": 1}, "FSDP2 only.*fsdp_version: 2.*use_snr_lr=False"),
        ({"snr_estimator": "two_batch"}, {"fsdp_version": 2}, "two_batch.*Allowed values under FSDP2: 'cross_step'"),
        ({}, {"deepspeed": True, "deepspeed_fp16": True}, "fp16 under DeepSpeed.*Use bf16"),
        ({"use_snr_lr": False, "baseline_weights": "exact"}, {"deepspeed": True}, "not available under DeepSpeed"),
        ({"snr_estimator": "per_sample"}, {"deepspeed": True}, "not available under DeepSpeed"),
    ],
    ids=["fsdp1", "fsdp2-two_batch", "deepspeed-fp16", "deepspeed-exact", "deepspeed-per_sample"],
)
def test_backend_conflicts_are_refused_naming_the_way_out(options, backend, message):
    config = OBLRPOOptions(**options)
    with pytest.raises(ValueError, match=message):
        check_backend(config, **{"fsdp_version": None, "deepspeed": False, "deepspeed_fp16": False, **backend})


@pytest.mark.parametrize(
    "options, backend",
    [
        ({}, {"fsdp_version": 2}),  # the defaults under FSDP2
        ({"baseline_weights": "exact", "snr_estimator": "per_sample"}, {"fsdp_version": 2}),
        ({"use_snr_lr": False}, {"fsdp_version": 1}),
        ({"use_snr_lr": False}, {"deepspeed": True, "deepspeed_fp16": True}),
        ({}, {"deepspeed": True}),  # bf16 / fp32 DeepSpeed with the defaults
    ],
)
def test_backends_take_the_options_they_can_honour(options, backend):
    check_backend(OBLRPOOptions(**options), **{"fsdp_version": None, "deepspeed": False, "deepspeed_fp16": False, **backend})


def test_the_fsdp_version_accelerate_launch_announces_is_checked_before_any_model_loads(tmp_path, monkeypatch):
    """`accelerate launch --config_file fsdp.yaml` announces FSDP in the environment; the config refuses what that
    backend cannot run, before the trainer (and the model) exist."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="FSDP2 only"):
        OBLRPOConfig(tmp_path, use_cpu=True)
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match="'two_batch' needs each process's micro-batch gradients"):
        OBLRPOConfig(tmp_path, use_cpu=True, snr_estimator="two_batch", gradient_accumulation_steps=2)
    assert OBLRPOConfig(tmp_path, use_cpu=True).snr_estimator == "cross_step"


def test_the_fsdp_version_of_the_trainer_arguments_is_checked(tmp_path):
    with pytest.raises(ValueError, match="uses FSDP version 1"):
        OBLRPOConfig(tmp_path, use_cpu=True, fsdp=True, fsdp_config={"version": 1})
    assert OBLRPOConfig(tmp_path, use_cpu=True, fsdp=True, fsdp_config={"version": 1}, use_snr_lr=False).fsdp
