"""oblr-trl: OBLR-PO (variance-optimal baseline and SNR-driven learning rate) for TRL users.

The public names are imported on first use, so that the command line (`oblr-trl --help`, `oblr-trl tasks`) starts
without loading torch, transformers and TRL.

Three layers, imports running one way (`docs/architecture.md`): the modules at this level are the user surface (the
command line, tasks, rewards, evaluation, plots, test helpers); `oblr_trl.training` wires OBLR-PO into TRL;
`oblr_trl.estimators` is the math, torch only.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    "AdvantageResult": "estimators.advantages",
    "aggregate_rewards": "estimators.advantages",
    "gradient_weighted_advantages": "estimators.advantages",
    "BaselineResult": "estimators.baselines",
    "gradient_weighted_baseline": "estimators.baselines",
    "gradient_weighted_loo_baseline": "estimators.baselines",
    "group_weighted_baseline": "estimators.baselines",
    "OBLRPOConfig": "training.config",
    "BiasCorrectedEMA": "estimators.snr",
    "NoiseEstimate": "estimators.snr",
    "SNRLearningRateController": "estimators.snr",
    "StepRateRule": "estimators.step_rate",
    "per_sample_noise_estimate": "estimators.snr",
    "snr_lr_factor": "estimators.snr",
    "two_batch_noise_estimate": "estimators.snr",
    "OBLRPOTrainer": "training.trainer",
    "TrainingPreempted": "training.guards",
    "end_distributed_training": "training.guards",
    "length_weights": "estimators.weights",
    "log_sum_sq_probs": "estimators.weights",
    "logit_gradient_sq_norms": "estimators.weights",
    "logit_proxy_weights": "estimators.weights",
    "uniform_weights": "estimators.weights",
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
