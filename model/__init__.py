"""The model package: config, transformer, checkpoints, generation. Takes tensors and configs, never paths.

Nothing is imported here: `kiln.model.atomic` and `kiln.model.errors` (the writer and the failures every stage
shares) import no torch, and importing them must not pull in the transformer. Import from the module that
defines a name: `kiln.model.gpt` (GPT, ModelConfig, KVCache), `kiln.model.checkpoint` (load_model, save_model,
load_config), `kiln.model.generate` (generate, stream)."""
