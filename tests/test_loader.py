"""TokenBatches' random mode on shards whose token i is the id i, so every row names its own start: epochs of
windows drawn without replacement, split across ranks, resumable mid-epoch."""

import hashlib
import json

import numpy as np
import pytest

from kiln.pipeline.errors import UserError
from kiln.pipeline.text.loader import ShardSet, TokenBatches, pack_rows
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


# --- document-aligned rows (train.batching: documents) ----------------------------------------------------------

EOT = 4095


def write_documents(folder, sizes, seed=0):
    """A train split of documents of `sizes` tokens (each ending with EOT, the last without), every other token's
    id its position in the split, so a target names where it came from; three shards."""
    ids = np.arange(sum(sizes), dtype="<u2")
    ends = np.cumsum(sizes)
    ids[ends[:-1] - 1] = EOT
    assert len(ids) < EOT
    folder.mkdir()
    entries = []
    for i, part in enumerate(np.array_split(ids, 3)):
        data = ShardHeader(tokens=len(part), vocab_size=4096, tokenizer_sha256=SHA, itemsize=2).pack() + part.tobytes()
        (folder / f"train_{i:06d}.bin").write_bytes(data)
        entries.append({"file": f"train_{i:06d}.bin", "tokens": len(part), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format_version": 1, "tokenizer_sha256": SHA, "vocab_size": 4096, "dtype": "uint16", "eot_id": EOT,
                "splits": {"train": {"tokens": len(ids), "documents": len(sizes), "shards": entries}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return ShardSet(folder, "train"), np.concatenate([[0], ends])


# short, exactly a row (T + 1), longer than a row, one token, and many in between; 3,000-odd tokens
SIZES = [5, T + 1, 3 * T + 7, 1, 2, *np.random.default_rng(0).integers(2, 3 * T, 40).tolist(), 9]


@pytest.fixture
def documents(tmp_path):
    return write_documents(tmp_path / "docs", SIZES)


def read_rows(loader, steps):
    out = []
    for _ in range(steps):
        x, y = next(loader)
        assert x.shape == y.shape == (loader.batch_size, T)
        out += list(zip(x.numpy(), y.numpy()))
    return out


def test_document_rows_start_at_documents_and_cover_each_target_once_an_epoch(documents):
    shards, bounds = documents
    loader = TokenBatches(shards, 4, T, seed=1, documents=True)
    per_epoch = len(loader._packed_epoch(0))
    rows = read_rows(loader, -(-per_epoch // 4))[:per_epoch]
    predicted = []
    for x, y in rows:
        real = y != -100
        n = int(real.sum())
        assert real[:n].all() and (x[n:] == EOT).all()  # padding only after the tokens, read as EOT
        seq = [*x[:n].tolist(), int(y[n - 1])]
        # positions: a token's id, or for EOT one past the token before it (a piece never starts with EOT)
        at = []
        for token in seq:
            at.append(at[-1] + 1 if token == EOT else token)
        # the row's pieces: cut where positions jump and after each EOT (a document's end)
        pieces, piece = [], [at[0]]
        for prev, (token, here) in zip(seq, zip(seq[1:], at[1:])):
            if here != piece[-1] + 1 or prev == EOT:
                pieces.append(piece)
                piece = []
            piece.append(here)
        pieces.append(piece)
        for piece in pieces:
            doc = int(np.searchsorted(bounds, piece[0], side="right")) - 1
            # a piece starts at its document's first token, or a long one's next row (stride T)
            assert (piece[0] - bounds[doc]) % T == 0 and piece[-1] < bounds[doc + 1], (piece[0], bounds[doc])
            predicted += piece[1:]
    # within an epoch every token but a document's first is predicted once, from inside its own document: no
    # document is split across rows unless it is longer than one, and none is repeated
    want = [t for b, e in zip(bounds[:-1], bounds[1:]) for t in range(b + 1, e)]
    assert sorted(predicted) == want


def test_short_documents_stay_whole_in_one_row(documents):
    shards, bounds = documents
    loader = TokenBatches(shards, 4, T, seed=2, documents=True)
    for pieces in loader._packed_epoch(0):
        assert loader.pieces[1][pieces].sum() <= T + 1
    for b, e in zip(bounds[:-1], bounds[1:]):
        if 2 <= e - b <= T + 1:  # fits a row: exactly one piece, the whole document
            assert ((loader.pieces[0] == b) & (loader.pieces[1] == e - b)).sum() == 1, (b, e)


def test_document_rows_fill_rows_best_fit(documents):
    shards, _ = documents
    loader = TokenBatches(shards, 4, T, seed=3, documents=True)
    rows = loader._packed_epoch(0)
    used = sum(loader.pieces[1][r].sum() for r in rows)
    assert used / (len(rows) * (T + 1)) > 0.9  # ~3,000 tokens in pieces of up to 3T: few padding slots
    # best fit by hand: each row takes the longest waiting piece that fits (the earliest of equals); a full one
    # is a row of its own
    assert [r.tolist() for r in pack_rows(np.array([5, 3, 4, 2, 9, 4]), 9, np.array([0, 1, 2, 3, 4, 5]))] == \
        [[4], [0, 2], [5, 1, 3]]


def test_document_rows_resume_exactly_and_split_across_ranks(documents):
    shards, _ = documents
    whole = read_rows(TokenBatches(shards, 4, T, seed=4, documents=True), 30)  # across epochs
    interrupted = TokenBatches(shards, 4, T, seed=4, documents=True)
    read_rows(interrupted, 11)
    resumed = TokenBatches(shards, 4, T, seed=4, documents=True)
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    for (x, y), (want_x, want_y) in zip(read_rows(resumed, 19), whole[44:], strict=True):
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)
    ranks = [TokenBatches(shards, 2, T, seed=4, documents=True, rank=r, world_size=2) for r in range(2)]
    for step in range(30):
        parts = read_rows(ranks[0], 1) + read_rows(ranks[1], 1)
        for (x, _), (want, _) in zip(parts, whole[4 * step:4 * step + 4], strict=True):
            np.testing.assert_array_equal(x, want)
    with pytest.raises(UserError, match="documents=False, this run has True"):
        TokenBatches(shards, 4, T, seed=4, documents=True).load_state_dict(
            TokenBatches(shards, 4, T, seed=4).state_dict())


def test_document_rows_mark_each_piece_as_a_segment(documents):
    """segments=True (train.doc_mask): each row's third tensor numbers its pieces, the padding one past them; the
    same rows as without, and inside one segment the tokens run on in the split."""
    shards, _ = documents
    plain = read_rows(TokenBatches(shards, 4, T, seed=5, documents=True), 6)
    loader = TokenBatches(shards, 4, T, seed=5, documents=True, segments=True)
    packed = loader._packed_epoch(0)
    at = 0
    for _ in range(6):
        x, y, segments = (t.numpy() for t in next(loader))
        for row_x, row_y, seg in zip(x, y, segments):
            np.testing.assert_array_equal(row_x, plain[at][0])
            np.testing.assert_array_equal(row_y, plain[at][1])
            pieces = packed[at]
            n = int(loader.pieces[1][pieces].sum())
            # piece j's tokens are segment j; the rest of the row (padding, target -100) one more
            ends = np.cumsum(loader.pieces[1][pieces])  # where each piece's tokens end in the row
            want = [min(int((ends <= i).sum()), len(pieces)) for i in range(T)]
            np.testing.assert_array_equal(seg, want)
            assert (row_y[n - 1:] == -100).all() and (seg[:n - 1] < len(pieces)).all()
            for i in range(1, n - 1):
                if seg[i] == seg[i - 1] and row_x[i] != EOT and row_x[i - 1] != EOT:
                    assert row_x[i] == row_x[i - 1] + 1  # ids are positions: one piece reads on
            at += 1
