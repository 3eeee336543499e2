"""Built-in model ids (`builtin:smollm2-135m-instruct`): the import path notebooks and user code use.

The code lives in `oblr_trl.training.models`, below the trainer, which accepts these ids as `model` too; this module is
the user surface's name for it.
"""

from .training.models import BUILTIN_MODELS, cache_dir, check_model_available, model_card_id, resolve_model

__all__ = ["BUILTIN_MODELS", "cache_dir", "check_model_available", "model_card_id", "resolve_model"]
