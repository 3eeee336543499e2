"""The names of the estimators' variants, the values their options take.

Free of imports, so that the options (`oblr_trl.training.options`) and the command line check a value without loading
torch.
"""

from __future__ import annotations

__all__ = ["BASELINE_ESTIMATORS", "BASELINE_WEIGHTS", "SNR_ESTIMATORS", "SNR_LR_REFERENCES", "TRUST_REGION_CURVATURES",
           "TRUST_REGION_MODES"]

BASELINE_WEIGHTS = ("logit", "length", "exact", "uniform")  # where w_i comes from (`weights`, `ghost_norms`)
BASELINE_ESTIMATORS = ("pooled_slope", "weighted")  # how b* is estimated from them (`baselines`)
SNR_ESTIMATORS = ("cross_step", "two_batch", "per_sample")  # how ‖μ‖² and tr Σ are estimated (`snr`)
SNR_LR_REFERENCES = ("calibrated", "absolute")  # what the SNR factor is relative to (`snr`)
TRUST_REGION_MODES = ("peak", "cap", "target")  # the forms of `trust_region.TrustRegionRate` (peak ships)
TRUST_REGION_CURVATURES = ("per_rate", "per_update")  # how it reads the curvature (`trust_region`, `step_kl`)
