"""Post-training: SFT, DPO and GRPO, their losses, params and the skeleton they share."""
