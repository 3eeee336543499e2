"""One training run for the multi-process equivalence test: `torchrun --nproc_per_node W multiprocess_worker.py ...`.

Completions are a deterministic function of (prompt, position in its group, generation round), and TRL's shuffle of
the generation batch is turned off, so a 1-process and a 2-process run see the same completions and the same
micro-batches; only the process layout differs. A case is what it changes from what ships: config fields and the rate
rule's constants, mixed (`with_rate_tuning` sorts them), over the run's fixed size (`RUN`). Rank 0 writes what the
trainer computed to a JSON file.

A case with `fsdp2` shards the policy with FSDP2 through accelerate's own `fsdp2_prepare_model` (transformer layers,
then the root, as `recipes/accelerate_configs/fsdp.yaml` asks). accelerate sets FSDP up only for GPU-like devices and
falls back to DDP on a CPU; `allow_fsdp_on_cpu` lifts that one refusal, so everything after it (wrapping, gradient
accumulation without sync, clipping of DTensor gradients, the optimizer on shards) is accelerate's and torch's real
FSDP2 path over gloo.
"""

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

torch.set_num_threads(1)

import trl.trainer.grpo_trainer as grpo_trainer  # noqa: E402
from datasets import Dataset  # noqa: E402

from oblr_trl import OBLRPOConfig, OBLRPOTrainer  # noqa: E402
from oblr_trl.testing import allow_fsdp_on_cpu, tiny_causal_lm, tiny_tokenizer, with_rate_tuning  # noqa: E402
from oblr_trl.training.guards import end_distributed_training  # noqa: E402

grpo_trainer.shuffle_sequence_dict = lambda batch: batch  # micro-batches follow the order of the generation batch


def parameter_summary(model) -> list[list[float]]:
    """Per trainable parameter: sum and sum of squares of the whole (gathered) tensor, on every rank."""
    summary = []
    for param in model.parameters():
        if param.requires_grad:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            summary.append([full.double().sum().item(), full.double().square().sum().item()])
    return summary


class DeterministicTrainer(OBLRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation_round = 0
        self.gathered = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        offset = self.accelerator.process_index * len(prompt_ids)
        completions = []
        for i, prompt in enumerate(prompt_ids):
            position = (offset + i) % num_generations
            rng = random.Random(f"{prompt}-{position}-{self.generation_round}")
            length = rng.randint(1, self.max_completion_length)
            completions.append([rng.randint(8, 100) for _ in range(length)])
        self.generation_round += 1
        return completions, None

    def _replace_advantages(self, output, local_weights, *args):
        super()._replace_advantages(output, local_weights, *args)
        gather = self.accelerator.gather
        self.gathered.append(
            {
                "weights": gather(local_weights.float().contiguous()).tolist(),
                "advantages": gather(output["advantages"].contiguous()).tolist(),
            }
        )


# What every case shares: the run's size (4 steps of completions of at most 6 tokens; the launch sets the
# micro-batches), a rate at which the tiny model moves, and what the comparison holds still (no shuffling, fp32, CPU,
# no gradient checkpointing unless a case asks). Everything else, OBLRPOConfig's fields and the rate rule's constants
# alike, is what ships unless a case says otherwise.
RUN = dict(max_completion_length=6, max_steps=4, learning_rate=1e-2, logging_steps=1, report_to=[],
           save_strategy="no", bf16=False, use_cpu=True, gradient_checkpointing=False, shuffle_dataset=False, seed=0)
WORKER_KEYS = ("fsdp2", "reward", "tie_word_embeddings", "sketch_first_shard_only")  # how the run is built, not config
LOGGED = ("snr/grad_sq_norm", "snr/trace_cov", "snr/bound_factor", "snr/resolved", "snr/reference_factor",
          "snr/lr_factor", "oblr/lr", "grad_norm", "loss", "snr/full_batch_grad_sq_norm",
          "snr/small_batch_grad_sq_norm", "oblr/step_kl", "oblr/trust_region_factor")


def reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


def reward_alike_for_even_b(prompts, completions, **kwargs):
    """`reward`, except that every completion of a prompt "a*b=" with b even scores 0.5: groups without reward spread,
    whose `exact` weights are not measured (with 4 completions a prompt, one process holds such a group, the other
    not)."""
    return [0.5 if int(p[2]) % 2 == 0 else r for p, r in zip(prompts, reward(completions), strict=True)]


def run_case(case: dict, output_dir: str) -> dict:
    """One training run with the options of ``case`` (config fields and rate-rule constants, mixed, over `RUN` and
    what ships); what rank 0 reports of it."""
    fsdp = {}
    if case.get("fsdp2"):
        fsdp = {"fsdp": "full_shard", "fsdp_config": {
            "version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True}}
    tokenizer = tiny_tokenizer()
    trainer_cls, fields = with_rate_tuning(
        DeterministicTrainer, {key: value for key, value in case.items() if key not in WORKER_KEYS})
    config = OBLRPOConfig(output_dir=output_dir, **{**RUN, **fields}, **fsdp)
    trainer = trainer_cls(
        model=tiny_causal_lm(tokenizer, tie_word_embeddings=case.get("tie_word_embeddings", False)),
        reward_funcs={"digits": reward, "alike_for_even_b": reward_alike_for_even_b}[case.get("reward", "digits")],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"{a}*{b}=" for a in range(6) for b in range(6)]}),
        processing_class=tokenizer,
    )
    trainer.train()
    parameters = parameter_summary(trainer.model_wrapped)
    steps = [{k: h.get(k) for k in LOGGED} for h in trainer.state.log_history if "loss" in h]
    return {"processes": trainer.accelerator.num_processes, "batches": trainer.gathered, "steps": steps,
            "distributed_type": str(trainer.accelerator.distributed_type), "parameters": parameters,
            "is_main_process": trainer.accelerator.is_main_process}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of cases: each a dict of the run's options")
    args = parser.parse_args()
    cases = json.loads(args.cases)
    if any(case.get("sketch_first_shard_only") for case in cases):  # the negative test: the sum over shards dropped
        import oblr_trl.training.step_noise as step_noise

        sketch_all = step_noise.sketch_step_gradients
        step_noise.sketch_step_gradients = lambda params, sketch, sharded: (
            sketch_all(params, sketch, sharded) if int(os.environ["RANK"]) == 0 else None
        )
    if any(case.get("fsdp2") for case in cases):
        allow_fsdp_on_cpu()
    # several cases in one launch: the interpreter, torch and the process group start once
    results = [run_case(case, os.path.join(os.path.dirname(args.output), str(index)))
               for index, case in enumerate(cases)]
    if results[0].pop("is_main_process"):
        for result in results[1:]:
            result.pop("is_main_process")
        with open(args.output, "w") as f:
            json.dump(results, f)
    end_distributed_training()  # the trainers of the cases are unreferenced: collected before the group goes


if __name__ == "__main__":
    sys.exit(main())
