"""Hostile input to the data stages (issue 18, classes 13 and 14): a tokenizer.json that is random bytes, not
UTF-8, or has a field of the wrong type or missing; source and corpus files that are corrupt or truncated; a
disk that fills up while shards are written. Each stops with one line naming the file (and the field or line),
the right exit code, and what an earlier run wrote left as it was."""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.text.bpe import check_byte_level, load_tokenizer, tiktoken_encoding

from conftest import fails_in_one_line, tree_bytes, write_params


@pytest.fixture
def workdir(tmp_path, monkeypatch, tiny):
    """A project folder holding a copy of the tiny pipeline's shards as the earlier hand run's output (run/shards)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny.shards, tmp_path / "run" / "shards")
    write_params(tmp_path / "params.yaml", {"shard": {"shard_tokens": 2048}})
    return tmp_path


def run_kiln(args: list[str]):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    return CliRunner().invoke(app, args)


def shard_args(corpus, tokenizer) -> list[str]:
    return ["data", "shard", "--params", "params.yaml", "--corpus", str(corpus), "--tokenizer", str(tokenizer),
            "--out", "run"]


def spec_of(tiny) -> dict:
    return json.loads(tiny.tokenizer.read_text(encoding="utf-8"))


def edited(change):
    def make(spec: dict) -> bytes:
        spec = copy.deepcopy(spec)
        change(spec)
        return json.dumps(spec).encode()
    return make


def last_piece(spec: dict) -> str:
    return next(p for p, i in spec["model"]["vocab"].items() if i == len(spec["model"]["vocab"]) - 1)


# name: (the file's bytes from the good tokenizer's JSON, the field the error must name)
BAD_TOKENIZERS = {
    "random bytes": (lambda spec: random.Random(0).randbytes(400), "not UTF-8"),
    "not UTF-8": (lambda spec: json.dumps(spec).encode().replace(b'"model"', b'"mod\xe9l"'), "not UTF-8"),
    "truncated": (lambda spec: json.dumps(spec).encode()[:5000], "not valid JSON"),
    "a JSON list": (lambda spec: b"[1, 2, 3]", "expected an object"),
    "no model": (edited(lambda s: s.pop("model")), "model"),
    "model a string": (edited(lambda s: s.update(model="BPE")), "model"),
    "model not a BPE": (edited(lambda s: s["model"].update(type="Unigram")), "model.type"),
    "no vocab": (edited(lambda s: s["model"].pop("vocab")), "model.vocab"),
    "vocab a list": (edited(lambda s: s["model"].update(vocab=list(s["model"]["vocab"]))), "model.vocab"),
    "vocab ids as text": (edited(lambda s: s["model"]["vocab"].update({"a": "65"})), "model.vocab"),
    "merges an object": (edited(lambda s: s["model"].update(merges={})), "model.merges"),
    "pre_tokenizer a number": (edited(lambda s: s.update(pre_tokenizer=7)), "pre_tokenizer"),
    "no pre_tokenizer": (edited(lambda s: s.update(pre_tokenizer=None)), "pre_tokenizer"),
    "pre_tokenizer without ByteLevel": (edited(lambda s: s["pre_tokenizer"]["pretokenizers"].pop()), "pre_tokenizer"),
    "added_tokens ids as text": (edited(lambda s: s["added_tokens"][0].update(id="0")), "added_tokens"),
    "a token outside the byte alphabet": (
        edited(lambda s: s["model"]["vocab"].update({"東京": len(s["model"]["vocab"])})), "model.vocab"),
    "an id with no token": (
        edited(lambda s: s["model"]["vocab"].update({last_piece(s): 5000})), "model.vocab"),
    "two tokens with one id": (
        edited(lambda s: s["model"]["vocab"].update({last_piece(s): 7})), "model.vocab"),
}


@pytest.mark.parametrize("case", BAD_TOKENIZERS)
def test_shard_refuses_a_hostile_tokenizer(workdir, tiny, case):
    make, field = BAD_TOKENIZERS[case]
    bad = workdir / "bad.json"
    bad.write_bytes(make(spec_of(tiny)))
    before = tree_bytes(workdir / "run" / "shards")
    fails_in_one_line(shard_args(tiny.corpus, bad), 2, bad, field)
    assert tree_bytes(workdir / "run" / "shards") == before
    assert not (workdir / "run" / "checkpoints").exists()  # nothing started: no resume state either


def test_pretrain_refuses_a_hostile_tokenizer(workdir, tiny):
    """The shards name the tokenizer they were made with (its sha256), so training stops before reading it."""
    bad = workdir / "bad.json"
    bad.write_bytes(BAD_TOKENIZERS["no pre_tokenizer"][0](spec_of(tiny)))
    fails_in_one_line(["pretrain", "--shards", "run/shards", "--tokenizer", str(bad), "--out", "base",
                       "--checkpoints", "ckpt"], 2, "another tokenizer")
    assert not (workdir / "base" / "model").exists()


def tokenizer_reader_verdict(path: Path) -> None:
    """What shard does with a tokenizer.json: load it, check it is byte-level, build the tiktoken encoder."""
    try:
        tok = load_tokenizer(path, ordinary=True)
        check_byte_level(tok, path)
        tiktoken_encoding(tok, path=path)
    except UserError as e:
        assert str(path) in str(e) and "\n" not in str(e)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_give_a_tokenizer_or_user_error(raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_bytes(raw)
        tokenizer_reader_verdict(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children,
                                                                                      max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def good_spec(tiny) -> dict:
    return spec_of(tiny)


def places(spec: dict) -> list[tuple]:
    """Every object key down to the pre-tokenizer's steps and the first added token: where a value can go."""
    found = []

    def walk(node, at):
        if isinstance(node, dict):
            for key, value in node.items():
                if key not in ("vocab", "merges") or at != ("model",):
                    found.append((*at, key))
                    walk(value, (*at, key))
        elif isinstance(node, list) and node and len(at) < 4:
            found.append((*at, 0))
            walk(node[0], (*at, 0))
    walk(spec, ())
    return found + [("model", "vocab"), ("model", "merges")]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_field_replaced_or_dropped_gives_a_tokenizer_or_user_error(good_spec, data):
    spec = copy.deepcopy(good_spec)
    where = data.draw(st.sampled_from(places(good_spec)))
    parent = spec
    for key in where[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        parent.pop(where[-1])
    else:
        parent[where[-1]] = data.draw(JSON)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        tokenizer_reader_verdict(path)


@pytest.mark.parametrize("affix", ["continuing_subword_prefix", "end_of_word_suffix"])
def test_a_subword_affix_longer_than_a_merge_is_refused_before_the_parser_panics(good_spec, tmp_path, affix):
    """Found by the test above: a long continuing_subword_prefix made tokenizers' Rust code panic (pyo3's
    PanicException, which `except Exception` does not catch)."""
    spec = copy.deepcopy(good_spec)
    spec["model"][affix] = "x" * 40
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(UserError, match=f"model.{affix}"):
        load_tokenizer(path)


# --- sources and corpus files ---------------------------------------------------------------------------------


@pytest.fixture
def corpus_run(tmp_path, monkeypatch):
    """A project with an earlier good corpus in `corpus/`: returns its bytes to compare after a failed run."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {"data": {"val_fraction": 0.3}})
    texts = [f"document {i}: " + "to be or not to be, that is the question " * (i % 7 + 1) for i in range(200)]
    pq.write_table(pa.table({"text": texts}), "good.parquet", compression="zstd")
    Path("good.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    assert run_kiln(["data", "prepare", "--set", "data.source=good.parquet", "--out", "corpus"]).exit_code == 0
    return tree_bytes(tmp_path / "corpus")


def prepare_fails(source: str, *names: str) -> None:
    fails_in_one_line(["data", "prepare", "--set", f"data.source={source}", "--out", "corpus"], 2, source, *names)


def test_truncated_parquet_source(corpus_run):
    data = Path("good.parquet").read_bytes()
    Path("bad.parquet").write_bytes(data[: len(data) // 2])
    prepare_fails("bad.parquet", "not a readable parquet file")
    assert tree_bytes(Path("corpus")) == corpus_run


def test_parquet_source_with_a_corrupted_page(corpus_run):
    data = bytearray(Path("good.parquet").read_bytes())
    for i in range(200, 400):  # inside the first column chunk: the footer still reads
        data[i] ^= 0x5A
    Path("bad.parquet").write_bytes(bytes(data))
    prepare_fails("bad.parquet", "row group 0")
    assert tree_bytes(Path("corpus")) == corpus_run


def test_truncated_jsonl_source_names_the_line(corpus_run):
    lines = Path("good.jsonl").read_bytes().splitlines(keepends=True)
    Path("bad.jsonl").write_bytes(b"".join(lines[:150]) + lines[150][:20])
    prepare_fails("bad.jsonl", "bad.jsonl:151", "not valid JSON")
    assert tree_bytes(Path("corpus")) == corpus_run


def test_jsonl_source_of_random_bytes_names_the_line(corpus_run):
    Path("bad.jsonl").write_bytes(b'{"text": "fine"}\n' + random.Random(1).randbytes(300).replace(b"\n", b" "))
    prepare_fails("bad.jsonl", "bad.jsonl:2")
    assert tree_bytes(Path("corpus")) == corpus_run


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_any_jsonl_bytes_give_a_corpus_or_user_error(raw):
    from kiln.pipeline.config import build_section
    from kiln.pipeline.text.prepare import prepare
    from kiln.pipeline.text.sources import DataParams

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_bytes(raw)
        params = build_section(DataParams, {"source": str(source), "val_fraction": 0.5})
        try:
            prepare(params, Path(tmp) / "corpus")
        except UserError as e:
            assert "\n" not in str(e)


# --- sources too large to hold (issue 68, finding 11b): refused in one line, never read whole ------------------


def test_a_3gb_txt_source_is_refused_by_its_size_before_it_is_read(corpus_run):
    from kiln.pipeline.text.sources import MAX_DOCUMENT_BYTES

    with open("big.txt", "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk spent; read whole, it ended in Arrow's capacity error
    prepare_fails("big.txt", "3,221,225,472 bytes", "a .txt file (one document)", f"at most {MAX_DOCUMENT_BYTES:,}")
    assert tree_bytes(Path("corpus")) == corpus_run


# The whole file one unit (the line inside it), or units of 64 bytes (the line runs past where planning looks).
@pytest.mark.parametrize("unit_bytes", [1 << 20, 64])
def test_a_jsonl_line_longer_than_a_document_names_its_line(corpus_run, monkeypatch, unit_bytes):
    monkeypatch.setattr("kiln.pipeline.text.sources.MAX_DOCUMENT_BYTES", 1000)
    monkeypatch.setattr("kiln.pipeline.text.sources.JSONL_UNIT_BYTES", unit_bytes)
    lines = Path("good.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[150] = json.dumps({"text": "x" * 5000}) + "\n"
    Path("long.jsonl").write_text("".join(lines), encoding="utf-8")
    prepare_fails("long.jsonl", "long.jsonl:151", "more than 1,000 bytes")
    assert tree_bytes(Path("corpus")) == corpus_run


def test_a_parquet_value_longer_than_a_document_is_refused(corpus_run, monkeypatch):
    monkeypatch.setattr("kiln.pipeline.text.sources.MAX_DOCUMENT_BYTES", 1000)
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(20)] + ["é" * 501]}), "long.parquet")
    prepare_fails("long.parquet", "a document of 1,002 bytes", "at most 1,000 bytes")
    assert tree_bytes(Path("corpus")) == corpus_run


def test_shard_refuses_a_truncated_corpus_split(workdir, tiny):
    corpus = workdir / "corpus"
    shutil.copytree(tiny.corpus, corpus)
    data = (corpus / "val.parquet").read_bytes()
    (corpus / "val.parquet").write_bytes(data[: len(data) - 100])
    before = tree_bytes(workdir / "run" / "shards")
    fails_in_one_line(shard_args(corpus, tiny.tokenizer), 2, corpus / "val.parquet", "unreadable")
    assert tree_bytes(workdir / "run" / "shards") == before


# --- class 13: the disk fills up while shards are written ----------------------------------------------------


def test_disk_full_mid_shard_keeps_the_previous_output_and_the_finished_shards(workdir, tiny, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up as the second train shard is flushed
        if "train_000001.bin" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    before = tree_bytes(workdir / "run" / "shards")
    monkeypatch.setattr(os, "fsync", fsync)
    fails_in_one_line(shard_args(tiny.corpus, tiny.tokenizer), 1, "train_000001.bin", "No space left on device")
    assert tree_bytes(workdir / "run" / "shards") == before
    assert [p.name for p in (workdir / "run").iterdir() if p.name.startswith("shards")] == ["shards"]
    # The shard finished before the disk filled is kept for the next run; the one being written is gone.
    work = workdir / "run/checkpoints/shard"
    assert sorted(p.name for p in work.iterdir()) == ["progress.json", "train_000000.bin"]
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert run_kiln(shard_args(tiny.corpus, tiny.tokenizer)).exit_code == 0
    assert tree_bytes(workdir / "run" / "shards") == before
