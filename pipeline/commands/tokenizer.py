"""`kiln tokenizer`: train the byte-level BPE (stage `tokenizer`), and encode or decode with it."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import (
    CorpusOpt,
    ForceOpt,
    OutOpt,
    ParamsOpt,
    SetOpt,
    TokenizerOpt,
    hand_runs,
    params_help,
    print_metrics,
    reports_errors,
)

app = typer.Typer(help="Byte-level BPE: train, encode, decode.", no_args_is_help=True)


@app.command("train", epilog=params_help("tokenizer"))
@reports_errors
@hand_runs("tokenizer", "tokenizer")
def tokenizer_train(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], corpus: CorpusOpt = layout.CORPUS,
                    out: OutOpt = layout.TOKENIZER_DIR, force: ForceOpt = False):
    """Train the byte-level BPE on the train split, or build GPT-2's with `source=gpt2` (stage `tokenizer`)."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.tokenizer import TokenizerParams, train_tokenizer

    metrics = train_tokenizer(load_section(TokenizerParams, params, set_), corpus, out)
    print_metrics("tokenizer", metrics)


@app.command("encode")
@reports_errors
def tokenizer_encode(text: Annotated[str, typer.Argument(help="Text to encode ('-' reads stdin).")],
                     tokenizer: TokenizerOpt = layout.TOKENIZER):
    """Print the ids of TEXT, then its pieces (special-token text becomes the special token)."""
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.text.bpe import load_tokenizer, token_bytes
    from kiln.pipeline.text.corpus import SURROGATE

    tok = load_tokenizer(tokenizer)
    text = sys.stdin.read() if text == "-" else text
    if bad := SURROGATE.search(text):
        raise UserError(f"TEXT: not valid Unicode (lone surrogate {bad.group()!r} at character {bad.start()})")
    ids = tok.encode(text).ids
    typer.echo(" ".join(map(str, ids)))
    pieces = (token_bytes(tok, i) for i in ids)
    # A piece that ends inside a UTF-8 character shows as bytes rather than as a replacement character.
    typer.echo(" ".join(repr(p.decode()) if is_utf8(p) else repr(p) for p in pieces))


@app.command("decode")
@reports_errors
def tokenizer_decode(ids: Annotated[list[str], typer.Argument(help="Token ids, space- or comma-separated.")],
                     tokenizer: TokenizerOpt = layout.TOKENIZER):
    """Print the text of token IDS."""
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.text.bpe import load_tokenizer

    tok = load_tokenizer(tokenizer)
    words = [w for item in ids for w in item.replace(",", " ").split()]
    bad = [w for w in words if not w.isdigit() or int(w) >= tok.get_vocab_size()]
    if bad:
        raise UserError(f"ids: {bad[0]!r} is not a token id (expected 0..{tok.get_vocab_size() - 1})")
    typer.echo(tok.decode([int(w) for w in words], skip_special_tokens=False))


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
