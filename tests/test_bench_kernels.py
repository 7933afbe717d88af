"""`kiln bench kernels` times kernels on a GPU only; without one it says so instead of timing the interpreter."""

import torch
from typer.testing import CliRunner

from pipeline.cli import app


def test_without_cuda_it_says_it_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--quick", "--out", str(out)])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output and "Traceback" not in result.output
    assert not out.exists()
