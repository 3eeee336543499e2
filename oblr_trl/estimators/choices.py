"""The names of the estimators' variants, the values their options take, and the check of such a value.

Free of imports, so that the options (`oblr_trl.training.options`), the rate rule's builder (`step_rate`) and the
command line check a value without loading torch.
"""

from __future__ import annotations

__all__ = ["BASELINE_ESTIMATORS", "BASELINE_WEIGHTS", "SNR_ESTIMATORS", "SNR_LR_REFERENCES", "check_one_of",
           "invalid_value"]

BASELINE_WEIGHTS = ("logit", "length", "exact", "uniform")  # where w_i comes from (`weights`, `ghost_norms`)
BASELINE_ESTIMATORS = ("pooled_slope", "weighted")  # how b* is estimated from them (`baselines`)
SNR_ESTIMATORS = ("cross_step", "two_batch", "per_sample")  # how ‖μ‖² and tr Σ are estimated (`snr`)
SNR_LR_REFERENCES = ("calibrated", "absolute")  # what the SNR factor is relative to (`snr`)


def invalid_value(name: str, value, allowed: str) -> ValueError:
    """The error of an option ``name`` set to ``value``, naming the ``allowed`` values."""
    return ValueError(f"Invalid value for `{name}`: {value!r}. Allowed values: {allowed}.")


def check_one_of(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise invalid_value(name, value, ", ".join(repr(c) for c in choices))
