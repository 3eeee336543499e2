"""A learning rate sized by the measured policy step: the trust region (docs/math.md, docs/rate_rule.md).

The paper's step η_t = η_max·f_t leaves η_max = 1/(BL + B²M) to be set by hand. It can be measured. A step of size η
along the optimizer's direction u moves the policy by

    KL(π_t ‖ π_{t+1}) ≈ ½ η² uᵀF u          (F the Fisher matrix of the policy on its own completions)

and under Adam the update's size scales with η while its direction does not, so the realised per-token KL of a step
divided by the square of the rate it used measures the curvature c = ½ uᵀF u along the update. The rate that moves the
policy by a target δ per step is then η_δ = sqrt(δ / ĉ), with ĉ a smoothed curvature. Robotics PPO has adapted its rate
to a desired KL this way for years (rsl_rl's `desired_kl`, by fixed multiplicative steps); here the step is read off
the curvature directly.

Three ways to use η_δ, with η_s = scheduled rate × SNR factor (the rate the SNR rule alone would use) and η_peak the
schedule's peak (the configured rate):

* **cap**: η = min(η_s, η_δ) — the configured rate becomes a ceiling, never exceeded;
* **target**: η = clip(η_δ, r_min·η_s, r_max·η_s) — the rate follows δ both ways, so a too-low configured rate is
  raised as well as a too-high one lowered. Inside its bounds the schedule and the SNR factor cancel: the rate used is
  η_δ, constant between measurements;
* **peak**: η = η_s · clip(η_δ/η_peak, r_min, r_max) = η̂_max · (scheduled ÷ peak) · f — the paper's η_t = η_max·f_t
  with η_max measured: η_δ replaces the configured *peak* rate, and the user's schedule (warm-up, decay) and the SNR
  factor shape every step around it. δ is then the KL aimed at at the schedule's peak; a step at rate η below η̂_max
  aims at δ·(η/η̂_max)² (`aimed_kl`).

All are written as a factor on η_s, floored at r_min so that a spike of curvature cannot stall training. Until a
step has moved the policy there is no curvature to size the step with, so that step is a **probe** at r_min·η_s: it
measures the curvature at a rate too small to do harm, and the next step is sized by it. Without the probe the first
step runs at the configured rate unmeasured, and Adam's first step is its largest (m̂/√v̂ = sign(g), every coordinate
moves by the full rate): on SmolLM2 at 10× the best rate that one step moved the policy by 6.8 nats a token and the
run never recovered (CHANGELOG.md).

The probe's reading overstates the curvature of the steps after it: Adam's first step moves every coordinate by the
full rate, later steps mostly less, so KL/η² of the probe was a median 6.4× that of the next measured step on SmolLM2
a + b (40 runs of the target form; 38 above 1.9×), and the measured steps after it landed at a median 0.16 of the KL
the averaged curvature predicted. In the `peak` form the probe's reading is therefore **provisional**: the step after
the probe is measured too, and its reading replaces the probe's in the average (`needs_measurement`). The `cap` and
`target` forms keep the probe's reading, as they were validated.

Why it overstates them: under Adam the move of a step of rate η is η·u, u = m̂/(√v̂ + ε), and u's size is not fixed.
Its mean square ū² is 1 at the first step (u = sign g) and shrinks as v̂ accumulates gradients whose signs disagree,
so KL/η² falls with ū² even where the policy's curvature does not. With ``per_update`` the curvature is read per unit
of Adam's update, KL/(η²·ū²) (`adam_update_square_sum` reads ū² from the optimizer after the step), and the next step
is sized with the last gradient step's ū²: η_δ = sqrt(δ / (ĉ·ū²)).

Only steps driven by a gradient are measured. A step whose gradient is zero (every group scored alike) still moves the
parameters by Adam's momentum, m̂/√v̂ with no new gradient in m, a move far shorter than a gradient step of the same
rate, so its KL/η² understates the curvature the next gradient step meets: on SmolLM2 (seed 1, 3× the best rate,
target form) three such steps in a row lowered ĉ 7-fold, the next gradient step ran at 4.9e-4, moved the policy by
5.7 nats a token and the rewards were 0 for the next 12 steps (CHANGELOG.md). Nor does the target form raise
such a step above the scheduled rate (`step_rate.StepRateRule.note_grad_norm`): on SmolLM2 (seed 0, the best rate) five
momentum-only steps at 6–10× the schedule drifted a policy that had learned until it collapsed. Where the gradient
norm is not known before the step (DeepSpeed computes it inside), such a step keeps its factor.

The KL itself is measured on tokens sampled from π_t with the k3 estimator E[(ρ − 1) − log ρ], ρ = π_{t+1}/π_t
(non-negative, unbiased; TRL's estimator for its β-KL).

Everything here is torch-only arithmetic: the trainer measures log-probabilities and hands them over.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .choices import TRUST_REGION_MODES
from .snr import BiasCorrectedEMA

__all__ = ["TrustRegionRate", "adam_update_square_sum", "largest_factor", "sampled_token_kl"]


def largest_factor(mode: str, max_ratio: float) -> float:
    """The ceiling of the trust-region factor in ``mode``: 1 for ``"cap"`` (η ≤ η_s, never raised) and r_max for
    ``"target"`` and ``"peak"`` (η ≤ r_max·η_s)."""
    return 1.0 if mode == "cap" else max_ratio


def sampled_token_kl(
    new_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over the masked tokens of the k3 estimate of KL(π_old ‖ π_new), and the number of tokens.

    With Δ = log π_new(y_t) − log π_old(y_t) on tokens y_t sampled from π_old, k3 = e^Δ − 1 − Δ ≥ 0 and
    E[k3] = KL(π_old ‖ π_new) per token. Returned as (sum, count) so that processes can add theirs before dividing.

    Args:
        new_log_probs, old_log_probs: ``(B, T)`` log-probabilities of the completion tokens under the two policies.
        mask: ``(B, T)`` 1 for the tokens that count.
    """
    delta = (new_log_probs.float() - old_log_probs.float()).clamp(-20.0, 20.0)  # exp of a huge Δ is not a number
    k3 = torch.expm1(delta) - delta
    weights = mask.float()
    return (k3 * weights).sum(), weights.sum()


def adam_update_square_sum(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Σ u_i² and the number of coordinates, over the parameters an Adam-type optimizer has stepped, of its last
    update per unit rate u = m̂ / (√v̂ + ε), m̂ = m/(1 − β₁ᵗ), v̂ = v/(1 − β₂ᵗ) (v the running maximum with
    ``amsgrad``), read from its state after the step: a step of rate η moves the parameters by η·u (weight decay
    aside). Returned as a float32 ``[sum, count]`` so that processes holding shards add theirs before dividing (a
    replicated state adds alike in both, so the mean square is the same); None where no parameter has Adam's state
    (another optimizer). The mean square is 1 after Adam's first step (u = sign g) and shrinks as v̂ accumulates
    gradients whose signs disagree from step to step (docs/math.md, "The curvature per unit update").
    """
    total: torch.Tensor | None = None
    count = 0
    for group in optimizer.param_groups:
        beta1, beta2 = group.get("betas", (None, None))
        eps = group.get("eps")
        if beta1 is None or eps is None:
            continue
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
                continue
            # a step count the optimizer keeps on an accelerator (fused, capturable) stays there, in float32 as the
            # optimizer itself computes with it: reading it on the host would wait for the device once per parameter
            step = state["step"]
            if not isinstance(step, torch.Tensor) or step.device.type == "cpu":
                step = float(step)
            second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
            first, second = _local(state["exp_avg"]).float(), _local(second).float()
            denominator = (second / (1.0 - beta2**step)).sqrt_().add_(eps)
            square_sum = first.div(1.0 - beta1**step).div_(denominator).square().sum()
            total = square_sum if total is None else total + square_sum.to(total.device)
            count += first.numel()
    if total is None:
        return None
    return torch.stack([total, torch.tensor(float(count), device=total.device)])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded (DTensor) state, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class TrustRegionRate:
    """The factor that keeps each optimizer step's measured KL near ``target_kl`` (module docstring).

    Args:
        target_kl: δ, the mean per-token KL(π_t ‖ π_{t+1}) a step may move the policy by (at the schedule's peak in
            the ``"peak"`` form).
        mode: ``"cap"`` (never above the scheduled × SNR rate), ``"target"`` (follows δ both ways) or ``"peak"``
            (η_δ replaces the schedule's peak rate; the schedule and the SNR factor shape the steps around it).
        ema_decay: decay of the bias-corrected moving average of the curvature KL/η².
        min_ratio: smallest factor (every form).
        max_ratio: largest factor of ``"target"`` and ``"peak"`` (``"cap"`` never exceeds 1).
        per_update: read the curvature per unit mean-square update, KL/(lr²·ū²), ū² that step's update per unit rate
            (`note_update` before `update`), and predict the next step with the last ū² (module docstring).
    """

    def __init__(self, target_kl: float, mode: str = "cap", ema_decay: float = 0.5, min_ratio: float = 0.01,
                 max_ratio: float = 10.0, per_update: bool = False):
        if mode not in TRUST_REGION_MODES:
            raise ValueError(f"mode must be one of {TRUST_REGION_MODES}; got {mode!r}.")
        if not target_kl > 0 or not math.isfinite(target_kl):
            raise ValueError(f"target_kl must be a finite float > 0; got {target_kl}.")
        self.target_kl, self.mode = float(target_kl), mode
        self.min_ratio, self.max_ratio = float(min_ratio), float(max_ratio)
        self.curvature = BiasCorrectedEMA(ema_decay)
        self.provisional = False  # the curvature is the probe's reading alone ("peak": replaced by the next one)
        self.per_update = per_update
        self.update_mean_square: float | None = None  # of the last gradient step's update per unit rate

    def note_update(self, mean_square: float | None) -> None:
        """A gradient step's update per unit rate had mean square ``mean_square`` (`adam_update_square_sum`): with
        ``per_update`` the readings are divided by it and the next step is predicted to have the same (None, zero or
        non-finite: nothing to note)."""
        if self.per_update and mean_square is not None and math.isfinite(mean_square) and mean_square > 0:
            self.update_mean_square = float(mean_square)

    @property
    def _update_scale(self) -> float:
        """ū² of the last gradient step with ``per_update`` (once known), else 1: what a reading is divided by."""
        return self.update_mean_square if self.per_update and self.update_mean_square is not None else 1.0

    def update(self, kl: float, lr: float) -> bool:
        """A step of rate ``lr`` moved the policy by ``kl``: fold KL/lr² (KL/(lr²·ū²) with ``per_update``, ū² that
        step's, `note_update`) into the curvature. Returns whether it
        counted (a zero or non-finite rate, or a non-finite KL, is no measurement). In the ``"peak"`` form the probe's
        reading is provisional: the next reading replaces it."""
        if not (math.isfinite(kl) and math.isfinite(lr) and lr > 0):
            return False
        was_probe = self.probing
        if self.provisional:
            self.curvature = BiasCorrectedEMA(self.curvature.decay)
        self.curvature.update(max(kl, 0.0) / (lr**2 * self._update_scale))
        self.provisional = self.mode == "peak" and was_probe and not self.probing
        return True

    @property
    def rate(self) -> float:
        """η_δ = sqrt(δ / ĉ) (sqrt(δ / (ĉ·ū²)) with ``per_update``, ū² the last gradient step's): the rate the smoothed
        curvature says moves the policy by δ (inf before any measurement or while no step moved it). In the ``"peak"``
        form this is η̂_max, the measured peak rate."""
        curvature = self.curvature.value
        if not math.isfinite(curvature) or curvature <= 0:
            return math.inf
        return math.sqrt(self.target_kl / (curvature * self._update_scale))

    @property
    def probing(self) -> bool:
        """True until a step that moved the policy has been folded in: no curvature yet, so the next step is the
        probe (factor r_min) and measuring it is the only way to size the ones after."""
        return math.isinf(self.rate)

    @property
    def needs_measurement(self) -> bool:
        """Whether the next step must be measured whatever the cadence: while probing, and in the ``"peak"`` form
        while the curvature is the probe's provisional reading."""
        return self.probing or self.provisional

    def aimed_kl(self, lr: float) -> float:
        """The KL the smoothed curvature predicts for a step of rate ``lr``: ĉ·lr² = δ·(lr/η_δ)² (NaN while
        probing: nothing is aimed at)."""
        if self.probing or not math.isfinite(lr):
            return math.nan
        return self.target_kl * (lr / self.rate) ** 2

    def factor(self, base_lr: float, peak_lr: float | None = None) -> float:
        """The factor on ``base_lr`` (scheduled rate × SNR factor) for the next step: min(1, η_δ/η_s) (cap),
        clip(η_δ/η_s, r_min, r_max) (target) or clip(η_δ/η_peak, r_min, r_max) (peak, ``peak_lr`` the schedule's
        peak; ``base_lr`` when not given), never below r_min; r_min (the probe) until a step has moved the policy."""
        if not base_lr > 0:
            return 1.0
        if self.probing:
            return self.min_ratio
        reference = peak_lr if self.mode == "peak" and peak_lr is not None and peak_lr > 0 else base_lr
        return min(largest_factor(self.mode, self.max_ratio), max(self.min_ratio, self.rate / reference))

    def state_dict(self) -> dict[str, Any]:
        return {"curvature": self.curvature.state_dict(), "provisional": self.provisional,
                "update_mean_square": self.update_mean_square}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curvature.load_state_dict(state["curvature"])
        self.provisional = bool(state.get("provisional", False))
        self.update_mean_square = state.get("update_mean_square")
