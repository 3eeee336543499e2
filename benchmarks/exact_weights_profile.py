"""Benchmark `exact_weights_profile`: where the exact weights' time goes, beside the training pass of the same rows.

`baseline_weights="exact"` measures every completion's ‖∇ log p‖² with one forward and one backward of its own per
chunk of rows (ghost norms, `estimators.ghost_norms`). On the same model and the same rows (random tokens, prompt and
completion of fixed lengths) this times, each synchronised, as the median of ``--repeats`` after a warm-up:

* the **training pass**: the loss's forward and backward to the parameters for these rows, as a GRPO step runs it
  (logits of the completion positions, log-softmax, gradients into ``.grad``; with gradient checkpointing if asked);
* the **no-grad forward** of the same rows (what the trust region's measurement or an old-log-probability pass costs);
* the **ghost-norm pass** (`log_likelihood_grad_sq_norms`, chunks of ``--chunk`` rows, gradient checkpointing off as
  the trainer runs it);

then profiles one ghost-norm pass (torch.profiler) and splits it by its phase labels (`ghost_norms.backbone_forward`,
`.backward`, and inside the backward `.linear`, `.rms_norm`, `.head_backward`; then `.embedding`, `.tied_cross`):
inclusive time of each (CPU time on CPU; kernel time on a GPU, where the backward's own kernels run on autograd's
thread and count under their operators, not under `.backward`), and the operators that take the most.

    python benchmarks/exact_weights_profile.py                                  # built-in SmolLM2-135M, CPU preset size
    python benchmarks/exact_weights_profile.py --model random:smollm2-1.7b --rows 64 --chunk 16 \\
        --completion_length 64 --dtype bfloat16 --gradient_checkpointing --name exact_weights_profile_gpu   # GPU preset
    python benchmarks/exact_weights_profile.py --lora --name exact_weights_profile_lora   # CPU preset, LoRA
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, markdown_table, new_figure, save_figure, write_results  # noqa: E402

PHASES = ("backbone_forward", "backward", "linear", "rms_norm", "head_backward", "embedding",
          "tied_cross")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct",
                        help="a model folder, builtin: id, or random:<shape> (random_model.py, built under output_dir)")
    parser.add_argument("--rows", type=int, default=8, help="completions (the generation batch)")
    parser.add_argument("--chunk", type=int, default=4, help="rows per ghost-norm pass and per training micro-batch")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--completion_length", type=int, default=24)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="in the training pass, as TRL would")
    parser.add_argument("--lora", action="store_true",
                        help="train the recipes' LoRA adapters (overhead.RECIPE_LORA) instead of every parameter")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (ignored on a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="exact_weights_profile")
    parser.add_argument("--output_dir", default=str(RESULTS / "overhead"))
    return parser.parse_args(argv)


def load_model(name: str, output_dir: Path, dtype):
    import random_model
    import torch
    from transformers import AutoModelForCausalLM

    from oblr_trl.training.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(random_model.resolve(name, output_dir)),
                                                 dtype=getattr(torch, dtype))
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def timed(function, sync, repeats: int) -> list[float]:
    function()  # warm-up: allocator, kernels, autotuning
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        function()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    from oblr_trl.estimators.ghost_norms import log_likelihood_grad_sq_norms

    output_dir = Path(args.output_dir)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = load_model(args.model, output_dir, args.dtype)
    if args.lora:
        from overhead import RECIPE_LORA
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**RECIPE_LORA))
    model.train()
    generator = torch.Generator().manual_seed(args.seed)
    length = args.prompt_length + args.completion_length
    input_ids = torch.randint(0, model.config.vocab_size, (args.rows, length), generator=generator).to(model.device)
    attention_mask = torch.ones_like(input_ids)
    scale = torch.full((args.rows, args.completion_length), 1.0 / args.completion_length, device=model.device)
    chunks = [slice(start, start + args.chunk) for start in range(0, args.rows, args.chunk)]
    keep = args.completion_length

    def completion_log_probs(rows):
        logits = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows], logits_to_keep=keep + 1).logits
        log_probs = torch.log_softmax(logits[:, :-1].float(), -1)
        return log_probs.gather(-1, input_ids[rows, -keep:].unsqueeze(-1)).squeeze(-1)

    def training_pass():
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        for rows in chunks:
            (-(completion_log_probs(rows) * scale[rows]).sum() / len(chunks)).backward()
        model.zero_grad(set_to_none=True)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_disable()

    def no_grad_forward():
        with torch.no_grad():
            for rows in chunks:
                completion_log_probs(rows)

    def ghost_pass():
        return torch.cat([log_likelihood_grad_sq_norms(model, input_ids[rows], attention_mask[rows], keep, scale[rows])
                          for rows in chunks])

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = {}
    for name, function in tqdm([("training_pass", training_pass), ("no_grad_forward", no_grad_forward),
                                ("ghost_pass", ghost_pass)], desc="timing", unit="pass"):
        seconds[name] = timed(function, sync, args.repeats)
    medians = {name: statistics.median(values) for name, values in seconds.items()}

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        ghost_pass()
        sync()
    events = profile.key_averages()
    device_key = "device_time_total" if cuda else "cpu_time_total"
    self_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    by_name = {event.key: event for event in events}
    total_ms = sum(getattr(event, self_key) for event in events) / 1e3
    phases = [{"phase": phase, "ms": getattr(by_name[f"ghost_norms.{phase}"], device_key) / 1e3,
               "calls": by_name[f"ghost_norms.{phase}"].count}
              for phase in PHASES if f"ghost_norms.{phase}" in by_name]
    operators = sorted((e for e in events if not e.key.startswith("ghost_norms.")), key=lambda e: -getattr(e, self_key))
    top = [{"operator": e.key, "self_ms": getattr(e, self_key) / 1e3, "calls": e.count} for e in operators[:15]]

    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    clock = "kernel time on the GPU" if cuda else "CPU time"
    figure, axes = new_figure(2, (14, 4.5))
    axes[0].bar(list(medians), list(medians.values()))
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_title(f"{args.rows} rows × {length} tokens")
    axes[1].barh([p["phase"] for p in phases][::-1], [p["ms"] for p in phases][::-1])
    axes[1].set_xlabel(f"ms ({clock}, inclusive)")
    axes[1].set_title("phases of one ghost-norm pass")
    figure_path = save_figure(figure, output_dir, args.name)
    markdown = (
        f"# Where the exact weights' time goes\n\n![profile]({figure_path.name})\n\n"
        f"Model `{args.model}` ({parameters / 1e6:.0f} M parameters, {trainable / 1e6:.1f} M of them trained"
        f"{' (LoRA adapters)' if args.lora else ''}, {args.dtype}), {args.rows} rows of "
        f"{args.prompt_length} prompt + {args.completion_length} completion tokens in chunks of {args.chunk}; "
        f"gradient checkpointing in the training pass: {args.gradient_checkpointing}; median of {args.repeats}.\n\n"
        + markdown_table(["pass", "s (median)", "÷ training pass"],
                         [[name, medians[name], medians[name] / medians["training_pass"]] for name in medians])
        + f"\n\nOne profiled ghost-norm pass ({clock}, all operators' self time {total_ms:.1f} ms):\n\n"
        + markdown_table(["phase", "ms (inclusive)", "calls"], [[p["phase"], p["ms"], p["calls"]] for p in phases])
        + "\n\nOperators by self time:\n\n"
        + markdown_table(["operator", "self ms", "calls"], [[t["operator"], t["self_ms"], t["calls"]] for t in top])
        + "\n"
    )
    results = {"arguments": vars(args), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "parameters": parameters, "trainable_parameters": trainable, "seconds": seconds, "median_seconds": medians,
               "ghost_to_training_pass": medians["ghost_pass"] / medians["training_pass"],
               "phases": phases, "profiled_total_ms": total_ms, "top_operators": top,
               "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
    write_results(output_dir, args.name, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
