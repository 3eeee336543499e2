"""oblr-trl: OBLR-PO (variance-optimal baseline and SNR-driven learning rate) for TRL users."""

from .advantages import AdvantageResult, aggregate_rewards, gradient_weighted_advantages
from .baselines import BaselineResult, gradient_weighted_baseline, gradient_weighted_loo_baseline, group_weighted_baseline
from .config import OBLRPOConfig
from .snr import (
    BiasCorrectedEMA,
    NoiseEstimate,
    SNRLearningRateController,
    per_sample_noise_estimate,
    snr_lr_factor,
    two_batch_noise_estimate,
)
from .trainer import OBLRPOTrainer
from .weights import length_weights, log_sum_sq_probs, logit_gradient_sq_norms, logit_proxy_weights, uniform_weights

__version__ = "0.1.0"

__all__ = [
    "AdvantageResult",
    "BaselineResult",
    "BiasCorrectedEMA",
    "NoiseEstimate",
    "OBLRPOConfig",
    "OBLRPOTrainer",
    "SNRLearningRateController",
    "aggregate_rewards",
    "gradient_weighted_advantages",
    "gradient_weighted_baseline",
    "gradient_weighted_loo_baseline",
    "group_weighted_baseline",
    "length_weights",
    "log_sum_sq_probs",
    "logit_gradient_sq_norms",
    "logit_proxy_weights",
    "per_sample_noise_estimate",
    "snr_lr_factor",
    "two_batch_noise_estimate",
    "uniform_weights",
]
