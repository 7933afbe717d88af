"""The commands of `kiln`, one module per group; pipeline/cli.py puts them together."""
