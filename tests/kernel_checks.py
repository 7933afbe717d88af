"""What every kernel test needs: the device to run on, float64 references, per-dtype tolerances, and
NaN-poisoned allocations.

Tests build their inputs on the CPU from a seeded generator (the same values on any machine) and move them to
DEVICE: a CUDA GPU when there is one, so the kernels run natively, else the CPU, where they run in Triton's
interpreter. Shapes of a real model are far too slow for the interpreter, so tests list them through
`on_gpu`, which on a CPU-only machine marks them skipped, saying where they run (so a CPU run reports them).

Kernels allocate their outputs with `torch.empty`/`torch.empty_like`; under `poisoned_allocations()` those
come back filled with NaN, so an element a kernel forgot to write fails the comparison instead of passing
with whatever the allocator left there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max abs error allowed relative to the reference's scale: fp32 kernels accumulate in fp32; bf16 inputs and
# outputs carry ~3 significant digits (8 mantissa bits), so their error is dominated by the final rounding.
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def on_gpu(*cases, single: bool = False) -> list:
    """`cases` on a CUDA machine; on a CPU-only one the same cases marked skipped (the interpreter would take
    hours): append to a parametrize list for LLM-scale shapes. A tuple case fills several names, unless `single`
    (the parametrize has one name, whose values are tuples)."""
    if torch.cuda.is_available():
        return list(cases)
    skip = pytest.mark.skip(reason="a GPU case (an LLM-scale shape or the cuda device): runs in make gpu-check")
    return [pytest.param(*(case if isinstance(case, tuple) and not single else (case,)), marks=skip)
            for case in cases]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "output",
                 scale: float = 1.0) -> None:
    """Compare a kernel result with a float64 reference; `scale` widens the tolerance for long reductions."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{name}: NaN (an element the kernel never wrote?)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale,
                               msg=lambda m: f"{name} ({dtype}): {m}")


@contextlib.contextmanager
def poisoned_allocations():
    """Every torch.empty / torch.empty_like inside the block returns NaN-filled memory (ints: -1), on whatever
    device it was asked for (`device=` and every other argument pass through unchanged)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def record_launches(monkeypatch, module, op_name: str) -> list:
    """Wrap the custom op `module.<op_name>` (what the module's public function launches) to record each call, so
    a test of backend="auto" sees whether the Triton path was taken."""
    launched = []
    op = getattr(module, op_name)

    def record(*args):
        launched.append(args)
        return op(*args)

    monkeypatch.setattr(module, op_name, record)
    return launched


def inside_kiln_op(mode, func, args: tuple, kwargs: dict):
    """Run kiln custom op `func` from `mode`'s __torch_dispatch__ with `mode` pushed again, so that the mode also
    sees the aten ops the op's implementation runs (a dispatch mode is off while it handles an op)."""
    with mode:
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
        return func.redispatch(keys, *args, **kwargs)
