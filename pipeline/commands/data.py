"""`kiln data`: the corpus (stage `prepare`), its token shards (stage `shard`) and a look inside one shard."""

from __future__ import annotations

from pathlib import Path
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

app = typer.Typer(help="Corpus and token shards: prepare, shard, inspect.", no_args_is_help=True)


@app.command("prepare", epilog=params_help("data"))
@reports_errors
@hand_runs("prepare", "corpus")
def data_prepare(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], out: OutOpt = layout.CORPUS,
                 force: ForceOpt = False):
    """Build train/val parquet files from `data.source` (stage `prepare`)."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.prepare import prepare
    from kiln.pipeline.text.sources import DataParams

    metrics = prepare(load_section(DataParams, params, set_), out)
    print_metrics("prepare", metrics)


@app.command("shard", epilog=params_help("shard"))
@reports_errors
@hand_runs("shard", "shards")
def data_shard(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], corpus: CorpusOpt = layout.CORPUS,
               tokenizer: TokenizerOpt = layout.TOKENIZER, out: OutOpt = layout.SHARDS,
               checkpoints: Annotated[Path, typer.Option(help="The finished shards of a killed run, to resume.")] =
               layout.checkpoints("shard"), force: ForceOpt = False):
    """Tokenize both splits into binary shards and a manifest (stage `shard`); a rerun after a kill keeps the
    shards already finished."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.shard import ShardParams, shard

    metrics = shard(load_section(ShardParams, params, set_), corpus, tokenizer, out, checkpoints)
    print_metrics("shard", metrics)


@app.command("inspect")
@reports_errors
def data_inspect(path: Annotated[Path, typer.Argument(help="A shard file (.bin).")],
                 tokenizer: TokenizerOpt = layout.TOKENIZER,
                 tokens: Annotated[int, typer.Option("-n", "--tokens", help="How many tokens to decode.")] = 64):
    """Print a shard's header, token count and its first tokens decoded."""
    from kiln.pipeline.text.bpe import load_tokenizer
    from kiln.pipeline.text.shard_format import ShardHeader, open_tokens

    header = ShardHeader.read(path)
    ids = [int(i) for i in open_tokens(path, header)[:tokens]]
    typer.echo(f"file:       {path}\nformat:     v{header.version}, {header.dtype.name}\n"
               f"tokens:     {header.tokens:,}\nvocab size: {header.vocab_size:,}\n"
               f"tokenizer:  sha256 {header.tokenizer_sha256}")
    if tokenizer.is_file():
        typer.echo(f"first {len(ids)} tokens:\n{load_tokenizer(tokenizer).decode(ids, skip_special_tokens=False)}")
    else:
        typer.echo(f"first {len(ids)} ids: {ids}")
