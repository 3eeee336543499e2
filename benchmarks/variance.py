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

Run it at several points in training (the base model, and after some OBLR-PO steps): the spread of the weights, hence
what the baseline can gain, changes with the policy.

    python benchmarks/variance.py                      # SmolLM2-135M-Instruct, base and after 30 OBLR-PO steps
    python benchmarks/variance.py --prompts 2 --pool 8 --train_steps 0 --model <tiny>   # smoke size
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, markdown_table, new_figure, save_figure, write_results  # noqa: E402

from oblr_trl.baselines import gradient_weighted_baseline  # noqa: E402
from oblr_trl.weights import log_sum_sq_probs, logit_proxy_weights  # noqa: E402

# (label, weight source, leave-one-out); the oracle (a fixed b* per prompt, from the whole pool) is added separately
BASELINES = [
    ("group mean (GRPO)", "uniform", False),
    ("uniform LOO (RLOO)", "uniform", True),
    ("length, whole group (OPO)", "length", False),
    ("length LOO", "length", True),
    ("logit, whole group", "logit", False),
    ("logit LOO (OBLR-PO default)", "logit", True),
    ("exact, whole group", "exact", False),
    ("exact LOO", "exact", True),
    ("exact full-model, whole group", "exact_full", False),
    ("exact full-model LOO (OBLR-PO exact)", "exact_full", True),
]
ORACLE = "oracle b* (fixed per prompt)"


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
    """‖∇_θ log π(o|q)‖² over all parameters, by the batched ghost-norm pass (`oblr_trl.ghost_norms`)."""
    from oblr_trl.ghost_norms import log_likelihood_grad_sq_norms

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


def group_variances(gram, rewards, weights, group_size, draws, generator):
    """(tr Cov ĝ, ‖E ĝ‖²) of the group estimator for each baseline, groups drawn with replacement from the pool
    (Gram trick). ‖E ĝ‖² is the squared norm of the mean over the draws less its own sampling noise, tr Cov / draws.

    The pool stands in for the policy's distribution, so its gradients are centred first (g_i − ḡ, on the Gram
    matrix): the score identity E[∇ log π] = 0 holds for the policy, and the pool's mean gradient ḡ is sampling noise.
    Left in, it would add −E[b]·ḡ to every estimator's mean, so that unbiased baselines had different expectations.
    The weights stay the uncentred ‖g_i‖², what training uses."""
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
    for label, source, loo in BASELINES:
        w = torch.ones_like(r) if source == "uniform" else weights[source][index]
        result[label] = trace_cov(gradient_weighted_baseline(r, w, leave_one_out=loo).baseline)
    exact = weights["exact"]
    result[ORACLE] = trace_cov((exact * rewards).sum() / exact.sum() if exact.sum() > 0 else rewards.mean())
    return result


def spearman(a, b):
    if len(a) < 3:
        return float("nan")
    ranks = torch.stack([a.argsort().argsort(), b.argsort().argsort()]).double()
    return torch.corrcoef(ranks)[0, 1].item()


def pearson(a, b):
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def measure(model_path, args, label):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.models import resolve_model
    from oblr_trl.rewards import accuracy_reward
    from oblr_trl.tasks import TaskOptions, load_task

    path = resolve_model(model_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    params = trainable_subset(model, args.layers)
    dataset = load_task("arithmetic", "test", TaskOptions(limit=args.prompts, operators=args.task_operators, seed=args.seed))
    generator = torch.Generator().manual_seed(args.seed)
    totals = {name: 0.0 for name, _, _ in BASELINES} | {ORACLE: 0.0}
    signal = dict.fromkeys(totals, 0.0)
    all_exact, all_full, all_logit, all_length, all_rewards = [], [], [], [], []
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
        weights = {"exact": gram.diagonal().clone(), "exact_full": full, "logit": logit, "length": length}
        for name, (trace, mean_sq_norm) in group_variances(gram, rewards, weights, args.group_size, args.draws,
                                                           generator).items():
            totals[name] += trace
            signal[name] += mean_sq_norm
        for bucket, values in ((all_exact, weights["exact"]), (all_full, full), (all_logit, logit), (all_length, length),
                               (all_rewards, rewards)):
            bucket.append(values)
    exact, full, logit, length = torch.cat(all_exact), torch.cat(all_full), torch.cat(all_logit), torch.cat(all_length)
    rewards = torch.cat(all_rewards)
    reference, rloo = totals["group mean (GRPO)"], totals["uniform LOO (RLOO)"]
    noise_to_signal = {name: totals[name] / signal[name] if signal[name] > 0 else float("nan") for name in totals}
    nsr_rloo, nsr_best = noise_to_signal["uniform LOO (RLOO)"], noise_to_signal[ORACLE]
    rows = []
    for name, value in totals.items():
        rows.append({
            "baseline": name,
            "trace_cov": value,
            "ratio_to_group_mean": value / reference if reference else float("nan"),
            "ratio_to_rloo": value / rloo if rloo else float("nan"),
            "mean_sq_norm": signal[name],
            "noise_to_signal": noise_to_signal[name],
            "noise_to_signal_ratio_to_rloo": noise_to_signal[name] / nsr_rloo,
            "share_of_oracle_reduction": ((nsr_rloo - noise_to_signal[name]) / (nsr_rloo - nsr_best)
                                          if nsr_rloo != nsr_best else float("nan")),
        })
    return {
        "point": label,
        "model": model_path,
        "parameters_measured": sum(p.numel() for p in params),
        "completions": len(exact),
        "mean_reward": rewards.mean().item(),
        "mixed_groups": sum(1 for r in all_rewards if r.min() != r.max()),
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
        axes[0].barh([i + k * width for i in range(len(names))], ratios, height=width, label=point["point"])
    axes[0].set_yticks([i + width * (len(points) - 1) / 2 for i in range(len(names))], names)
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_xlabel("noise ÷ signal (tr Cov / ‖E ĝ‖²), ÷ that of RLOO (= group mean's)")
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
               "--save_strategy", "no", "--task_operators", args.task_operators, "--plot", "false"])
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
        "common scale does not change (whole-group baselines shrink ĝ by ≈ (G−1)/G, see the script's docstring). "
        "Share of b*'s reduction: (RLOO's noise ÷ signal − this one's) / (RLOO's − the oracle b*'s), the oracle being "
        "the variance-optimal baseline E[w r]/E[w] with exact weights, fixed per prompt from the whole pool.\n"
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
                ["baseline", "tr Cov", "÷ group mean", "÷ RLOO", "noise ÷ signal", "÷ RLOO's",
                 "share of b*'s reduction"],
                [[r["baseline"], r["trace_cov"], r["ratio_to_group_mean"], r["ratio_to_rloo"], r["noise_to_signal"],
                  r["noise_to_signal_ratio_to_rloo"], r["share_of_oracle_reduction"]] for r in point["baselines"]],
            )
            + "\n\n"
            + markdown_table(
                ["weights", "Pearson", "Spearman"],
                [[name, c["pearson"], c["spearman"]] for name, c in corr.items()],
            )
        )
    json_path, md_path = write_results(output_dir, "variance", {"arguments": vars(args), "points": points},
                                       "\n\n".join(markdown))
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
