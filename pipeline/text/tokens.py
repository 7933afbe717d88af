"""Reading and using a tokenizer: the file, the special tokens, ids <-> bytes, and the fast batch encoders.

The tokenizer stage (text/tokenizer.py) writes `tokenizer.json`; everything after it (shards, training,
post-training, evaluation, conversion) reads it through this module, so no later stage depends on the code
that trains one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer

from kiln.pipeline.errors import UserError

EOT = "<|endoftext|>"


# <|endoftext|> separates documents; <|pad|> fills batches; ChatML turn markers for SFT/DPO/chat.
SPECIAL_TOKENS = (EOT, "<|pad|>", "<|im_start|>", "<|im_end|>")


PATTERNS = {
    "gpt4": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""",
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
}


def resolve_pattern(pattern: str) -> str:
    """A named pattern or a regex of the user's own, checked by the regex engine that will run it."""
    regex = PATTERNS.get(pattern, pattern)
    try:
        Regex(regex)
    except Exception as e:  # tokenizers raises a bare Exception for Oniguruma errors
        raise ValueError(str(e)) from None
    return regex


def load_tokenizer(path: Path, ordinary: bool = False) -> Tokenizer:
    """Load `tokenizer.json`; `ordinary=True` treats special-token text as plain text (for documents)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer not found (run `kiln tokenizer train` first)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise UserError(f"{path}: not a valid tokenizer.json ({e})") from None
    tok.encode_special_tokens = ordinary
    return tok


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, the alphabet of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the code points from 256 upwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for (special tokens: their UTF-8 text)."""
    piece = tok.id_to_token(token_id)
    if token_id in tok.get_added_tokens_decoder():
        return piece.encode()
    return bytes(UNICODE_TO_BYTE[c] for c in piece)


def tiktoken_encoding(tok: Tokenizer, pattern: str | None = None):
    """The same BPE as a `tiktoken.Encoding`: ranks are the HF ids, which follow merge order. Special tokens
    are taken by their flag, not their ids: kiln's sit at 0..k-1, GPT-2's at 50256 and up."""
    import tiktoken

    spec = json.loads(tok.to_str())
    if pattern is None:
        pattern = _split_pattern(spec)
    specials = {t["content"]: t["id"] for t in spec["added_tokens"] if t["special"]}
    ranks = {}
    for piece, idx in spec["model"]["vocab"].items():
        if piece in specials:
            continue
        ranks[bytes(UNICODE_TO_BYTE[c] for c in piece)] = idx
    return tiktoken.Encoding(name="kiln", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def _split_pattern(spec: dict) -> str:
    for step in spec["pre_tokenizer"].get("pretokenizers", []):
        if step["type"] == "Split":
            return step["pattern"]["Regex"]
    raise UserError("tokenizer.json: no Split pre-tokenizer to take the regex from (was it made by kiln?)")


def batch_encoder(path: Path, backend: str, threads: int = 0):
    """A function from a list of documents to their ids (ordinary text), using every core by default.

    `tiktoken` releases the GIL and runs `threads` threads; `hf` uses the tokenizers library's own pool.
    """
    tok = load_tokenizer(path, ordinary=True)
    if backend == "hf":
        return lambda texts: [e.ids for e in tok.encode_batch_fast(texts)]
    enc = tiktoken_encoding(tok)
    workers = threads or os.cpu_count() or 1
    return lambda texts: enc.encode_ordinary_batch(texts, num_threads=workers)
