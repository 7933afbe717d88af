"""RoPE kernel: outputs and q/k gradients against the float64 reference, GQA head counts, position offsets,
odd head dims, strided inputs, and agreement with the model's own `apply_rope` on its (B, H, T, D) layout.

Tables come from `kiln.model.gpt.rope_tables`, so the angles are the ones the model uses. A rotation is one
multiply-add per element with no reduction, so every comparison uses the unscaled per-dtype tolerance. On a GPU
the main test also runs attention-sized q/k: 2048 positions of 32 q / 8 kv heads of 128, and 12 / 12 of 64.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch

import kiln.kernels.rope
from kiln.kernels.rope import reference, rope
from kiln.model.config import ModelConfig
from kiln.model.gpt import apply_rope, rope_tables

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]
MAX_POS = 32


def tables(D: int, max_pos: int = MAX_POS, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(vocab_size=1, n_head=1, n_kv_head=1, d_model=D, max_seq_len=max_pos)
    return tuple(t.to(device) for t in rope_tables(config))


def inputs(B, T, H, H_kv, D, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, T, H_kv, D, generator=g).to(device, dtype)
    dq_rot = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    dk_rot = torch.randn(B, T, H_kv, D, generator=g).to(device, dtype)
    return q, k, dq_rot, dk_rot


def check_against_reference(q, k, dq_rot, dk_rot, cos, sin, pos, dtype):
    """Triton output and both gradients vs the float64 reference on the same values."""
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    want_q, want_k = reference(q64, k64, cos.double(), sin.double(), pos)
    want_dq, want_dk = torch.autograd.grad((want_q, want_k), (q64, k64), (dq_rot.double(), dk_rot.double()))

    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    with poisoned_allocations():
        got_q, got_k = rope(q, k, cos, sin, pos, backend="triton")
        got_dq, got_dk = torch.autograd.grad((got_q, got_k), (q, k), (dq_rot, dk_rot))
    assert got_q.dtype == got_k.dtype == dtype
    for name, got, want in (("q_rot", got_q, want_q), ("k_rot", got_k, want_k), ("dq", got_dq, want_dq),
                            ("dk", got_dk, want_dk)):
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pos", [0, 5])
@pytest.mark.parametrize("B,T,H,H_kv,D", [
    *((B, T, H, H_kv, D) for B, T, (H, H_kv), D in product([1, 2], [1, 17], [(4, 4), (4, 2), (6, 1)], [10, 64])),
    *on_gpu((2, 2048, 32, 8, 128), (2, 2048, 12, 12, 64)),
])
def test_matches_reference(B, T, H, H_kv, D, pos, dtype):
    cos, sin = tables(D, max(MAX_POS, pos + T))
    check_against_reference(*inputs(B, T, H, H_kv, D, dtype), cos, sin, pos, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [6, 128])
def test_other_head_dims(D, dtype):
    cos, sin = tables(D)
    check_against_reference(*inputs(2, 3, 4, 2, D, dtype), cos, sin, 7, dtype)


@pytest.mark.parametrize("tile,H,H_kv,D", [(32, 6, 1, 10), (64, 6, 3, 64), (128, 4, 2, 10)])
def test_small_tiles(monkeypatch, tile, H, H_kv, D):
    """At test sizes one program holds every row and head; a small tile forces what large models hit: one row
    per program and loops over head blocks, the last one partial (32: 6 q heads in blocks of 4; 64: 3 k heads
    in blocks of 2), or several programs with a partial last row block (128: 34 rows in blocks of 4)."""
    monkeypatch.setattr(kiln.kernels.rope, "TILE_ELEMENTS", tile)
    cos, sin = tables(D)
    check_against_reference(*inputs(2, 17, H, H_kv, D, torch.float32), cos, sin, 5, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs_and_gradients(dtype):
    """q as the model's (B, H, T, D) transposed back, k with a last-dim stride of 2, gradients transposed too."""
    B, T, H, H_kv, D = 2, 5, 4, 2, 10
    q, k, dq_rot, dk_rot = inputs(B, T, H, H_kv, 2 * D, dtype)
    q = q[..., :D].transpose(1, 2).contiguous().transpose(1, 2)
    k = k[..., ::2]
    dq_rot = dq_rot[..., :D].transpose(1, 2).contiguous().transpose(1, 2)
    dk_rot = dk_rot[..., 1::2]
    assert not (q.is_contiguous() or k.is_contiguous() or dq_rot.is_contiguous() or dk_rot.is_contiguous())
    cos, sin = tables(D)
    check_against_reference(q, k, dq_rot, dk_rot, cos, sin, 3, dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_equals_model_apply_rope(backend):
    """rope on (B, T, H, D) == apply_rope on the model's transposed (B, H, T, D), so the model can switch."""
    B, T, H, H_kv, D, pos = 2, 9, 4, 2, 16, 5
    q, k, _, _ = inputs(B, T, H, H_kv, D, torch.float32)
    cos, sin = tables(D)
    got_q, got_k = rope(q, k, cos, sin, pos, backend=backend)
    want_q = apply_rope(q.transpose(1, 2), cos[pos:pos + T], sin[pos:pos + T]).transpose(1, 2)
    want_k = apply_rope(k.transpose(1, 2), cos[pos:pos + T], sin[pos:pos + T]).transpose(1, 2)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_is_reference(dtype):
    q, k, dq_rot, dk_rot = inputs(2, 4, 4, 2, 10, dtype)
    cos, sin = tables(10)
    q, k = q.requires_grad_(), k.requires_grad_()
    want = reference(q, k, cos, sin, 2)
    got = rope(q, k, cos, sin, 2, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    grads = torch.autograd.grad(got, (q, k), (dq_rot, dk_rot))
    want_grads = torch.autograd.grad(want, (q, k), (dq_rot, dk_rot))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", *on_gpu("cuda")])
def test_auto_uses_kernels_only_on_cuda(monkeypatch, device):
    launched = record_launches(monkeypatch, kiln.kernels.rope, "rope_op")
    q, k, _, _ = inputs(1, 3, 2, 1, 6, torch.float32, device=device)
    cos, sin = tables(6, device=device)
    for a, b in zip(rope(q, k, cos, sin, 1), reference(q.double(), k.double(), cos.double(), sin.double(), 1)):
        assert_close(a, b, torch.float32)
    assert bool(launched) == (device == "cuda")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs(backend):
    cos, sin = tables(10)
    q, k, _, _ = inputs(1, 3, 2, 1, 10, torch.float32)
    with pytest.raises(ValueError, match="must be even"):
        rope(q[..., :9], k[..., :9], cos, sin, backend=backend)
    with pytest.raises(ValueError, match="outside the tables"):
        rope(q, k, cos, sin, MAX_POS - 2, backend=backend)
    with pytest.raises(ValueError, match="share B, T and D"):
        rope(q, k[:, :2], cos, sin, backend=backend)
