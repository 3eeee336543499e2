"""Benchmark `overhead`: wall time per optimizer step and peak memory of OBLRPOTrainer against TRL's GRPOTrainer.

Every variant trains the same model on the same data and seeds, completions held to `max_completion_length` (EOS held
back), so a difference in time is the trainer's own. Per run, the mean of the timed steps after the warm-up (a cost
paid every k-th step counts in full); per variant, the paired ratio to GRPO in each repeat, its mean with a 95 %
t-interval over repeats. Peak memory: resident set size (CPU) or peak allocated (GPU). Runs in separate processes
change order between repeats (`balanced_orders`), since the first to run is slower on a small machine; between
processes minutes apart the machine's speed drifts by up to ±15 % on 2 shared cores, so ``--interleave`` starts every
variant of a repeat at once, each in a process of its own, and lets them take one optimizer step each in turn
(`LockStep`). Each trainer runs in its process's main thread, as a user's does: torch's CPU kernels called from a
second thread of a process wake their OpenMP team slowly (on 2 cores a read of Adam's state took 0.24-0.30 s from a
second thread against 0.11-0.13 s from the main one), which made every read a step pays look dearer than it is.

Generation is timed inside every step (TRL's `_generate_single_turn`), so each step splits into generation and the
**trainer's own part** (step minus generation): what a vLLM user pays, since vLLM makes generation cheap. OBLR-PO's
phases (`PHASES`) are timed inside the same steps.

    python -m benchmarks.overhead                       # quickstart size on CPU
    python -m benchmarks.overhead --interleave --variants grpo oblrpo oblrpo-no-trust --name overhead_interleaved
    python -m benchmarks.overhead --preset gpu --name overhead_gpu   # one GPU, nothing from the Hub (below)
    python -m benchmarks.overhead --preset gpu-lora --name overhead_gpu_lora   # the same under LoRA (rank 32)
    python -m benchmarks.overhead --preset cpu-lora --variants grpo exact --name overhead_cpu_lora   # CPU, LoRA

The `gpu` preset needs nothing from the Hub: a random model of SmolLM2-1.7B's shape (`random_model.py`), full
fine-tuning in bf16 with gradient checkpointing, 8 prompts × 8 completions of 64 tokens a step, and a reward that
varies per completion (`text_hash_parity_reward`), so every group carries a signal for every variant alike.

Each run's result is appended to ``<name>_runs.jsonl`` as it finishes: ``--resume`` runs only the missing ones (a lent
GPU's time limit), ``--recorded_only`` reports the repeats whose runs all finished. The cost under FSDP2 is settled:
its page, ``results/overhead/overhead_fsdp2_cpu.md``, names the commit that runs it (bf5d8f0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks import random_model
from benchmarks.common import (
    RESULTS,
    build_trainer,
    markdown_table,
    new_figure,
    parse_overrides,
    run_in_subprocesses,
    save_figure,
    t_interval,
    text_hash_parity_reward,
    write_results,
)

VARIANTS = {
    "grpo": None,  # TRL's GRPOTrainer with GRPOConfig defaults
    # OBLR-PO defaults: logit weights + SNR learning rate + the trust region (peak form per unit of Adam's update, its KL
    # forward every 16th step with a gradient after gaps of 1, 2, 4, 8)
    "oblrpo": {},
    "oblrpo-no-trust": {"lr_trust_region_kl": None},  # the defaults before 2026-11-26
    "oblrpo-no-snr": {"use_snr_lr": False},
    "exact": {"baseline_weights": "exact"},
    # the defaults without the trust region's rule, measuring each step's KL (one no-grad forward a step)
    "oblrpo-step-kl": {"lr_trust_region_kl": None, "log_step_kl": True},
    # the step's KL measured on every step: what one measurement costs, in every window
    "oblrpo-every-step": {"lr_trust_region_measure_steps": 1},
}
# OBLR-PO's own phases, timed inside each step (seconds a step): Adam's update size, which the trust region reads
# after every step; its measuring forward, on the steps it measures; the weights; the SNR estimator's sketch of the
# step's gradients (a read of every gradient, at memory bandwidth on a CPU)
PHASES = {"update_size": ("oblr_trl.training.step_control", "OptimizerStepControl", "_update_mean_square"),
          "step_kl": ("oblr_trl.training.step_kl", "StepKLRecorder", "after_step"),
          "weights": ("oblr_trl.training.completion_weights", "CompletionWeights", "compute"),
          "snr_sketch": ("oblr_trl.training.step_noise", "StepNoiseRecorder", "read_step_gradients")}
RECIPE_LORA = {"r": 32, "lora_alpha": 64, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}  # the recipes'
PRESETS = {
    "cpu": {
        "model": "builtin:smollm2-135m-instruct",
        "config": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8,
                       learning_rate=3e-5, gradient_checkpointing=False, bf16=False, use_cpu=True),
        "peft": None,
    },
    "gpu": {
        "model": "random:smollm2-1.7b",
        "config": dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=8,
                       learning_rate=1e-5, gradient_checkpointing=True, bf16=True),
        "peft": None,
        "reward": "text_hash_parity_reward",
        "max_completion_length": 64,
    },
}
# the gpu preset under LoRA: what most users with one GPU train, and where the exact weights' per-completion norms
# cover the adapters' parameters only
PRESETS["gpu-lora"] = {**PRESETS["gpu"], "peft": RECIPE_LORA}
PRESETS["cpu-lora"] = {**PRESETS["cpu"], "peft": RECIPE_LORA}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default=None, help="override the preset's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the preset's config (YAML value), e.g. --set use_vllm=false")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=8,
                        help="repeats of every variant, the order balanced over them")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    parser.add_argument("--warmup_steps", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--max_completion_length", type=int, default=None,
                        help="completion length (fixed); default: the preset's (24 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="overhead", help="results file name")
    parser.add_argument("--output_dir", default=str(RESULTS / "overhead"))
    parser.add_argument("--resume", action="store_true",
                        help="reuse the runs already recorded in <output_dir>/<name>_runs.jsonl; run only the others")
    parser.add_argument("--recorded_only", action="store_true",
                        help="start no run: report the repeats whose runs are all recorded in <name>_runs.jsonl (a "
                             "benchmark the time limit stopped; implies --resume)")
    parser.add_argument("--interleave", action="store_true",
                        help="train every variant of a repeat at once, each in a process of its own, one optimizer "
                             "step each in turn (each round in the next balanced order), so that the machine's drift "
                             "between runs cancels from the paired ratios")
    return parser.parse_args(argv)


class PeakMemory:
    """Peak resident memory of this process while active (sampled), or peak CUDA allocation."""

    def __init__(self):
        import psutil
        import torch

        self.cuda = torch.cuda.is_available()
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.process.memory_info().rss)


def synchronize() -> None:
    """Wait for the GPU's queued kernels (nothing on a CPU), so that a timer counts them where they ran."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Seconds spent in one method of a class, synchronised with the GPU: a phase of OBLR-PO's step, or TRL's
    generation (`GRPOTrainer._generate_single_turn`, the same method for every variant)."""

    def __init__(self, module: str, owner: str, method: str):
        import importlib

        cls = getattr(importlib.import_module(module), owner)
        original, self.seconds = getattr(cls, method), 0.0

        def timed(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                synchronize()
                self.seconds += time.perf_counter() - start

        setattr(cls, method, timed)  # this process trains one variant, then exits


class LockStep:
    """Lets trainers, each in a process of its own, take one optimizer step each in turn, each round in the next order
    of `balanced_orders`, so a drift of the machine's speed reaches every variant alike and none keeps one place or
    predecessor. A trainer that finished (or failed) leaves the rounds. Built before the processes start, which take
    its condition and shared state with them."""

    def __init__(self, names: list[str], context=None):
        context = context or multiprocessing.get_context("spawn")
        self.names = list(names)
        self.orders = balanced_orders(len(self.names))
        self.condition = context.Condition()
        # the round, the place in its order, then a flag for each trainer that left
        self._state = context.Array("q", 2 + len(self.names), lock=False)

    def _finished(self, name: str) -> bool:
        return bool(self._state[2 + self.names.index(name)])

    def _current(self) -> str:
        return self.names[self.orders[self._state[0] % len(self.orders)][self._state[1]]]

    def _advance(self) -> None:
        while not all(self._finished(name) for name in self.names):
            self._state[1] += 1
            if self._state[1] == len(self.names):
                self._state[0], self._state[1] = self._state[0] + 1, 0
            if not self._finished(self._current()):
                return

    def wait_turn(self, name: str) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self._current() == name)

    def pass_turn(self, name: str) -> None:
        with self.condition:
            if self._current() == name:
                self._advance()
            self.condition.notify_all()

    def leave(self, name: str) -> None:
        with self.condition:
            self._state[2 + self.names.index(name)] = 1
        self.pass_turn(name)


def run_child(spec: dict) -> dict | list[dict]:
    """One training run of one variant, or (``interleave``) of each of ``variants`` in lock step, each in a process
    of its own; returns per-step times and peak memory (per variant when interleaved)."""
    if not spec.get("interleave"):
        return train_variant(spec, spec["variant"])
    variants = spec["variant"].split("+")
    # two colocated vLLM engines on one machine, where vLLM's CPU build sizes each one's KV cache from the memory as if
    # it were alone: a fixed 1 GiB each (16 completions of 256 tokens need 0.2 GiB)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    context = multiprocessing.get_context("spawn")
    lock_step = LockStep(variants, context)
    receivers, processes = {}, {}
    for variant in variants:
        receivers[variant], sender = context.Pipe(duplex=False)
        processes[variant] = context.Process(target=train_in_turn, args=(spec, variant, lock_step, sender),
                                             name=f"overhead-{variant}")
        processes[variant].start()
        sender.close()
    outcomes = {}  # a result, or why there is none
    while len(outcomes) < len(variants):
        waiting = {receiver: variant for variant, receiver in receivers.items() if variant not in outcomes}
        for ready in multiprocessing.connection.wait(list(waiting)):
            variant = waiting[ready]
            try:
                outcomes[variant] = ready.recv()
            except EOFError:  # its process died unsent (a crash in C), skipping its own leave
                processes[variant].join()
                outcomes[variant] = f"its process exited with code {processes[variant].exitcode} and no result"
                lock_step.leave(variant)
    for process in processes.values():
        process.join()
    failures = [f"{variant}: {outcome}" for variant, outcome in outcomes.items() if isinstance(outcome, str)]
    if failures:
        raise RuntimeError("interleaved runs failed:\n" + "\n".join(failures))
    return [{**outcomes[variant], "position": position} for position, variant in enumerate(variants)]


def train_variant(spec: dict, variant: str, lock_step: LockStep | None = None) -> dict:
    """Train ``variant`` in this process's main thread (in turn with others under ``lock_step``) and time it."""
    from oblr_trl.training.vllm_colocate import close_colocated_vllm

    generation = PhaseTimer("trl", "GRPOTrainer", "_generate_single_turn")
    phases = {name: PhaseTimer(*where) for name, where in PHASES.items()}
    if lock_step is None:
        trainer, times = timed_trainer(spec, variant, generation, phases)
    else:
        with lock_step.condition:  # one at a time: each picks a free port for its process group while the other waits
            trainer, times = timed_trainer(spec, variant, generation, phases, lock_step)
    with PeakMemory() as memory:
        trainer.train()
    close_colocated_vllm(trainer)  # while the process group exists: its teardown at exit prints a traceback
    return run_result(spec, variant, trainer, times, memory.peak)


def train_in_turn(spec: dict, variant: str, lock_step: LockStep, sender) -> None:
    """`train_variant` in a process of an interleaved repeat: its result, or the traceback of its failure, goes to
    ``sender``; it leaves the rounds either way, so the others go on."""
    import traceback

    try:
        outcome = train_variant(spec, variant, lock_step)
    except BaseException:
        outcome = traceback.format_exc()
    finally:
        lock_step.leave(variant)
    sender.send(outcome)
    sender.close()


def timed_trainer(spec: dict, variant: str, generation: PhaseTimer, phases: dict[str, PhaseTimer],
                  lock_step: LockStep | None = None):
    """The variant's trainer for ``spec``, with a callback that times each optimizer step, the generation in it and
    OBLR-PO's phases (and, under ``lock_step``, a step that waits for its turn and passes it on at its end); returns
    the trainer and the dict its times go to."""
    from transformers import TrainerCallback

    from oblr_trl.tasks import TaskOptions, load_task

    preset = PRESETS[spec["preset"]]
    config = {**preset["config"], **spec["overrides"]}
    task = load_task("arithmetic", "train", TaskOptions(num_problems=200, seed=spec["seed"]))
    length = spec["max_completion_length"]
    reward = {"text_hash_parity_reward": text_hash_parity_reward}.get(preset.get("reward"))
    min_tokens = "min_tokens" if config.get("use_vllm") else "min_new_tokens"  # vLLM's name / transformers'
    output_dir = spec["output_dir"] if not spec.get("interleave") else str(Path(spec["output_dir"]) / variant)
    common = dict(
        output_dir=output_dir, max_steps=spec["warmup_steps"] + spec["steps"], max_completion_length=length,
        generation_kwargs={min_tokens: length}, logging_steps=1, save_strategy="no", report_to=[],
        seed=spec["seed"], **config,
    )
    times = {"step": [], "generation": [], "span": [], **{name: [] for name in phases}}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.start, self.generated = time.perf_counter(), generation.seconds
            self.phases = {name: timer.seconds for name, timer in phases.items()}

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            end = time.perf_counter()
            times["step"].append(end - self.start)
            times["span"].append([self.start, end])
            times["generation"].append(generation.seconds - self.generated)
            for name, timer in phases.items():
                times[name].append(timer.seconds - self.phases[name])
            if lock_step is not None:
                lock_step.pass_turn(variant)

    trainer = build_trainer(spec["model"], VARIANTS[variant], common, preset["peft"], task,
                            callbacks=[StepTimer()], reward_funcs=reward)
    if lock_step is not None:
        # the turn is taken where the Trainer fetches a step's batches, before it sets the gradient-sync flag of
        # accelerate's GradientState, which is one object for every trainer of the process
        fetch = trainer.get_batch_samples

        def get_batch_samples_in_turn(*args, **kwargs):
            lock_step.wait_turn(variant)
            return fetch(*args, **kwargs)

        trainer.get_batch_samples = get_batch_samples_in_turn
    return trainer, times


def run_result(spec: dict, variant: str, trainer, times: dict[str, list[float]], peak_memory: int | None) -> dict:
    warmup = spec["warmup_steps"]
    timed, generating = times["step"][warmup:], times["generation"][warmup:]
    trainer_part = [step - gen for step, gen in zip(timed, generating, strict=True)]
    # the share of completions whose exact weights were measured (groups with reward spread), over the timed steps
    measured = [log["oblr/weights/measured_frac"] for log in trainer.state.log_history
                if "oblr/weights/measured_frac" in log][warmup:]
    return {"weights_measured_frac": statistics.fmean(measured) if measured else None,
            **step_kl_cadence(trainer, times["step_kl"]),
            "variant": variant, "repeat": spec["repeat"], "position": spec["position"],
            "num_generations": trainer.args.num_generations, "processes": trainer.accelerator.num_processes,
            # what the optimizer trains (the adapters alone under a preset's LoRA), of the model's parameters
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "distributed_type": str(trainer.accelerator.distributed_type), "step_seconds": timed,
            # where it trained: a process of its own (interleaved or not), in that process's main thread
            "process_id": os.getpid(), "main_thread": threading.current_thread() is threading.main_thread(),
            "step_spans": times["span"][warmup:],  # (start, end) of each timed step on this process's clock
            "generation_seconds": generating, "median_step_seconds": statistics.median(timed),
            "median_generation_seconds": statistics.median(generating),
            "median_trainer_seconds": statistics.median(trainer_part), "peak_memory_bytes": peak_memory,
            "mean_step_seconds": statistics.fmean(timed), "mean_generation_seconds": statistics.fmean(generating),
            "mean_trainer_seconds": statistics.fmean(trainer_part),
            # per timed step: each phase's seconds, and whether the step's KL was measured
            "phase_seconds": {name: times[name][warmup:] for name in PHASES},
            "kl_measured": [("oblr/step_kl" in log) for log in trainer.state.log_history if "grad_norm" in log][warmup:],
            **{f"{statistic}_{name}_seconds": function(times[name][warmup:])
               for name in PHASES
               for statistic, function in (("median", statistics.median), ("mean", statistics.fmean))}}


def step_kl_cadence(trainer, step_kl_seconds: list[float]) -> dict:
    """How often one run measured the step's KL and what one measurement cost.

    The forward runs on the first step with a gradient, then on the rule's cadence over steps with a gradient
    (`StepRateRule._kl_due`). Recorded: the measurements over the whole run, warm-up included, their seconds per
    measurement (None without one), the share of the run's steps with a gradient (``grad_norm`` > 0), and k."""
    steps = [log for log in trainer.state.log_history if "grad_norm" in log]
    measurements = sum("oblr/step_kl" in log for log in steps)
    rule = getattr(trainer, "step_rate", None)  # GRPOTrainer has none
    measures = rule is not None and rule.measures_kl
    return {"step_kl_measure_every": rule.measure_every if measures else None, "step_kl_measurements": measurements,
            "step_kl_seconds_per_measurement": sum(step_kl_seconds) / measurements if measurements else None,
            "gradient_step_frac": statistics.fmean(log["grad_norm"] > 0 for log in steps) if steps else None}


def unmeasured_trainer_ratio(run: dict, reference: dict) -> float | None:
    """``run``'s mean trainer part over its timed steps that measured no KL ÷ ``reference``'s over the same steps (the
    same step numbers, taken in turn when interleaved): what a step that measures nothing costs; None where the run
    does not record which steps measured, or measured every one."""
    flags = run.get("kl_measured")
    if not flags or len(flags) != len(run["step_seconds"]):
        return None
    quiet = [index for index, measured in enumerate(flags) if not measured]
    if not quiet:
        return None

    def trainer_part(result: dict) -> float:
        return statistics.fmean(result["step_seconds"][i] - result["generation_seconds"][i] for i in quiet)

    return trainer_part(run) / trainer_part(reference)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` items, the first the identity, to be taken in turn (cyclically): a Williams design. Over all of
    them every item holds every place equally often and, for ``n`` ≥ 3, follows every other item inside an order
    equally often; taken in turn, no item comes twice in a row across two orders. For two items: A B, B A. (A plain
    reversal keeps the same variants at the ends, where a step runs at another speed than in the middle.)

    Rows of the cyclic Latin square built on 0, 1, n−1, 2, n−2, …, with their reverses for an odd ``n``; relabelled
    so that the first is the identity, and put in an order whose junctions repeat no item."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(item + shift) % n for item in first] for shift in range(n)]
    if n % 2 and n > 1:
        rows += [row[::-1] for row in rows]
    place = {item: index for index, item in enumerate(first)}
    rows = [[place[item] for item in row] for row in rows]

    def chain(done: list[list[int]], left: list[list[int]]) -> list[list[int]] | None:
        """``done`` extended by every row of ``left``, no junction repeating an item (nor the last row's end and the
        first row's start)."""
        if not left:
            return done if n < 3 or done[-1][-1] != done[0][0] else None
        for index, row in enumerate(left):
            if n < 3 or row[0] != done[-1][-1]:
                found = chain(done + [row], left[:index] + left[index + 1:])
                if found:
                    return found
        return None

    return chain([rows[0]], rows[1:])


def balanced_order(variants: list[str], repeat: int) -> list[str]:
    """The variants in the ``repeat``-th order of `balanced_orders`: over as many repeats as there are orders every
    variant runs in every place equally often (A B, B A, A B, … for two)."""
    orders = balanced_orders(len(variants))
    return [variants[index] for index in orders[repeat % len(orders)]]


def by_repeat(runs: list[dict], variants: list[str]) -> dict[str, list[dict]]:
    return {v: sorted((r for r in runs if r["variant"] == v), key=lambda r: r["repeat"]) for v in variants}


def summarise(runs: list[dict], variants: list[str]) -> list[dict]:
    """One row per variant: its times and peak memory, paired with GRPO's repeat by repeat."""
    by_variant = by_repeat(runs, variants)
    reference = by_variant.get("grpo")
    rows = []
    for variant, results in by_variant.items():
        medians = [r["mean_step_seconds"] for r in results]  # the median over runs of each run's mean step
        memory = [r["peak_memory_bytes"] for r in results]
        measured = [r["weights_measured_frac"] for r in results if r.get("weights_measured_frac") is not None]
        row = {"variant": variant, "median_step_seconds": statistics.median(medians), "min": min(medians),
               "weights_measured_frac": statistics.fmean(measured) if measured else None,
               "max": max(medians), "peak_memory_mib": statistics.median(memory) / 2**20 if memory else None,
               "median_generation_seconds": statistics.median(r["mean_generation_seconds"] for r in results),
               "median_trainer_seconds": statistics.median(r["mean_trainer_seconds"] for r in results),
               # a phase added after some runs were recorded (--resume): reported only where every run timed it
               **{f"median_{name}_seconds": statistics.median(r[f"mean_{name}_seconds"] for r in results)
                  for name in PHASES if all(f"mean_{name}_seconds" in r for r in results)}}
        if reference:
            def paired(key):
                return [r[key] / g[key] for r, g in zip(results, reference, strict=True)]

            time_ratios = paired("mean_step_seconds")
            trainer_ratios, generation_ratios = paired("mean_trainer_seconds"), paired("mean_generation_seconds")
            if memory:
                memory_ratios = paired("peak_memory_bytes")
                row |= {"memory_ratio": statistics.median(memory_ratios), "memory_ratio_min": min(memory_ratios),
                        "memory_ratio_max": max(memory_ratios)}
            row |= {"time_ratio": statistics.median(time_ratios), "time_ratio_min": min(time_ratios),
                    "time_ratio_max": max(time_ratios), "time_ratio_mean": statistics.fmean(time_ratios),
                    "time_ratio_ci": t_interval(time_ratios),
                    "trainer_ratio_mean": statistics.fmean(trainer_ratios), "trainer_ratio_ci": t_interval(trainer_ratios),
                    "trainer_ratio_min": min(trainer_ratios), "trainer_ratio_max": max(trainer_ratios),
                    "generation_ratio_mean": statistics.fmean(generation_ratios)}
            quiet = [ratio for r, g in zip(results, reference, strict=True)
                     if (ratio := unmeasured_trainer_ratio(r, g)) is not None]
            if quiet:
                row |= {"unmeasured_trainer_ratio_mean": statistics.fmean(quiet),
                        "unmeasured_trainer_ratio_ci": t_interval(quiet)}
        rows.append(row)
    return rows


def plot(rows, output_dir, name):
    figure, axes = new_figure(3, (18, 4.5))
    labels = [r["variant"] for r in rows]
    panels = ((axes[0], "time_ratio_mean", "time_ratio_ci", "whole optimizer step",
               "÷ GRPOTrainer (paired mean, 95 % interval)", 1.02),
              (axes[1], "trainer_ratio_mean", "trainer_ratio_ci", "trainer's own part (step minus generation)",
               "÷ GRPOTrainer (paired mean, 95 % interval)", 1.05),
              (axes[2], "memory_ratio", None, "peak memory", "÷ GRPOTrainer (median, min–max over repeats)", 1.01))
    for axis, key, interval, title, label, bar in panels:
        values = [r.get(key, float("nan")) for r in rows]
        ends = [r.get(interval, [v, v]) if interval else [r.get("memory_ratio_min", v), r.get("memory_ratio_max", v)]
                for v, r in zip(values, rows)]
        errors = [[max(0.0, v - low) for v, (low, _) in zip(values, ends)],
                  [max(0.0, high - v) for v, (_, high) in zip(values, ends)]]
        axis.bar(labels, values, yerr=errors, capsize=4)
        axis.axhline(1.0, color="black", lw=0.8)
        axis.axhline(bar, color="red", lw=0.8, ls="--", label=f"{bar:g}× bar (default mode)")
        axis.set_ylabel(label)
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=30)
        axis.legend()
    return save_figure(figure, output_dir, name)


def run_key(spec: dict) -> str:
    """What makes two runs the same measurement (the folder a run writes to aside)."""
    return json.dumps({k: v for k, v in spec.items() if k != "output_dir"}, sort_keys=True)


def append_run(path: Path, spec: dict, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(json.dumps({"key": run_key(spec), "result": result}) + "\n")


def recorded_runs(path: Path, specs: list[dict]) -> dict[str, dict]:
    """The results recorded in ``path`` for any of ``specs``, by `run_key`."""
    wanted = {run_key(spec) for spec in specs}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["key"]: r["result"] for r in records if r["key"] in wanted}


def complete_repeats(specs: list[dict], done: dict[str, dict]) -> int:
    """How many repeats, counted from the first, have every run recorded in ``done``."""
    repeats = 0
    while any(spec["repeat"] == repeats for spec in specs) and all(
            run_key(spec) in done for spec in specs if spec["repeat"] == repeats):
        repeats += 1
    return repeats


def interval(row: dict, key: str) -> str:
    return "[{:.3f}, {:.3f}]".format(*row.get(key, [float("nan")] * 2))


def main(argv=None):
    args = parse_args(argv)
    overrides = parse_overrides(args.overrides)
    output_dir = Path(args.output_dir)
    preset = PRESETS[args.preset]
    model = random_model.resolve(args.model or preset["model"], output_dir, build=not args.recorded_only)
    length = args.max_completion_length or preset.get("max_completion_length", 24)
    specs = [
        {"preset": args.preset, "model": model, "overrides": overrides, "variant": variant, "repeat": repeat,
         "position": position, "seed": args.seed + repeat,
         "steps": args.steps, "warmup_steps": args.warmup_steps, "max_completion_length": length,
         "output_dir": str(output_dir / "runs" / f"{variant}-{repeat}")}
        for repeat in range(args.repeats)
        for position, variant in enumerate(balanced_order(args.variants, repeat))
    ]
    if args.interleave:  # one run a repeat, its variants named together in the order of their first round
        specs = [{**spec, "variant": "+".join(balanced_order(args.variants, repeat)), "position": 0,
                  "interleave": True, "output_dir": str(output_dir / "runs" / f"interleaved-{repeat}")}
                 for repeat, spec in enumerate(spec for spec in specs if spec["position"] == 0)]
    runs_log = output_dir / f"{args.name}_runs.jsonl"
    done = recorded_runs(runs_log, specs) if args.resume or args.recorded_only else {}
    if args.recorded_only:
        args.repeats = complete_repeats(specs, done)
        if not args.repeats:
            raise SystemExit(f"{runs_log}: no repeat has all of its runs recorded")
        specs = [spec for spec in specs if spec["repeat"] < args.repeats]
    elif not args.resume:
        runs_log.unlink(missing_ok=True)
    todo = [spec for spec in specs if run_key(spec) not in done]
    fresh = run_in_subprocesses(__spec__.name, todo, "overhead runs",
                                on_result=lambda spec, result: append_run(runs_log, spec, result))
    done |= {run_key(spec): result for spec, result in zip(todo, fresh, strict=True)}
    runs = [run for spec in specs for run in (done[run_key(spec)] if args.interleave else [done[run_key(spec)]])]
    rows = summarise(runs, args.variants)
    figure = plot(rows, output_dir, args.name)
    config = {**preset["config"], **overrides}
    markdown = (
        f"# Overhead against GRPOTrainer ({args.preset} preset)\n\n![overhead]({figure.name})\n\n"
        f"Model `{args.model or preset['model']}`, {config['num_generations']} completions per prompt, "
        f"{config['per_device_train_batch_size']} × {config['gradient_accumulation_steps']} "
        f"completions per step, completions fixed at {length} tokens; {args.repeats} repeats "
        f"(orders balanced over repeats, the first {' '.join(balanced_order(args.variants, 0))}) × {args.steps} "
        f"timed steps (after {args.warmup_steps} warm-up; per run their mean)"
        + ("; interleaved: in each repeat the variants train at once, each in a process of its own (its main "
           "thread), and take one optimizer step each in turn, each round in the next balanced order (every variant "
           "in every place and after every other alike)" if args.interleave else "")
        + (f"; preset overrides `{overrides}`" if overrides else "") + ".\n\n"
        + "The trainer's own part is the step minus the time in TRL's generation (what a vLLM user pays). Ratios "
          "are measured: per repeat the mean over its timed steps paired with GRPO's, their mean over repeats with a "
          "95 % t-interval. 'Steps measuring nothing' pairs the trainer part of the steps whose KL the trust region "
          "did not measure with GRPO's same steps. Adam's update size, the step-KL forward, the weights and the SNR "
          "estimator's gradient sketch are OBLR-PO's own phases inside the trainer part (median seconds a step, "
          "timed in the same runs). `exact` weights are measured only for groups whose rewards "
          "differ: the share measured is given.\n\n"
        + markdown_table(
            ["variant", "s / step (median)", "min", "max", "÷ GRPO step (paired mean)", "95 % interval",
             "generation s (median)", "trainer part s (median)", "÷ GRPO trainer part (paired mean)", "95 % interval",
             "÷ GRPO trainer part, steps measuring nothing", "÷ GRPO generation", "Adam update size s",
             "step-KL forward s", "weights s", "SNR sketch s",
             "exact weights measured", "peak MiB", "÷ GRPO memory", "memory ratio min–max"],
            [[r["variant"], r["median_step_seconds"], r["min"], r["max"], r.get("time_ratio_mean", "—"),
              interval(r, "time_ratio_ci"), r["median_generation_seconds"], r["median_trainer_seconds"],
              r.get("trainer_ratio_mean", "—"), interval(r, "trainer_ratio_ci"),
              "—" if "unmeasured_trainer_ratio_mean" not in r else
              f"{r['unmeasured_trainer_ratio_mean']:.3f} {interval(r, 'unmeasured_trainer_ratio_ci')}",
              r.get("generation_ratio_mean", "—"), r.get("median_update_size_seconds", "—"),
              r.get("median_step_kl_seconds", "—"), r["median_weights_seconds"], r.get("median_snr_sketch_seconds", "—"),
              "—" if r["weights_measured_frac"] is None else f"{r['weights_measured_frac']:.0%}",
              "—" if r["peak_memory_mib"] is None else r["peak_memory_mib"], r.get("memory_ratio", "—"),
              f"{r['memory_ratio_min']:.3f}–{r['memory_ratio_max']:.3f}" if "memory_ratio_min" in r else "—"]
             for r in rows],
        )
    )
    write_results(output_dir, args.name, {"arguments": vars(args), "summary": rows, "runs": runs}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
