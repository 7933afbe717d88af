"""`kiln bench adapters` counts what each method really holds: the numbers are checked against what the shapes
imply (4 bytes per fp32 weight, NF4's ~0.52, two AdamW moments per trainable parameter), not against itself."""

import json

from kiln.model.config import ModelConfig
from kiln.pipeline.tools.bench_adapters import bench_adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_memory_table_counts_weights_gradients_and_adamw_state(tmp_path):
    llama = ModelConfig(vocab_size=500, n_layer=2, n_head=2, n_kv_head=1, d_model=128, max_seq_len=32)
    gpt2 = ModelConfig(vocab_size=300, arch="gpt2", n_layer=1, n_head=2, n_kv_head=2, d_model=64, max_seq_len=32)
    result = bench_adapters({"llama": llama, "gpt2": gpt2}, 4, 8.0, TARGETS, "cpu", 16, tmp_path / "a.json")
    assert json.loads((tmp_path / "a.json").read_text())["results"] == result["results"]
    rows = {(r["shape"], r["method"]): r for r in result["results"]}
    for shape, config in (("llama", llama), ("gpt2", gpt2)):
        full, lora, qlora = (rows[shape, m] for m in ("full", "lora", "qlora"))
        n = config.num_params()
        assert full["trainable_params"] == n and full["trainable_bytes"] == 4 * n
        assert full["optimizer_bytes"] == 2 * 4 * n  # exp_avg and exp_avg_sq
        # rank 4 on each projection: (in + out) x 4 per adapted matrix, per layer
        d, f, kv = config.d_model, config.ffn_dim, config.n_kv_head * config.head_dim
        per_layer = {"llama": (d + d) + 2 * (d + kv) + (d + d) + 3 * (d + f), "gpt2": 4 * (d + d) + 2 * (d + f)}
        assert lora["trainable_params"] == qlora["trainable_params"] == 4 * per_layer[shape] * config.n_layer
        assert lora["optimizer_bytes"] == lora["grad_bytes"] * 2 == 8 * lora["trainable_params"]
        assert lora["base_bytes"] == 4 * n  # the whole model, frozen, in fp32
        assert 0.5 < qlora["base_bytes_per_param"] < 0.7  # 4-bit codes, absmaxes, fp32 norms and biases
    assert result["worst"]["qlora_base_bytes_per_param"] == max(rows[s, "qlora"]["base_bytes_per_param"]
                                                               for s in ("llama", "gpt2"))


def test_bad_options_fail_in_one_line(tmp_path):
    from tests.conftest import fails_in_one_line

    fails_in_one_line(["bench", "adapters", "--tokens", "0", "--out", str(tmp_path / "a.json")], 2, "--tokens 0")
    fails_in_one_line(["bench", "adapters", "--device", "tpu", "--out", str(tmp_path / "a.json")], 2, "'tpu'")
    assert not (tmp_path / "a.json").exists()
