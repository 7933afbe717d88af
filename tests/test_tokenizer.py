import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.text.tokenizer import TokenizerParams, train_tokenizer
from kiln.pipeline.text.bpe import SPECIAL_TOKENS, load_tokenizer, tiktoken_encoding

from conftest import build, make_documents

TRICKY = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows\rline endings\n\n\n",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇩🇪",
    "CJK 東京タワー 你好世界 한국어",
    "combining e\u0301 vs \u00e9, RTL \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "control \x00\x01\x07\x1b[31m red \x7f and \u200b zero width \ufeff BOM",
    "surrogates written as text: \\ud800 \\udfff \\uD83D\\uDE00",
    "replacement char \ufffd and private use \ue000 and max \U0010ffff",
    "<|endoftext|> special text <|im_start|>user",
    "numbers 1234567890 3.14159 -42 1e-9",
    " " * 50 + "x" + "\n" * 20,
]


def random_strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def test_round_trip_any_string(shakespeare):
    tok = load_tokenizer(shakespeare.tokenizer)
    for s in TRICKY + random_strings(300, seed=1):
        ids = tok.encode(s).ids
        assert tok.decode(ids, skip_special_tokens=False) == s, repr(s)


def test_special_tokens_reserved_first(shakespeare):
    tok = load_tokenizer(shakespeare.tokenizer)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
        assert tok.encode(special).ids == [i]
    # As document text (ordinary mode) the same characters are plain text, never a control token.
    ordinary = load_tokenizer(shakespeare.tokenizer, ordinary=True)
    ids = ordinary.encode("<|endoftext|>").ids
    assert len(ids) > 1 and not set(ids) & set(range(len(SPECIAL_TOKENS)))
    assert ordinary.decode(ids) == "<|endoftext|>"


def test_vocab_and_metrics(shakespeare):
    tok = load_tokenizer(shakespeare.tokenizer)
    metrics = json.loads((shakespeare.root / "metrics/tokenizer.json").read_text())["tokenizer"]
    assert tok.get_vocab_size() == metrics["vocab_size"] == 1024
    # bytes/token recomputed independently: one text at a time through the plain HF tokenizer
    ordinary = load_tokenizer(shakespeare.tokenizer, ordinary=True)
    texts = pq.read_table(shakespeare.corpus / "val.parquet")["text"].to_pylist()
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tokens = sum(len(ordinary.encode(t).ids) for t in texts)
    assert metrics["bytes_per_token_val"] == pytest.approx(n_bytes / n_tokens, rel=1e-3)
    assert 2.2 < metrics["bytes_per_token_val"] < 6  # BPE on English; bytes-level would be 1.0


def test_tiktoken_identical_to_hf_on_whole_val_split(shakespeare):
    ordinary = load_tokenizer(shakespeare.tokenizer, ordinary=True)
    enc = tiktoken_encoding(ordinary)
    texts = pq.read_table(shakespeare.corpus / "val.parquet")["text"].to_pylist()
    assert len(texts) > 20
    for text in texts:
        assert enc.encode_ordinary(text) == ordinary.encode(text).ids
    for text in TRICKY + random_strings(200, seed=2):
        assert enc.encode_ordinary(text) == ordinary.encode(text).ids, repr(text)


def test_transformers_loads_tokenizer_json(shakespeare):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(shakespeare.tokenizer))
    tok = load_tokenizer(shakespeare.tokenizer)
    for s in TRICKY[1:]:
        assert fast.encode(s, add_special_tokens=False) == tok.encode(s).ids
        assert fast.decode(fast.encode(s, add_special_tokens=False)) == s


def test_training_is_deterministic(tiny, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(make_documents(300)):
        (src / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    again = build(tmp_path, {"source": str(src), "val_fraction": 0.2}, {"vocab_size": 300}, {"shard_tokens": 2048})
    assert again.tokenizer.read_bytes() == tiny.tokenizer.read_bytes()


def test_default_sample_is_the_whole_train_split(shakespeare):
    metrics = json.loads((shakespeare.root / "metrics/tokenizer.json").read_text())["tokenizer"]
    texts = pq.read_table(shakespeare.corpus / "train.parquet")["text"].to_pylist()
    assert metrics["train_chars"] == sum(map(len, texts)) < TokenizerParams().max_chars


def test_max_chars_trains_on_the_documents_in_order_up_to_the_budget(tiny, tmp_path, monkeypatch):
    """tokenizer.max_chars = 100 documents and 7 characters: the same tokenizer as one trained on a corpus whose
    train split is exactly those documents, the 101st cut to its first 7 characters."""
    texts = pq.read_table(tiny.corpus / "train.parquet")["text"].to_pylist()
    budget = sum(map(len, texts[:100])) + 7
    sample = tmp_path / "sample"
    sample.mkdir()
    pq.write_table(pa.table({"text": texts[:100] + [texts[100][:7]]}), sample / "train.parquet")
    shutil.copy(tiny.corpus / "val.parquet", sample / "val.parquet")
    monkeypatch.chdir(tmp_path)
    capped = train_tokenizer(build_section(TokenizerParams, {"vocab_size": 300, "max_chars": budget}), tiny.corpus,
                             tmp_path / "capped")
    whole = train_tokenizer(build_section(TokenizerParams, {"vocab_size": 300}), sample, tmp_path / "whole")
    assert capped["train_chars"] == whole["train_chars"] == budget
    made = (tmp_path / "capped/tokenizer.json").read_bytes()
    assert made == (tmp_path / "whole/tokenizer.json").read_bytes()
    assert made != tiny.tokenizer.read_bytes()  # the cap changed what the trainer saw


def test_gpt2_pattern_and_vocab_size(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("".join(make_documents(200)), encoding="utf-8")
    (src / "b.txt").write_text("".join(make_documents(200, seed=1)), encoding="utf-8")
    (src / "c.txt").write_text("".join(make_documents(200, seed=2)), encoding="utf-8")
    built = build(tmp_path, {"source": str(src), "val_fraction": 0.4}, {"vocab_size": 280, "pattern": "gpt2"},
                  {"shard_tokens": 2048})
    tok = load_tokenizer(built.tokenizer)
    assert tok.get_vocab_size() == 280
    # gpt2's split keeps a run of digits whole and "'s" apart; gpt4's cuts digits into groups of three.
    split = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str("1234567 king's")]
    assert split == ["1234567", "Ġking", "'s"]


def test_gpt4_pattern_splits_digits(shakespeare):
    tok = load_tokenizer(shakespeare.tokenizer)
    split = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str("1234567 KING'S")]
    assert split == ["123", "456", "7", "ĠKING", "'S"]


def test_cli_encode_decode(shakespeare):
    runner = CliRunner()
    tok = str(shakespeare.tokenizer)
    text = "To be, or not to be 🙂"
    result = runner.invoke(app, ["tokenizer", "encode", text, "--tokenizer", tok])
    assert result.exit_code == 0, result.output
    ids_line, pieces_line = result.output.strip().splitlines()
    ids = [int(i) for i in ids_line.split()]
    assert ids == load_tokenizer(shakespeare.tokenizer).encode(text).ids
    assert "'To'" in pieces_line and "b'\\xf0'" in pieces_line  # the emoji's bytes are shown as bytes
    result = runner.invoke(app, ["tokenizer", "decode", ",".join(map(str, ids)), "--tokenizer", tok])
    assert result.exit_code == 0 and result.output == text + "\n"
    result = runner.invoke(app, ["tokenizer", "decode", "12", "999999", "--tokenizer", tok])
    assert result.exit_code == 2 and "999999" in result.output
    result = runner.invoke(app, ["tokenizer", "encode", "x", "--tokenizer", str(shakespeare.root / "nope.json")])
    assert result.exit_code == 2 and "nope.json" in result.output
