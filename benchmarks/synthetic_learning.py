"""Benchmark `synthetic_learning`: the learning comparison with statistical power, on a policy small enough for it.

The SmolLM2 run (`learning.py`) is the realistic comparison but affords a handful of seeds; this one runs every method
at every learning rate over 50+ seeds in minutes on a CPU, with the same pure functions the trainer uses
(`estimators.advantages`, `estimators.weights`, `estimators.snr`). Only the policy and the task are synthetic.

Task. A prompt is a feature vector x ∈ R^d (fresh prompts every step, so there is no over-fitting to measure); the
answer is T tokens over a vocabulary of V, token 0 being EOS. The right token at position t is the arg-max over the
non-EOS tokens of a fixed teacher W*_t·x. The reward is the fraction of the T positions answered right before the
first EOS: verifiable, dense, with completions of varied length. The held-out score is the greedy reward on 256
prompts no run trains on.

Policy. logits_t = W_t·x + b_t, one linear layer per position (T·V·(d+1) parameters, exact gradients by autograd;
the seeds run side by side as a batch dimension). Its gradient w.r.t. W_t for one completion is (e_{y_t} − p_t)·xᵀ,
so the `logit` weight Σ_t ‖e_{y_t} − p_t‖² is the exact squared gradient norm up to the per-prompt factor ‖x‖² + 1,
which a group's baseline does not see.

Every method uses TRL's default `dapo` loss (token sum over the batch's tokens), Adam (0.9, 0.999), no clipping, n
prompts × G completions per step. Its learning rate is the trainer's own rule (`estimators.step_rate.StepRateRule`,
built by `estimators.step_rate.step_rate_rule` from the rule's options and constants), driven through each step as the
trainer drives it: the `defaults` arm runs exactly what ships — the trust region measuring the peak rate (its KL every
16th step with a gradient, per unit of Adam's update), the calibrated SNR factor — on a constant schedule (or TRL's
linear decay, `schedule`). The KL of a measured step is taken on all of its completions' tokens (the trainer samples 8
completions). A method's learning rate is chosen on validation seeds (highest mean area under the held-out curve) from
a log-spaced grid; the comparison then runs on fresh test seeds, paired (same initial parameters and prompts per seed),
with 95 % t-intervals of the paired differences over the paired seeds.

    python -m benchmarks.synthetic_learning                  # 20 validation + 100 test seeds, 16 min on 2 busy cores
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import cached_property, partial
from types import SimpleNamespace

import torch

from benchmarks.common import (
    RESULTS, markdown_table, new_figure, save_figure, shipped, t_interval, write_results,
)

from oblr_trl.estimators.advantages import gradient_weighted_advantages
from oblr_trl.estimators.baselines import PooledSlope
from oblr_trl.estimators.snr import cross_step_noise_estimate
from oblr_trl.estimators.step_rate import (
    RATE_RULE_OPTIONS, RateRuleTuning, StepRateRule, step_rate_rule,
)
from oblr_trl.estimators.trust_region import sampled_token_kl
from oblr_trl.estimators.weights import length_weights, logit_gradient_sq_norms, uniform_weights

# the rate rules, as options of the rule (`RATE_RULE_OPTIONS`) over the shipped defaults ({} is what ships)
CONSTANT_RATE = {"use_snr_lr": False, "lr_trust_region_kl": None}  # the scheduled rate, as TRL's GRPO


def calibrated_snr_rate(min_ratio: float = 1.0, max_ratio: float = 2.0) -> dict:
    """The calibrated SNR factor in [min_ratio, max_ratio], without a trust region."""
    return {"lr_trust_region_kl": None, "snr_lr_min_ratio": min_ratio, "snr_lr_max_ratio": max_ratio}


@dataclass(frozen=True)
class Method:
    """A baseline (weights, leave-one-out, reward scaling) and a learning-rate rule."""

    weights: str  # "logit", "length" or "uniform"
    leave_one_out: bool
    scale_rewards: str  # "none" or "group"
    rate: dict = field(default_factory=lambda: dict(CONSTANT_RATE))  # `RATE_RULE_OPTIONS` and `RateRuleTuning` fields
    estimator: str = "weighted"  # the estimate of b* (OBLRPOConfig.baseline_estimator); "weighted" for the others
    description: str = ""

    def rate_rule(self) -> StepRateRule:
        """A fresh rate rule, the trainer's (`step_rate_rule`) with this method's options (the shipped ones where not
        set) and constants; a setting that is neither is refused by name."""
        tuning, options = RateRuleTuning.split(self.rate)
        unknown = sorted(set(options) - set(RATE_RULE_OPTIONS))
        if unknown:
            raise ValueError(f"{unknown} are neither options of the rate rule {RATE_RULE_OPTIONS} nor its constants "
                             "(`RateRuleTuning`).")
        options = {name: options.get(name, shipped(name)) for name in RATE_RULE_OPTIONS}
        return step_rate_rule(SimpleNamespace(**options), tuning)

    @property
    def runs_shipped_rate(self) -> bool:
        """Whether the rate rule is what ships: no option and no constant of the rule changed."""
        return all(shipped(key) == value for key, value in self.rate.items())

    @property
    def has_snr_factor(self) -> bool:
        return self.rate.get("use_snr_lr", True)


METHODS = {
    "defaults": Method("logit", True, "group", {}, estimator="pooled_slope",
                       description="OBLR-PO's defaults as they ship: pooled-slope LOO (logit weights), group std "
                       "scaling (TRL's), the trust region's peak rate (δ = 0.005 per update, every 16th step), the "
                       "calibrated SNR factor in [1, 2]"),
    "oblrpo": Method("logit", True, "group", calibrated_snr_rate(), estimator="pooled_slope",
                     description="OBLR-PO's defaults before the trust region (2026-11-26): pooled-slope LOO (logit "
                     "weights), group std scaling (TRL's), calibrated SNR rate in [1, 2]"),
    "oblrpo-unscaled": Method("logit", True, "none", calibrated_snr_rate(), estimator="pooled_slope",
                              description="the defaults before 2026-11-23: as oblrpo, without std scaling"),
    "oblrpo-weighted": Method("logit", True, "none", calibrated_snr_rate(),
                              description="the paper's weighted LOO baseline, calibrated SNR rate, no std scaling"),
    "grpo": Method("uniform", False, "group", description="TRL's GRPO defaults: group mean, group std scaling"),
    "rloo": Method("uniform", True, "none", description="uniform leave-one-out, no scaling"),
    "opo": Method("length", False, "none", description="length-weighted whole-group baseline (verl's OPO)"),
    "oblrpo-no-snr": Method("logit", True, "none", estimator="pooled_slope",
                            description="OBLR-PO's baseline, no std scaling, constant rate"),
    "oblrpo-absolute": Method("logit", True, "none", {"lr_trust_region_kl": None, "snr_lr_reference": "absolute"},
                              estimator="pooled_slope", description="OBLR-PO with the paper-literal rate, no std scaling"),
    "oblrpo-two-sided": Method("logit", True, "none", calibrated_snr_rate(0.5, 2.0), "pooled_slope",
                               description="calibrated, ratio in [0.5, 2], no std scaling"),
    "oblrpo-wide": Method("logit", True, "none", calibrated_snr_rate(0.25, 4.0), "pooled_slope",
                          description="calibrated, ratio in [0.25, 4], no std scaling"),
    "rloo-group-scale": Method("uniform", True, "group", description="uniform LOO with group std scaling"),
    "oblrpo-group-scale": Method("logit", True, "group", estimator="pooled_slope",
                                 description="OBLR-PO's baseline with group std scaling"),
}


@dataclass(frozen=True)
class Task:
    dim: int = 8
    length: int = 4
    vocab: int = 6
    prompts_per_step: int = 4
    group_size: int = 8
    steps: int = 200
    eval_every: int = 10


def teacher_targets(task: Task, features: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """(…, T) right tokens: arg-max over the non-EOS tokens of W*_t·x."""
    scores = torch.einsum("tvd,...d->...tv", teacher, features)
    return scores[..., 1:].argmax(-1) + 1


def rewards_of(tokens: torch.Tensor, targets: torch.Tensor, eos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward (fraction right before the first EOS) and the loss mask (tokens up to and including the first EOS)."""
    before_eos = (tokens == eos).long().cumsum(-1) == 0
    mask = before_eos | ((tokens == eos) & ((tokens == eos).long().cumsum(-1) == 1))
    right = (tokens == targets) & before_eos
    return right.float().mean(-1), mask.float()


def completion_log_probs(log_p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(S, n, G, T) log-probabilities of the sampled tokens under the per-prompt (S, n, T, V) log-softmax."""
    S, n, G, T = tokens.shape
    return log_p.unsqueeze(2).expand(S, n, G, T, log_p.shape[-1]).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def problem(task: Task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher, the 256 held-out prompts and their right answers: fixed seeds, one problem for every study."""
    teacher = torch.randn(task.length, task.vocab, task.dim, generator=torch.Generator().manual_seed(12345))
    held_out = torch.randn(256, task.dim, generator=torch.Generator().manual_seed(54321))
    return teacher, held_out, teacher_targets(task, held_out, teacher)


class TakenStep:
    """What the rate rules may ask of the step just taken (`StepRateRule.end_step`), computed for every seed at the
    first request: the KL(π_t ‖ π_t+1) of a seed's step on its own completions' tokens, and the mean square of Adam's
    update per unit rate, m̂ / (√v̂ + ε)."""

    def __init__(self, params: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor, token_log_p: torch.Tensor,
                 mask: torch.Tensor, exp_avg: torch.Tensor, bias_correction: float, denom: torch.Tensor):
        self.params, self.x, self.tokens, self.token_log_p, self.mask = params, x, tokens, token_log_p, mask
        self.exp_avg, self.bias_correction, self.denom = exp_avg, bias_correction, denom

    @cached_property
    def new_token_log_p(self) -> torch.Tensor:
        return completion_log_probs(torch.log_softmax(torch.einsum("stvd,snd->sntv", self.params, self.x), -1),
                                    self.tokens)

    @cached_property
    def update_mean_squares(self) -> list[float]:
        return (self.exp_avg / self.bias_correction / self.denom).pow(2).mean((1, 2, 3)).tolist()

    def kl(self, seed: int, measure: bool) -> float | None:
        if not measure:
            return None
        total, count = sampled_token_kl(self.new_token_log_p[seed], self.token_log_p[seed], self.mask[seed])
        return float(total / count)

    def update_mean_square(self, seed: int) -> float:
        return self.update_mean_squares[seed]


SCHEDULES = ("constant", "linear")  # "linear": TRL's default, the rate decays linearly to 0 over the run, no warm-up


def run(method: Method, lrs: torch.Tensor, seeds: list[int], task: Task, teacher: torch.Tensor, held_out: torch.Tensor,
        held_out_targets: torch.Tensor, schedule: str = "constant") -> dict:
    """Train one policy per seed (side by side) and return held-out curves and learning-rate traces."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    S, T, V, D = len(seeds), task.length, task.vocab, task.dim
    n, G = task.prompts_per_step, task.group_size
    init = torch.stack([torch.randn(T, V, D + 1, generator=torch.Generator().manual_seed(seed)) * 0.05 for seed in seeds])
    params = init.clone().requires_grad_(True)
    exp_avg, exp_avg_sq = torch.zeros_like(params), torch.zeros_like(params)
    prompt_gens = [torch.Generator().manual_seed(10_000 + seed) for seed in seeds]
    sample_gen = torch.Generator().manual_seed(20_000 + seeds[0])
    # the trainer's rate rule, one per seed, driven through each step as `OptimizerStepControl` drives it (no
    # learning-rate warm-up here, so the calibration window opens after `snr_warmup_steps`)
    rules = [method.rate_rule() for _ in seeds]
    previous_grad = None
    slopes = [PooledSlope(0.9) for _ in seeds]  # the trainer's POOLED_SLOPE_DECAY
    curve, lr_trace, factor_trace = [], [], []

    def held_out_score() -> torch.Tensor:
        with torch.no_grad():
            x = torch.cat([held_out, torch.ones(held_out.shape[0], 1)], -1)
            logits = torch.einsum("stvd,qd->sqtv", params, x)
            tokens = logits.argmax(-1)
            return rewards_of(tokens, held_out_targets.expand(S, -1, -1))[0].mean(-1)

    for step in range(task.steps + 1):
        if step % task.eval_every == 0:
            curve.append(held_out_score())
        if step == task.steps:
            break
        features = torch.stack([torch.randn(n, D, generator=g) for g in prompt_gens])  # (S, n, D)
        targets = teacher_targets(task, features, teacher)  # (S, n, T)
        x = torch.cat([features, torch.ones(S, n, 1)], -1)
        logits = torch.einsum("stvd,snd->sntv", params, x)  # (S, n, T, V)
        log_p = torch.log_softmax(logits, -1)
        with torch.no_grad():
            probs = log_p.exp().unsqueeze(2).expand(S, n, G, T, V)
            tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=sample_gen).view(S, n, G, T)
            reward, mask = rewards_of(tokens, targets.unsqueeze(2))
        token_log_p = completion_log_probs(log_p, tokens)
        flat_mask = mask.reshape(-1, T)
        if method.weights == "logit":
            log_sum_sq = torch.logsumexp(2 * log_p.detach(), -1).unsqueeze(2).expand(S, n, G, T)
            per_token = logit_gradient_sq_norms(token_log_p.detach().reshape(-1, T), log_sum_sq.reshape(-1, T))
            weights = (per_token * flat_mask).sum(-1)
        elif method.weights == "length":
            weights = length_weights(flat_mask)
        else:
            weights = uniform_weights(flat_mask)
        slope = torch.tensor([fit.value for fit in slopes], dtype=torch.float32).repeat_interleave(n).unsqueeze(1)
        advantages = gradient_weighted_advantages(
            reward.reshape(-1), weights, G, method.leave_one_out, method.scale_rewards, estimator=method.estimator,
            slope=slope,
        ).advantages.view(S, n, G, 1)
        if method.estimator == "pooled_slope":  # after this batch's baselines, as in the trainer
            for fit, seed_rewards, seed_weights in zip(slopes, reward, weights.view(S, n, G), strict=True):
                fit.update(seed_rewards, seed_weights, method.leave_one_out)
        tokens_per_seed = mask.sum((1, 2, 3))
        loss = -((advantages * token_log_p * mask).sum((1, 2, 3)) / tokens_per_seed).sum()
        (grad,) = torch.autograd.grad(loss, params)

        scheduled = lrs * (1.0 - step / task.steps) if schedule == "linear" else lrs
        for rule, rate, peak in zip(rules, scheduled.tolist(), lrs.tolist(), strict=True):  # on_step_begin
            rule.begin_step(rate, peak)
        flat = grad.reshape(S, -1).double()
        sq = flat.pow(2).sum(-1)
        grad_norms = sq.sqrt().tolist()
        factors = torch.tensor([rule.note_grad_norm(norm) for rule, norm in zip(rules, grad_norms, strict=True)])
        if method.has_snr_factor:  # the step's noise sizes the next step's factor
            dots = (flat * previous_grad).sum(-1).tolist() if previous_grad is not None else [None] * S
            for rule, s_q, dot in zip(rules, sq.tolist(), dots, strict=True):
                rule.observe_noise(None if dot is None else cross_step_noise_estimate(s_q, dot, n), n)
            previous_grad = flat
        lr = scheduled * factors
        lr_trace.append(lr)
        with torch.no_grad():  # Adam, one learning rate per seed
            t = step + 1
            exp_avg.mul_(0.9).add_(grad, alpha=0.1)
            exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
            denom = (exp_avg_sq / (1 - 0.999**t)).sqrt_().add_(1e-8)
            params.sub_(lr.view(S, 1, 1, 1) * (exp_avg / (1 - 0.9**t)) / denom)
            taken = TakenStep(params, x, tokens, token_log_p.detach(), mask, exp_avg, 1 - 0.9**t, denom)
            records = [rule.end_step(float(lr[s]), step_kl=partial(taken.kl, s),
                                     update_mean_square=partial(taken.update_mean_square, s))
                       for s, rule in enumerate(rules)]
        factor_trace.append(torch.tensor([1.0 if r.snr_factor is None else r.snr_factor for r in records]))

    curve = torch.stack(curve, 1)  # (S, evals)
    lr_trace = torch.stack(lr_trace, 1)  # (S, steps)
    return {
        "curve": curve,
        "auc": curve.mean(1),
        "final": curve[:, -1],
        "mean_lr": lr_trace.mean(1),
        "lr_trace": lr_trace,
        "mean_factor": torch.stack(factor_trace, 1).mean(1),
        "factor_trace": torch.stack(factor_trace, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validation_seeds", type=int, default=20)
    parser.add_argument("--test_seeds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--output_dir", default=str(RESULTS / "learning_synthetic"))
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    torch.set_num_threads(2)
    task = Task(steps=args.steps)
    teacher, held_out, held_out_targets = problem(task)
    validation = list(range(args.validation_seeds))
    test = list(range(1000, 1000 + args.test_seeds))

    def evaluate(method: Method, lr: float, seeds: list[int]) -> dict:
        return run(method, torch.full((len(seeds),), lr), seeds, task, teacher, held_out, held_out_targets)

    sweep, best = {}, {}
    with tqdm(total=len(args.methods) * len(args.lrs), desc="learning-rate sweep (validation seeds)") as bar:
        for name in args.methods:
            sweep[name] = {}
            for lr in args.lrs:
                sweep[name][lr] = float(evaluate(METHODS[name], lr, validation)["auc"].mean())
                bar.update()
            best[name] = max(sweep[name], key=sweep[name].get)

    results = {}
    for name in tqdm(args.methods, desc="test seeds"):
        results[name] = evaluate(METHODS[name], best[name], test)
    if "oblrpo" in results:  # a constant rate at the default's realised mean rate: is it the adaptation or the level?
        constant = Method("logit", True, "group", estimator="pooled_slope",
                          description="OBLR-PO's baseline at oblrpo's realised mean rate")
        realised = float(results["oblrpo"]["mean_lr"].mean())
        results["oblrpo-constant-control"] = evaluate(constant, realised, test)
        best["oblrpo-constant-control"] = realised

    reference = results["grpo"]
    summary = {"task": task.__dict__, "lrs": args.lrs, "validation_seeds": validation, "test_seeds": test,
               "sweep_auc": {k: {str(lr): v for lr, v in d.items()} for k, d in sweep.items()}, "methods": {}}
    rows = []
    for name, result in results.items():
        auc_diff = result["auc"] - reference["auc"]
        final_diff = result["final"] - reference["final"]
        entry = {
            "description": (METHODS.get(name) or constant).description,
            "best_lr": best[name],
            "auc_mean": float(result["auc"].mean()),
            "auc_ci": t_interval(result["auc"].tolist()),
            "final_acc_mean": float(result["final"].mean()),
            "final_acc_ci": t_interval(result["final"].tolist()),
            "auc_minus_grpo": float(auc_diff.mean()),
            "auc_minus_grpo_ci": t_interval(auc_diff.tolist()),
            "final_minus_grpo": float(final_diff.mean()),
            "final_minus_grpo_ci": t_interval(final_diff.tolist()),
            "mean_lr_factor": float(result["mean_factor"].mean()),
            "mean_lr_over_configured": float(result["mean_lr"].mean()) / best[name],
            "lr_factor_range": [float(result["factor_trace"].min()), float(result["factor_trace"].max())],
            "seeds": len(test),
        }
        summary["methods"][name] = entry
        rows.append([name, entry["best_lr"], entry["auc_mean"],
                     f"{entry['auc_minus_grpo']:+.4f} [{entry['auc_minus_grpo_ci'][0]:+.4f}, {entry['auc_minus_grpo_ci'][1]:+.4f}]",
                     entry["final_acc_mean"],
                     f"{entry['final_minus_grpo']:+.4f} [{entry['final_minus_grpo_ci'][0]:+.4f}, {entry['final_minus_grpo_ci'][1]:+.4f}]",
                     entry["mean_lr_factor"], f"{entry['lr_factor_range'][0]:.2f}–{entry['lr_factor_range'][1]:.2f}",
                     entry["mean_lr_over_configured"]])

    sweep_rows = [[name, *[sweep[name][lr] for lr in args.lrs]] for name in args.methods]
    markdown = (
        f"## Synthetic learning testbed ({len(test)} paired test seeds, {task.steps} steps, "
        f"{task.prompts_per_step} prompts × {task.group_size} completions a step)\n\n"
        "Each method at its own best learning rate (chosen on validation seeds). AUC: mean held-out greedy score over "
        "the run; differences are paired against `grpo` with 95 % t-intervals over paired seeds. The rate used is the "
        "configured one × the schedule (constant) × the SNR factor × the trust region's factor (`defaults`).\n\n"
        + markdown_table(["method", "best lr", "AUC", "AUC − grpo [95 % CI]", "final score", "final − grpo [95 % CI]",
                          "mean SNR factor", "SNR factor range", "mean rate ÷ configured"], rows)
        + "\n\n### Learning-rate sweep (validation AUC)\n\n"
        + markdown_table(["method", *[str(lr) for lr in args.lrs]], sweep_rows)
    )
    write_results(args.output_dir, "summary", summary, markdown)

    figure, (curves, factors) = new_figure(2, (12, 4.5))
    steps = list(range(0, task.steps + 1, task.eval_every))
    for name, result in results.items():
        mean = result["curve"].mean(0)
        curves.plot(steps, mean.tolist(), label=f"{name} (lr {best[name]:.3g})")
        if METHODS.get(name, constant).has_snr_factor:
            factors.plot(result["factor_trace"].mean(0).tolist(), label=name)
    curves.set(xlabel="step", ylabel="held-out greedy score", title=f"mean of {len(test)} seeds")
    curves.legend(fontsize=7)
    factors.set(xlabel="step", ylabel="learning-rate factor (mean over seeds)", title="SNR factor")
    factors.legend(fontsize=7)
    save_figure(figure, args.output_dir, "summary")
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
