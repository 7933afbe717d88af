import fcntl
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import build, tree_bytes
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import exclusive, lock_path
from kiln.pipeline.text.bpe import load_tokenizer
from kiln.pipeline.text.loader import ShardSet, TokenBatches
from kiln.pipeline.text.shard import ShardParams, shard
from kiln.pipeline.text.shard_format import HEADER_BYTES

B, T = 4, 16


def expected_stream(built, split: str) -> np.ndarray:
    """Each document encoded on its own by plain HF tokenizers, each followed by <|endoftext|>."""
    tok = load_tokenizer(built.tokenizer, ordinary=True)
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for text in pq.read_table(built.corpus / f"{split}.parquet")["text"].to_pylist():
        ids += tok.encode(text).ids + [eot]
    return np.array(ids, dtype=np.int64)


def raw_tokens(path) -> np.ndarray:
    """Parse a shard by hand from the documented header layout."""
    data = path.read_bytes()
    magic, version, itemsize, count, vocab = struct.unpack_from("<8sIIQI", data)
    assert magic == b"KILNTOKS" and version == 1 and itemsize == 2 and vocab == 300
    body = np.frombuffer(data[HEADER_BYTES:], dtype="<u2")
    assert len(body) == count
    return body.astype(np.int64)


def copy_shards(built, tmp_path):
    dst = tmp_path / "shards"
    shutil.copytree(built.shards, dst)
    return dst


@pytest.mark.parametrize("split", ["train", "val"])
def test_shards_hold_every_document_then_eot(tiny, split):
    manifest = json.loads((tiny.shards / "manifest.json").read_text())
    entries = manifest["splits"][split]["shards"]
    assert len(entries) >= 2  # shard_tokens=2048 cuts the tiny corpus into several files
    assert all(e["tokens"] == 2048 for e in entries[:-1]) and 0 < entries[-1]["tokens"] <= 2048
    stream = np.concatenate([raw_tokens(tiny.shards / e["file"]) for e in entries])
    np.testing.assert_array_equal(stream, expected_stream(tiny, split))
    assert manifest["splits"][split]["tokens"] == len(stream)
    for e in entries:
        assert hashlib.sha256((tiny.shards / e["file"]).read_bytes()).hexdigest() == e["sha256"]
    assert manifest["tokenizer_sha256"] == hashlib.sha256(tiny.tokenizer.read_bytes()).hexdigest()
    assert [e["file"] for e in entries] == [f"{split}_{i:06d}.bin" for i in range(len(entries))]


def test_hf_backend_writes_identical_shards(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shard(build_section(ShardParams, {"shard_tokens": 2048, "backend": "hf"}), tiny.corpus, tiny.tokenizer,
          tmp_path / "hf")
    for path in tiny.shards.iterdir():
        assert (tmp_path / "hf" / path.name).read_bytes() == path.read_bytes(), path.name
    metrics = json.loads((tmp_path / "metrics/shard.json").read_text())["shard"]
    timings = json.loads((tmp_path / "metrics/timings/shard.json").read_text())
    assert timings["mb_per_s"] > 0 and metrics["train_tokens"] + metrics["val_tokens"] > 0
    assert not {"seconds", "mb_per_s"} & set(metrics)  # timings stay out of what `dvc metrics diff` compares


class Killed(BaseException):
    """A kill: nothing in kiln catches it, as nothing runs after SIGKILL."""


def shard_run(tiny, root, monkeypatch, kill_before: tuple[str, int] | None = None, **params) -> list[str]:
    """Run the shard stage in `root` (output `root/shards`), killed as it is about to write shard `kill_before`
    (split, index); returns the names of the shard files this run wrote."""
    import kiln.pipeline.text.shard as stage
    from kiln.pipeline.outputs import atomic_write_bytes as real

    written = []

    def write(path, data):
        if kill_before is not None and path.name == f"{kill_before[0]}_{kill_before[1]:06d}.bin":
            raise Killed
        if path.suffix == ".bin":
            written.append(path.name)
        real(path, data)

    monkeypatch.chdir(root)
    monkeypatch.setattr(stage, "atomic_write_bytes", write)
    shard(build_section(ShardParams, {"shard_tokens": 2048, **params}), tiny.corpus, tiny.tokenizer, root / "shards")
    return written


def files(folder) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kill_before", [("train", 3), ("val", 1)])
def test_a_killed_run_resumes_after_its_last_finished_shard(tiny, tmp_path, monkeypatch, kill_before):
    with pytest.raises(Killed):
        shard_run(tiny, tmp_path, monkeypatch, kill_before)
    assert not (tmp_path / "shards").exists()
    work = tmp_path / "data/checkpoints/shard"
    progress = json.loads((work / "progress.json").read_text())["shards"]
    finished = [e["file"] for split in ("train", "val") for e in progress[split]]
    n_train = len(json.loads((tiny.shards / "manifest.json").read_text())["splits"]["train"]["shards"])
    assert len(finished) == (3 if kill_before[0] == "train" else n_train + 1)
    # Shards end inside documents: the resume point is a document and an offset into its tokens.
    assert any(e["next_offset"] > 0 for split in ("train", "val") for e in progress[split])
    kept = {name: os.stat(work / name).st_ino for name in finished}
    written = shard_run(tiny, tmp_path, monkeypatch)
    assert not set(written) & set(finished), "a finished shard was encoded again"
    assert written, "the rerun wrote the shards after the kill"
    assert files(tmp_path / "shards") == {name: (os.stat(tmp_path / "shards" / name).st_ino, data)
                                          for name, (_, data) in files(tiny.shards).items()}
    assert {name: os.stat(tmp_path / "shards" / name).st_ino for name in finished} == kept  # the same files
    assert not work.exists()


def test_a_run_that_opened_the_lock_file_before_the_end_excludes_any_later_one(tiny, tmp_path, monkeypatch):
    """Another run opens the lock file while this one holds it, and locks it once this one ends: were the file
    removed at the end, a third run would create and lock a new one, and two runs would shard into one folder."""
    import kiln.pipeline.text.shard as stage

    work, opened, write_metrics = tmp_path / "data/checkpoints/shard", [], stage.write_metrics

    def opening(*args, **kwargs):  # called while the lock is held
        opened.append(open(lock_path(work), "a+"))
        return write_metrics(*args, **kwargs)

    monkeypatch.setattr(stage, "write_metrics", opening)
    shard_run(tiny, tmp_path, monkeypatch)
    with opened[0] as second:
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="in use by another kiln run"), exclusive(work):
            pass


def test_a_damaged_finished_shard_is_encoded_again(tiny, tmp_path, monkeypatch):
    with pytest.raises(Killed):
        shard_run(tiny, tmp_path, monkeypatch, ("train", 3))
    work = tmp_path / "data/checkpoints/shard"
    data = bytearray((work / "train_000001.bin").read_bytes())
    data[HEADER_BYTES + 5] ^= 0xFF
    (work / "train_000001.bin").write_bytes(bytes(data))
    (work / "train_000003.bin.tmp-killed").write_bytes(b"half a shard")  # what a kill mid-write leaves
    written = shard_run(tiny, tmp_path, monkeypatch)
    assert written[:3] == ["train_000001.bin", "train_000002.bin", "train_000003.bin"]
    assert tree_bytes(tmp_path / "shards") == tree_bytes(tiny.shards)


def test_a_rerun_on_other_inputs_starts_afresh(tiny, tmp_path, monkeypatch):
    with pytest.raises(Killed):
        shard_run(tiny, tmp_path, monkeypatch, ("train", 3))
    written = shard_run(tiny, tmp_path, monkeypatch, shard_tokens=4096)  # another shard size: other shards
    assert written[0] == "train_000000.bin"
    manifest = json.loads((tmp_path / "shards/manifest.json").read_text())
    entries = manifest["splits"]["train"]["shards"]
    stream = np.concatenate([raw_tokens(tmp_path / "shards" / e["file"]) for e in entries])
    np.testing.assert_array_equal(stream, expected_stream(tiny, "train"))
    assert all(e["tokens"] == 4096 for e in entries[:-1])


def test_a_folder_that_is_not_the_resume_state_is_left_alone(tiny, tmp_path, monkeypatch):
    work = tmp_path / "data/checkpoints/shard"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="progress.json"):
        shard_run(tiny, tmp_path, monkeypatch)
    assert (work / "notes.txt").read_text() == "mine"


def test_read_across_shard_boundaries(tiny):
    shards = ShardSet(tiny.shards, "train")
    stream = expected_stream(tiny, "train")
    assert shards.tokens == len(stream)
    for start, n in [(0, 10), (2040, 20), (2048 - 1, 2), (0, len(stream)), (len(stream) - 5, 5)]:
        np.testing.assert_array_equal(shards.read(start, n), stream[start:start + n])


def test_random_batches_are_windows_of_the_stream(tiny):
    stream = expected_stream(tiny, "train")
    windows = np.lib.stride_tricks.sliding_window_view(stream, T + 1)
    batches = TokenBatches(ShardSet(tiny.shards, "train"), B, T, seed=3)
    for _ in range(3):
        x, y = next(batches)
        assert x.shape == y.shape == (B, T) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            row = np.concatenate([row_x, row_y[-1:]])
            assert (windows == row).all(axis=1).any()


def batches(built, n, **kw):
    loader = TokenBatches(ShardSet(built.shards, "train"), kw.pop("batch_size", B), T, **kw)
    return [next(loader) for _ in range(n)], loader


def test_batches_deterministic_and_resumable(tiny):
    first, _ = batches(tiny, 8, seed=1)
    again, _ = batches(tiny, 8, seed=1)
    other, _ = batches(tiny, 8, seed=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
    assert not torch.equal(first[0][0], first[1][0])  # steps differ
    _, interrupted = batches(tiny, 5, seed=1)
    state = json.loads(json.dumps(interrupted.state_dict()))  # the state survives JSON
    resumed = TokenBatches(ShardSet(tiny.shards, "train"), B, T, seed=1)
    resumed.load_state_dict(state)
    for expected in first[5:]:
        x, y = next(resumed)
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    mismatched = TokenBatches(ShardSet(tiny.shards, "train"), B, T + 1, seed=1)
    with pytest.raises(UserError, match="seq_len"):
        mismatched.load_state_dict(state)


def test_ranks_split_the_global_batch(tiny):
    single, _ = batches(tiny, 3, seed=5, batch_size=2 * B)
    rank0, _ = batches(tiny, 3, seed=5, rank=0, world_size=2)
    rank1, _ = batches(tiny, 3, seed=5, rank=1, world_size=2)
    for whole, a, b in zip(single, rank0, rank1):
        assert torch.equal(torch.cat([a[0], b[0]]), whole[0])
        assert not torch.equal(a[0], b[0])


def test_sequential_batches_cover_the_split_once(tiny):
    shards = ShardSet(tiny.shards, "val")
    n_windows = (shards.tokens - 1) // T
    seen = []
    for rank in range(2):
        loader = TokenBatches(shards, B, T, random=False, rank=rank, world_size=2)
        got = list(loader)
        assert len(got) == len(loader)
        seen += [row for x, _ in got for row in x.numpy().tolist()]
    stream = expected_stream(tiny, "val")
    expected = [stream[i * T:(i + 1) * T].tolist() for i in range(n_windows)]
    assert sorted(seen) == sorted(expected) and len(seen) == n_windows


def refuse(shard_dir, match, **kw):
    with pytest.raises(UserError, match=match) as info:
        ShardSet(shard_dir, "train", **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_reader_refuses_truncated_shard(tiny, tmp_path):
    shards = copy_shards(tiny, tmp_path)
    path = shards / "train_000000.bin"
    path.write_bytes(path.read_bytes()[:-7])
    assert "train_000000.bin" in refuse(shards, "truncated")
    path.write_bytes(path.read_bytes()[:100])
    refuse(shards, "truncated")


def test_reader_refuses_corrupted_shard(tiny, tmp_path):
    shards = copy_shards(tiny, tmp_path)
    path = shards / "train_000001.bin"
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "train_000001.bin" in refuse(shards, "corrupted")
    ShardSet(shards, "train", verify=False)  # the size check alone cannot see a flipped token
    data[:8] = b"GARBAGE!"
    path.write_bytes(bytes(data))
    refuse(shards, "magic", verify=False)


def test_reader_refuses_other_tokenizer(tiny, tmp_path):
    refuse(tiny.shards, "another tokenizer", tokenizer_sha256="0" * 64)
    # A shard from a different tokenizer dropped into the folder is caught by its own header.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("completely different text " * 400)
    (src / "b.txt").write_text("and another document here " * 400)
    (src / "c.txt").write_text("third document for the split " * 400)
    other = build(tmp_path, {"source": str(src), "val_fraction": 0.4}, {"vocab_size": 300}, {"shard_tokens": 2048})
    shards = copy_shards(tiny, tmp_path / "mixed")
    shutil.copy(other.shards / "train_000000.bin", shards / "train_000000.bin")
    refuse(shards, "another tokenizer")


def test_shard_stage_fails_cleanly_without_tokenizer(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="tokenizer not found"):
        shard(ShardParams(), tiny.corpus, tmp_path / "missing.json", tmp_path / "shards")
    assert list(tmp_path.iterdir()) == []


def test_inspect_cli(tiny, tmp_path):
    runner = CliRunner()
    path = tiny.shards / "val_000000.bin"
    result = runner.invoke(app, ["data", "inspect", str(path), "--tokenizer", str(tiny.tokenizer), "-n", "12"])
    assert result.exit_code == 0, result.output
    n_tokens = json.loads((tiny.shards / "manifest.json").read_text())["splits"]["val"]["shards"][0]["tokens"]
    assert f"tokens:     {n_tokens:,}" in result.output and "uint16" in result.output
    first_text = pq.read_table(tiny.corpus / "val.parquet")["text"][0].as_py()
    assert first_text[:5] in result.output
    broken = tmp_path / "broken.bin"
    broken.write_bytes(path.read_bytes()[:-3])
    result = runner.invoke(app, ["data", "inspect", str(broken)])
    assert result.exit_code == 2 and "broken.bin" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("where", ["tmpfs", "simulated"])
def test_shards_out_on_another_filesystem(tiny, tmp_path, monkeypatch, where):
    """The output on another filesystem than the resume state (data/checkpoints/shard): finished shards cannot be
    hard-linked or renamed across, so they are copied. A tmpfs where the machine has one beside tmp_path's disk;
    everywhere, os.link and cross-folder renames raising EXDEV as they would."""
    import errno
    import tempfile

    shm = Path("/dev/shm")
    if where == "tmpfs":
        if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("no second filesystem here (the simulated case runs instead)")
        out = Path(tempfile.mkdtemp(dir=shm)) / "shards"
    else:
        out = tmp_path / "elsewhere" / "shards"
        real_replace = os.replace

        def cross_device(*args, **kwargs):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        def elsewhere(path) -> bool:  # the second filesystem
            return (tmp_path / "elsewhere") in Path(path).resolve().parents

        def replace(src, dst, **kwargs):
            if elsewhere(src) != elsewhere(dst):
                cross_device()
            return real_replace(src, dst, **kwargs)
        monkeypatch.setattr(os, "link", cross_device)
        monkeypatch.setattr(os, "replace", replace)
    try:
        monkeypatch.chdir(tmp_path)
        shard(build_section(ShardParams, {"shard_tokens": 2048}), tiny.corpus, tiny.tokenizer, out)
        got = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        want = {p.name: p.read_bytes() for p in sorted(tiny.shards.iterdir())}
        assert got == want
    finally:
        if where == "tmpfs":
            shutil.rmtree(out.parent)
