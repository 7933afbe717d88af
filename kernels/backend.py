"""Which implementation an op runs: its Triton kernels or its plain-torch reference.

`auto` picks Triton for CUDA tensors and the reference for anything else. `triton` insists on the kernels:
on CUDA, or on CPU tensors when `TRITON_INTERPRET=1` was set before `triton` decorated them (Triton reads it
at import time), which is how CI runs every kernel without a GPU. `torch` is the reference everywhere.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """True when the op should launch its Triton kernels for these tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return on_cuda
    if not (on_cuda or interpreting()):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before kiln is imported "
                         "to run the kernels on CPU through Triton's interpreter")
    return True
