"""Benchmark `variance`: how much each baseline reduces the variance of the policy-gradient estimator, on a real model.

For a set of prompts, sample a pool of completions per prompt from the model, compute the exact per-completion gradient
g_i = ∇_θ log π(o_i|q) over a stated subset of the parameters, and the rewards. Groups of G completions are then
drawn from each pool (with replacement, many times) and, for each baseline, the trace of the covariance of the group
estimator ĝ = (1/G) Σ_i (r_i − b_i) g_i is computed exactly from the pool's Gram matrix ⟨g_i, g_j⟩ (gradients
centred in the pool, see `group_variances`). Reported per baseline: tr Cov, its ratio to the group-mean (GRPO)
baseline and to uniform leave-one-out (RLOO), the noise-to-signal ratio Σ_prompts tr Cov / Σ_prompts ‖E ĝ‖², the
share it achieves of the reduction of that ratio by the oracle b* (E[w r]/E[w] with exact weights, fixed per prompt
from the whole pool: what a baseline estimated from the group approximates), and how well each proxy weight
correlates with the exact ‖g_i‖².

Why noise-to-signal as well as tr Cov: a baseline that includes the completion itself (the whole-group ones) shrinks
the estimator, E ĝ ≈ (G−1)/G ∇J, and tr Cov with it by ≈ ((G−1)/G)²; with uniform weights the group mean's estimator
is exactly (G−1)/G times RLOO's, group by group. Adam and gradient clipping undo a common scale, so two estimators
that differ only in scale take the same steps; tr Cov / ‖E ĝ‖² does not change with scale and compares them fairly.

Two exact weights are compared: the norm over the measured subset (the b* of the space the covariance is measured in)
and the norm over the whole model, computed for every completion by the batched ghost-norm pass (what
`baseline_weights="exact"` uses in training).

What a leave-one-out baseline can reach: part of the oracle's gain is knowing E[r|q] exactly, which no estimate from
the other G − 1 completions can. Two more fixed references separate it: the oracle mean E[r|q] (uniform weights), and
RLOO shifted by the exact b* − p (the leave-one-out mean plus the oracle's reweighting shift). The gap between RLOO and
the shifted RLOO is what reweighting can reach; each estimator's share of it is reported (the pooled slope fitted on
the other prompts' groups, as training fits it on earlier batches). Every ratio to RLOO has a 95 % interval from a
two-level bootstrap (prompts, then the completions of each pool). The `shrunk` estimator, which lost to the pooled
slope, left the code; the committed table (3e18be7) still shows it.

Run it at several points in training (the base model, and after some OBLR-PO steps): the spread of the weights, hence
what the baseline can gain, changes with the policy.

    python -m benchmarks.variance                      # SmolLM2-135M-Instruct, base and after 30 OBLR-PO steps
    python -m benchmarks.variance --prompts 2 --pool 8 --train_steps 0 --model <tiny>   # smoke size
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.common import RESULTS, markdown_table, new_figure, save_figure, write_results

from oblr_trl.estimators.baselines import (
    PooledSlope,
    gradient_weighted_baseline,
    pooled_slope_baseline,
)
from oblr_trl.estimators.weights import log_sum_sq_probs, logit_proxy_weights
from oblr_trl.training.options import OBLRPOOptions

# name → (label, weight source, kind): "loo"/"group" weighted means, "pooled" (leave-one-out mean + ρ̂·variance, ρ̂ fitted on the other prompts' groups with these weights)
BASELINES = {
    "grpo": ("group mean (GRPO)", "uniform", "group"),
    "rloo": ("uniform LOO (RLOO)", "uniform", "loo"),
    "opo": ("length, whole group (OPO)", "length", "group"),
    "length_loo": ("length LOO", "length", "loo"),
    "logit_group": ("logit, whole group", "logit", "group"),
    "weighted": ("logit LOO, weighted (the paper's estimator)", "logit", "loo"),
    "pooled_slope": ("pooled slope LOO, logit weights (OBLR-PO default)", "logit", "pooled"),
    # the control that separates pooling from weighting: with uniform weights b* is the prompt's mean reward, and
    # what the slope still buys is the shrinkage of the leave-one-out mean (docs/math.md, "ρ̂ without weights")
    "uniform_pooled_slope": ("pooled slope LOO, uniform weights (control: no weights)", "uniform", "pooled"),
    "exact_subset_group": ("exact, whole group", "exact", "group"),
    "exact_subset_loo": ("exact LOO", "exact", "loo"),
    "exact_group": ("exact full-model, whole group", "exact_full", "group"),
    "exact_weighted": ("exact full-model LOO (baseline_weights='exact')", "exact_full", "loo"),
    "exact_pooled_slope": ("pooled slope LOO, exact full-model weights", "exact_full", "pooled"),
}
# references that know what a group cannot: fixed per prompt from the whole pool (exact subset weights)
ORACLES = {
    "oracle_b_star": "oracle b* (fixed per prompt)",
    "oracle_mean": "oracle E[r|q] (uniform weights, exact mean)",
    "rloo_exact_shift": "RLOO + exact (b* − p) shift",
}
DEFAULT_ESTIMATOR = OBLRPOOptions.baseline_estimator  # the default of OBLRPOConfig, read from it so results match


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--checkpoints", nargs="*", default=None,
                        help="more models to measure (points later in training); default: train --train_steps steps")
    parser.add_argument("--train_steps", type=int, default=30, help="OBLR-PO steps (quickstart recipe) for the 2nd point")
    parser.add_argument("--task_operators", default="+-", help="arithmetic task: operators")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--pool", type=int, default=32, help="completions sampled per prompt")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--draws", type=int, default=20000, help="groups drawn per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=4, help="g_i over the last LAYERS decoder blocks + final norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", type=int, default=200,
                        help="replicates of the two-level bootstrap (prompts, then completions in each pool)")
    parser.add_argument("--bootstrap_draws", type=int, default=2000, help="groups drawn per prompt in a replicate")
    parser.add_argument("--output_dir", default=str(RESULTS / "variance"))
    return parser.parse_args(argv)


def trainable_subset(model, layers: int) -> list[torch.nn.Parameter]:
    """The parameters of the last ``layers`` decoder blocks and the final norm (the gradient space measured)."""
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = model.model.layers[-layers:]
    params = [p for block in blocks for p in block.parameters()] + list(model.model.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def sample_pool(model, tokenizer, prompt, count, max_new_tokens, temperature, seed):
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            prompt_ids.expand(count, -1), attention_mask=torch.ones(count, prompt_ids.size(1), dtype=torch.long),
            do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    eos = tokenizer.eos_token_id
    completions = []
    for row in out[:, prompt_ids.size(1):].tolist():
        completions.append(row[: row.index(eos) + 1] if eos in row else row)
    return prompt_ids, completions


def per_completion(model, prompt_ids, completions, params, temperature):
    """Exact gradients (float32, one row per completion), logit-proxy weights and lengths."""
    gradients, logit, lengths = [], [], []
    for completion in completions:
        ids = torch.cat([prompt_ids[0], torch.tensor(completion)]).unsqueeze(0)
        logits = model(ids).logits[0, prompt_ids.size(1) - 1 : -1].float() / temperature
        targets = torch.tensor(completion).unsqueeze(-1)
        log_probs = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
        grads = torch.autograd.grad(log_probs.sum(), params)
        gradients.append(torch.cat([g.reshape(-1) for g in grads]))
        mask = torch.ones(1, len(completion))
        logit.append(logit_proxy_weights(log_probs.detach()[None], log_sum_sq_probs(logits.detach())[None], mask))
        lengths.append(float(len(completion)))
    return torch.stack(gradients), torch.cat(logit).double(), torch.tensor(lengths, dtype=torch.float64)


def full_model_norms(model, prompt_ids, completions, temperature, chunk=8):
    """‖∇_θ log π(o|q)‖² over all parameters, by the batched ghost-norm pass (`oblr_trl.estimators.ghost_norms`)."""
    from oblr_trl.estimators.ghost_norms import log_likelihood_grad_sq_norms

    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), prompt_ids.size(1) + width), 0)
    mask = torch.zeros_like(ids)
    scale = torch.zeros(len(completions), width)
    for i, completion in enumerate(completions):
        ids[i, : prompt_ids.size(1)] = prompt_ids[0]
        ids[i, prompt_ids.size(1) : prompt_ids.size(1) + len(completion)] = torch.tensor(completion)
        mask[i, : prompt_ids.size(1) + len(completion)] = 1
        scale[i, : len(completion)] = 1.0
    try:
        return torch.cat([
            log_likelihood_grad_sq_norms(model, ids[s : s + chunk], mask[s : s + chunk], width, scale[s : s + chunk],
                                         temperature)
            for s in range(0, len(completions), chunk)
        ]).double()
    finally:
        for p in frozen:
            p.requires_grad_(False)


def group_variances(gram, rewards, weights, group_size, draws, generator, slopes):
    """(tr Cov ĝ, ‖E ĝ‖²) of the group estimator for each baseline, groups drawn with replacement from the pool
    (Gram trick). ‖E ĝ‖² is the squared norm of the mean over the draws less its own sampling noise, tr Cov / draws.

    The pool stands in for the policy's distribution, so its gradients are centred first (g_i − ḡ, on the Gram
    matrix): the score identity E[∇ log π] = 0 holds for the policy, and the pool's mean gradient ḡ is sampling noise.
    Left in, it would add −E[b]·ḡ to every estimator's mean, so that unbiased baselines had different expectations.
    The weights stay the uncentred ‖g_i‖², what training uses. ``slopes``: ρ̂ of the pooled baselines, by weight
    source, fitted without this prompt."""
    pool = len(rewards)
    gram = gram - gram.mean(0, keepdim=True) - gram.mean(1, keepdim=True) + gram.mean()
    index = torch.randint(0, pool, (draws, group_size), generator=generator)
    r = rewards[index]
    pair_gram = gram[index[:, :, None], index[:, None, :]]

    def trace_cov(baseline):
        coefficients = (r - baseline) / group_size
        sq_norms = torch.einsum("si,sj,sij->s", coefficients, coefficients, pair_gram)
        pooled = torch.zeros(pool, dtype=torch.float64).index_add_(0, index.reshape(-1), coefficients.reshape(-1))
        mean_sq_norm = (pooled @ gram @ pooled / draws**2).item()
        trace = sq_norms.mean().item() - mean_sq_norm
        return trace, mean_sq_norm - trace / draws

    result = {}
    for name, (_, source, kind) in BASELINES.items():
        w = weights[source][index]
        if kind == "pooled":
            baseline = pooled_slope_baseline(r, slopes[source]).baseline
        else:
            baseline = gradient_weighted_baseline(r, w, leave_one_out=kind == "loo").baseline
        result[name] = trace_cov(baseline)
    exact = weights["exact"]
    b_star = (exact * rewards).sum() / exact.sum() if exact.sum() > 0 else rewards.mean()
    rloo = gradient_weighted_baseline(r, torch.ones_like(r)).baseline
    result["oracle_b_star"] = trace_cov(b_star)
    result["oracle_mean"] = trace_cov(rewards.mean())
    result["rloo_exact_shift"] = trace_cov(rloo + (b_star - rewards.mean()))
    return result


def fit_slopes(pools, skip, group_size, draws, generator):
    """ρ̂ per weight source from groups drawn from every pool but ``skip`` (what earlier batches give in training)."""
    slopes = {}
    for source in {source for _, source, kind in BASELINES.values() if kind == "pooled"}:
        fit = PooledSlope(decay=0.0)
        rewards, weights = [], []
        for k, pool in enumerate(pools):
            if k == skip:
                continue
            index = torch.randint(0, len(pool["rewards"]), (draws, group_size), generator=generator)
            rewards.append(pool["rewards"][index])
            weights.append(pool["weights"][source][index])
        fit.update(torch.cat(rewards), torch.cat(weights))
        slopes[source] = fit.value
    return slopes


def pearson(a, b):
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def spearman(a, b):
    return pearson(a.argsort().argsort().double(), b.argsort().argsort().double())


def noise_to_signal(per_prompt, prompts=None):
    """Σ tr Cov / Σ ‖E ĝ‖² over (a resample of) the prompts, per baseline."""
    prompts = range(len(per_prompt)) if prompts is None else prompts
    names = per_prompt[0].keys()
    return {
        name: (sum(per_prompt[k][name][0] for k in prompts) / signal if (signal := sum(per_prompt[k][name][1] for k in
                                                                                        prompts)) > 0 else float("nan"))
        for name in names
    }


def bootstrap_ratios(pools, slopes, args, generator):
    """95 % intervals of each baseline's noise ÷ signal ÷ RLOO's: prompts resampled, then each chosen pool's
    completions resampled, then groups drawn from that (the slopes stay those fitted on the full pools)."""
    replicates = {name: [] for name in [*BASELINES, *ORACLES]}
    for _ in tqdm(range(args.bootstrap), desc="bootstrap", unit="replicate", leave=False):
        per_prompt = []
        for k in torch.randint(0, len(pools), (len(pools),), generator=generator).tolist():
            pool = pools[k]
            pick = torch.randint(0, len(pool["rewards"]), (len(pool["rewards"]),), generator=generator)
            weights = {source: values[pick] for source, values in pool["weights"].items()}
            per_prompt.append(group_variances(pool["gram"][pick][:, pick], pool["rewards"][pick], weights,
                                              args.group_size, args.bootstrap_draws, generator, slopes[k]))
        ratios = noise_to_signal(per_prompt)
        for name in replicates:  # a resample without reward spread has no signal: left out of the interval
            replicates[name].append(ratios[name] / ratios["rloo"] if ratios["rloo"] > 0 else float("nan"))
    return {
        name: [torch.tensor(v, dtype=torch.float64).nanquantile(q).item() for q in (0.025, 0.975)]
        for name, v in replicates.items()
    }


def measure(model_path, args, label):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.rewards import accuracy_reward
    from oblr_trl.tasks import TaskOptions, load_task
    from oblr_trl.training.models import resolve_model

    path = resolve_model(model_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    params = trainable_subset(model, args.layers)
    dataset = load_task("arithmetic", "test", TaskOptions(limit=args.prompts, operators=args.task_operators, seed=args.seed))
    generator = torch.Generator().manual_seed(args.seed)
    pools = []
    for i, row in enumerate(tqdm(dataset, desc=f"variance[{label}]", unit="prompt")):
        prompt_ids, completions = sample_pool(
            model, tokenizer, row["prompt"], args.pool, args.max_new_tokens, args.temperature, args.seed + i
        )
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor(accuracy_reward(texts, answer=[row["answer"]] * len(texts)), dtype=torch.float64)
        gradients, logit, length = per_completion(model, prompt_ids, completions, params, args.temperature)
        gram = (gradients.double() @ gradients.double().T)
        del gradients
        full = full_model_norms(model, prompt_ids, completions, args.temperature)
        weights = {"exact": gram.diagonal().clone(), "exact_full": full, "logit": logit, "length": length,
                   "uniform": torch.ones_like(rewards)}
        pools.append({"gram": gram, "rewards": rewards, "weights": weights})
    slopes = [fit_slopes(pools, k, args.group_size, args.draws, generator) for k in range(len(pools))]
    per_prompt = [
        group_variances(pool["gram"], pool["rewards"], pool["weights"], args.group_size, args.draws, generator, slope)
        for pool, slope in zip(pools, slopes, strict=True)
    ]
    intervals = bootstrap_ratios(pools, slopes, args, generator)
    exact, full, logit, length = (
        torch.cat([pool["weights"][key] for pool in pools]) for key in ("exact", "exact_full", "logit", "length")
    )
    rewards = torch.cat([pool["rewards"] for pool in pools])
    totals = {name: sum(p[name][0] for p in per_prompt) for name in per_prompt[0]}
    signal = {name: sum(p[name][1] for p in per_prompt) for name in per_prompt[0]}
    ratios = noise_to_signal(per_prompt)
    nsr_rloo, nsr_best, nsr_shift = ratios["rloo"], ratios["oracle_b_star"], ratios["rloo_exact_shift"]
    labels = {name: label for name, (label, _, _) in BASELINES.items()} | ORACLES
    rows = []
    for name, value in totals.items():
        rows.append({
            "name": name,
            "baseline": labels[name],
            "trace_cov": value,
            "ratio_to_group_mean": value / totals["grpo"] if totals["grpo"] else float("nan"),
            "ratio_to_rloo": value / totals["rloo"] if totals["rloo"] else float("nan"),
            "mean_sq_norm": signal[name],
            "noise_to_signal": ratios[name],
            "noise_to_signal_ratio_to_rloo": ratios[name] / nsr_rloo,
            "noise_to_signal_ratio_to_rloo_ci": intervals[name],
            "share_of_oracle_reduction": ((nsr_rloo - ratios[name]) / (nsr_rloo - nsr_best)
                                          if nsr_rloo != nsr_best else float("nan")),
            "share_of_reachable": ((nsr_rloo - ratios[name]) / (nsr_rloo - nsr_shift)
                                   if nsr_rloo != nsr_shift else float("nan")),
        })
    return {
        "point": label,
        "model": model_path,
        "parameters_measured": sum(p.numel() for p in params),
        "completions": len(exact),
        "mean_reward": rewards.mean().item(),
        "mixed_groups": sum(1 for pool in pools if pool["rewards"].min() != pool["rewards"].max()),
        "pooled_slopes": slopes,
        "correlation_with_exact": {
            f"{proxy} vs {reference}": {"pearson": pearson(ref, values), "spearman": spearman(ref, values)}
            for reference, ref in (("exact (measured subset)", exact), ("exact (full model)", full))
            for proxy, values in (("logit", logit), ("length", length))
        } | {"subset vs full model": {"pearson": pearson(full, exact), "spearman": spearman(full, exact)}},
        "weight_spread_max_min": (exact.max() / exact.min().clamp(min=1e-12)).item(),
        "baselines": rows,
    }, (full, logit, length)


def plot(points, scatter, output_dir):
    figure, axes = new_figure(3, (18, 5.5))
    names = [row["baseline"] for row in points[0]["baselines"]]
    width = 0.8 / len(points)
    for k, point in enumerate(points):
        ratios = [row["noise_to_signal_ratio_to_rloo"] for row in point["baselines"]]
        errors = [[r - row["noise_to_signal_ratio_to_rloo_ci"][0] for r, row in zip(ratios, point["baselines"])],
                  [row["noise_to_signal_ratio_to_rloo_ci"][1] - r for r, row in zip(ratios, point["baselines"])]]
        axes[0].barh([i + k * width for i in range(len(names))], ratios, height=width, label=point["point"],
                     xerr=[[max(e, 0.0) for e in side] for side in errors], capsize=2)
    axes[0].set_yticks([i + width * (len(points) - 1) / 2 for i in range(len(names))], names)
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_xlabel("noise ÷ signal (tr Cov / ‖E ĝ‖²), ÷ that of RLOO (= group mean's); 95 % bootstrap intervals")
    axes[0].invert_yaxis()
    axes[0].legend()
    axes[0].set_title("estimator variance by baseline")
    exact, logit, length = scatter
    for axis, proxy, name in ((axes[1], logit, "logit proxy"), (axes[2], length, "length")):
        axis.scatter(exact.numpy(), proxy.numpy(), s=6, alpha=0.5)
        axis.set_xscale("log")
        axis.set_xlabel("exact ‖∇ log π(o|q)‖², full model (ghost norms)")
        axis.set_ylabel(name)
        axis.set_title(f"{name} vs exact, {points[0]['point']}")
    return save_figure(figure, output_dir, "variance")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    output_dir = Path(args.output_dir)
    checkpoints = [(args.model, "base")]
    if args.checkpoints:
        checkpoints += [(path, Path(path).name) for path in args.checkpoints]
    elif args.train_steps > 0:
        from oblr_trl.cli import train

        trained = output_dir / f"oblrpo-{args.train_steps}-steps"
        train(["--model_name_or_path", args.model, "--output_dir", str(trained), "--max_steps", str(args.train_steps),
               "--save_strategy", "no", "--task_operators", args.task_operators, "--plot", "false",
               "--overwrite_output_dir", "true"])
        checkpoints.append((str(trained), f"after {args.train_steps} OBLR-PO steps"))
    points, scatter = [], None
    for path, label in checkpoints:
        point, values = measure(path, args, label)
        points.append(point)
        scatter = scatter or values
    figure = plot(points, scatter, output_dir)
    markdown = [
        f"# Estimator variance by baseline\n\n![variance]({figure.name})\n\n"
        "tr Cov: of the one-group estimator ĝ, summed over prompts. noise ÷ signal: Σ tr Cov / Σ ‖E ĝ‖², which a "
        "common scale does not change (whole-group baselines shrink ĝ by ≈ (G−1)/G, see the script's docstring); its "
        "ratio to RLOO's with a 95 % two-level bootstrap interval (prompts, then completions within each pool). "
        "References fixed per prompt from the whole pool: the oracle b* = E[w r]/E[w] (exact weights), the oracle "
        "mean E[r|q], and RLOO shifted by the exact b* − p (the best a leave-one-out estimate of p can do once the "
        "shift is known). Unreachable for any leave-one-out baseline: the gap between that shifted RLOO and b*; "
        "reachable: the gap between RLOO and the shifted RLOO. Share of reachable: (RLOO's − this one's) / (RLOO's "
        "− shifted RLOO's) noise ÷ signal. Pooled slope: ρ̂ fitted on the other prompts' groups.\n"
    ]
    for point in points:
        corr = point["correlation_with_exact"]
        markdown.append(
            f"## {point['point']} (`{point['model']}`)\n\n"
            f"{point['completions']} completions ({args.prompts} prompts × {args.pool}), groups of {args.group_size}, "
            f"{args.draws} draws per prompt; g over the last {args.layers} blocks + final norm "
            f"({point['parameters_measured']:,} parameters); mean reward {point['mean_reward']:.3f}, "
            f"{point['mixed_groups']} of {args.prompts} prompts with mixed outcomes; exact ‖g‖² max/min "
            f"{point['weight_spread_max_min']:.3g}.\n\n"
            + markdown_table(
                ["baseline", "tr Cov ÷ group mean", "noise ÷ signal", "÷ RLOO's", "95 % interval",
                 "share of b*'s reduction", "share of reachable"],
                [[r["baseline"], r["ratio_to_group_mean"], r["noise_to_signal"], r["noise_to_signal_ratio_to_rloo"],
                  "[{:.3f}, {:.3f}]".format(*r["noise_to_signal_ratio_to_rloo_ci"]), r["share_of_oracle_reduction"],
                  r["share_of_reachable"]] for r in point["baselines"]],
            )
            + "\n\n"
            + markdown_table(
                ["weights", "Pearson", "Spearman"],
                [[name, c["pearson"], c["spearman"]] for name, c in corr.items()],
            )
        )
    keys = ["base", "trained"][: len(points)] if len(points) <= 2 else [point["point"] for point in points]
    estimators = {}
    for row in points[0]["baselines"]:
        name = row["name"]
        per_point = [next(r for r in point["baselines"] if r["name"] == name) for point in points]
        estimators[name] = {
            "label": row["baseline"],
            "noise_to_signal_vs_rloo": dict(zip(keys, [r["noise_to_signal_ratio_to_rloo"] for r in per_point])),
            "noise_to_signal_vs_rloo_ci": dict(zip(keys, [r["noise_to_signal_ratio_to_rloo_ci"] for r in per_point])),
            "share_of_reachable": dict(zip(keys, [r["share_of_reachable"] for r in per_point])),
        }
    json_path, md_path = write_results(
        output_dir, "variance",
        {"arguments": vars(args), "default_estimator": DEFAULT_ESTIMATOR, "estimators": estimators, "points": points},
        "\n\n".join(markdown),
    )
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
