"""`kiln bench post` times SFT's padded and packed layouts on the same chat examples: the packed rows hold every
example's tokens in fewer rows, and both layouts' summed loss on the same examples must agree before any figure
counts."""

import json

from kiln.pipeline.tools.bench_post import bench_post
from kiln.pipeline.train.params import ModelParams
from tests.conftest import fails_in_one_line, write_jsonl


def test_packed_and_padded_rows_move_the_same_tokens_in_fewer_rows(tiny, tmp_path):
    data = tmp_path / "chat.jsonl"
    # mixed lengths: short exchanges that pad most of a 64-token row, and a few long ones
    write_jsonl(data, [{"prompt": "say " + "x " * (i % 7), "response": "king " * (1 + (i * 5) % 23)}
                       for i in range(40)])
    model = ModelParams(n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=64)
    result = bench_post(model, [str(data)], tiny.tokenizer, 64, 4, 3, 1, 8, None, "cpu", tmp_path / "post.json")
    assert json.loads((tmp_path / "post.json").read_text())["rows"] == result["rows"]
    padded, packed = result["rows"]["padded"], result["rows"]["packed"]
    assert result["examples"] == padded["rows"] == 40 > packed["rows"]  # one example a row, against several
    assert packed["fill"] > padded["fill"]
    # equal micro-batches of rows: the packed ones hold more real tokens
    assert packed["non_pad_tokens"] > padded["non_pad_tokens"]
    assert result["check_relative_difference"] < 1e-5
    assert result["packed_over_padded"] == round(packed["non_pad_tokens_per_s"] / padded["non_pad_tokens_per_s"], 3)


def test_bad_options_fail_in_one_line(tiny, tmp_path):
    out, tokenizer = tmp_path / "post.json", ["--tokenizer", str(tiny.tokenizer)]
    fails_in_one_line(["bench", "post", "--data", "x.jsonl", "--steps", "0", *tokenizer, "--out", str(out)], 2,
                      "--steps 0")
    fails_in_one_line(["bench", "post", "--data", str(tmp_path / "missing.jsonl"), *tokenizer, "--out", str(out)],
                      2, "missing.jsonl")
    assert not out.exists()
