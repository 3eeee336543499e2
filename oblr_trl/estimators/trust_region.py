"""A learning rate sized by the measured policy step: the trust region (docs/math.md, docs/rate_rule.md).

A step of rate η along Adam's update u = m̂/(√v̂ + ε) moves the policy by

    KL(π_t ‖ π_{t+1}) ≈ ½ η² uᵀF u          (F the Fisher matrix of the policy on its own completions)

Under Adam the update's direction does not scale with η, and its mean square ū² is 1 at the first step (u = sign g)
and shrinks as v̂ accumulates gradients whose signs disagree, so a step's KL divided by η²·ū² measures the curvature
c = ½ uᵀF u / ū² along the update; ū² comes from the optimizer's state after the step (`adam_update_square_sum`; an
optimizer without Adam's state is read per unit rate, ū² = 1). With ĉ a bias-corrected moving average of the readings
and ū² the last gradient step's, the rate that moves the policy by a target δ is

    η_δ = sqrt(δ / (ĉ · ū²))

and it replaces the paper's hand-set peak rate η_max: with η_s = scheduled rate × SNR factor and η_peak the rate the
schedule multiplies, a step runs at

    η = η_s · clip(η_δ / η_peak, r_min, r_max) = η̂_max · (scheduled ÷ peak) · f,

so the user's schedule (warm-up, decay) and the SNR factor shape every step around the measured peak; a step at rate
η aims at δ·(η/η̂_max)² (`aimed_kl`). Until a step has moved the policy there is no curvature, and the step is a
**probe** at r_min·η_s: a rate too small to do harm, whose reading sizes the steps after it, where an unmeasured
first Adam step (every coordinate moving by the full rate) could wreck a run at once. The probe's reading overstates
the curvature of later steps (u = sign g is Adam's largest update), so it is **provisional**: the step after the probe
is measured too and its reading replaces the probe's in the average (`needs_measurement`).

The KL itself is measured on tokens sampled from π_t with the k3 estimator E[(ρ − 1) − log ρ], ρ = π_{t+1}/π_t
(non-negative, unbiased; TRL's estimator for its β-KL). Why the rule is built this way, with the measurements that
decided each part: docs/rate_rule.md. Everything here is torch-only arithmetic: the trainer measures
log-probabilities and hands them over.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .snr import BiasCorrectedEMA

__all__ = ["TrustRegionRate", "adam_update_square_sum", "sampled_token_kl"]


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

    The trust region reads it after every step, so it is computed as Σ m²/(√v + ε√c₂)² · c₂/c₁² (c₁, c₂ = 1 − β₁ᵗ,
    1 − β₂ᵗ: the same u, the bias corrections taken out of the elementwise work) over pieces of each state tensor
    small enough that their temporaries stay in the CPU's cache: the state is then read from memory once, where the
    elementwise form over whole tensors moved it about a dozen times and cost nearly what Adam's own step does
    (benchmarks/README.md, "Under vLLM").
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
            first, second = _local(state["exp_avg"]), _local(second)
            first_correction, second_correction = 1.0 - beta1**step, 1.0 - beta2**step
            square_sum = _update_square_sum(first, second, eps * second_correction**0.5)
            square_sum = square_sum * (second_correction / first_correction**2)
            total = square_sum if total is None else total + square_sum.to(total.device)
            count += first.numel()
    if total is None:
        return None
    return torch.stack([total, torch.tensor(float(count), device=total.device)])


# Elements per piece on a CPU: its one float32 temporary (2 MiB) stays in cache while the piece is worked on, and the
# pieces are few enough that Python's overhead stays small (on 2 CPU cores and SmolLM2-135M's Adam state, 2^18 to
# 2^21 took 0.11-0.12 s against 0.77 s for whole tensors in the elementwise form, 0.55 s for 2^13). An accelerator
# takes a tensor whole: its memory is fast and each piece would cost a kernel launch.
_CPU_PIECE = 1 << 19


def _update_square_sum(first: torch.Tensor, second: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """Σ first² / (√second + eps)² in float32, over pieces of the flattened tensors on a CPU."""
    first, second = first.reshape(-1), second.reshape(-1)
    piece = _CPU_PIECE if first.device.type == "cpu" else max(first.numel(), 1)
    total = torch.zeros((), dtype=torch.float32, device=first.device)
    for start in range(0, first.numel(), piece):
        denominator = second[start:start + piece].float().sqrt().add_(eps)
        ratio = torch.div(first[start:start + piece].float(), denominator, out=denominator)
        total += torch.dot(ratio, ratio)
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded (DTensor) state, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class TrustRegionRate:
    """The factor that keeps each optimizer step's measured KL near ``target_kl`` at the schedule's peak (module
    docstring).

    Args:
        target_kl: δ, the mean per-token KL(π_t ‖ π_{t+1}) a step at the schedule's peak may move the policy by.
        ema_decay: decay of the bias-corrected moving average of the curvature KL/(η²·ū²).
        min_ratio: smallest factor, and the probe's.
        max_ratio: largest factor.
    """

    def __init__(self, target_kl: float, ema_decay: float = 0.5, min_ratio: float = 0.01, max_ratio: float = 10.0):
        if isinstance(target_kl, bool) or not isinstance(target_kl, (int, float)) or not (
                math.isfinite(target_kl) and target_kl > 0):
            raise ValueError(f"target_kl must be a finite float > 0; got {target_kl!r}.")
        self.target_kl = float(target_kl)
        self.min_ratio, self.max_ratio = float(min_ratio), float(max_ratio)
        self.curvature = BiasCorrectedEMA(ema_decay)
        self.provisional = False  # the curvature is the probe's reading alone: the next reading replaces it
        self.update_mean_square: float | None = None  # ū² of the last gradient step's update per unit rate

    def note_update(self, mean_square: float | None) -> None:
        """A gradient step's update per unit rate had mean square ``mean_square`` (`adam_update_square_sum`): the
        step's reading is divided by it and the next step is predicted to have the same (None, zero or non-finite:
        nothing to note)."""
        if mean_square is not None and math.isfinite(mean_square) and mean_square > 0:
            self.update_mean_square = float(mean_square)

    @property
    def _update_scale(self) -> float:
        """ū² of the last gradient step (once known), else 1: what a reading is divided by."""
        return self.update_mean_square if self.update_mean_square is not None else 1.0

    def update(self, kl: float, lr: float) -> bool:
        """A step of rate ``lr`` moved the policy by ``kl``: fold KL/(lr²·ū²), ū² that step's (`note_update`), into
        the curvature. Returns whether it counted (a zero or non-finite rate, or a non-finite KL, is no
        measurement). The probe's reading is provisional: the next reading replaces it."""
        if not (math.isfinite(kl) and math.isfinite(lr) and lr > 0):
            return False
        was_probe = self.probing
        if self.provisional:
            self.curvature = BiasCorrectedEMA(self.curvature.decay)
        self.curvature.update(max(kl, 0.0) / (lr**2 * self._update_scale))
        self.provisional = was_probe and not self.probing
        return True

    @property
    def rate(self) -> float:
        """η̂_max = η_δ = sqrt(δ / (ĉ·ū²)), ū² the last gradient step's: the peak rate the smoothed curvature says
        moves the policy by δ (inf before any measurement or while no step moved it)."""
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
        """Whether the next step must be measured whatever the cadence: while probing, and while the curvature is the
        probe's provisional reading."""
        return self.probing or self.provisional

    def aimed_kl(self, lr: float) -> float:
        """The KL the smoothed curvature predicts for a step of rate ``lr``: ĉ·ū²·lr² = δ·(lr/η_δ)² (NaN while
        probing: nothing is aimed at)."""
        if self.probing or not math.isfinite(lr):
            return math.nan
        return self.target_kl * (lr / self.rate) ** 2

    def factor(self, base_lr: float, peak_lr: float | None = None) -> float:
        """clip(η_δ/η_peak, r_min, r_max) on ``base_lr`` (scheduled rate × SNR factor) for the next step, ``peak_lr``
        the schedule's peak (``base_lr`` when not given or not positive); r_min (the probe) until a step has moved
        the policy, 1 where ``base_lr`` is not positive (nothing to scale)."""
        if not base_lr > 0:
            return 1.0
        if self.probing:
            return self.min_ratio
        reference = peak_lr if peak_lr is not None and peak_lr > 0 else base_lr
        return min(self.max_ratio, max(self.min_ratio, self.rate / reference))

    def state_dict(self) -> dict[str, Any]:
        return {"curvature": self.curvature.state_dict(), "provisional": self.provisional,
                "update_mean_square": self.update_mean_square}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curvature.load_state_dict(state["curvature"])
        self.provisional = bool(state.get("provisional", False))
        self.update_mean_square = state.get("update_mean_square")
