"""Hostile post-training data (issue 18, classes 14 and 15): a damaged SFT or DPO file is refused by `kiln sft`
and `kiln dpo` in one line naming the file (and the line, where there are lines), exit 2, with the previous
model untouched; a file whose every row has fields of the wrong type is refused naming the file and the count."""

import gzip
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import fails_in_one_line, tree_bytes, write_params
from test_posttrain import save_base

SFT_ROWS = [{"prompt": f"Name number {i}?", "response": f"Name {i}"} for i in range(8)]
DPO_ROWS = [{"prompt": f"Name number {i}?", "chosen": f"Name {i}", "rejected": "Nobody"} for i in range(8)]
LOOP = {"max_steps": 1, "batch_size": 2, "batch_examples": 2, "val_examples": 2, "eval_every": 1,
        "checkpoint_every": 1, "log_every": 1}


def lines(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def parquet(rows: list) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


# name -> (content from the stage's good rows, what the one line says after the file's path)
DAMAGED = {
    "broken.jsonl": (lambda rows: lines(rows[:5]) + '{"prompt": "p",\n' + lines(rows[5:]), ":6: not JSON"),
    "cut.jsonl": (lambda rows: lines(rows)[:-20], ":8: not JSON"),
    "scalar.jsonl": (lambda rows: lines(rows[:2]) + "42\n" + lines(rows[2:]), ":3: expected a JSON object"),
    "binary.jsonl": (lambda rows: lines(rows[:1]).encode() + b"\xff\xfe\x00\n", ":2: not UTF-8"),
    "bad.json": (lambda rows: json.dumps(rows, indent=1).replace('"prompt"', "prompt", 1), ": not JSON"),
    "cut.jsonl.gz": (lambda rows: gzip.compress(lines(rows).encode())[:-25], ": cannot read it"),
    "cut.parquet": (lambda rows: parquet(rows)[:-200], ": not a readable Parquet file"),
    "text.parquet": (lambda rows: lines(rows), ": not a readable Parquet file"),
}
# Rows whose every field has the wrong type: skipped and counted, and none left is an error naming the count.
WRONG_TYPES = {
    "sft": [{"prompt": ["Name?"], "response": "Name"}, {"prompt": "Name?", "response": 7},
            {"prompt": "Name?", "response": "bad \ud800"}, {"prompt": {"role": "user"}, "response": "Name"}],
    "dpo": [{"prompt": "Q", "chosen": 1, "rejected": "r"}, {"prompt": "Q", "chosen": "c", "rejected": [None]},
            {"prompt": 2.5, "chosen": "c", "rejected": "r"}, {"prompt": "Q", "chosen": "c\udfff", "rejected": "r"}],
}


@pytest.fixture(scope="module")
def start_model(tiny, tmp_path_factory):
    """A tiny random model for the tiny tokenizer: the base model of `kiln sft` and the SFT model of `kiln dpo`."""
    return save_base(tiny.tokenizer, tmp_path_factory.mktemp("start") / "model")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A params file for one-step runs and a previous model in each stage's output folder."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {"sft": LOOP, "dpo": LOOP, "train": {"device": "cpu"}})
    for stage in ("sft", "dpo"):
        (tmp_path / "models" / stage / "model").mkdir(parents=True)  # a hand run's folder and its earlier model
        (tmp_path / "models" / stage / "model" / "model.safetensors").write_bytes(b"the previous model")
    return tmp_path


def refused(root, tiny, start_model, stage: str, data, *names):
    """`kiln <stage>` on `data` fails in one line naming `names`, and changes no file under `root`."""
    before = tree_bytes(root)
    model = ["--base" if stage == "sft" else "--sft", str(start_model)]
    fails_in_one_line([stage, "--set", f"data={data}", *model, "--tokenizer", str(tiny.tokenizer),
                       "--corpus", str(tiny.corpus), "--out", str(root / "models" / stage),
                       "--checkpoints", str(root / "ckpt" / stage)], 2, *names)
    assert tree_bytes(root) == before


@pytest.mark.parametrize("stage", ["sft", "dpo"])
@pytest.mark.parametrize("name", DAMAGED)
def test_damaged_files_are_refused_naming_file_and_line(workdir, tiny, start_model, stage, name):
    content, said = DAMAGED[name]
    path = workdir / name
    data = content(SFT_ROWS if stage == "sft" else DPO_ROWS)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    refused(workdir, tiny, start_model, stage, path, f"{path}{said}")


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_rows_of_wrong_types_only_are_refused(workdir, tiny, start_model, stage):
    path = workdir / "wrong.jsonl"
    path.write_text(lines(WRONG_TYPES[stage]))
    refused(workdir, tiny, start_model, stage, path, f"{stage}.data='{path}'", "no usable row among 4",
            "bad messages: 4")


@pytest.mark.parametrize("stage", ["sft", "dpo"])
@pytest.mark.parametrize(("name", "said"), [("data.csv", "unsupported file type"), ("gone.jsonl", "no such file"),
                                            ("empty.jsonl", "no rows"), ("odd.jsonl", "cannot tell the format")])
def test_files_that_are_no_dataset(workdir, tiny, start_model, stage, name, said):
    path = workdir / name
    if name != "gone.jsonl":
        path.write_text(lines([{"question": "q", "answer": "a"}]) if name == "odd.jsonl" else "")
    refused(workdir, tiny, start_model, stage, path, str(path), said)


# --- params that cannot train together: refused as they are loaded (issue 68, finding 15a) --------------------

# (stage, params.yaml's sections, what the one line names): each was refused only once the start model was loaded
# and the rows built (fp8 with an adapter after 14-16 s, leaving the checkpoints' lock file behind).
CANNOT_TRAIN = [
    ("sft", {"train": {"precision": "fp8"}, "sft": {"adapter": "lora"}}, "sft.adapter=lora"),
    ("dpo", {"train": {"precision": "fp8"}, "dpo": {"adapter": "qlora"}}, "dpo.adapter=qlora"),
    ("grpo", {"train": {"precision": "fp8"}, "grpo": {"adapter": "lora"}}, "grpo.adapter=lora"),
    ("sft", {"train": {"nproc_per_node": 2}, "sft": {"batch_size": 4, "batch_examples": 4}},
     "sft.batch_examples=4: expected a multiple of sft.batch_size x train.nproc_per_node = 8"),
    ("grpo", {"grpo": {"data": "builtin", "max_examples": None}}, "grpo.max_examples=null"),
]


@pytest.mark.parametrize(("stage", "sections", "named"), CANNOT_TRAIN)
@pytest.mark.parametrize("how", ["dag", "by hand"])
def test_params_that_cannot_train_together_are_refused_before_any_work(tmp_path, monkeypatch, stage, sections,
                                                                       named, how):
    """As the DAG runs the stage (params.yaml alone) and by hand (--set): exit 2 in one line at once, with no
    start model needed and no file written (no lock, no run folder)."""
    monkeypatch.chdir(tmp_path)
    if how == "dag":
        write_params(tmp_path / "params.yaml", sections)
        args = [stage]
    else:
        write_params(tmp_path / "params.yaml", {})
        args = [stage, *(part for section, values in sections.items() for key, value in values.items()
                         for part in ("--set", f"{section}.{key}={json.dumps(value)}"))]
    start = time.monotonic()
    fails_in_one_line(args, 2, named)
    assert time.monotonic() - start < 2
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]
