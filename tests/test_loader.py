"""TokenBatches' random mode on shards whose token i is the id i, so every row names its own start: epochs of
windows drawn without replacement, split across ranks, resumable mid-epoch."""

import hashlib
import json

import numpy as np
import pytest

from kiln.pipeline.text.loader import ShardSet, TokenBatches
from kiln.pipeline.text.shard_format import ShardHeader

T = 16
N = 1000  # tokens in the split: 62 windows of stride 16 at offset 0, one fewer at large offsets
SHA = "ab" * 32


def write_counting_shards(folder, n=N, cut=(300, 700)):
    """A train split of ids 0..n-1 in three shards (so windows straddle files), written by hand from the
    documented format: the header, uint16 ids, a manifest with each file's sha256."""
    folder.mkdir()
    entries = []
    for i, ids in enumerate(np.split(np.arange(n, dtype="<u2"), cut)):
        data = ShardHeader(tokens=len(ids), vocab_size=4096, tokenizer_sha256=SHA, itemsize=2).pack() + ids.tobytes()
        (folder / f"train_{i:06d}.bin").write_bytes(data)
        entries.append({"file": f"train_{i:06d}.bin", "tokens": len(ids), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format_version": 1, "tokenizer_sha256": SHA, "vocab_size": 4096, "dtype": "uint16", "eot_id": 0,
                "splits": {"train": {"tokens": n, "documents": 1, "shards": entries}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return ShardSet(folder, "train")


@pytest.fixture
def counting(tmp_path):
    return write_counting_shards(tmp_path / "shards")


def starts(loader, steps):
    """The window start of every row of the next `steps` batches, checking each row is a window of the split."""
    out = []
    for _ in range(steps):
        x, y = next(loader)
        assert x.shape == y.shape == (loader.batch_size, T)
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            np.testing.assert_array_equal(row_x, np.arange(row_x[0], row_x[0] + T))
            np.testing.assert_array_equal(row_y, row_x + 1)
        out += x[:, 0].tolist()
    return out


def epochs(stream, n_epochs):
    """Cut a stream of starts into epochs: an epoch at offset o holds the (N - 1 - o) // T windows o + kT."""
    out = []
    for _ in range(n_epochs):
        offset = stream[0] % T
        count = (N - 1 - offset) // T
        out.append((offset, stream[:count]))
        stream = stream[count:]
    return out


def test_each_epoch_covers_every_window_once(counting):
    stream = starts(TokenBatches(counting, 4, T, seed=0), 70)  # 280 windows: four epochs and a bit
    for offset, windows in epochs(stream, 4):
        assert sorted(windows) == [offset + k * T for k in range(len(windows))]
        targets = np.sort(np.concatenate([np.arange(s + 1, s + T + 1) for s in windows]))
        np.testing.assert_array_equal(targets, np.arange(offset + 1, offset + len(windows) * T + 1))  # each once
        assert offset < T and N - 1 - targets[-1] < T  # fewer than T tokens sit out at either edge


def test_epochs_differ_in_offset_and_order(counting):
    stream = starts(TokenBatches(counting, 4, T, seed=0), 70)
    cut = epochs(stream, 4)
    assert len({offset for offset, _ in cut}) > 1
    orders = [tuple((np.array(windows) - offset) // T) for offset, windows in cut]
    assert len(set(orders)) == 4
    assert all(order != tuple(sorted(order)) for order in orders)  # shuffled, not in file order


def test_seeds_give_other_batches(counting):
    assert starts(TokenBatches(counting, 4, T, seed=0), 3) != starts(TokenBatches(counting, 4, T, seed=1), 3)


def test_ranks_are_disjoint_and_make_up_the_one_process_batch(counting):
    whole = TokenBatches(counting, 6, T, seed=3)
    ranks = [TokenBatches(counting, 2, T, seed=3, rank=r, world_size=3) for r in range(3)]
    for _ in range(25):  # 150 windows: across two epoch boundaries
        expected = starts(whole, 1)
        parts = [starts(loader, 1) for loader in ranks]
        assert sum(parts, []) == expected
        assert len(set(expected)) == 6


def test_resume_mid_epoch_is_exact(counting):
    reference = starts(TokenBatches(counting, 4, T, seed=2), 40)
    interrupted = TokenBatches(counting, 4, T, seed=2)
    starts(interrupted, 23)  # mid second epoch
    resumed = TokenBatches(counting, 4, T, seed=2)  # a fresh process: nothing memoised
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    assert starts(resumed, 17) == reference[23 * 4:]


def test_resume_with_another_global_batch_goes_on_after_the_windows_consumed(counting):
    reference = starts(TokenBatches(counting, 4, T, seed=2), 30)
    interrupted = TokenBatches(counting, 2, T, seed=2, rank=1, world_size=2)
    starts(interrupted, 21)  # 21 global batches of 4 windows
    resumed = TokenBatches(counting, 6, T, seed=2)  # one process, 6 windows a step
    resumed.load_state_dict(interrupted.state_dict())
    assert starts(resumed, 5) == reference[84:114]
