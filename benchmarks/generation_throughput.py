"""Benchmark `generation_throughput`: completion tokens a second of vLLM against transformers' `generate`.

A training step's generation, alone: the overhead benchmark's CPU preset (SmolLM2-135M-Instruct in float32, 2 prompts
of the arithmetic task × 8 completions a step, sampling at temperature 1) with every completion fixed at each length
(EOS held back until it, `min_tokens` / `min_new_tokens`), so that both engines produce the same number of tokens.
vLLM is the engine TRL's colocate mode builds, in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), loaded in the policy's
float32; transformers' `generate` is what TRL runs without vLLM. Each (engine, repeat) is a fresh process that loads
its engine once (its start-up time is recorded apart), generates each length once untimed and then ``--rounds`` times
timed; the engines' order alternates between repeats. Per run and length, the median of the rounds; per engine, the
median over runs, and vLLM's throughput ÷ transformers' paired by repeat (mean, 95 % bootstrap interval).

    python benchmarks/generation_throughput.py                      # 24, 128 and 512 tokens (needs vLLM)
    python benchmarks/generation_throughput.py --engines hf --lengths 24 --repeats 1   # transformers alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    bootstrap_ci,
    markdown_table,
    new_figure,
    run_in_subprocesses,
    save_figure,
    write_results,
)

ENGINES = ("hf", "vllm")
MODEL = "builtin:smollm2-135m-instruct"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 128, 512], help="completion tokens (fixed)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step")
    parser.add_argument("--num_generations", type=int, default=8, help="completions a prompt")
    parser.add_argument("--repeats", type=int, default=3, help="processes per engine, the order alternating")
    parser.add_argument("--rounds", type=int, default=2, help="timed generations per length in each process")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--name", default="generation_throughput")
    parser.add_argument("--output_dir", default=str(RESULTS / "overhead"))
    return parser.parse_args(argv)


def prompt_ids(tokenizer, prompts: int) -> list[list[int]]:
    from oblr_trl.tasks import TaskOptions, load_task

    task = load_task("arithmetic", "train", TaskOptions(num_problems=200, seed=0))
    return [tokenizer.apply_chat_template(task[index]["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            for index in range(prompts)]


def hf_generator(path: str, prompts: list[list[int]], num_generations: int):
    """A function of a length that samples every prompt's completions in one `generate` call, as TRL does; returns
    the completion tokens it produced."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # as TRL sets it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [ids for ids in prompts for _ in range(num_generations)]
    inputs = tokenizer.pad({"input_ids": rows}, return_tensors="pt")

    def generate(length: int) -> int:
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=length,
                                 min_new_tokens=length, pad_token_id=tokenizer.pad_token_id)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]

    return generate


def vllm_generator(path: str, prompts: list[list[int]], num_generations: int, longest: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as TRL's colocate mode runs it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype="float32", max_model_len=max(map(len, prompts)) + longest, seed=0,
              max_num_batched_tokens=4096, gpu_memory_utilization=0.3)  # TRL's default share (of CPU memory here)
    rows = [TokensPrompt(prompt_token_ids=ids) for ids in prompts for _ in range(num_generations)]

    def generate(length: int) -> int:
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=length, min_tokens=length)
        outputs = llm.generate(rows, params, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    return generate


def run_child(spec: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    from oblr_trl.training.models import resolve_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    path = str(resolve_model(spec["model"]))
    prompts = prompt_ids(AutoTokenizer.from_pretrained(path), spec["prompts"])
    start = time.perf_counter()
    if spec["engine"] == "hf":
        generate = hf_generator(path, prompts, spec["num_generations"])
    else:
        generate = vllm_generator(path, prompts, spec["num_generations"], max(spec["lengths"]))
    startup = time.perf_counter() - start
    lengths = {}
    for length in spec["lengths"]:
        generate(length)  # untimed: the first call at a shape compiles or warms caches
        seconds, tokens = [], []
        for _ in range(spec["rounds"]):
            begin = time.perf_counter()
            tokens.append(generate(length))
            seconds.append(time.perf_counter() - begin)
        expected = spec["prompts"] * spec["num_generations"] * length
        if set(tokens) != {expected}:
            raise RuntimeError(f"{spec['engine']} produced {tokens} tokens at length {length}, not {expected}")
        lengths[str(length)] = {"seconds": seconds, "tokens": expected,
                                "tokens_per_second": expected / statistics.median(seconds)}
    return {"engine": spec["engine"], "repeat": spec["repeat"], "startup_seconds": startup, "lengths": lengths}


def summarise(runs: list[dict], engines: list[str], lengths: list[int]) -> list[dict]:
    """One row per (length, engine): median tokens a second and seconds a generation over runs, and (vLLM) its
    throughput ÷ transformers' paired by repeat."""
    by_engine = {engine: sorted((r for r in runs if r["engine"] == engine), key=lambda r: r["repeat"])
                 for engine in engines}
    rows = []
    for length in lengths:
        key = str(length)
        for engine, results in by_engine.items():
            throughput = [r["lengths"][key]["tokens_per_second"] for r in results]
            row = {"length": length, "engine": engine, "tokens_per_second": statistics.median(throughput),
                   "min": min(throughput), "max": max(throughput),
                   "seconds_per_generation": statistics.median(statistics.median(r["lengths"][key]["seconds"])
                                                               for r in results),
                   "startup_seconds": statistics.median(r["startup_seconds"] for r in results)}
            if engine != "hf" and "hf" in by_engine:
                ratios = [mine["lengths"][key]["tokens_per_second"] / hf["lengths"][key]["tokens_per_second"]
                          for mine, hf in zip(results, by_engine["hf"], strict=True)]
                row |= {"ratio_to_hf_mean": statistics.fmean(ratios), "ratio_to_hf_ci": bootstrap_ci(ratios),
                        "ratio_to_hf_min": min(ratios), "ratio_to_hf_max": max(ratios)}
            rows.append(row)
    return rows


def plot(rows: list[dict], output_dir: Path, name: str) -> Path:
    figure, axis = new_figure(1, (5.5, 3.8))
    for engine in sorted({row["engine"] for row in rows}):
        mine = [row for row in rows if row["engine"] == engine]
        lengths = [row["length"] for row in mine]
        medians = [row["tokens_per_second"] for row in mine]
        spread = [[m - row["min"] for m, row in zip(medians, mine)], [row["max"] - m for m, row in zip(medians, mine)]]
        label = {"hf": "transformers generate", "vllm": "vLLM (CPU build)"}[engine]
        axis.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("completion tokens (fixed)")
    axis.set_ylabel("completion tokens / s (median, min–max)")
    axis.set_title("Generation throughput, one step's 16 completions")
    axis.grid(alpha=0.3)
    axis.legend()
    return save_figure(figure, output_dir, name)


def main(argv=None) -> int:
    args = parse_args(argv)
    specs = []
    for repeat in range(args.repeats):
        order = args.engines if repeat % 2 == 0 else args.engines[::-1]
        specs += [{"engine": engine, "repeat": repeat, "model": args.model, "lengths": args.lengths,
                   "prompts": args.prompts, "num_generations": args.num_generations, "rounds": args.rounds}
                  for engine in order]
    runs = run_in_subprocesses(__file__, specs, "generation runs")
    rows = summarise(runs, args.engines, args.lengths)
    output_dir = Path(args.output_dir)
    figure = plot(rows, output_dir, args.name)
    table = markdown_table(
        ["completion tokens", "engine", "tokens / s (median)", "min", "max", "s / generation (median)",
         "÷ transformers (paired mean)", "95 % interval", "start-up s (median)"],
        [[row["length"], row["engine"], row["tokens_per_second"], row["min"], row["max"],
          row["seconds_per_generation"], row.get("ratio_to_hf_mean", "—"),
          "[{:.2f}, {:.2f}]".format(*row["ratio_to_hf_ci"]) if "ratio_to_hf_ci" in row else "—",
          row["startup_seconds"]] for row in rows])
    markdown = (
        f"# Generation throughput: vLLM against transformers' generate\n\n![throughput]({figure.name})\n\n"
        f"Model `{args.model}` in float32, {args.prompts} prompts × {args.num_generations} completions a generation "
        f"(one training step's), temperature 1, every completion fixed at the length; {args.repeats} processes per "
        f"engine (the order alternating), each timing {args.rounds} generations per length after an untimed one. "
        "Start-up: loading the engine (vLLM: its model, compilation and KV cache) before the first generation.\n\n"
        f"{table}\n")
    write_results(output_dir, args.name, {"args": vars(args), "rows": rows, "runs": runs}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
