"""kiln: an end-to-end LLM training pipeline run with `dvc repro`. Installed, this folder is the
package `kiln` (`kiln.kernels`, `kiln.model`, `kiln.pipeline`): see pyproject.toml."""
