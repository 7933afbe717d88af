"""Quantized inference (model/quantize.py): int8 is kiln's Int8Linear, whose two ways of computing (the CPU's
fused int8 kernel for decoding rows, the cast weight for the rest) agree with the dequantized weight; the blocks'
linear layers are quantized and nothing else; the serving engine gives what the quantized model's plain forward
gives; int4 (TorchAO, CUDA only) is set up on its mslk-free layout, which this CPU checks as far as it can, and
refused in one line where it cannot run."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.nn import functional as F

from kiln.model import quantize as q
from kiln.model.config import ModelConfig
from kiln.model.errors import UserError
from kiln.model.generate import generate
from kiln.model.gpt import GPT
from kiln.model.quantize import KERNEL_MAX_ROWS, Int8Linear, check_quantize, quantize, weight_bytes
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.request import Request, SamplingParams


def model(arch: str, d_model: int = 64, d_ff: int = 0) -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=d_model, d_ff=d_ff, max_seq_len=64,
                         arch=arch)
    return GPT(config).eval()


def dequantized(layer: Int8Linear) -> torch.Tensor:
    return layer.weight.float() * layer.scale[:, None]


def kernel_calls():
    """A spy on the fused int8 kernel (Int8Linear's CPU decoding path)."""
    return mock.patch.object(torch.ops.aten, "_weight_int8pack_mm", wraps=torch.ops.aten._weight_int8pack_mm)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_int8_quantizes_the_blocks_linears_and_keeps_the_logits_close(arch):
    plain, quantized = model(arch), quantize(model(arch), "int8")
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        want, got = plain(x), quantized(x)
    # int8 per-channel weights: about 1/127 of each row's largest weight, a small error on the logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert not torch.equal(got, want)
    assert not [n for n, m in quantized.blocks.named_modules() if isinstance(m, torch.nn.Linear)]
    layers = [m for m in quantized.blocks.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 * (7 if arch == "llama" else 6) and all(m.weight.dtype == torch.int8 for m in layers)
    assert all((m.bias is not None) == (arch == "gpt2") for m in layers)
    for name in ("tok_emb", "lm_head"):  # kept as they were
        assert torch.equal(getattr(quantized, name).weight, getattr(plain, name).weight)


def test_int8_weights_are_each_rows_absmax_over_127_steps():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer = Int8Linear(linear)
    w = linear.weight.detach()
    assert torch.allclose(layer.scale, w.abs().amax(dim=1) / 127)
    assert layer.weight.abs().amax(dim=1).eq(127).all()  # each row's largest weight is exact
    assert (dequantized(layer) - w).abs().le(layer.scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(layer.bias, linear.bias)


def test_the_kernel_decodes_and_the_cast_weight_prefills_both_as_the_dequantized_weight():
    """A layer large enough for the kernel: up to KERNEL_MAX_ROWS rows go through `_weight_int8pack_mm` (bf16
    activations: within bf16's rounding of the dequantized product), more rows through the cast weight (fp32:
    to fp32's rounding)."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(512, 256))
    assert layer.kernel
    for rows, calls, tolerance in ((1, 1, 1e-2), (KERNEL_MAX_ROWS, 1, 1e-2), (KERNEL_MAX_ROWS + 1, 0, 1e-5)):
        x = torch.randn(1, rows, 512)
        want = F.linear(x, dequantized(layer)) + layer.bias
        with kernel_calls() as spy:
            got = layer(x)
        assert spy.call_count == calls, rows
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max() <= tolerance * want.abs().max(), rows


def test_the_kernel_takes_inputs_at_any_offset_and_in_bf16():
    """The kernel's aligned loads need rows on 32-byte boundaries: an input that is a view at an odd offset (which
    crashes the kernel if handed over as it is) is copied first; a bf16 input gives bf16 out."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(256, 256, bias=False))
    values = torch.randn(3 * 256 + 1)
    x, xb = values[1:].view(1, 3, 256), values.bfloat16()[1:].view(1, 3, 256)  # views one element in
    assert x.data_ptr() % 32 and xb.data_ptr() % 32 and layer.kernel
    with kernel_calls() as spy:
        got, half = layer(x), layer(xb)
    assert spy.call_count == 2
    assert torch.equal(got, layer(x.clone()))
    assert half.dtype == torch.bfloat16 and (half.float() - got).abs().max() < 0.02 * got.abs().max()


@pytest.mark.parametrize("shape", [(72, 1024), (128, 128)], ids=["width-not-a-multiple-of-16", "small"])
def test_layers_the_kernel_cannot_read_or_would_not_speed_take_the_cast_weight(shape):
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(*shape))
    x = torch.randn(1, 1, shape[0])
    with kernel_calls() as spy:
        got = layer(x)
    assert not layer.kernel and spy.call_count == 0
    assert torch.allclose(got, F.linear(x, dequantized(layer)) + layer.bias, atol=1e-5)


def test_int8_holds_a_quarter_of_the_linear_weights_bytes():
    plain = model("llama")
    before = weight_bytes(plain)
    after = weight_bytes(quantize(model("llama"), "int8"))
    weights = sum(m.weight.numel() for m in plain.blocks.modules() if isinstance(m, torch.nn.Linear))
    rows = sum(m.out_features for m in plain.blocks.modules() if isinstance(m, torch.nn.Linear))
    assert before["linear_bytes"] == 4 * weights
    assert after["linear_bytes"] == weights + (4 + 2) * rows  # int8 weights, fp32 scales, the kernel's bf16 ones
    assert before["model_bytes"] - after["model_bytes"] == before["linear_bytes"] - after["linear_bytes"]


def test_the_engine_serves_a_quantized_model_as_its_forward_computes():
    m = quantize(model("llama"), "int8")
    prompts = [[5, 17, 42, 8], [99, 3, 250, 1, 7, 7, 60]]
    want = generate(m, prompts, 10, temperature=0.0)
    requests = Engine(m, num_blocks=16, block_size=8).run([Request(p, SamplingParams(10)) for p in prompts])
    assert [r.output for r in requests] == want


def test_int4_is_tinygemms_layout_on_bf16_weights_of_the_layers_128_divides(monkeypatch):
    """What a CPU can check of int4 (its kernels are CUDA's): TorchAO's `quantize_` is asked for the tile-packed
    layout (`aten._weight_int4pack_mm`, no mslk), groups of 128, without changing torch.compile's settings, on
    exactly the blocks' linear layers whose input width 128 divides, their weights cast to bf16 first; the rest
    stay fp32 (d_model 128 and an MLP 320 wide: every layer but the MLP's down projection)."""
    torchao = pytest.importorskip("torchao.quantization")
    asked = []
    monkeypatch.setattr(torchao, "quantize_", lambda module, config, filter_fn: asked.append(
        (config, [m for n, m in module.named_modules() if filter_fn(m, n)])))
    m = quantize(model("llama", d_model=128, d_ff=320), "int4")
    (config, chosen), = asked
    assert (config.int4_packing_format, config.group_size, config.set_inductor_config) == \
        ("tile_packed_to_4d", 128, False)
    linears = [l for l in m.blocks.modules() if isinstance(l, torch.nn.Linear)]
    assert chosen == [l for l in linears if l.in_features != 320] and len(chosen) == 2 * 6
    assert all((l.weight.dtype == torch.bfloat16) == (l in chosen) for l in linears)


def test_int4_refuses_a_model_none_of_whose_layers_it_can_group():
    pytest.importorskip("torchao.quantization")
    with pytest.raises(UserError, match=r"^--quantize int4: no linear layer .* multiple of 128"):
        quantize(model("llama", d_model=64), "int4")


@pytest.mark.parametrize("kind, said", [("int3", "expected one of int8, int4, fp8"),
                                        ("int4", "need a CUDA GPU of compute capability 8.0 or more; this is cpu"),
                                        ("fp8", "compute capability 8.9 or more")])
def test_a_kind_the_device_cannot_run_is_refused_in_one_line(kind, said):
    with pytest.raises(UserError) as e:
        check_quantize(kind, torch.device("cpu"))
    assert said in str(e.value) and str(e.value).startswith(f"--quantize {kind}: ")


def test_int4_is_refused_on_a_gpu_older_than_ampere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(UserError, match=r"^--quantize int4: .*; this is Tesla T4\. int8 runs on any device$"):
        check_quantize("int4", torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert q.runs_int4(torch.device("cuda:0"))


def test_kiln_serve_quantize_int8_answers_as_the_quantized_model(tiny, tmp_path):
    """`kiln serve --quantize int8`: a real server's greedy completion is the quantized model's own."""
    import openai

    from kiln.pipeline.serve.text_model import TextModel
    from kiln.pipeline.text.bpe import EOT, load_tokenizer
    from test_serve_api import running_server

    with running_server(tiny, tmp_path, "--quantize", "int8") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny", prompt="the king of", max_tokens=8, temperature=0)
    lm = TextModel(tmp_path / "tiny", tiny.tokenizer, "cpu", quantize="int8")
    tok = load_tokenizer(tiny.tokenizer, ordinary=True)
    eot = tok.token_to_id(EOT)
    out = generate(lm.model.eval(), [[eot, *tok.encode("the king of").ids]], 8, temperature=0.0, stop_ids=[eot])[0]
    assert done.choices[0].text == tok.decode(out)
