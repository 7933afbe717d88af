"""The model package: config, transformer, checkpoints, generation. Takes tensors and configs, never paths."""
