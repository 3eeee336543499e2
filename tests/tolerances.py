"""Tolerances for the SNR estimates, which are differences of larger terms.

‖μ‖² and tr Σ are never measured directly: the cross-step ‖μ‖² is ⟨G_t, G_{t−1}⟩ (each product of size
‖G_t‖·‖G_{t−1}‖, the result possibly near 0), tr Σ = n(‖G_t‖² − ⟨G_t, G_{t−1}⟩), the two-batch ones combine |G_b|²
and |G_N|², the per-sample ones Σ‖g_i‖² and N‖ḡ‖². Round-off (float32 reduction order, fp16 gradients, the CPU's
vector kernels) perturbs each term in proportion to the term, so a difference is compared in the scale of its terms:
a tolerance relative to the (cancelling) result passes or fails with the CPU it runs on.
"""

from __future__ import annotations

import pytest


def noise_terms_scale(step: dict, previous: dict | None = None) -> float:
    """The size of the terms a step's ‖μ‖² estimate is a difference of, from what the step logged.

    ‖G_t‖² and ‖G_{t−1}‖² bound the cross-step products (|⟨a, b⟩| ≤ (‖a‖² + ‖b‖²)/2); the micro-batch |G_b|² the
    two-batch ones; |tr Σ| + ‖G_t‖² is the mean per-sample squared norm of the per-sample estimator. tr Σ's terms are
    these times the samples of a step (`trace_scale`).
    """
    terms = [step["snr/full_batch_grad_sq_norm"], step.get("snr/small_batch_grad_sq_norm") or 0.0,
             abs(step.get("snr/trace_cov") or 0.0)]
    if previous is not None:
        terms.append(previous["snr/full_batch_grad_sq_norm"])
    return sum(terms)


def assert_noise_estimates_match(expected: list[dict], actual: list[dict], samples: int, rel: float) -> None:
    """The logged SNR estimates of two runs of the same steps agree to ``rel`` of their terms' scale.

    ``samples`` (completions a step) bounds the factor between ‖μ‖²'s terms and tr Σ's (n, 1/(1/b − 1/N) or N/(N−1)).
    The factor f = N·SNR/(1 + N·SNR) lies in [0, 1], so it is compared absolutely, and the rate used in the scale of
    the scheduled rate.
    """
    assert len(expected) == len(actual)
    previous = None
    for one, two in zip(expected, actual, strict=True):
        scale = noise_terms_scale(one, previous)
        if one.get("snr/grad_sq_norm") is not None:
            assert two["snr/grad_sq_norm"] == pytest.approx(one["snr/grad_sq_norm"], abs=rel * scale), (one, two)
            assert two["snr/trace_cov"] == pytest.approx(one["snr/trace_cov"], abs=rel * samples * scale), (one, two)
        assert two["snr/lr_factor"] == pytest.approx(one["snr/lr_factor"], abs=rel), (one, two)
        scheduled = one["oblr/lr"] / one["snr/lr_factor"]
        assert two["oblr/lr"] == pytest.approx(one["oblr/lr"], abs=rel * scheduled), (one, two)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=rel), (one, two)  # a norm: no cancellation
        if one.get("oblr/step_kl") is not None:
            # each token's k3 = e^Δ − 1 − Δ is formed from log-probability differences Δ of size ~sqrt(2·KL)
            kl = one["oblr/step_kl"]
            assert two["oblr/step_kl"] == pytest.approx(kl, abs=rel * (2 * kl) ** 0.5), (one, two)
        if one.get("oblr/trust_region_factor") is not None:
            assert two["oblr/trust_region_factor"] == pytest.approx(one["oblr/trust_region_factor"], rel=rel)
        previous = one
