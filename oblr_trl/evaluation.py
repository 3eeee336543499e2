"""Evaluate a model on a task: pass@1 and pass@k from n samples per problem, graded with `oblr_trl.rewards`.

Generation uses vLLM when it is installed and a GPU is present, and transformers' `generate` otherwise (CPU included).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .rewards import is_correct
from .tasks import TaskOptions, load_task

__all__ = ["EvalResult", "evaluate", "generate_completions", "grade", "write_eval_report"]

BACKENDS = ("auto", "transformers", "vllm")


@dataclass
class EvalResult:
    model: str
    task: str
    n: int
    temperature: float
    max_new_tokens: int
    backend: str
    num_problems: int
    pass_at_1: float  # mean correctness over all samples (avg@n), the unbiased pass@1 estimate
    pass_at_n: float  # share of problems with at least one correct sample
    seconds: float
    samples: list[dict] = field(default_factory=list, repr=False)


def check_sampling(n: int, temperature: float, backend: str) -> None:
    """Raise ValueError for a sampling setting `evaluate` cannot honour."""
    if n < 1:
        raise ValueError(f"Invalid value for `n`: {n}. Allowed values: an integer >= 1.")
    if temperature < 0.0:
        raise ValueError(f"Invalid value for `temperature`: {temperature}. Allowed values: 0 (greedy) or a float > 0.")
    if temperature == 0.0 and n > 1:
        raise ValueError(f"Invalid value for `n`: {n}. Allowed values with temperature 0 (greedy): 1.")
    if backend not in BACKENDS:
        raise ValueError(f"Invalid value for `backend`: {backend!r}. Allowed values: {', '.join(map(repr, BACKENDS))}.")


def evaluate(
    model: str,
    task: str,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    backend: str = "auto",
    seed: int = 0,
    options: TaskOptions | None = None,
    progress: bool = True,
    dataset=None,
) -> EvalResult:
    """Sample ``n`` completions per problem of the task's test split (greedy when ``temperature`` is 0) and grade them.
    ``dataset``: that split already loaded with ``load_task`` (the CLI loads it first, to report a bad task before any
    model loads)."""
    from .training.models import resolve_model

    check_sampling(n, temperature, backend)
    if dataset is None:
        dataset = load_task(task, "test", options)
    path = resolve_model(model)
    if backend == "auto":
        backend = "vllm" if _vllm_usable() else "transformers"
    start = time.perf_counter()
    prompts = list(dataset["prompt"])
    if backend == "vllm":
        completions = _generate_vllm(path, prompts, n, temperature, top_p, max_new_tokens, seed, progress)
    else:
        loaded, tokenizer = _load_transformers(path)
        completions = generate_completions(
            loaded, tokenizer, prompts, n, temperature, top_p, max_new_tokens, batch_size, seed, progress
        )
    samples, pass_at_1, pass_at_n = grade(dataset, completions)
    return EvalResult(
        model=model,
        task=task,
        n=n,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        backend=backend,
        num_problems=len(samples),
        pass_at_1=pass_at_1,
        pass_at_n=pass_at_n,
        seconds=time.perf_counter() - start,
        samples=samples,
    )


def grade(dataset, completions: list[list[str]]) -> tuple[list[dict], float, float]:
    """Per-problem records, pass@1 (mean correctness over all samples) and pass@n (any sample correct)."""
    samples, per_problem = [], []
    for row, outputs in zip(dataset, completions, strict=True):
        correct = [bool(is_correct(text, row["answer"])) for text in outputs]
        per_problem.append(correct)
        samples.append({"question": row["question"], "answer": row["answer"], "completions": outputs, "correct": correct})
    total = sum(len(c) for c in per_problem)
    pass_at_1 = sum(sum(c) for c in per_problem) / max(total, 1)
    pass_at_n = sum(any(c) for c in per_problem) / max(len(per_problem), 1)
    return samples, pass_at_1, pass_at_n


def _vllm_usable() -> bool:
    import importlib.util

    import torch

    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def _load_transformers(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def generate_completions(
    model, tokenizer, prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=256, batch_size=16, seed=0, progress=True
) -> list[list[str]]:
    """``n`` completions per conversational prompt with transformers' `generate` (greedy when temperature is 0)."""
    import torch
    from tqdm.auto import tqdm

    # Batched prompts need a pad token; a checkpoint without one (SmolLM2's GGUF under some transformers versions)
    # pads with its eos, as TRL does. Both are put back afterwards: the caller may go on training with this tokenizer.
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad_token = tokenizer.pad_token
    if pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    else:
        sampling = {"do_sample": False}
    outputs = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc="evaluating", disable=not progress, unit="batch"):
            texts = [
                tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in prompts[start : start + batch_size]
            ]
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                generated = model.generate(
                    **encoded, max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=pad_token_id,
                    **sampling,
                )
            decoded = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            outputs.extend(decoded[i : i + n] for i in range(0, len(decoded), n))
    finally:
        tokenizer.padding_side = padding_side
        if pad_token is None:
            tokenizer.pad_token = None
    return outputs


def _generate_vllm(path, prompts, n, temperature, top_p, max_new_tokens, seed, progress):
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, seed=seed)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    results = llm.chat(prompts, params, use_tqdm=progress)
    return [[choice.text for choice in result.outputs] for result in results]


def write_eval_report(result: EvalResult, output_dir: str | Path) -> tuple[Path, Path]:
    """``<task>.json`` (every sample) and ``<task>.md`` (the summary table) in ``output_dir``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output_dir / f"{result.task}.json", output_dir / f"{result.task}.md"
    json_path.write_text(json.dumps(asdict(result), indent=2))
    md_path.write_text(
        f"# Evaluation of `{result.model}` on {result.task}\n\n"
        "| task | problems | samples/problem | temperature | pass@1 | pass@n | backend | seconds |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {result.task} | {result.num_problems} | {result.n} | {result.temperature} | {result.pass_at_1:.3f} | "
        f"{result.pass_at_n:.3f} | {result.backend} | {result.seconds:.0f} |\n"
    )
    return json_path, md_path
