"""Every kiln kernel is a torch.library custom op that the compiler can trust: `torch.library.opcheck` runs
each op on real inputs (odd sizes, strided views, fp32 and bf16, gradients wanted) and checks its schema
(declared mutations and no aliasing), its autograd registration, its fake implementation (shapes, strides and
dtypes equal to the real outputs'), and that AOT autograd tracing with dynamic shapes gives the eager outputs
and gradients. On this CPU the kernels run in Triton's interpreter; on a GPU natively."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.cross_entropy import cross_entropy_op
from kiln.kernels.flash_attention import flash_attention_backward_op, flash_attention_op
from kiln.kernels.launch import calculate_settings, near_derived_warps, picked
from kiln.kernels.linear_cross_entropy import linear_cross_entropy_backward_op, linear_cross_entropy_op
from kiln.kernels.nf4 import _dequantize_op, quantize_nf4
from kiln.kernels.paged_attention import paged_attention_op
from kiln.kernels.rms_norm import WARPS, rms_norm, rms_norm_backward_op, rms_norm_op
from kiln.kernels.rope import rope_op
from kiln.kernels.swiglu import swiglu_backward_op, swiglu_op

from kernel_checks import DEVICE

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, grad=False, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    return x.requires_grad_(grad)


def targets(n: int, vocab: int) -> torch.Tensor:
    t = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    t[1::3] = -100
    return t


def opcheck(op, args):
    torch.library.opcheck(op, args, raise_exception=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype):
    x = randn(3, 5, 37, dtype=dtype, grad=True)
    w = randn(37, dtype=dtype, grad=True, seed=1)
    opcheck(rms_norm_op, (x, w, 1e-5))
    opcheck(rms_norm_op, (randn(37, 6, dtype=dtype, grad=True).t(), w, 1e-2))  # rows 1 apart, columns 6
    with torch.no_grad():
        _, rstd = rms_norm_op(x, w, 1e-5)
    opcheck(rms_norm_backward_op, (randn(3, 5, 37, dtype=dtype, seed=2), x.detach(), w.detach(), rstd))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype):
    gate_up = randn(7, 2 * 123, dtype=dtype, grad=True)
    opcheck(swiglu_op, (gate_up[:, :123], gate_up[:, 123:]))  # two halves of one projection: strided
    gate, up = randn(1531, dtype=dtype), randn(1531, dtype=dtype, seed=1)
    opcheck(swiglu_backward_op, (randn(1531, dtype=dtype, seed=2), gate, up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backward", [False, True])
def test_rope(dtype, backward):
    cos, sin = randn(12, 5), randn(12, 5, seed=1)
    q = randn(2, 4, 5, 10, dtype=dtype, grad=True).transpose(1, 2)  # the model's (B, H, T, D) transposed back
    k = randn(2, 5, 2, 20, dtype=dtype, grad=True, seed=2)[..., ::2]  # last-dim stride 2
    opcheck(rope_op, (q, k, cos, sin, 3, backward))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(dtype, reduction):
    logits = randn(9, 1000, dtype=dtype, grad=True)
    opcheck(cross_entropy_op, (logits, targets(9, 1000), -100, 1e-4, reduction, True))
    opcheck(cross_entropy_op, (logits.detach(), targets(9, 1000), -100, 0.0, reduction, False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy(dtype, reduction):
    hidden, weight = randn(20, 8, dtype=dtype, grad=True), randn(53, 8, dtype=dtype, grad=True, seed=1)
    # 53 weight rows of which 50 are classes (the rest padding), and all 53
    opcheck(linear_cross_entropy_op, (hidden, weight, targets(20, 50), 50, -100, 1e-4, 0.0, reduction, 7, True,
                                      True))
    opcheck(linear_cross_entropy_op, (hidden, weight.detach(), targets(20, 53), 53, -100, 0.0, 5.0, reduction, 20,
                                      True, False))
    opcheck(linear_cross_entropy_backward_op, (randn(20, seed=2), hidden.detach(), weight.detach(),
                                               targets(20, 50), 50, -100, 1e-4, 5.0, 7, True, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention(dtype, causal):
    q = randn(1, 17, 4, 24, dtype=dtype, grad=True).transpose(1, 2)  # (B, H, T, D) read through strides
    k, v = randn(1, 2, 17, 24, dtype=dtype, grad=True, seed=1), randn(1, 2, 17, 24, dtype=dtype, grad=True, seed=2)
    opcheck(flash_attention_op, (q, k, v, causal, 0.3))
    segments = torch.tensor([[0] * 6 + [1] * 11], dtype=torch.int32, device=q.device)
    opcheck(flash_attention_op, (q, k, v, causal, 0.3, segments))
    with torch.no_grad():
        o, lse = flash_attention_op(q, k, v, causal, 0.3)
    opcheck(flash_attention_backward_op, (randn(1, 4, 17, 24, dtype=dtype, seed=3), q.detach(), k.detach(),
                                          v.detach(), o, lse, causal, 0.3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention(dtype):
    k_cache, v_cache = randn(6, 4, 2, 24, dtype=dtype), randn(6, 4, 2, 24, dtype=dtype, seed=1)
    tables = torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([11, 2], dtype=torch.int32, device=DEVICE)
    opcheck(paged_attention_op, (randn(2, 4, 24, dtype=dtype, seed=2), k_cache, v_cache, tables, lens, 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nf4_dequantize(dtype):
    codes = quantize_nf4(randn(3, 100, dtype=dtype))  # 300 weights: a short last block
    opcheck(_dequantize_op, (*(codes[k] for k in ("packed", "absmax", "absmax_scale", "absmax_offset")), [3, 100],
                             dtype))


def test_launch_settings_derive_from_the_row_width():
    assert [calculate_settings(n) for n in (123, 2048, 8192, 40000)] == [(128, 4), (2048, 8), (8192, 16),
                                                                          (65536, 32)]
    with pytest.raises(ValueError, match="rms_norm: 65537 elements"):
        calculate_settings(65537, "rms_norm")
    prune = near_derived_warps("n_cols")
    assert [c.num_warps for c in prune(WARPS, {"n_cols": 768})] == [4, 2, 8]
    assert [c.num_warps for c in prune(WARPS, {"n_cols": 16384})] == [8, 16, 32]


def test_picked_reports_the_config_each_kernel_ran():
    """After a launch, picked() names the kernel and its config: on a GPU one of the pruned candidates per key
    (37 columns: 2, 4 or 8 warps), in the interpreter the single config (4 warps)."""
    rms_norm(randn(3, 37), randn(37, seed=1), backend="triton")
    ran = picked()["_rms_norm_fwd"]
    assert ran and all(entry["config"]["num_warps"] in (2, 4, 8) for entry in ran)


def test_no_kernel_retunes_per_token_count():
    """Autotuned kernels key on what a model fixes (widths, heads, vocabulary, dtypes) or on a power-of-two
    bucket of a length, never on a raw token count: each new key times every config, and a server's or SFT's
    token counts change every step."""
    import kiln.kernels.cross_entropy
    import kiln.kernels.flash_attention
    import kiln.kernels.paged_attention
    import kiln.kernels.rope
    import kiln.kernels.swiglu  # noqa: F401  (each module registers its tuned kernels)
    from kiln.kernels.launch import _TUNED

    keys = {tuned.base_fn.__name__: set(tuned.keys) for tuned in _TUNED}
    assert {"_swiglu_fwd", "_swiglu_bwd", "_rms_norm_fwd", "_decode_kernel", "_forward_kernel"} <= set(keys)
    fixed_or_bucketed = {"n_cols", "row_stride", "COMPUTE_GRAD", "SOFTCAP", "SEGMENTS", "D", "CAUSAL", "T_BUCKET",
                         "N_BUCKET", "BLOCK_T", "REP", "BLOCK_D", "n_q_heads", "n_k_heads", "HALF"}
    assert {name: k - fixed_or_bucketed for name, k in keys.items() if k - fixed_or_bucketed} == {}
