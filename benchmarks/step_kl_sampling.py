"""Benchmark `step_kl_sampling`: how precisely the trust region's step KL is measured on a sample of a step's completions.

The trust region measures each optimizer step's KL(π_t ‖ π_{t+1}) with one no-grad forward of the step's completions
(`training.step_kl`). `lr_trust_region_sample_size` measures it on n of them instead, a forward that costs n/N of the
full one. Whether that is precise enough depends on how the step's KL spreads over its completions: this benchmark
trains with the defaults, records every completion's KL (Σ_t k3 over its tokens, and its token count) at every step,
and replays the sampled estimator — Σ_S KL_i / Σ_S T_i over n completions drawn uniformly without replacement, as the
trainer computes it — against the full measurement of the same step: the ratio estimate/full per draw (its relative
RMSE, median, 10th and 90th percentiles) and what it does to the rate the trust region sets from one reading
(∝ KL^-1/2). It also reports how concentrated the KL is (the largest completion's share of its step), the correlation
of a completion's KL with what is known of it before the forward (|advantage|, length, its log-likelihood), which says
whether drawing completions by such a proxy instead of uniformly could help, and — for the other way to measure less,
every k-th step — how far the curvature KL/lr² moves between steps and how well the rule's moving average (decay 0.5)
of the steps measured every k-th step predicts the next step's curvature.

    python benchmarks/step_kl_sampling.py                      # the overhead benchmark's CPU preset, 30 steps
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, build_trainer, markdown_table, new_figure, parse_overrides, save_figure,  # noqa: E402
                    text_hash_parity_reward, write_results)

PRESET = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8, learning_rate=3e-5,
              gradient_checkpointing=False, bf16=False, use_cpu=True)  # overhead.py's CPU preset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max_completion_length", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reward", choices=["accuracy", "hash"], default="accuracy",
                        help="graded accuracy on the arithmetic task, or the parity of a hash of the text (a reward "
                        "that varies per completion whatever the model; for tests)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="sample sizes replayed")
    parser.add_argument("--draws", type=int, default=400, help="draws replayed per step and sample size")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--name", default="step_kl_sampling")
    parser.add_argument("--output_dir", default=str(RESULTS / "overhead"))
    return parser.parse_args(argv)


def record_completion_kls(args) -> tuple[list[list[dict]], list[float]]:
    """Train with the defaults; per measured step, every completion's k3 sum, tokens, |advantage| and −log π, and the
    rate the step ran at."""
    import torch

    from oblr_trl.tasks import TaskOptions, load_task

    # every step measured whole: the replays draw their samples and cadences from all of it
    config = dict(PRESET, output_dir=str(Path(args.output_dir) / "runs" / args.name), max_steps=args.steps,
                  max_completion_length=args.max_completion_length, logging_steps=1, save_strategy="no",
                  report_to=[], seed=args.seed, lr_trust_region_measure_steps=1, **parse_overrides(args.overrides))
    task = load_task("arithmetic", "train", TaskOptions(num_problems=200, seed=args.seed))
    reward = [text_hash_parity_reward] if args.reward == "hash" else None
    trainer = build_trainer(args.model, {}, config, None, task, reward_funcs=reward)
    recorder, control, steps, kept, rates = trainer.kl_recorder, trainer.step_control, [], {}, []
    keep, measure, after_step = recorder.keep, recorder.token_log_probs, control.after_step

    def keeping(batch, log_probs, mask):
        kept[id(batch)] = (log_probs.detach(), mask)
        keep(batch, log_probs, mask)

    def measuring(batch):
        new = measure(batch)
        old, mask = kept.pop(id(batch))
        delta = (new.float() - old.float()).clamp(-20.0, 20.0)
        k3 = ((torch.expm1(delta) - delta) * mask).sum(1)
        steps[-1].extend({"kl": k, "tokens": n, "abs_advantage": abs(a), "neg_log_likelihood": nll}
                         for k, n, a, nll in zip(k3.tolist(), mask.sum(1).tolist(), batch["advantages"].tolist(),
                                                 (-(old.float() * mask).sum(1)).tolist(), strict=True))
        return new

    def stepping():
        steps.append([])
        # a momentum-only step: the rule does not fold it in
        rates.append(control.applied_lr if control.grad_norm != 0.0 else None)
        after_step()

    recorder.keep, recorder.token_log_probs, control.after_step = keeping, measuring, stepping
    trainer.train()
    measured = [i for i, rows in enumerate(steps) if rows and sum(r["kl"] for r in rows) > 0]  # a step that moved
    return [steps[i] for i in measured], [rates[i] for i in measured]


def every_kth_step(steps: list[list[dict]], rates: list[float], periods: list[int], decay: float = 0.5) -> list[dict]:
    """The rule's bias-corrected moving average of the curvature KL/lr², fed every k-th step only (after the first,
    the probe), against the next step's measured curvature: RMS of the natural-log error, from the 8th step on. Steps
    with a zero gradient (Adam's momentum alone moved the policy) are left out, as the rule leaves them out."""
    curvature = [sum(r["kl"] for r in rows) / sum(r["tokens"] for r in rows) / rate**2
                 for rows, rate in zip(steps, rates, strict=True) if rate is not None]
    results = []
    for period in periods:
        errors = []
        for t in range(8, len(curvature)):
            total = weight = 0.0
            for s in range(1, t):
                if (s - 1) % period == 0:
                    total, weight = decay * total + (1 - decay) * curvature[s], decay * weight + (1 - decay)
            errors.append(math.log(curvature[t] / (total / weight)))
        results.append({"period": period, "rms_log_error": math.sqrt(statistics.fmean(e * e for e in errors)),
                        "mean_log_error": statistics.fmean(errors)})
    jumps = [abs(math.log(b / a)) for a, b in zip(curvature[1:], curvature[2:])]  # after the probe
    return results, {"curvature": curvature, "median_step_to_step_factor": math.exp(statistics.median(jumps))}


def replay(steps: list[list[dict]], size: int, draws: int, seed: int) -> dict:
    """The sampled estimate ÷ the full measurement, over ``draws`` uniform draws of ``size`` completions per step."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ratios = []
    for rows in steps:
        kl = torch.tensor([r["kl"] for r in rows], dtype=torch.float64)
        tokens = torch.tensor([r["tokens"] for r in rows], dtype=torch.float64)
        full = kl.sum() / tokens.sum()
        for _ in range(draws):
            drawn = torch.randperm(len(rows), generator=generator)[:size]
            ratios.append(float(kl[drawn].sum() / tokens[drawn].sum() / full))
    values = torch.tensor(ratios, dtype=torch.float64)
    rate = values.rsqrt()  # the trust region's rate from one reading scales as KL^-1/2
    return {"sample_size": size, "completions_per_step": len(steps[0]), "relative_rmse": float((values - 1).square().mean().sqrt()),
            "median_ratio": float(values.median()), "p10_ratio": float(values.quantile(0.1)),
            "p90_ratio": float(values.quantile(0.9)), "rate_p10": float(rate.quantile(0.1)),
            "rate_p90": float(rate.quantile(0.9)), "ratios": ratios}


def correlations(steps: list[list[dict]]) -> dict:
    """Pearson correlation of each completion's share of its step's KL with what is known of it before the forward."""
    import torch

    share = torch.tensor([r["kl"] / sum(x["kl"] for x in rows) for rows in steps for r in rows], dtype=torch.float64)
    result = {}
    for key in ("abs_advantage", "tokens", "neg_log_likelihood"):
        proxy = torch.tensor([r[key] for rows in steps for r in rows], dtype=torch.float64)
        a, b = share - share.mean(), proxy - proxy.mean()
        result[key] = float((a * b).sum() / (a.norm() * b.norm()))
    return result


def plot(replays: list[dict], steps: list[list[dict]], output_dir, name):
    figure, axes = new_figure(2, (12, 4.5))
    axes[0].boxplot([r["ratios"] for r in replays], whis=(10, 90), showfliers=False)
    axes[0].set_xticks(range(1, len(replays) + 1), [f"{r['sample_size']} of {r['completions_per_step']}" for r in replays])
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("sampled step KL ÷ full measurement")
    axes[0].set_title("the step KL on a sample (box: quartiles, whiskers: 10–90 %)")
    shares = sorted((max(r["kl"] for r in rows) / sum(r["kl"] for r in rows) for rows in steps), reverse=True)
    axes[1].plot(range(1, len(shares) + 1), shares, marker="o")
    axes[1].set_xlabel("steps, sorted")
    axes[1].set_ylabel("largest completion's share of the step's KL")
    axes[1].set_title("how concentrated a step's KL is")
    return save_figure(figure, output_dir, name)


def main(argv=None):
    args = parse_args(argv)
    steps, rates = record_completion_kls(args)
    replays = [replay(steps, size, args.draws, args.seed) for size in args.sizes]
    periods, drift = every_kth_step(steps, rates, [1, 2, 4, 8])
    shares = [max(r["kl"] for r in rows) / sum(r["kl"] for r in rows) for rows in steps]
    per_completion_cv = statistics.fmean(
        statistics.pstdev([r["kl"] for r in rows]) / statistics.fmean([r["kl"] for r in rows]) for rows in steps
    )
    related = correlations(steps)
    figure = plot(replays, steps, args.output_dir, args.name)
    markdown = (
        f"# The step KL on a sample of the step's completions\n\n![sampling]({figure.name})\n\n"
        f"`{args.model}`, the defaults on the overhead benchmark's CPU preset ({len(steps[0])} completions a step), "
        f"{len(steps)} measured steps; each sample size replayed {args.draws} times per step against the step's full "
        "measurement.\n\n"
        + markdown_table(["sample", "relative RMSE", "median ÷ full", "10 % ÷ full", "90 % ÷ full",
                          "trust region's rate ÷ full's, 10–90 %"],
                         [[f"{r['sample_size']} of {r['completions_per_step']}", r["relative_rmse"], r["median_ratio"],
                           r["p10_ratio"], r["p90_ratio"], f"{r['rate_p10']:.2f}–{r['rate_p90']:.2f}"] for r in replays])
        + f"\n\nThe largest completion holds {statistics.median(shares):.0%} of its step's KL (median over steps; "
        f"{min(shares):.0%}–{max(shares):.0%}); the coefficient of variation of the per-completion KL within a step is "
        f"{per_completion_cv:.2f} (mean over steps). Correlation of a completion's share with |advantage| "
        f"{related['abs_advantage']:+.2f}, with its length {related['tokens']:+.2f}, with −log π of it "
        f"{related['neg_log_likelihood']:+.2f}.\n\n"
        "Measuring every k-th step instead (steps with a gradient only, as the rule folds them): the curvature KL/lr² "
        "moves by a factor of "
        f"{drift['median_step_to_step_factor']:.2f} from one step to the next (median, after the probe); the rule's "
        "moving average of the steps measured every k-th step predicts the next step's curvature with a natural-log "
        "error of\n\n"
        + markdown_table(["measured every", "RMS log error", "mean log error"],
                         [[f"{r['period']} step(s)", r["rms_log_error"], r["mean_log_error"]] for r in periods])
        + "\n"
    )
    results = {"arguments": vars(args), "replays": replays, "largest_share": shares,
               "per_completion_cv": per_completion_cv, "correlations": related, "every_kth_step": periods,
               "curvature": drift, "rates": rates, "steps": steps}
    write_results(args.output_dir, args.name, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
