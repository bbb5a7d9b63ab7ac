"""The GPT model and how it is cut into pipeline stages."""

from .gpt import GPTConfig, GPTStage, build_full_model, build_stages, lm_loss
from .partition import partition

__all__ = ["GPTConfig", "GPTStage", "build_full_model", "build_stages", "lm_loss", "partition"]
