"""The model package: config, transformer, checkpoints, generation. Takes tensors and configs, never paths."""

from kiln.model.checkpoint import load_config, load_model, save_model
from kiln.model.generate import generate, stream
from kiln.model.gpt import GPT, KVCache, ModelConfig

__all__ = ["GPT", "KVCache", "ModelConfig", "generate", "load_config", "load_model", "save_model", "stream"]
