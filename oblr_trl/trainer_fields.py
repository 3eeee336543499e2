"""The names `oblr-trl train` accepts from TRL's GRPOConfig, transformers' TrainingArguments and trl.ModelConfig.

Recorded for the versions in `RECORDED_FOR`, so that a misspelt flag or recipe field is refused before torch,
transformers and TRL are imported (6 s on an idle machine, up to a minute on a busy one). With other versions
installed, `known_trainer_fields()` returns None and the check waits for the real parser. Regenerate after a version
change with `python scripts/record_trainer_fields.py`; `tests/test_cli.py` compares the record with the installed
classes (`oblr_trl.cli.installed_trainer_fields`). This module imports nothing of the package: the CLI reads it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["RECORDED_FOR", "known_trainer_fields", "write_record"]

RECORDED_FOR = {"trl": "1.16.0", "transformers": "5.23.0"}
_RECORD = Path(__file__).with_name("trainer_fields.txt")


def known_trainer_fields() -> frozenset[str] | None:
    """The recorded names, or None where the installed trl or transformers is not the version they were read from."""
    try:
        if any(version(package) != recorded for package, recorded in RECORDED_FOR.items()):
            return None
    except PackageNotFoundError:
        return None
    return frozenset(_RECORD.read_text().split())


def write_record(names: set[str]) -> str:
    """Record ``names`` for the installed versions; returns what to set `RECORDED_FOR` to in this file."""
    _RECORD.write_text("\n".join(sorted(names)) + "\n")
    installed = {package: version(package) for package in RECORDED_FOR}
    return f"wrote {_RECORD}; set RECORDED_FOR = {installed} in {__file__}"
