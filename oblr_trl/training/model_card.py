"""The model card of an OBLR-PO run: what was trained from what, on which problems, how, and how it went.

TRL's card names the base model by the Hub id in the model's config, which is empty for a local folder (the
built-in model is one), and links `dataset_name` on the Hub even for a task generated on the fly; its training
procedure is a link to a tracker, if any. This card takes the base model and the problems' source from the caller and
fills the procedure from the configuration and the log history.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

__all__ = ["TOTAL_RUNTIME_KEY", "ModelCardFacts", "model_card_text"]

# logged beside the Trainer's `train_runtime` (the last segment's) at the end of training: every segment's seconds
TOTAL_RUNTIME_KEY = "train_runtime_all_segments"


@dataclass
class ModelCardFacts:
    """What the card says; `OBLRPOTrainer.create_model_card` gathers it."""

    model_name: str
    base_model: str | None  # a Hub id, or None
    base_model_path: str | None  # where the weights came from when there is no Hub id (a local folder)
    hub_model_id: str | None
    output_dir: str
    dataset_id: str | None  # a Hub dataset id, or None
    dataset_description: str | None
    settings: dict[str, str]
    log_history: list[dict]
    tags: list[str]
    paper: dict[str, str]  # title, arXiv id and BibTeX citation of OBLR-PO
    curves: str | None = None  # file name of the training curves next to the card
    tracker_urls: list[str] = field(default_factory=list)
    recipe: str | None = None
    training_seconds: float | None = None  # over every segment so far; the log's end-of-training summary wins


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def counted(number: int, noun: str) -> str:
    """'1 logged step', '3 logged steps'."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def final_metrics(history: list[dict], training_seconds: float | None = None) -> list[tuple[str, str]]:
    """Reward at the start and end of the run (a fifth of the logged steps each), the SNR factor, steps and time (of
    every segment of a resumed run: the summary's `train_runtime_all_segments`, else ``training_seconds``)."""
    # a reward function that returns None for every completion leaves None (or NaN) in the logs: no number to show
    steps = [entry for entry in history if _is_finite_number(entry.get("reward"))]
    rows = []
    if steps:
        window = max(1, len(steps) // 5)
        first = statistics.fmean(entry["reward"] for entry in steps[:window])
        last = statistics.fmean(entry["reward"] for entry in steps[-window:])
        rows.append(("mean reward", f"{first:.3f} (first {counted(window, 'logged step')}) → {last:.3f} (last {window})"))
    factors = [entry["snr/lr_factor"] for entry in history if _is_finite_number(entry.get("snr/lr_factor"))]
    if factors:
        rows.append(("learning-rate factor", f"mean {statistics.fmean(factors):.3f}, range {min(factors):.3f}–{max(factors):.3f}"))
    noise = [entry for entry in history if _is_finite_number(entry.get("oblr/noise_scale"))]
    if noise:  # the batch-size counterpart of the step size (McCandlish et al. 2018), over the last fifth measured
        window = noise[-max(1, len(noise) // 5):]
        scale = statistics.median(entry["oblr/noise_scale"] for entry in window)
        used = window[-1].get("oblr/completions_per_step")
        rows.append(("gradient noise scale", f"~{scale:.3g} completions (B_noise = tr Σ/‖μ‖², median of the last "
                     f"{counted(len(window), 'measured step')})" + (f"; this run used {used:.0f} a step" if
                                                                   _is_finite_number(used) else "")))
    summary = next((entry for entry in reversed(history) if "train_runtime" in entry), None)
    if summary is not None:
        training_seconds = summary.get(TOTAL_RUNTIME_KEY, summary["train_runtime"])
    if training_seconds is not None:
        rows.append(("training time", f"{training_seconds:.0f} s"))
    if history:
        rows.append(("optimizer steps", str(max(entry.get("step", 0) for entry in history))))
    return rows


def model_card_text(facts: ModelCardFacts) -> str:
    """The card as Markdown with a YAML header (the Hub's `ModelCardData` fields)."""
    from huggingface_hub import ModelCardData

    header = ModelCardData(
        base_model=facts.base_model,
        datasets=[facts.dataset_id] if facts.dataset_id else None,
        library_name="transformers",
        model_name=facts.model_name,
        tags=facts.tags,
        pipeline_tag="text-generation",
    ).to_yaml()
    if facts.base_model:
        origin = f"a fine-tuned version of [{facts.base_model}](https://huggingface.co/{facts.base_model})"
    else:
        origin = f"a fine-tuned version of the local model `{facts.base_model_path}`"
    problems = facts.dataset_description or (
        f"[{facts.dataset_id}](https://huggingface.co/datasets/{facts.dataset_id})" if facts.dataset_id else None
    )
    lines = [
        "---", header.rstrip(), "---", "",
        f"# Model card for {facts.model_name}", "",
        f"This model is {origin}, trained with OBLR-PO (the `oblr-trl` package, on [TRL](https://github.com/huggingface/trl))"
        + (f" on {problems}." if problems else "."),
        "", "## Quick start", "", "```python", "from transformers import pipeline", "",
        f'generator = pipeline("text-generation", model="{facts.hub_model_id or facts.output_dir}")',
        'messages = [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]',
        'print(generator(messages, max_new_tokens=64, return_full_text=False)[0]["generated_text"])', "```", "",
        "## Training procedure", "",
        f"Trained with OBLR-PO ([{facts.paper['title']}](https://huggingface.co/papers/{facts.paper['id']})): "
        "GRPO's policy gradient with a baseline weighted by each completion's gradient (RLOO's leave-one-out mean plus "
        "a shift fitted on earlier batches) and a learning rate scaled by the measured gradient signal-to-noise "
        "ratio.", "",
        "| setting | value |", "|---|---|",
        *[f"| {name} | {value} |" for name, value in facts.settings.items()], "",
    ]
    metrics = final_metrics(facts.log_history, facts.training_seconds)
    if metrics:
        lines += ["Results of the run (the full log: `trainer_state.json`):", "", "| metric | value |", "|---|---|",
                  *[f"| {name} | {value} |" for name, value in metrics], ""]
    if facts.curves:
        lines += [f"![training curves]({facts.curves})", ""]
    if facts.tracker_urls:
        lines += [f"Run tracked at {', '.join(facts.tracker_urls)}.", ""]
    lines += [
        "### Framework versions", "",
        *[f"- {package}: {_version(package)}" for package in ("oblr-trl", "trl", "transformers", "torch", "datasets")], "",
        "## Citations", "", "Cite OBLR-PO as:", "", "```bibtex", facts.paper["citation"], "```", "",
        "Cite TRL as:", "", "```bibtex",
        "@software{vonwerra2020trl,\n  title  = {{TRL: Transformers Reinforcement Learning}},\n"
        "  author = {von Werra, Leandro and others},\n  url    = {https://github.com/huggingface/trl},\n  year   = {2020}\n}",
        "```", "",
    ]
    if facts.recipe:
        lines += ["## Training recipe", "", "Trained with `oblr-trl train` from this recipe:", "", "```yaml",
                  facts.recipe.rstrip(), "```", ""]
    return "\n".join(lines)
