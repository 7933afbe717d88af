"""The one training loop and what it is made of; the pretrain stage."""
