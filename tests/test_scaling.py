"""vLLM (colocate and server, with a test double), exact resume, graceful preemption, and the backend glue on fakes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import fake_vllm
import pytest
import torch
from tolerances import noise_terms_scale
from transformers import TrainerCallback

from oblr_trl import OBLRPOTrainer
from oblr_trl.estimators.weights import logit_proxy_weights
from oblr_trl.training.completion_weights import CompletionWeights, loss_mask
from oblr_trl.training.optim_hooks import (
    MicroBatchGradSqNorms,
    OptimizerStepGate,
    StepLearningRateScale,
    innermost_optimizer,
)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------------------------


class RecordedWeightsUnderIS(CompletionWeights):
    """Records, per generation batch, the weights used, the plain logit-proxy inputs and TRL's IS ratios."""

    def compute(self, output, record, mode, measure=None):
        used = super().compute(output, record, mode, measure)
        log_probs, log_sum_sq = self.logit_inputs(output, None, mode)  # a fresh forward, no IS
        self.metrics[mode]["oblr/weights/extra_forward"].pop()  # that forward is the test's, not the trainer's
        self.weight_records.append((used, log_probs, log_sum_sq, loss_mask(output),
                                    output["importance_sampling_ratio"]))
        return used


class WeightsUnderIS(OBLRPOTrainer):
    weights_class = RecordedWeightsUnderIS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_records = self.completion_weights.weight_records = []


@pytest.mark.parametrize("mode", ["colocate", "server"])
@pytest.mark.parametrize("is_mode", ["sequence_truncate", "token_truncate"])
def test_vllm_generation_and_importance_weighted_baseline(make_trainer, saved_tiny_model, monkeypatch, mode, is_mode):
    fake_vllm.install(monkeypatch, str(saved_tiny_model))
    trainer = make_trainer(
        model=str(saved_tiny_model), trainer_cls=WeightsUnderIS, use_vllm=True, vllm_mode=mode, max_steps=2,
        vllm_importance_sampling_mode=is_mode, vllm_importance_sampling_clip_max=10.0,
    )
    trainer.train()
    backend = fake_vllm.FakeLLM.instances if mode == "colocate" else fake_vllm.FakeVLLMClient.instances
    assert len(backend) == 1
    assert (backend[0].weight_syncs if mode == "colocate" else backend[0].weight_updates) >= 2  # one per step
    if mode == "colocate":  # the engine is built in the dtype the policy computes in (TRL passes none)
        assert backend[0].kwargs["dtype"] == "float32" and backend[0].model.dtype == torch.float32
    if mode == "server":
        assert all(call["n"] == 4 for call in backend[0].generate_calls)
    ratios_seen = []
    for used, log_probs, log_sum_sq, mask, ratio in trainer.weight_records:
        expected = logit_proxy_weights(log_probs, log_sum_sq, mask, ratio.square())
        assert torch.allclose(used, expected, rtol=1e-5, atol=1e-7)
        assert ratio.shape[1] == (1 if is_mode.startswith("sequence") else mask.shape[1])
        ratios_seen.append(ratio[mask.bool() if ratio.shape[1] > 1 else slice(None)].flatten())
    assert not torch.allclose(torch.cat(ratios_seen), torch.ones(1))  # the double really samples off-policy
    logged = [h for h in trainer.state.log_history if "oblr/weights/extra_forward" in h]
    assert logged and all(h["oblr/weights/extra_forward"] == 0.0 for h in logged)  # TRL's IS forward was reused


@pytest.mark.parametrize("with_setup", [True, False])
def test_trls_own_trainer_with_the_colocate_setup_loads_vllm_in_the_policy_dtype(
        saved_tiny_model, monkeypatch, tmp_path, tokenizer, prompt_dataset, with_setup):
    """`ColocatedVLLMSetup` before `GRPOTrainer` (what the benchmarks' GRPO reference on vLLM's CPU build is) builds
    TRL's engine in the policy's dtype and leaves TRL's training as it is; TRL alone passes no dtype."""
    from conftest import base_config_kwargs, digit_fraction_reward
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl.training.vllm_colocate import ColocatedVLLMSetup

    fake_vllm.install(monkeypatch, str(saved_tiny_model))
    trainer_cls = type("GRPOTrainer", (ColocatedVLLMSetup, GRPOTrainer), {}) if with_setup else GRPOTrainer
    trainer = trainer_cls(model=str(saved_tiny_model), reward_funcs=[digit_fraction_reward], train_dataset=prompt_dataset,
                          args=GRPOConfig(**base_config_kwargs(tmp_path, use_vllm=True, vllm_mode="colocate")),
                          processing_class=tokenizer)
    trainer.train()
    (engine,) = fake_vllm.FakeLLM.instances
    assert engine.kwargs.get("dtype") == ("float32" if with_setup else None)
    assert engine.weight_syncs >= 2 and len([h for h in trainer.state.log_history if "loss" in h]) == 2


# ----------------------------------------------------------------------------------------------------------------
# Exact resume
# ----------------------------------------------------------------------------------------------------------------


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


KEYS = ("loss", "snr/lr_factor", "snr/snr", "snr/trace_cov", "snr/grad_sq_norm_ema", "reward", "grad_norm",
        "snr/full_batch_grad_sq_norm", "snr/trace_cov_ema")


def per_step(trainer, keys=KEYS):
    return {h["step"]: {k: h.get(k) for k in keys} for h in trainer.state.log_history if "loss" in h}


def test_resume_continues_exactly(make_trainer, tmp_path):
    # cross-step estimates (the default) with the paper-literal factor, so that the restored state moves the rate:
    # step 4 pairs with step 3's gradient sketch, which only the checkpoint carries
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, snr_warmup_steps=1, snr_lr_reference="absolute")
    straight = make_trainer(output_dir=str(tmp_path / "straight"), **common)
    straight.train()

    first = make_trainer(output_dir=str(tmp_path / "split"), callbacks=[StopAt(3)], **common)
    first.train()
    checkpoint = tmp_path / "split" / "checkpoint-3"
    state = json.loads((checkpoint / "oblr_state.json").read_text())
    assert state["step_rate"]["snr"]["trace_cov"]["count"] == 2  # steps 2 and 3; step 1 had no pair
    assert (checkpoint / "oblr_gradient_sketch.pt").exists()
    second = make_trainer(output_dir=str(tmp_path / "split"), **common)
    second.train(resume_from_checkpoint=str(checkpoint))

    expected, resumed = per_step(straight), {**per_step(first), **per_step(second)}
    assert sorted(resumed) == list(range(1, 7))
    assert any(expected[step]["snr/lr_factor"] < 1.0 for step in range(4, 7))  # the restored factor matters
    for step in range(1, 7):
        # the SNR estimates are differences of larger terms: compared in the scale of those terms (8 samples a step);
        # the SNR = ‖μ‖²/tr Σ inherits ‖μ‖²'s absolute error divided by tr Σ
        terms = noise_terms_scale(expected[step], expected.get(step - 1))
        trace = expected[step]["snr/trace_cov_ema"]
        scales = {"snr/trace_cov": 8 * terms, "snr/trace_cov_ema": 8 * terms, "snr/grad_sq_norm_ema": terms,
                  "snr/snr": terms / abs(trace) if trace else None}
        for key in KEYS:
            a, b = expected[step][key], resumed[step][key]
            if a is None:  # not measured yet (NaN is logged as None)
                assert b is None, (step, key, b)
            elif scales.get(key) is not None:
                assert b == pytest.approx(a, abs=1e-5 * scales[key]), (step, key, a, b)
            else:
                assert b == pytest.approx(a, rel=1e-5, abs=1e-8), (step, key, a, b)


def test_resuming_a_tied_embedding_model_does_not_report_its_tied_head_missing(make_trainer, tokenizer, tmp_path,
                                                                               monkeypatch):
    """transformers 5 lists lm_head.weight, tied to the embeddings and so never saved, as a missing key on resume."""
    import transformers.trainer

    from oblr_trl.testing import tiny_causal_lm

    warned = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda message, *a, **k: warned.append(str(message)))
    common = dict(max_steps=3, save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))
    make_trainer(model=tiny_causal_lm(tokenizer, tie_word_embeddings=True), callbacks=[StopAt(2)], **common).train()
    trainer = make_trainer(model=tiny_causal_lm(tokenizer, tie_word_embeddings=True, seed=1), **common)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert not [message for message in warned if "missing keys" in message], warned
    model = trainer.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_old_checkpoint_without_oblr_state_resumes_with_a_warning(make_trainer, tmp_path):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))
    make_trainer(callbacks=[StopAt(2)], **common).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "oblr_state.json").unlink()
    trainer = make_trainer(**common)
    with pytest.warns(UserWarning, match="no oblr_state.json"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4


# ----------------------------------------------------------------------------------------------------------------
# Graceful preemption
# ----------------------------------------------------------------------------------------------------------------

class SignalAt(TrainerCallback):
    """Stands in for a SIGTERM arriving during optimizer step ``step`` (before the trainer's own step-end check)."""

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.records.preemption.received = signal.SIGTERM


def test_a_resumed_run_that_finishes_counts_every_segment_and_leaves_a_current_card(make_trainer, tmp_path):
    """Python flow, as the README's example: preempted at step 2, resumed to step 4 with save_strategy="no", then
    save_model(). The preemption checkpoint goes once the run finishes; the card and the summary count both segments
    and describe the step-4 model."""
    from oblr_trl import TrainingPreempted
    from oblr_trl.progress import training_summary
    from oblr_trl.training.model_card import TOTAL_RUNTIME_KEY

    out = tmp_path / "run"
    interrupt = SignalAt(2)
    first = make_trainer(callbacks=[interrupt], max_steps=4, output_dir=str(out))
    interrupt.trainer = first
    with pytest.raises(TrainingPreempted) as stopped:
        first.train()
    checkpoint = Path(stopped.value.checkpoint)
    assert checkpoint == out / "checkpoint-2" and (checkpoint / "oblr_preemption.json").exists()
    first_seconds = json.loads((checkpoint / "oblr_state.json").read_text())["training_seconds"]
    assert first_seconds > 0

    second = make_trainer(max_steps=4, output_dir=str(out))
    second.train(resume_from_checkpoint=str(checkpoint))
    assert not checkpoint.exists()  # superseded by the finished run
    summary = next(h for h in second.state.log_history if "train_runtime" in h)
    assert summary[TOTAL_RUNTIME_KEY] == pytest.approx(first_seconds + summary["train_runtime"])
    line = training_summary(second.state.global_step, summary)
    assert line.startswith("trained 4 steps in ") and "; this segment " in line  # resumed: both times shown
    second.save_model()
    card = (out / "README.md").read_text()
    assert "| optimizer steps | 4 |" in card and f"| training time | {summary[TOTAL_RUNTIME_KEY]:.0f} s |" in card
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_the_card_names_the_seed_the_hub_id_and_counts_in_the_singular(make_trainer, tmp_path):
    trainer = make_trainer(per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, seed=42,
                           hub_model_id="me/tiny-oblrpo")
    trainer.create_model_card()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "| completions per step | 4 (1 prompt × 4) |" in card and "| training seed | 42 |" in card
    assert 'model="me/tiny-oblrpo"' in card  # where the model will be, not this machine's folder
    assert "| learning rate | 0.01, `linear`, 0 warm-up steps |" in card

def preemptible_cli_run(model, out, save_on_preemption) -> list[str]:
    return ["train", "--model_name_or_path", str(model), "--output_dir", str(out), "--max_steps", "500",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
            "--task_num_problems", "64", "--save_strategy", "no", "--plot", "false", "--save_on_preemption",
            save_on_preemption, "--disable_tqdm", "true"]  # the metrics dict printed per step tells a step is done


CLI_RUN = """
import sys
sys.path.insert(0, {tests!r})
from oblr_trl.cli import main
raise SystemExit(main({argv!r}))
"""

# A script that calls train() itself, as the README's `trainer.train(); trainer.push_to_hub()` does
PYTHON_RUN = """
import sys
sys.path.insert(0, {tests!r})
from datasets import Dataset
from conftest import digit_fraction_reward
from oblr_trl import OBLRPOConfig, OBLRPOTrainer, TrainingPreempted

trainer = OBLRPOTrainer(
    model={model!r}, reward_funcs=digit_fraction_reward,
    args=OBLRPOConfig(output_dir={out!r}, max_steps=500, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True),
    train_dataset=Dataset.from_dict({{"prompt": [f"{{a}}+{{b}}=" for a in range(8) for b in range(8)]}}),
)
try:
    trainer.train()
except TrainingPreempted as stopped:
    print("RAISED", stopped.signal, stopped.step, stopped.checkpoint, flush=True)
    print("MESSAGE", stopped, flush=True)
    raise SystemExit(3)
print("RETURNED", flush=True)  # what a script must never see after a preemption: it would push a partial model
"""


def wait_for_first_logged_step(process, timeout=240):
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if "'loss'" in line:
            return "".join(seen)
        assert line or process.poll() is None, "training ended before the signal:\n" + "".join(seen)[-3000:]
    raise AssertionError("no training step logged in time")


def signal_after_first_step(script, signum):
    """Start a long run, signal it once a step is logged, and return (process, its whole output)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    before = wait_for_first_logged_step(process)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=240)
    return process, before + output


def cli_script(argv: list[str]) -> str:
    return CLI_RUN.format(tests=str(ROOT / "tests"), argv=argv)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_resumable_checkpoint(saved_tiny_model, tmp_path, signum):
    out = tmp_path / "run"
    process, output = signal_after_first_step(cli_script(preemptible_cli_run(saved_tiny_model, out, "true")), signum)
    assert process.returncode == 128 + signum, output[-2000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "oblr_state.json").exists()
    step = int(checkpoints[0].name.split("-")[1])
    assert 1 <= step < 500
    assert f"stopped by {signal.Signals(signum).name}" in output and "--resume_from_checkpoint" in output
    assert "trainer.train(resume_from_checkpoint" not in output  # the CLI's command only, not the Python hint too


def test_two_interruptions_leave_one_checkpoint_and_a_resume_command_with_one_checkpoint(saved_tiny_model, tmp_path):
    import shlex

    out = tmp_path / "run"
    argv = preemptible_cli_run(saved_tiny_model, out, "true")
    for interruption in (1, 2):
        process, output = signal_after_first_step(cli_script(argv), signal.SIGTERM)
        assert process.returncode == 128 + signal.SIGTERM, output[-2000:]
        command = next(line for line in output.splitlines() if line.startswith("resume with: "))
        argv = shlex.split(command)[3:]  # after "resume with: oblr-trl"
        assert argv.count("--resume_from_checkpoint") == 1 and not any("--resume_from_checkpoint=" in a for a in argv)
        checkpoints = sorted(out.glob("checkpoint-*"))
        assert [str(c) for c in checkpoints] == [argv[argv.index("--resume_from_checkpoint") + 1]]
        if interruption == 1:
            first = checkpoints[0]
    assert checkpoints[0] != first and not first.exists()  # the second run continued from the first's and replaced it


def test_signal_during_train_from_python_raises_with_the_checkpoint(saved_tiny_model, tmp_path):
    out = tmp_path / "run"
    script = PYTHON_RUN.format(tests=str(ROOT / "tests"), model=str(saved_tiny_model), out=str(out))
    process, output = signal_after_first_step(script, signal.SIGTERM)
    assert process.returncode == 3 and "RETURNED" not in output, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("RAISED"))
    _, signum, step, checkpoint = line.split()
    assert int(signum) == signal.SIGTERM and Path(checkpoint) == out / f"checkpoint-{step}" and Path(checkpoint).is_dir()
    assert f"resume_from_checkpoint='{checkpoint}'" in output  # the exception's message says how to resume


def test_save_on_preemption_off_leaves_the_default_signal_behaviour(saved_tiny_model, tmp_path):
    out = tmp_path / "run"
    process, _ = signal_after_first_step(cli_script(preemptible_cli_run(saved_tiny_model, out, "false")), signal.SIGTERM)
    assert process.returncode == -signal.SIGTERM
    assert not list(out.glob("checkpoint-*"))


# ----------------------------------------------------------------------------------------------------------------
# Backend glue on fakes (DeepSpeed's optimizer wrappers)
# ----------------------------------------------------------------------------------------------------------------


class FakeZeroOptimizer:
    """Shaped like DeepSpeed's ZeRO optimizers: not a torch optimizer, wraps one under `.optimizer`, steps it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self):
        self.optimizer.step()


class FakeAcceleratedOptimizer:
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_learning_rate_scale_and_gate_reach_the_optimizer_deepspeed_steps():
    """Under DeepSpeed the trainer's optimizer is accelerate's wrapper of DeepSpeed's wrapper of the torch optimizer,
    and DeepSpeed calls the torch optimizer's step from inside `backward`. The hooks sit on that innermost one."""
    parameter = torch.nn.Parameter(torch.ones(3))
    torch_optimizer = torch.optim.SGD([parameter], lr=0.5)
    zero = FakeZeroOptimizer(torch_optimizer)
    wrapped = FakeAcceleratedOptimizer(zero)
    assert innermost_optimizer(wrapped) is torch_optimizer
    seen = []
    StepLearningRateScale(wrapped, lambda: 0.2, lambda lr, factor: seen.append((lr, factor)))
    allowed = [True, False]
    gate = OptimizerStepGate(wrapped, lambda: allowed.pop(0), lambda: seen.append("skipped"))
    parameter.grad = torch.ones(3)
    zero.step()  # DeepSpeed's path: scaled to 0.5 × 0.2
    assert torch.allclose(parameter.detach(), torch.full((3,), 0.9))
    assert torch_optimizer.param_groups[0]["lr"] == 0.5  # back on the schedule after the step
    zero.step()  # refused
    assert torch.allclose(parameter.detach(), torch.full((3,), 0.9)) and seen == [(0.5, 0.2), "skipped"]
    gate.remove()
    with pytest.raises(TypeError, match="torch optimizer"):
        innermost_optimizer(FakeAcceleratedOptimizer(object()))


def test_micro_batch_norms_see_each_local_gradient_before_accumulation():
    layer = torch.nn.Linear(3, 2)
    norms = MicroBatchGradSqNorms(layer.parameters())
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected = 0.0
    for batch in batches:
        norms.active = True
        layer(batch).pow(2).sum().backward()
        norms.active = False
        grads = torch.autograd.grad(layer(batch).pow(2).sum(), list(layer.parameters()))  # not counted: inactive
        expected += sum(g.pow(2).sum() for g in grads).item()
    assert norms.pop(torch.device("cpu")).item() == pytest.approx(expected, rel=1e-5)
    assert norms.pop(torch.device("cpu")).item() == 0.0
    norms.remove()
    with pytest.raises(ValueError, match="no trainable parameters"):
        MicroBatchGradSqNorms([torch.nn.Parameter(torch.ones(1), requires_grad=False)])


def test_unobservable_micro_batch_gradients_fail_loudly(make_trainer):
    """A backend whose hooked parameters never see a micro-batch gradient (as under FSDP before the recorder read its
    shards): an error, not a factor computed from nothing."""
    trainer = make_trainer(max_steps=1, snr_estimator="two_batch")
    trainer.snr_recorder.hooks.remove()
    with pytest.raises(RuntimeError, match="saw no micro-batch gradient.*use_snr_lr=False"):
        trainer.train()


def test_one_decision_and_one_log_per_step_when_the_optimizer_steps_once_per_param_group(make_trainer):
    """DeepSpeed's ZeRO optimizers call the torch optimizer's `step` once per param group: the step is judged once
    (one cross-process sync) and its factor or its skip is logged once."""
    trainer = make_trainer()
    trainer.create_optimizer()
    optimizer = innermost_optimizer(trainer.optimizer)
    assert len(optimizer.param_groups) == 2  # decay / no decay, as the Trainer builds them
    trainer.step_rate.next_snr_factor = 0.5
    trainer.step_control.begin_step()
    optimizer.step()
    optimizer.step()
    trainer.step_control.after_step()  # the Trainer's `on_optimizer_step`, once per step
    assert trainer._metrics["train"]["snr/lr_factor"] == [0.5]
    assert trainer._metrics["train"]["oblr/lr"] == [pytest.approx(trainer.args.learning_rate * 0.5 * 0.01)]

    trainer.step_rate.next_snr_factor = float("nan")
    trainer.step_control.begin_step()
    optimizer.step()
    trainer.step_control.factor = 0.5  # the decision was taken at the step's first call and holds for the whole step
    optimizer.step()
    trainer.step_control.after_step()
    assert trainer.skipped_nonfinite_steps == 1
    assert trainer._metrics["train"]["snr/lr_factor"] == [0.5]


def test_checkpoints_carry_the_pooled_slope(make_trainer, tmp_path):
    common = dict(max_steps=2, save_strategy="steps", save_steps=2, baseline_estimator="pooled_slope",
                  output_dir=str(tmp_path / "run"), use_snr_lr=False)
    trainer = make_trainer(**common)
    trainer.train()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "oblr_state.json").read_text())
    assert state["pooled_slope"] == trainer.pooled_slope.state_dict() and trainer.pooled_slope.count >= 1
    resumed = make_trainer(**{**common, "max_steps": 3})
    resumed.create_optimizer_and_scheduler(num_training_steps=3)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.pooled_slope.value == trainer.pooled_slope.value


def test_the_colocated_engine_samples_in_the_policys_compute_dtype_and_is_closed_on_request():
    """The CPU twin of tests/test_vllm.py's dtype check: the autocast dtype under bf16/fp16, the parameters' otherwise;
    a dtype the caller gives is kept; the context puts TRL's `LLM` back; the engine's shutdown is called once asked."""
    import trl.generation.vllm_generation as vllm_generation

    from oblr_trl.training.vllm_colocate import close_colocated_vllm, generation_dtype, vllm_loads_in

    model = torch.nn.Linear(2, 2).to(torch.float64)
    assert generation_dtype(model, bf16=False, fp16=False) == torch.float64
    assert generation_dtype(model, bf16=True, fp16=False) == torch.bfloat16
    assert generation_dtype(model, bf16=False, fp16=True) == torch.float16
    built = []
    original = getattr(vllm_generation, "LLM", None)
    vllm_generation.LLM = lambda **kwargs: built.append(kwargs)
    try:
        with vllm_loads_in(lambda: torch.float32):
            vllm_generation.LLM(model="m")
            vllm_generation.LLM(model="m", dtype="bfloat16")
        vllm_generation.LLM(model="m")
    finally:
        if original is None:
            del vllm_generation.LLM
        else:
            vllm_generation.LLM = original
    assert [kwargs.get("dtype") for kwargs in built] == ["float32", "bfloat16", None]
    shut = []
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(llm=SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: shut.append(True))))))
    close_colocated_vllm(trainer)
    close_colocated_vllm(SimpleNamespace())  # no engine: nothing to do
    assert shut == [True]
