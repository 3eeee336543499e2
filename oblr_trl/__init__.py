"""oblr-trl: OBLR-PO (variance-optimal baseline and SNR-driven learning rate) for TRL users.

The public names are imported on first use, so that the command line (`oblr-trl --help`, `oblr-trl tasks`) starts
without loading torch, transformers and TRL.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    "AdvantageResult": "advantages",
    "aggregate_rewards": "advantages",
    "gradient_weighted_advantages": "advantages",
    "BaselineResult": "baselines",
    "gradient_weighted_baseline": "baselines",
    "gradient_weighted_loo_baseline": "baselines",
    "group_weighted_baseline": "baselines",
    "OBLRPOConfig": "config",
    "BiasCorrectedEMA": "snr",
    "NoiseEstimate": "snr",
    "SNRLearningRateController": "snr",
    "per_sample_noise_estimate": "snr",
    "snr_lr_factor": "snr",
    "two_batch_noise_estimate": "snr",
    "OBLRPOTrainer": "trainer",
    "TrainingPreempted": "guards",
    "length_weights": "weights",
    "log_sum_sq_probs": "weights",
    "logit_gradient_sq_norms": "weights",
    "logit_proxy_weights": "weights",
    "uniform_weights": "weights",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'oblr_trl' has no attribute {name!r}")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])
