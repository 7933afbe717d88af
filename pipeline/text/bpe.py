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

from kiln.model.files import read_capped
from kiln.pipeline.errors import UserError

EOT = "<|endoftext|>"
MAX_TOKENIZER_BYTES = 1 << 30  # GPT-2's is 1.4 MB, the largest vocabularies' tens of MB


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


def encode_ids(tok: Tokenizer, text: str) -> list[int]:
    """The ids of `text`. A long text goes through `encode_batch`, which lets go of the GIL while it works
    (`encode` holds it: a thread tokenizing a megabyte would stall every other thread for seconds, the serving
    event loop among them)."""
    return tok.encode(text).ids if len(text) < 4096 else tok.encode_batch([text])[0].ids


def load_tokenizer(path: Path, ordinary: bool = False) -> Tokenizer:
    """Load `tokenizer.json`; `ordinary=True` treats special-token text as plain text (for documents).

    The fields kiln reads are checked first, so a damaged file is refused with the field named rather than
    with the Rust parser's column number (or not at all: the parser takes a file without a pre-tokenizer)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: tokenizer not found (run `kiln tokenizer train` first)")
    text = _check_spec(path, read_capped(path, MAX_TOKENIZER_BYTES, "a tokenizer.json"))
    try:
        tok = Tokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    # tokenizers raises a bare Exception on a malformed file, and a Rust panic is pyo3's PanicException, a
    # BaseException: a file the checks above let through must still be refused as bad input, not crash
    except BaseException as e:
        raise UserError(f"{path}: not a valid tokenizer.json ({str(e).strip().splitlines()[0]})") from None
    tok.encode_special_tokens = ordinary
    return tok


def _check_spec(path: Path, data: bytes) -> str:
    """The file's text, once its JSON holds the fields every kiln reader needs with the right types."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a tokenizer.json (not UTF-8 at byte {e.start})") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a tokenizer.json (not valid JSON: {e.msg} at line {e.lineno} column "
                        f"{e.colno})") from None
    except RecursionError:
        raise UserError(f"{path}: not a tokenizer.json (JSON nested too deep)") from None
    if not isinstance(spec, dict):
        raise UserError(f"{path}: not a tokenizer.json (a JSON {type(spec).__name__}, expected an object)")

    def bad(field: str, expected: str) -> UserError:
        return UserError(f"{path}: field {field}: expected {expected}")

    model = spec.get("model")
    if not isinstance(model, dict):
        raise bad("model", "an object (the tokenizer model with its vocab)")
    if model.get("type", "BPE") != "BPE":
        raise bad("model.type", f"'BPE', found {model.get('type')!r}")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise bad("model.vocab", "an object mapping each token to its id")
    if not all(type(i) is int and 0 <= i < 2**32 for i in vocab.values()):
        raise bad("model.vocab", "ids that are integers from 0 to 2**32 - 1")
    if not isinstance(model.get("merges"), list):
        raise bad("model.merges", "a list of merges")
    for affix in ("continuing_subword_prefix", "end_of_word_suffix"):
        # A byte-level BPE marks no subwords; one longer than a merge's piece panics the Rust parser.
        if model.get(affix) not in (None, ""):
            raise bad(f"model.{affix}", f"null or \"\" (a byte-level BPE has none), found {model[affix]!r}")
    if not isinstance(spec.get("pre_tokenizer"), dict | None):
        raise bad("pre_tokenizer", "an object or null")
    added = spec.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and type(t.get("id")) is int and 0 <= t["id"] < 2**32
            and isinstance(t.get("content"), str) and isinstance(t.get("special", False), bool) for t in added):
        raise bad("added_tokens", "a list of objects with an integer id, a string content and a boolean special")
    return text


def check_byte_level(tok: Tokenizer, path: Path) -> None:
    """Refuse what kiln cannot train on: every id from 0 to the vocabulary size must be a token, and every
    ordinary token must be a string of GPT-2's byte alphabet, so that each stands for known bytes (tiktoken's
    ranks, bits per byte). The tokenizers kiln trains and GPT-2's are; a SentencePiece-style one is not."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    if not any(step.get("type") == "ByteLevel" for step in steps):
        raise UserError(f"{path}: field pre_tokenizer: expected a ByteLevel step (a byte-level BPE, as "
                        "`kiln tokenizer train` makes), found " + (pre.get("type") or "none"))
    specials = set(tok.get_added_tokens_decoder())
    pieces = {}
    for piece, idx in spec["model"]["vocab"].items():
        if idx in pieces:
            raise UserError(f"{path}: field model.vocab: id {idx} is given to two tokens, {pieces[idx]!r} and "
                            f"{piece!r}")
        pieces[idx] = piece
        if idx not in specials and not all(c in UNICODE_TO_BYTE for c in piece):
            raise UserError(f"{path}: field model.vocab: token {piece!r} (id {idx}) is not made of byte-level "
                            "characters")
    for idx in range(tok.get_vocab_size()):
        if tok.id_to_token(idx) is None:
            raise UserError(f"{path}: field model.vocab: no token has id {idx} (ids must run from 0 to the "
                            "vocabulary size - 1)")


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


def tiktoken_encoding(tok: Tokenizer, pattern: str | None = None, path: Path | str = "tokenizer.json"):
    """The same BPE as a `tiktoken.Encoding`: ranks are the HF ids, which follow merge order. Special tokens
    are taken by their flag, not their ids: kiln's sit at 0..k-1, GPT-2's at 50256 and up. `tok` must have
    passed `check_byte_level`; `path` names the file in errors."""
    import tiktoken

    spec = json.loads(tok.to_str())
    if pattern is None:
        pattern = _split_pattern(spec, path)
    specials = {t["content"]: t["id"] for t in spec["added_tokens"] if t["special"]}
    ranks = {}
    for piece, idx in spec["model"]["vocab"].items():
        if piece in specials:
            continue
        ranks[bytes(UNICODE_TO_BYTE[c] for c in piece)] = idx
    try:
        return tiktoken.Encoding(name="kiln", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError as e:  # its regex engine (fancy-regex) lacks some of Oniguruma's syntax
        raise UserError(f"{path}: field pre_tokenizer: tiktoken cannot use the split regex ({e}); "
                        "set shard.backend=hf") from None


def _split_pattern(spec: dict, path: Path | str) -> str:
    pre = spec.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            return step["pattern"]["Regex"]
    raise UserError(f"{path}: field pre_tokenizer: no Split step with a regex to give tiktoken (was it made by "
                    "kiln?); set shard.backend=hf")


def batch_encoder(path: Path, backend: str, threads: int = 0):
    """A function from a list of documents to their ids (ordinary text), using every core by default.

    `tiktoken` releases the GIL and runs `threads` threads; `hf` uses the tokenizers library's own pool.
    """
    tok = load_tokenizer(path, ordinary=True)
    check_byte_level(tok, path)
    if backend == "hf":
        return lambda texts: [e.ids for e in tok.encode_batch_fast(texts)]
    enc = tiktoken_encoding(tok, path=path)
    workers = threads or os.cpu_count() or 1
    return lambda texts: enc.encode_ordinary_batch(texts, num_threads=workers)
