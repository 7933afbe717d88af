"""`kiln bench post` times SFT's padded and packed layouts on the same chat examples, and GRPO's pass with a row per
completion and a row per group: the packed rows hold every example's tokens in fewer rows, the shared rows every
completion with fewer tokens, and both layouts' losses on the same examples must agree before any figure counts."""

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
    result = bench_post(model, [str(data)], tiny.tokenizer, 64, 4, 3, 1, 8, None, "cpu", tmp_path / "post.json",
                        group_size=2, completion_tokens=8, repeats=2)
    assert json.loads((tmp_path / "post.json").read_text())["rows"] == result["rows"]
    padded, packed = result["rows"]["padded"], result["rows"]["packed"]
    assert result["examples"] == padded["rows"] == 40 > packed["rows"]  # one example a row, against several
    assert packed["fill"] > padded["fill"]
    # equal micro-batches of rows: the packed ones hold more real tokens
    assert packed["non_pad_tokens"] > padded["non_pad_tokens"]
    assert result["check_relative_difference"] < 1e-5
    # two repeats, the layouts taking turns: the ratio is the median of the repeats' own
    assert len(padded["non_pad_tokens_per_s_runs"]) == len(result["packed_over_padded_runs"]) == 2
    assert result["packed_over_padded"] == min(result["packed_over_padded_runs"])  # the lower of two
    # GRPO's pass: the same completions, each pair's prompt once, the same loss
    separate, shared = result["grpo"]["separate"], result["grpo"]["shared"]
    assert shared["completion_tokens"] == separate["completion_tokens"] > 0
    assert shared["forward_tokens"] < separate["forward_tokens"]
    assert result["grpo_check_relative_difference"] < 1e-5


def test_bad_options_fail_in_one_line(tiny, tmp_path):
    out, tokenizer = tmp_path / "post.json", ["--tokenizer", str(tiny.tokenizer)]
    fails_in_one_line(["bench", "post", "--data", "x.jsonl", "--steps", "0", *tokenizer, "--out", str(out)], 2,
                      "--steps 0")
    fails_in_one_line(["bench", "post", "--data", str(tmp_path / "missing.jsonl"), *tokenizer, "--out", str(out)],
                      2, "missing.jsonl")
    assert not out.exists()
