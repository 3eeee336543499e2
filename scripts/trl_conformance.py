"""Run TRL's own GRPO trainer tests against `GRPOTrainer` and against `OBLRPOTrainer`, offline, and compare.

    python scripts/trl_conformance.py --trl-source PATH/TO/trl          # a clone of TRL's repository (tests/ in it)
    python scripts/trl_conformance.py --trl-source PATH -k test_train   # a subset (pytest -k)

Nothing is fetched: the Hub models the tests name (`trl-internal-testing/tiny-*`) are built locally, randomly
initialised at tiny sizes, into a private Hugging Face cache; `trl-internal-testing/zen` is generated with the same
configurations and splits. Models or datasets that cannot be built here (vision-language models, remote code) make
the tests that need them fail for both trainers, so they do not count. The tests run against the *installed* TRL
(TRL's test file is copied out of its source tree), once per variant:

* `grpo`: TRL's `GRPOTrainer` and `GRPOConfig`, as the file is written;
* `oblrpo`: `OBLRPOTrainer`/`OBLRPOConfig` in their place, OBLR-PO defaults;
* `exact`, `per_sample`: the same with `baseline_weights="exact"` / `snr_estimator="per_sample"` as defaults.

The report lists the tests that pass for `grpo` and not for a variant; the exit code is 1 if there is any.
GRPOConfig defaults to bf16, which transformers refuses without a bf16 GPU: on a CPU-only machine the check is told
that the machine has one (autocast then runs bf16 on the CPU), for every variant alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PLUGIN = "trl_conformance_plugin"
VARIANTS = ("grpo", "oblrpo", "exact", "per_sample")


def outcomes(junit: Path) -> dict[str, str]:
    """test id → 'passed', 'failed', 'error' or 'skipped', from a pytest JUnit XML report."""
    results = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        results[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed").replace(
            "failure", "failed"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-source", required=True, type=Path, help="a TRL source tree (with tests/)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/oblr-trl-conformance"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--test-file", default="test_grpo_trainer.py")
    args = parser.parse_args(argv)

    tests = args.trl_source / "tests"
    if not (tests / args.test_file).exists():
        parser.error(f"--trl-source: {tests / args.test_file} does not exist")
    workdir = args.workdir.resolve()
    suite = workdir / "suite"
    shutil.rmtree(suite, ignore_errors=True)
    (suite / "tests").mkdir(parents=True)
    for path in tests.iterdir():  # the tests package without its sub-folders, away from TRL's own `trl` package
        if path.is_file():
            shutil.copy(path, suite / "tests" / path.name)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_CACHE": str(workdir / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    subprocess.run([sys.executable, "-c", f"import {PLUGIN}; {PLUGIN}.build_hub()"], env=env, check=True)

    results = {}
    for variant in args.variants:
        junit = workdir / f"{variant}.xml"
        command = [sys.executable, "-m", "pytest", f"tests/{args.test_file}", "-p", PLUGIN, "-p", "no:cacheprovider",
                   "-q", "-rN", f"--junitxml={junit}", "-o", "addopts="]
        if args.keyword:
            command += ["-k", args.keyword]
        print(f"== {variant}: {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=suite, env={**env, "OBLR_CONFORMANCE_VARIANT": variant})
        results[variant] = outcomes(junit)

    if any(not outcome for outcome in results.values()):
        print("conformance: a run collected no test (see its output above)")
        return 2
    reference = results.get("grpo", {})
    passing = {name for name, outcome in reference.items() if outcome == "passed"}
    regressions = 0
    print(f"\n{'variant':<12}{'passed':>8}{'failed':>8}{'skipped':>9}   passed for grpo, not here")
    for variant, outcome in results.items():
        counts = {kind: sum(v == kind for v in outcome.values()) for kind in ("passed", "failed", "error", "skipped")}
        missing = sorted(name for name in passing if outcome.get(name) != "passed")
        regressions += len(missing) if variant != "grpo" else 0
        print(f"{variant:<12}{counts['passed']:>8}{counts['failed'] + counts['error']:>8}{counts['skipped']:>9}   "
              f"{len(missing) if variant != 'grpo' else '-'}")
        for name in missing if variant != "grpo" else []:
            print(f"    {name}")
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
