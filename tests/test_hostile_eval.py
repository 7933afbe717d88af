"""Hostile eval task files (issue 18, classes 14 and 15): damaged files and rows of the wrong type, through
`kiln evaluate`. Each must stop before any scoring with one line naming the file (and the line and field of a bad
row), exit 2, and leave what an earlier run wrote as it was."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.bpe import load_tokenizer

from conftest import fails_in_one_line, tree_bytes, write_params

GOOD = {"query": "The king", "choices": ["said", "spoke"], "gold": 0}
MMLU_ROW = "What is 1+1?,1,2,3,4,B\n"


@pytest.fixture(scope="module")
def ws(tiny, tmp_path_factory):
    """A random model for the tiny corpus, and a first good run whose outputs every failing run must leave alone."""
    root = tmp_path_factory.mktemp("hostile_eval")
    config = ModelConfig(vocab_size=load_tokenizer(tiny.tokenizer).get_vocab_size(), n_layer=1, n_head=2,
                         n_kv_head=1, d_model=16, max_seq_len=32)
    torch.manual_seed(0)
    save_model(GPT(config), config, root / "models/base", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    good = root / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    run = Run(tiny, root)
    result = run.invoke({"name": "good", "data": str(good)})
    assert result.exit_code == 0, result.output
    return run


class Run:
    def __init__(self, built, root: Path):
        self.built, self.root, self.metrics = built, root, root / "run/metrics"

    def args(self, task: dict, samples: list[str] = ("The king",)) -> list[str]:
        params = write_params(self.root / "params.yaml", {
            "eval": {"models": ["base"], "tokens": 256, "batch_size": 4, "tasks": [task], "posttrain": False,
                     "samples": list(samples), "max_new_tokens": 2},
            "train": {"device": "cpu"}})
        return ["evaluate", "--params", str(params), "--models", str(self.root / "models"),
                "--shards", str(self.built.shards), "--tokenizer", str(self.built.tokenizer),
                "--corpus", str(self.built.corpus), "--out", str(self.root / "run")]  # a hand run

    def invoke(self, task: dict):
        from typer.testing import CliRunner

        from kiln.pipeline.cli import app

        return CliRunner().invoke(app, self.args(task))

    def fails(self, task: dict, *names: str, samples: list[str] = ("The king",)) -> str:
        before = tree_bytes(self.metrics)
        assert set(before) == {"eval.json", "report.md", "samples/base.md"}
        line = fails_in_one_line(self.args(task, samples), 2, *names)
        assert tree_bytes(self.metrics) == before
        return line


def jsonl(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def cut(data: bytes) -> bytes:
    return data[:len(data) // 2]


# (file name, bytes, what the one line must name besides the file)
CASES = {
    # class 14: damaged files
    "truncated mmlu csv.gz": ("mmlu_test.csv.gz", cut(gzip.compress(MMLU_ROW.encode() * 400)),
                              ("a truncated or corrupt gzip file",)),
    "truncated jsonl.gz": ("arc.jsonl.gz", cut(gzip.compress(jsonl(*[GOOD] * 300))), ("truncated",)),
    "not gzip at all": ("arc.jsonl.gz", jsonl(GOOD), ("gzip",)),
    "jsonl not UTF-8": ("arc.jsonl", jsonl(GOOD) + b'{"query": "caf\xe9"}\n', (":2:", "not UTF-8")),
    "jsonl cut mid-row": ("arc.jsonl", jsonl(GOOD, GOOD)[:-10], (":2:", "not JSON")),
    "a row that is not an object": ("arc.jsonl", jsonl(GOOD, "[1, 2]"), (":2:", "JSON object")),
    "json array of non-objects": ("arc.json", json.dumps([GOOD, 7]).encode(), (": row 2:", "JSON object")),
    "parquet that is not": ("arc.parquet", jsonl(GOOD), ("Parquet",)),
    "csv row of 5 cells": ("mmlu_test.csv", (MMLU_ROW * 3 + "q,1,2,3,B\n").encode(), (":4:", "6 cells")),
    "unknown columns": ("arc.jsonl", jsonl({"prompt": "p", "answer": "a"}), (":1:", "prompt, answer")),
    # class 15: rows of the wrong type
    "gold not an int": ("arc.jsonl", jsonl(GOOD, {**GOOD, "gold": "1"}), (":2:", "gold", "'1'")),
    "gold a float": ("arc.jsonl", jsonl(GOOD, {**GOOD, "gold": 1.0}), (":2:", "gold", "1.0")),
    "gold a bool": ("arc.jsonl", jsonl(GOOD, {**GOOD, "gold": True}), (":2:", "gold", "True")),
    "gold out of range": ("arc.jsonl", jsonl(GOOD, {**GOOD, "gold": 2}), (":2:", "gold", "0..1", "got 2")),
    "gold missing": ("arc.jsonl", jsonl(GOOD, {"query": "q", "choices": ["a", "b"]}), (":2:", "gold: missing")),
    "choices a string": ("arc.jsonl", jsonl(GOOD, {**GOOD, "choices": "ab"}), (":2:", "choices", "list")),
    "a choice not a string": ("arc.jsonl", jsonl(GOOD, {**GOOD, "choices": ["a", 3]}), (":2:", "choices[1]")),
    "a choice with a lone surrogate": ("arc.jsonl", jsonl(GOOD, '{"query": "q", "choices": ["a", "b\\ud800"], '
                                                              '"gold": 0}'), (":2:", "choices[1]", "surrogate")),
    "query not a string": ("arc.jsonl", jsonl(GOOD, {**GOOD, "query": 5}), (":2:", "query", "got 5")),
    "mmlu answer letter": ("mmlu_test.csv", (MMLU_ROW + "q,1,2,3,4,E\n").encode(), (":2:", "answer", "'E'")),
    "mmlu answer index in a row file": ("mmlu.jsonl", jsonl({"subject": "s", "question": "q", "choices": list("abcd"),
                                                             "answer": 4}), (":1:", "answer", "0..3")),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_or_mistyped_task_file_is_one_line_naming_it(ws, tmp_path, case):
    name, data, names = CASES[case]
    path = tmp_path / name
    path.write_bytes(data)
    ws.fails({"name": "t", "data": str(path)}, str(path), *names)


def test_a_task_whose_every_answer_is_longer_than_the_context_is_refused(ws, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(jsonl({"query": "q", "choices": ["a " * 40, "b " * 40], "gold": 0}))
    ws.fails({"name": "long", "data": str(path)}, "eval.tasks[0] long", "every item", "32-token context")


@pytest.mark.parametrize("samples, names", [
    (["The king", "The king " * 20], ("eval.samples[1]", "eval.max_new_tokens=2", "max_seq_len=32")),
    (["The king\ud800"], ("eval.samples[0]", "lone surrogate")),
])
def test_a_sample_prompt_that_cannot_be_continued_is_named_before_any_work(ws, samples, names):
    ws.fails({"name": "good", "data": str(ws.root / "good.jsonl")}, *names, samples=samples)


def test_a_task_file_that_never_ends_or_never_answers_is_refused_before_reading(ws, tmp_path):
    """A task file that was /dev/zero grew the process to 22.9 GB (the machine's out-of-memory killer ended
    it); a FIFO hung forever; a 50 MB single line was read whole. Each is one line now, before a row is read."""
    import os
    import threading

    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    ws.fails({"name": "t", "data": str(zero)}, str(zero), "a device; expected a task or dataset file")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)

    def unblock():  # should the FIFO be opened for reading after all, end that read so the test fails, not hangs
        if not done.wait(20):
            with open(fifo, "wb"):
                pass

    done = threading.Event()
    threading.Thread(target=unblock, daemon=True).start()
    try:
        ws.fails({"name": "t", "data": str(fifo)}, str(fifo), "a FIFO; expected a task or dataset file")
    finally:
        done.set()
    long = tmp_path / "long.jsonl"
    long.write_bytes(b'{"query": "' + b"x" * (9 << 20) + b'"}\n')
    ws.fails({"name": "t", "data": str(long)}, f"{long}:1", "a line of more than 8,388,608 bytes")
