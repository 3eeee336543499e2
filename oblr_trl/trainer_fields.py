"""The names `oblr-trl train` accepts from TRL's GRPOConfig, transformers' TrainingArguments and trl.ModelConfig.

Recorded for the versions in `RECORDED_FOR`, so that a misspelt flag or recipe field is refused before torch,
transformers and TRL are imported (6 s on an idle machine, up to a minute on a busy one). With other versions
installed, `known_trainer_fields()` returns None and the check waits for the real parser. Regenerate after a version
change with `python -m oblr_trl.trainer_fields`; `tests/test_cli.py` compares the record with the installed classes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["RECORDED_FOR", "known_trainer_fields"]

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


def read_installed_fields() -> set[str]:
    """The names the real parser of `oblr-trl train` accepts, less the ones oblr-trl defines itself (imports TRL)."""
    from dataclasses import fields

    from .cli import TaskArguments, make_train_parser
    from .options import OBLRPOOptions

    own = {f.name for f in fields(TaskArguments)} | {f.name for f in fields(OBLRPOOptions)}
    return {action.dest for action in make_train_parser()._actions} - own


if __name__ == "__main__":
    _RECORD.write_text("\n".join(sorted(read_installed_fields())) + "\n")
    RECORDED_FOR.update({package: version(package) for package in RECORDED_FOR})
    print(f"wrote {_RECORD}; set RECORDED_FOR = {RECORDED_FOR} in {__file__}")
