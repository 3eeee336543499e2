"""`OBLRPOTrainer`: TRL's `GRPOTrainer` with the gradient-weighted baseline and the SNR-driven learning rate.

The trainer is glue: it overrides the hooks of TRL 1.16 that docs/architecture.md names (with the order they run in
within one step) and hands each concern to a collaborator that keeps its own bookkeeping: `CompletionWeights` (the
weights w_i, per-sample gradient norms), `StepNoiseRecorder` (each step's ‖μ‖² and tr Σ), `StepKLRecorder` (how far a
step moved the policy), `OptimizerStepControl` (feeds those to the rate rule, `estimators.step_rate`, applies the
factor it decides and refuses a non-finite step) and `RunRecords` (checkpoints, preemption, the model card). The
advantages are recomputed with `estimators.advantages` at the end of `_generate_and_score_completions`, on the rewards
and weights gathered from every process, before the generation batch is split (a group can span ranks and
micro-batches).

No collaborator sees the trainer: each is given the functions and values it uses, and `__init__` is the one place
that hands TRL's private methods and attributes over to them (read there what a TRL upgrade can break).
"""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from ..estimators.advantages import (
    advantage_summary,
    aggregate_rewards,
    gradient_weighted_advantages,
    rows_whose_weights_matter,
)
from ..estimators.baselines import PooledSlope
from ..estimators.step_rate import RateRuleTuning, step_rate_rule
from . import models
from .completion_weights import CompletionWeights, loss_mask, reshard_fsdp2
from .config import OBLRPOConfig, check_backend, deepspeed_fp16
from .generation_hooks import empty_completions_as_eos
from .guards import check_prompt_lengths, checked_reward_funcs
from .run_records import RunDescription, RunRecords
from .step_control import OptimizerStepControl
from .vllm_colocate import ColocatedVLLMSetup
from .step_kl import StepKLRecorder
from .step_noise import StepNoiseRecorder, loss_scale

__all__ = ["OBLRPOTrainer"]

POOLED_SLOPE_DECAY = 0.9  # moving-average decay of the pooled slope's fit, over generation batches


class _OBLRPOCallback(TrainerCallback):
    """The trainer's own hooks into the training loop: optimizer hooks once the optimizer is final (DeepSpeed builds
    its own in `prepare`), the learning-rate factor of each step fixed before its first micro-batch (DeepSpeed steps
    inside the last `backward`), and the graceful stop on SIGTERM/SIGINT."""

    def __init__(self, trainer: OBLRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.step_control.attach(self.trainer.optimizer)
        # the calibration of the SNR factor starts once the learning rate has reached its scheduled value
        self.trainer.step_rate.open_calibration_after(args.get_warmup_steps(state.max_steps))
        if args.save_on_preemption:
            self.trainer.records.preemption.install()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.step_control.begin_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        measured = trainer.step_control.after_step()  # the step's own KL, before the next step's factor is fixed
        if measured and trainer._is_fsdp2:
            reshard_fsdp2(trainer.model)

    def on_step_end(self, args, state, control, **kwargs):
        records = self.trainer.records
        if args.save_on_preemption and records.stop_requested():
            records.preempted_at_step = state.global_step
            control.should_save = True
            control.should_training_stop = True


class OBLRPOTrainer(ColocatedVLLMSetup, GRPOTrainer):
    """Trainer for OBLR-PO (Optimal Baseline and Learning-Rate Policy Optimization, arXiv 2511.23310).

    A drop-in replacement for [`~trl.GRPOTrainer`] (same arguments) that changes two things:

    1. Advantages are r_i − b_i with a leave-one-out estimate of the variance-optimal baseline b* = E[w r]/E[w],
       w ∝ ‖∇_θ log π(o|q)‖² (see `OBLRPOConfig.baseline_estimator` and `baseline_weights`).
    2. The rate of each optimizer step is the scheduled one × an SNR factor × a trust-region factor: by default the
       trust region measures the schedule's peak, the rate that moves the policy by δ (`lr_trust_region_kl`; None
       turns it off), and f_t = N·SNR/(1 + N·SNR) shapes the steps around it (`use_snr_lr`, `snr_lr_reference`).

    Example:

    ```python
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    trainer = OBLRPOTrainer(
        model="Qwen/Qwen3-4B-Base",
        reward_funcs=accuracy_reward,
        args=OBLRPOConfig(output_dir="qwen3-oblrpo"),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model, reward_funcs, **kwargs: as for [`~trl.GRPOTrainer`]; `model` also takes `builtin:smollm2-135m-instruct`.
        args ([`OBLRPOConfig`], *optional*): configuration; a default one is built when `None`.
        recipe (`str`, *optional*): the YAML recipe the run was configured from, quoted in the model card.
        dataset_id (`str`, *optional*): the Hub dataset trained on, linked from the model card.
        dataset_description (`str`, *optional*): one line saying where the problems come from, for the model card.
    """

    _tag_names = ["trl", "oblr-po"]
    _name = "OBLR-PO"
    _paper = {
        "title": "OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning",
        "id": "2511.23310",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{huang2025oblrpo,
                title        = {{OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning}},
                author       = {Zixun Huang and Jiayi Sheng and Zeyu Zheng},
                year         = 2025,
                eprint       = {arXiv:2511.23310},
            }"""),
    }
    weights_class = CompletionWeights  # where the weights come from (a subclass can observe or replace them)
    rate_tuning = RateRuleTuning()  # the rate rule's constants (the benchmarks' ablations set their own)

    def __init__(self, model, reward_funcs=None, args: OBLRPOConfig | None = None, *trainer_args,
                 recipe: str | None = None, dataset_id: str | None = None, dataset_description: str | None = None,
                 **trainer_kwargs):
        base_model_id = models.model_card_id(model) if isinstance(model, str) else None
        if isinstance(model, str) and model.startswith(models.BUILTIN_PREFIX):  # the ids `oblr-trl train` accepts
            name, model = model[len(models.BUILTIN_PREFIX):], models.resolve_model(model, option="`model`")
        else:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
        if args is None:
            args = OBLRPOConfig(f"{name.rstrip('/').split('/')[-1]}-OBLR-PO")
        elif not isinstance(args, OBLRPOConfig):
            raise TypeError(
                f"OBLRPOTrainer needs an OBLRPOConfig, got {type(args).__name__}. OBLRPOConfig takes every GRPOConfig "
                "argument: replace `GRPOConfig(...)` with `OBLRPOConfig(...)`."
            )
        environment_owned = any(trainer_kwargs.get(key) is not None for key in ("environment_factory", "rollout_func"))
        reward_funcs = checked_reward_funcs(
            reward_funcs, trainer_kwargs.get("train_dataset", (*trainer_args, None)[0]), not environment_owned
        )
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        self._check_supported(args)
        # what the model card cannot read from the model and the data (`oblr-trl train` passes them): the YAML recipe,
        # the base model's Hub id (a built-in model is a local folder), the Hub dataset and where the problems came from
        self.recipe, self.base_model_id = recipe, base_model_id
        self.dataset_id, self.dataset_description = dataset_id, dataset_description

        self._policy_module = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self.completion_weights = self.weights_class(
            args, self._policy_module,
            model=lambda: self.model,
            token_forward=lambda *inputs, **options: self._get_per_token_logps_and_entropies(self.model, *inputs,
                                                                                             **options),
            trainable_parameters=self._trainable_parameters,
            metrics=self._metrics,
            temperature=self.temperature,
            loss_type=self.loss_type,
            generation_hands_logits=not (self.use_vllm or args.use_transformers_continuous_batching or self.tools),
            trl_computes_old_log_probs=self._trl_computes_old_log_probs(),
            sharded=self._is_fsdp2,
            gather=self.accelerator.gather,
            autocast=self.accelerator.autocast,
        )
        self._gathered_rewards_per_func: torch.Tensor | None = None
        self._open_loss_forward: list[torch.Tensor] | None = None  # filled while `_loss_forward` is open
        self._warned_context = False
        self.pooled_slope = PooledSlope(POOLED_SLOPE_DECAY)  # ρ̂ of `pooled_slope`, fitted on earlier batches

        # the rate of every step: f_t of step t comes from the estimates of steps < t (under DeepSpeed the optimizer
        # steps inside the last backward, before step t's gradient norm exists), g_t from the KL earlier steps moved
        self.step_rate = step_rate_rule(args, self.rate_tuning)
        self.snr_recorder = StepNoiseRecorder(
            self._trainable_parameters(), args.snr_estimator, self.num_generations,
            sharded=self._is_fsdp2, gradients_in_grad=not self.is_deepspeed_enabled, seed=args.seed,
        ) if self.step_rate.snr is not None else None
        self.kl_recorder = StepKLRecorder(
            self.completion_weights.token_log_probs, lambda stats: self.accelerator.reduce(stats, reduction="sum"),
            sample_size=None if self._is_vlm else args.lr_trust_region_sample_size,
            gather=self.accelerator.gather, process_index=self.accelerator.process_index, seed=args.seed,
        ) if self.step_rate.measures_kl else None
        self.step_control = OptimizerStepControl(
            self.accelerator, self._metrics["train"], self.step_rate, args.skip_nonfinite_steps,
            lambda: self.state.global_step, None if self.kl_recorder is None else self.kl_recorder.after_step,
        )
        self.records = RunRecords(args, self.accelerator, lambda: self.state, self._run_description,
                                  self.pooled_slope, self.step_rate, self.kl_recorder, self.snr_recorder)
        self.add_callback(_OBLRPOCallback(self))

    def train(self, *args, **kwargs):
        """`GRPOTrainer.train`; raises [`TrainingPreempted`] after a SIGTERM/SIGINT stopped it early and saved a
        checkpoint (`save_on_preemption`), instead of returning as if training had finished."""
        self.records.begin()
        try:
            output = super().train(*args, **kwargs)
        finally:
            self.records.preemption.uninstall()
        self.records.end()
        self.create_model_card()  # the card describes the finished run, whatever the save strategy
        return output

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Optimizer steps refused so far for a non-finite loss, gradient norm or factor."""
        return self.step_control.skipped

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------

    @property
    def _is_fsdp2(self) -> bool:
        return self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2

    def _check_supported(self, args: OBLRPOConfig) -> None:
        fsdp_version = getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) if self.is_fsdp_enabled else None
        check_backend(args, fsdp_version=fsdp_version, deepspeed=self.is_deepspeed_enabled,
                      deepspeed_fp16=self.is_deepspeed_enabled and deepspeed_fp16(self.accelerator, args))
        if args.baseline_weights == "exact" and self._is_vlm:
            raise ValueError(
                "Invalid value for `baseline_weights`: 'exact' is not supported for vision-language models. Allowed "
                "values for them: 'logit', 'length', 'uniform'."
            )

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        self._warned_context |= check_prompt_lengths(prompt_ids, self._context_limit(), self.max_completion_length,
                                                     warn=not self._warned_context)
        return prompt_ids, images, multimodal_fields

    def _context_limit(self) -> int | None:
        if self.use_vllm and self.args.vllm_max_model_length is not None:
            return self.args.vllm_max_model_length
        config = self._policy_module.config.get_text_config()
        return getattr(config, "max_position_embeddings", None)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _trl_computes_old_log_probs(self) -> bool:
        """Whether `GRPOTrainer._generate_and_score_completions` runs its no-grad forward of every generation batch
        (`old_per_token_logps`): generations reused over several optimizer steps, or vLLM's importance sampling."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _run_description(self) -> RunDescription:
        return RunDescription(
            model_source=get_config_model_id(self.model.config) or "",
            base_model_id=self.base_model_id,
            hub_model_id=getattr(self, "hub_model_id", None),  # set by the Trainer once a Hub repository exists
            dataset_id=self.dataset_id,
            dataset_description=self.dataset_description,
            recipe=self.recipe,
            tags=tuple(self._tag_names),
            paper=self._paper,
            num_generations=self.num_generations,
            reward_func_names=tuple(self.reward_func_names),
        )

    # ------------------------------------------------------------------------------------------------------------
    # Advantages (docs/math.md)
    # ------------------------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards_per_func = rewards_per_func  # gathered over processes, group by group
        return rewards_per_func

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = self.completion_weights.generate_capturing_logits(
            lambda: super(OBLRPOTrainer, self)._generate_single_turn(prompt_ids, *args, **kwargs)
        )
        return self._without_empty_completions(completion_ids, logprobs)

    def _without_empty_completions(self, completion_ids, logprobs):
        completion_ids, logprobs, empty = empty_completions_as_eos(completion_ids, logprobs, self.eos_token_ids[0])
        self._metrics["train" if self.model.training else "eval"]["oblr/empty_completions"].append(float(empty))
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        if self.model.training and self.snr_recorder is not None:
            self.snr_recorder.new_generation()
        weights = self.completion_weights
        with weights.generation_batch() as logit_sources:
            output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if mode == "eval" and self.num_generations_eval < 2:
            return output  # no group to take a baseline from; evaluation does not use the advantages
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = aggregate_rewards(
            self._gathered_rewards_per_func, self.reward_weights, num_generations, self.multi_objective_aggregation
        )
        local = self._process_rows(output["completion_ids"].size(0))
        measure = None
        if self.args.baseline_weights == "exact":  # the costly weights: only where they can change an advantage
            matters = rows_whose_weights_matter(rewards, num_generations)
            self._metrics[mode]["oblr/weights/measured_frac"].append(matters.float().mean().item())
            measure = matters[local]
        local_weights = weights.compute(output, logit_sources, mode, measure)
        self._replace_advantages(output, local_weights, rewards, num_generations, local, mode)
        return output

    def _process_rows(self, local: int) -> slice:
        """This process's completions among the gathered ones."""
        return slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)

    def _replace_advantages(
        self, output: dict, local_weights: torch.Tensor, rewards: torch.Tensor, num_generations: int, local: slice,
        mode: str,
    ) -> None:
        """Swap TRL's group-mean advantages for r_i − b_i computed on the gathered rewards and weights."""
        weights = self.accelerator.gather(local_weights.float().contiguous())
        result = gradient_weighted_advantages(
            rewards, weights, num_generations, self.args.leave_one_out, self.scale_rewards,
            estimator=self.args.baseline_estimator, slope=self.pooled_slope.value,
        )
        if self.args.baseline_estimator == "pooled_slope":
            self._metrics[mode]["oblr/baseline_slope"].append(self.pooled_slope.value)
            if mode == "train":  # after this batch's baselines: the slope a baseline uses never saw its group
                self.pooled_slope.update(
                    rewards.view(-1, num_generations), weights.view(-1, num_generations), self.args.leave_one_out
                )
        output["advantages"] = result.advantages[local].to(output["advantages"])

        # TRL logged its own advantages for the completions table; replace them with the ones used.
        for _ in range(min(len(result.advantages), len(self._logs["advantages"]))):
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(result.advantages.tolist())
        for name, value in advantage_summary(result, weights, num_generations).items():
            self._metrics[mode][f"oblr/{name}"].append(value)

    # ------------------------------------------------------------------------------------------------------------
    # SNR-driven learning rate (docs/math.md)
    # ------------------------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        loss_forward = self._open_loss_forward
        if loss_forward is not None and not loss_forward and torch.is_grad_enabled():
            loss_forward.extend(result[:2])
        return result

    @contextlib.contextmanager
    def _loss_forward(self):
        """Yields a list that the block's first grad-enabled `_get_per_token_logps_and_entropies` call, the one TRL's
        `_compute_loss` makes for the micro-batch, fills with its per-token log-probabilities and entropies; emptied
        when the block ends. TRL computes them inside `_compute_loss` and returns only the loss, and running that
        forward again for the per-sample norms and the step KL would double the step's cost."""
        outputs: list[torch.Tensor] = []
        self._open_loss_forward = outputs
        try:
            yield outputs
        finally:
            self._open_loss_forward = None
            outputs.clear()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training and torch.is_grad_enabled()
        recorder = self.snr_recorder if training else None
        per_sample = recorder is not None and self.args.snr_estimator == "per_sample"
        # only a step the rule will measure keeps its micro-batches (and the loss's log-probabilities) for it
        step_kl = training and self.kl_recorder is not None and self.step_control.measures_step_kl
        with self._loss_forward() if per_sample or step_kl else contextlib.nullcontext() as loss_forward:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if per_sample:
                recorder.add_per_sample_sq(self.completion_weights.loss_rows_grad_sq(loss, inputs, *loss_forward))
            if step_kl:  # the policy before the step, as the loss saw it: no extra forward
                self.kl_recorder.keep(inputs, loss_forward[0], loss_mask(inputs))
        if recorder is not None:
            recorder.start_backward(inputs["completion_ids"].size(0))
        if self.model.training and torch.is_grad_enabled():
            self.step_control.note_loss(loss)
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self.snr_recorder is not None:
                self.snr_recorder.end_backward()

    def _clip_grad_norm(self, model):
        if self.snr_recorder is not None:
            self.snr_recorder.read_step_gradients(model.parameters())  # before clipping rescales the gradients
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.snr_recorder is not None and grad_norm is None:
            self.snr_recorder.read_step_gradients(model.parameters())  # max_grad_norm=0: no clipping step
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.step_control.note_grad_norm(grad_norm)
        if self.snr_recorder is not None:
            self.step_control.observe_noise(*self.snr_recorder.finish_step(
                float(grad_norm), lambda stats: self.accelerator.reduce(stats, reduction="sum"),
                self.accelerator.device, self.accelerator.num_processes, loss_scale(self.accelerator.scaler),
                self._metrics["train"],
            ))
        return grad_norm

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.step_control.attach(optimizer)
        return optimizer

    # ------------------------------------------------------------------------------------------------------------
    # What the run leaves on disk (`RunRecords`)
    # ------------------------------------------------------------------------------------------------------------

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """README.md in output_dir: base model, problems, settings and results of this run (`training.model_card`)."""
        if self.is_world_process_zero():
            self.records.write_card(self.args.output_dir, model_name, dataset_name, tags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """`Trainer.save_model`; a save of the user's (not a checkpoint's) also writes the model card and
        `trainer_state.json` beside the model, so that they always describe the model saved."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if not _internal_call and self.args.should_save:
            folder = output_dir or self.args.output_dir
            self.state.save_to_json(str(Path(folder) / "trainer_state.json"))
            self.records.write_card(folder, None, None, None)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "train_runtime" in logs:  # the end-of-training summary: count every segment of a resumed run
            logs = self.records.with_all_segments(logs)
        super().log(logs, *args, **kwargs)

    def _issue_warnings_after_load(self, load_result) -> None:
        # transformers 5 reports a tied parameter (lm_head.weight tied to the embeddings) as missing from a resumed
        # checkpoint: it is never saved, and tying it again restores it. Only the untied ones deserve the warning.
        tied = {name for name, _ in self.model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in self.model.named_parameters()
        }
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        self.records.save(Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.records.load(checkpoint)

