"""Post-training: the chat format, its data, SFT and DPO."""
