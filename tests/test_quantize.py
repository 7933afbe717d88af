"""Quantized inference with TorchAO (model/quantize.py): the blocks' linear layers quantized, the rest as it was,
the logits near the original's, and the serving engine's paged attention giving what the quantized model's
plain forward gives."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.errors import UserError
from kiln.model.generate import generate
from kiln.model.gpt import GPT
from kiln.model.quantize import check_quantize, quantize
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.request import Request, SamplingParams

pytest.importorskip("torchao")


def model(arch: str) -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64, arch=arch)
    return GPT(config).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_int8_quantizes_the_blocks_linears_and_keeps_the_logits_close(arch):
    plain, quantized = model(arch), quantize(model(arch), "int8")
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        want, got = plain(x), quantized(x)
    # int8 per-channel weights: about 1/127 of each row's largest weight, a small error on the logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert not torch.equal(got, want)
    linears = [m for m in quantized.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m.weight) is not torch.nn.Parameter for m in linears)  # TorchAO's tensors
    for name in ("tok_emb", "lm_head"):  # kept as they were
        assert torch.equal(getattr(quantized, name).weight, getattr(plain, name).weight)


def test_the_engine_serves_a_quantized_model_as_its_forward_computes():
    m = quantize(model("llama"), "int8")
    prompts = [[5, 17, 42, 8], [99, 3, 250, 1, 7, 7, 60]]
    want = generate(m, prompts, 10, temperature=0.0)
    requests = Engine(m, num_blocks=16, block_size=8).run([Request(p, SamplingParams(10)) for p in prompts])
    assert [r.output for r in requests] == want


@pytest.mark.parametrize("kind, said", [("int3", "expected one of int8, int4, fp8"),
                                        ("int4", "need a CUDA GPU, not cpu"),
                                        ("fp8", "compute capability 8.9 or more")])
def test_a_kind_the_device_cannot_run_is_refused_in_one_line(kind, said):
    with pytest.raises(UserError) as e:
        check_quantize(kind, torch.device("cpu"))
    assert said in str(e.value) and str(e.value).startswith(f"--quantize {kind}: ")


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
