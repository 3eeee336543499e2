"""One short training run under a real backend, for `test_gpu.py` and its CPU twin `test_backend_rates.py`:

    accelerate launch --config_file recipes/accelerate_configs/zero3.yaml --num_processes 1 tests/backend_worker.py OUT
    FSDP2=1 torchrun --nproc_per_node 2 tests/backend_worker.py OUT      # 2 CPU processes, FSDP2 on gloo

What it changes from what ships, so that the SNR factor acts within the run's 4 steps: the factor read as 'absolute'
(the paper's, in [snr_lr_floor, 1]; the shipped calibrated reference stays at 1 until its window of 20 steps
resolves), from the first estimate (`snr_warmup_steps=0`), unsmoothed (`snr_ema_decay=0`). Everything else is the
defaults, the trust region's peak form per Adam update and its measuring cadence included (the equivalence matrix,
`tests/conftest.py::BACKEND_MATRIX`, runs the calibrated reference).

Records, for every call of the innermost torch optimizer's `step` (DeepSpeed's ZeRO optimizers call it once per
param group), the learning rate it actually used (read by a step pre-hook registered after the trainer's), the
scheduled rate, the factor the trainer applied and its two parts as the trainer logged them (SNR and trust region),
and whether the parameters that optimizer holds (gathered from ZeRO-3's partitions, FSDP2's shards) changed and
stayed finite. Rank 0 writes them to OUT as JSON. With FSDP2=1 the worker asks the Trainer for FSDP2 itself (what the
shipped fsdp.yaml asks of `accelerate launch`); on a CPU accelerate would quietly run DDP where FSDP is asked for, and
`allow_fsdp_on_cpu` lifts that refusal, so the run is FSDP2 there too.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from oblr_trl import OBLRPOConfig, OBLRPOTrainer  # noqa: E402
from oblr_trl.testing import allow_fsdp_on_cpu, tiny_causal_lm, tiny_tokenizer, with_rate_tuning  # noqa: E402
from oblr_trl.training.guards import end_distributed_training  # noqa: E402
from oblr_trl.training.optim_hooks import innermost_optimizer  # noqa: E402

if not torch.cuda.is_available():
    torch.set_num_threads(1)  # the processes share the machine's cores
    allow_fsdp_on_cpu()


def digit_fraction_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class StepRecorder(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.used_lrs, self.scaled = [], []
        self.hooked = None

    def _record_lr(self, optimizer, args, kwargs):
        self.used_lrs.append(float(optimizer.param_groups[0]["lr"]))

    def _snapshot(self):
        # the full weights, gathered from ZeRO-3's partitions where they are sharded
        state = self.trainer.accelerator.get_state_dict(self.trainer.model_wrapped)
        if not state:  # FSDP2 gathers the full state on rank 0 only; the other ranks write nothing
            return torch.zeros(0)
        return torch.cat([value.detach().float().flatten().cpu() for value in state.values()])

    def on_step_begin(self, args, state, control, **kwargs):
        optimizer = innermost_optimizer(self.trainer.optimizer)
        if self.hooked is not optimizer:  # after the trainer's hooks: this one sees the scaled rate
            optimizer.register_step_pre_hook(self._record_lr)
            self.hooked = optimizer
            self.initial = self._snapshot()
            scale = self.trainer.step_control.lr_scale
            log = scale.on_scaled

            def recording_log(scheduled, factor):
                self.scaled.append((state.global_step + 1, scheduled, factor))
                log(scheduled, factor)

            scale.on_scaled = recording_log

    def logged(self) -> list[tuple[float, float, float, float]]:
        """Per call of the torch optimizer's step: the scheduled rate, the factor applied, and the SNR and
        trust-region factors the trainer logged for that step."""
        parts = {log["step"]: (log["snr/lr_factor"], log["oblr/trust_region_factor"])
                 for log in self.trainer.state.log_history if "snr/lr_factor" in log}
        return [(scheduled, factor, *parts[step]) for step, scheduled, factor in self.scaled]


def main(out: str) -> None:
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer, hidden_size=64, num_layers=2)
    prompts = [f"{a}+{b}=" for a in range(8) for b in range(4)]
    trainer_cls, settings = with_rate_tuning(OBLRPOTrainer, {"snr_warmup_steps": 0, "snr_ema_decay": 0.0})
    tuning = trainer_cls.rate_tuning
    args = OBLRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "run"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, num_generations=4, max_completion_length=8, max_steps=4, learning_rate=1e-2,
        generation_kwargs={"sequence_bias": [[[1], 3.0]]}, lr_scheduler_type="linear", **settings,
        snr_lr_reference="absolute", logging_steps=1, report_to="none",
        save_strategy="no", bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        baseline_weights=os.environ.get("WEIGHTS", "logit"),
        **(dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                               "reshard_after_forward": True}) if os.environ.get("FSDP2") else {}),
    )
    recorder = StepRecorder()
    trainer = trainer_cls(model=model, reward_funcs=digit_fraction_reward, args=args,
                            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                            callbacks=[recorder])
    recorder.trainer = trainer
    trainer.train()
    final = recorder._snapshot()
    if trainer.accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({
                "distributed_type": str(trainer.accelerator.distributed_type),
                "optimizer": type(trainer.optimizer.optimizer).__name__,
                "innermost_optimizer": type(recorder.hooked).__name__,
                "used_lrs": recorder.used_lrs,
                "logged": recorder.logged(),
                "floor": tuning.snr_lr_floor,
                "trust_region": {"kl": args.lr_trust_region_kl, "min_ratio": tuning.lr_trust_region_min_ratio,
                                 "max_ratio": tuning.lr_trust_region_max_ratio,
                                 "measure_steps": tuning.lr_trust_region_measure_steps},
                "params_changed": bool((final != recorder.initial).any()),
                "params_finite": bool(final.isfinite().all()),
                "log_history": trainer.state.log_history,
            }, f)
    accelerator = trainer.accelerator
    del trainer
    end_distributed_training(accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
