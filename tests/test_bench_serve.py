"""`kiln bench serve` on a toy model: every variant computes the tokens the workload asks for, the engine holds
no block it does not need, prefix caching computes fewer prefill tokens, and the speculative row reports its
acceptance (a draft that is the model itself: all accepted)."""

import json

import torch

from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.tools.bench_serve import bench_serve
from kiln.pipeline.tools.serve_workload import workload


def test_every_variant_serves_the_whole_workload(tmp_path):
    config = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=48,
                         tie_embeddings=False)
    torch.manual_seed(0)
    save_model(GPT(config), config, tmp_path / "model")
    result = bench_serve(config, tmp_path / "model", tmp_path / "model", requests=6, rate=0.0, batch=2,
                         block_size=4, budget=16, seed=0, device_name="cpu", out=tmp_path / "serve.json",
                         quantize_kinds=["int8"])
    assert json.loads((tmp_path / "serve.json").read_text())["results"] == result["results"]
    rows = {r["variant"]: r for r in result["results"]}
    mixed, shared = workload(6, 0.0, config, 0), workload(6, 0.0, config, 1, shared=16)
    for name in ("static batching", "engine"):
        assert rows[name]["output_tokens"] == sum(mixed.outputs) and rows[name]["output_tokens_per_s"] > 0
    assert rows["engine"]["kv_blocks_over_need"] == 0
    assert rows["static batching"]["kv_slots_peak"] <= 2 * 48  # a batch's padded rows fit one context each
    off, on = (rows[f"engine, shared prompt, prefix caching {s}"] for s in ("off", "on"))
    # every prompt computed whole without caching; with it, the 5 requests after the first skip the shared
    # system prompt's 16 tokens (4 whole blocks of 4)
    assert off["prefill_tokens"] == sum(len(p) for p in shared.prompts)
    assert on["prefill_tokens"] == off["prefill_tokens"] - 5 * 16
    assert on["prefill_drop"] == round(5 * 16 / off["prefill_tokens"], 4)
    assert on["shared_whole_block_share"] == round(6 * 16 / sum(len(p) for p in shared.prompts), 4)
    assert rows["engine, batch 1, speculative"]["acceptance_rate"] == 1.0  # greedy: the draft is the model
    # sampled: p / q = 1 keeps every draft token too
    assert rows["engine, batch 1, speculative, temperature 1"]["acceptance_rate"] == 1.0
    assert "transformers generate (batch 1)" in rows
    # the quantized model's rows serve the same workloads, each against the original's
    assert rows["engine, int8"]["output_tokens"] == sum(mixed.outputs)
    assert rows["engine, int8"]["speedup_vs_original"] == round(
        rows["engine, int8"]["output_tokens_per_s"] / rows["engine"]["output_tokens_per_s"], 3)
    assert rows["engine, batch 1, int8"]["output_tokens"] == rows["engine, batch 1"]["output_tokens"]
    # every engine step reports its host time and crosses to the device once and back at most once
    assert 0 < rows["engine"]["copies_per_step"] <= 2 and rows["engine"]["host_us_per_step"] > 0
    generator, engine = (rows[f"rollouts 64 x 8: {how}"] for how in ("batched generator", "engine"))
    assert generator["requests"] == engine["requests"] == 512 and engine["output_tokens"] > 0
    # a prompt's full blocks are computed once for its 8 completions
    assert engine["prefill_tokens"] < 8 * 64 * config.max_seq_len // 2
    # the generator: a prefill, then a decode a token (until every row stops); the engine: one sample of each
    # prompt prefills first, the rest share the cached prompts, so a few steps more than the generator's
    assert 1 < generator["steps"] <= config.max_seq_len // 8
    assert generator["steps"] < engine["steps"] <= 1.5 * generator["steps"] + 4
    # the torch path's rollouts again without the cascade: the same work, grouped on the host no more
    plain = rows["rollouts 64 x 8: engine, no cascade"]
    assert plain["requests"] == 512 and plain["prefill_tokens"] == engine["prefill_tokens"]


def test_output_lengths_are_long_tailed_or_uniform_and_fit_the_context():
    config = ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, max_seq_len=256)
    geometric, uniform = workload(4000, 10.0, config, 0), workload(4000, 10.0, config, 0, output_lengths="uniform")
    for load in (geometric, uniform):
        assert all(1 <= n <= 257 - len(p) and 8 <= len(p) <= 128 for p, n in zip(load.prompts, load.outputs))
    assert 4 <= min(uniform.outputs) and max(uniform.outputs) <= 64
    # geometric, mean 256 / 8 = 32 where the prompt leaves room: about 1 in e^3 = 5 % of answers run past 3x it
    assert 30 < sum(geometric.outputs) / 4000 < 34 and 0.03 < sum(n > 96 for n in geometric.outputs) / 4000 < 0.07


def test_http_clients_get_what_the_engine_gives(tiny, tmp_path):
    """`kiln bench serve --http N`: N streaming clients through a real `kiln serve` and the same requests on the
    engine called directly: no errors, the same tokens generated (greedy), a first token for every stream."""
    from kiln.pipeline.text.bpe import load_tokenizer
    from kiln.pipeline.tools.bench_http import run_http

    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=48)
    torch.manual_seed(0)
    http, direct = run_http(GPT(config).eval(), None, tiny.tokenizer, clients=12, seed=0)
    assert http["errors"] == 0 and http["requests"] == direct["requests"] == 12, http
    assert http["output_tokens"] == direct["output_tokens"] > 0
    assert http["ttft_p99_ms"] > 0 and http["http_vs_engine"] > 0
