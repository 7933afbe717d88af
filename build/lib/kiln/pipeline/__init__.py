"""kiln's pipeline: the `kiln` CLI, params, and one module per DVC stage. Only this package knows about paths."""
