"""Hostile shard folders (issue 18, class 14): every damaged manifest or shard is refused by `kiln pretrain`
and `kiln data inspect` as one line naming the file and the field, exit 2, with earlier outputs untouched."""

import copy
import hashlib
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.text.loader import ShardSet
from kiln.pipeline.text.shard_format import HEADER_BYTES

from conftest import fails_in_one_line, tree_bytes, write_params

MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 64, "max_steps": 2, "eval_every": 2, "eval_tokens": 64,
         "checkpoint_every": 2, "device": "cpu"}


@pytest.fixture
def workdir(tiny, tmp_path, monkeypatch):
    """A copy of the tiny shards, a params file for a two-step model, and a previous model in the output folder."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny.shards, tmp_path / "shards")
    write_params(tmp_path / "params.yaml", {"model": MODEL, "train": TRAIN})
    (tmp_path / "base" / "model").mkdir(parents=True)  # a hand run's folder (--out base) and its earlier model
    (tmp_path / "base" / "model" / "model.safetensors").write_bytes(b"the previous model")
    return tmp_path


def pretrain_fails(root, tiny, *names):
    before = tree_bytes(root)
    fails_in_one_line(["pretrain", "--params", str(root / "params.yaml"), "--shards", str(root / "shards"),
                       "--tokenizer", str(tiny.tokenizer), "--out", str(root / "base"),
                       "--checkpoints", str(root / "ckpt")], 2, *names)
    assert tree_bytes(root) == before


def manifest(root) -> dict:
    return json.loads((root / "shards" / "manifest.json").read_text())


def edited(root, edit) -> dict:
    value = manifest(root)
    edit(value)
    return value


def set_path(value, path, new):
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def resign(root, name):
    """Recompute a shard's sha256 in the manifest after editing it, as a careless (or hostile) tool would."""
    value = manifest(root)
    for entry in value["splits"][name.split("_")[0]]["shards"]:
        if entry["file"] == name:
            entry["sha256"] = hashlib.sha256((root / "shards" / name).read_bytes()).hexdigest()
    (root / "shards" / "manifest.json").write_text(json.dumps(value))


CASES = {
    "random bytes": (lambda r: bytes(range(128, 256)), ["UTF-8"]),
    "not JSON": (lambda r: b"{splits: oops", ["not valid JSON"]),
    "a list": (lambda r: b"[]", ["JSON object", "list"]),
    "no tokenizer hash": (lambda r: edited(r, lambda m: m.pop("tokenizer_sha256")), ["tokenizer_sha256"]),
    "vocab size a string": (lambda r: edited(r, lambda m: m.update(vocab_size="300")), ["vocab_size", "'300'"]),
    "tokens a string": (lambda r: edited(r, lambda m: set_path(m, ["splits", "train", "shards", 0, "tokens"],
                                                                "2048")),
                        ["splits.train.shards[0].tokens", "'2048'"]),
    "shards not a list": (lambda r: edited(r, lambda m: set_path(m, ["splits", "train", "shards"], {"a": 1})),
                          ["splits.train.shards", "dict"]),
    "file escapes the folder": (lambda r: edited(r, lambda m: set_path(m, ["splits", "train", "shards", 0, "file"],
                                                                       "../../etc/passwd")),
                                ["splits.train.shards[0].file", "../../etc/passwd"]),
    "absolute file": (lambda r: edited(r, lambda m: set_path(m, ["splits", "train", "shards", 1, "file"],
                                                             "/etc/passwd")),
                      ["splits.train.shards[1].file", "/etc/passwd"]),
    "no train split": (lambda r: edited(r, lambda m: m["splits"].pop("train")), ["'train'"]),
    "split tokens disagree": (lambda r: edited(r, lambda m: set_path(m, ["splits", "val", "tokens"], 7)),
                              ["splits.val.tokens", "7"]),
}


@pytest.mark.parametrize("case", CASES)
def test_pretrain_refuses_a_hostile_manifest(workdir, tiny, case):
    make, names = CASES[case]
    content = make(workdir)
    path = workdir / "shards" / "manifest.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    pretrain_fails(workdir, tiny, path, *names)


def test_garbage_shard_header_is_refused(workdir, tiny):
    shard = workdir / "shards" / "train_000001.bin"
    data = bytearray(shard.read_bytes())
    data[:HEADER_BYTES] = np.random.default_rng(0).integers(0, 256, HEADER_BYTES, dtype=np.uint8).tobytes()
    shard.write_bytes(bytes(data))
    resign(workdir, shard.name)
    pretrain_fails(workdir, tiny, shard, "magic")
    fails_in_one_line(["data", "inspect", str(shard)], 2, shard, "magic")


def test_token_ids_outside_the_vocabulary_are_refused_even_when_re_signed(workdir, tiny):
    shard = workdir / "shards" / "val_000000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES + 2 * 5:HEADER_BYTES + 2 * 6] = (300).to_bytes(2, "little")  # vocab is 0..299
    shard.write_bytes(bytes(data))
    resign(workdir, shard.name)
    pretrain_fails(workdir, tiny, shard, "300", "position 5")
    fails_in_one_line(["data", "inspect", str(shard), "--tokenizer", str(tiny.tokenizer)], 2, shard, "300")


# ---------------------------------------------------------------- property tests of the manifest reader

def json_values():
    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def leaf_paths(value, path=()):
    """Every key path of a JSON value, containers included."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        yield from leaf_paths(child, (*path, key))


@pytest.fixture(scope="module")
def shard_copy(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("hypothesis")
    shutil.copytree(tiny.shards, root / "shards")
    return root / "shards", json.loads((tiny.shards / "manifest.json").read_text())


def opens_or_refuses(folder) -> None:
    for split in ("train", "val"):
        try:
            ShardSet(folder, split)
        except UserError as e:
            message = str(e)
            assert "\n" not in message and (str(folder / "manifest.json") in message or ".bin" in message), message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_manifest_bytes_give_a_shard_set_or_user_error(shard_copy, raw):
    folder, _ = shard_copy
    (folder / "manifest.json").write_bytes(raw)
    opens_or_refuses(folder)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_field_replaced_or_dropped_gives_a_shard_set_or_user_error(shard_copy, data):
    folder, valid = shard_copy
    value = copy.deepcopy(valid)
    path = data.draw(st.sampled_from([p for p in leaf_paths(valid) if p]))
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values())
    (folder / "manifest.json").write_text(json.dumps(value))
    opens_or_refuses(folder)
