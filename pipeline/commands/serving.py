"""Running a trained model: `kiln generate`, `kiln chat` and `kiln serve` (the OpenAI HTTP API)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import SamplingOpt, TokenizerOpt, reports_errors, show_error
from kiln.pipeline.errors import UserError
from kiln.pipeline.serve.request import TOOLS_TEMPERATURE, TOOLS_TOP_K, TOOLS_TOP_P

app = typer.Typer()
QuantizeOpt = Annotated[str | None, typer.Option(help="Quantize the blocks' linear layers after loading: "
                                                      "int8 (weight-only, kiln's, any device), int4 (weight-only, "
                                                      "TorchAO, CUDA 8.0+), "
                                                      "fp8 (weights and activations, compute capability 8.9+).")]


@app.command("generate")
@reports_errors
def generate_command(
        prompt: Annotated[list[str], typer.Option(help="Text to continue (repeatable: one completion each).")],
        model: Annotated[Path, typer.Option(help="A model folder (config.json + model.safetensors).")] =
        layout.BASE_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to add (default: fill the context).")] = None,
        temperature: SamplingOpt("0 is greedy; at most 2.", TOOLS_TEMPERATURE) = None,
        top_k: SamplingOpt("Sample among the k likeliest tokens.", TOOLS_TOP_K, int) = None,
        top_p: SamplingOpt("Sample among the likeliest tokens holding this mass.", TOOLS_TOP_P) = None,
        seed: Annotated[int | None, typer.Option(help="Make sampling reproducible.")] = None,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto", quantize: QuantizeOpt = None,
        json_schema: Annotated[Path | None, typer.Option(help="A JSON Schema file: each completion is JSON that "
                                                              "follows it.")] = None,
        regex: Annotated[str | None, typer.Option(help="Each completion matches this regular expression.")] = None):
    """Continue each --prompt with a trained model, stopping at <|endoftext|> (or where --json-schema's or
    --regex's grammar ends)."""
    from kiln.pipeline.runtime import pick_device
    from kiln.pipeline.serve.text_model import Sampling, TextModel

    structure = grammar_option(json_schema, regex)
    lm = TextModel(model, tokenizer, pick_device(device), quantize)
    outs = lm.complete(prompt, Sampling.with_defaults(max_new_tokens, temperature, top_k, top_p, seed), structure)
    for text, out in zip(prompt, outs, strict=True):
        typer.echo(text + out)
        if len(prompt) > 1:
            typer.echo("-" * 40)


def grammar_option(json_schema: Path | None, regex: str | None) -> tuple[str, str, object] | None:
    """(the option, the grammar's kind, its spec) of --json-schema or --regex; None for neither."""
    import json

    if json_schema is not None and regex is not None:
        raise UserError("--json-schema and --regex: give one of them")
    if regex is not None:
        return "--regex", "regex", regex
    if json_schema is None:
        return None
    try:
        return f"--json-schema {json_schema}", "json", json.loads(json_schema.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--json-schema {json_schema}: cannot be read ({e.__class__.__name__})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {json_schema}: not JSON (line {e.lineno}: {e.msg})") from None


@app.command("chat")
@reports_errors
def chat_command(
        model: Annotated[Path, typer.Option(help="A chat model folder (SFT or DPO).")] = layout.DPO_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        system: Annotated[str | None, typer.Option(help="A system message that opens the conversation.")] = None,
        max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer (default: a quarter of the "
                                                                "context).")] = None,
        temperature: SamplingOpt("0 is greedy; at most 2.", TOOLS_TEMPERATURE) = None,
        top_k: SamplingOpt("Sample among the k likeliest tokens.", TOOLS_TOP_K, int) = None,
        top_p: SamplingOpt("Sample among the likeliest tokens holding this mass.", TOOLS_TOP_P) = None,
        seed: Annotated[int | None, typer.Option(help="Make sampling reproducible.")] = None,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto", quantize: QuantizeOpt = None):
    """Talk to a chat model: each line you type is a user turn, the answer streams back (/reset starts over,
    /quit or end of input stops). A message of several lines: paste it (lines that arrive together are one turn),
    or put it between two lines of three double quotes."""
    from kiln.pipeline.runtime import pick_device
    from kiln.pipeline.serve.text_model import ChatSession, Sampling, TextModel

    session = ChatSession(TextModel(model, tokenizer, pick_device(device), quantize),
                          Sampling.with_defaults(max_new_tokens, temperature, top_k, top_p, seed), system)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach the turn's check, not a traceback
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        line = read_message(lambda: input("you> " if interactive else ""), pasted if interactive else None)
        if line is None:
            break
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            session.turns = []
            continue
        if not line.strip():
            continue
        pieces = session.reply(line)
        try:  # a turn that cannot be answered (not UTF-8, longer than the context) is refused; the session goes on
            first = next(pieces, "")
        except UserError as e:
            show_error(e, "; not sent, type another")
            continue
        typer.echo("kiln> " + first, nl=False)
        for piece in pieces:
            typer.echo(piece, nl=False)
        typer.echo()


@app.command("serve")
@reports_errors
def serve_command(
        model: Annotated[Path, typer.Option(help="A model folder (config.json + model.safetensors).")] =
        layout.DPO_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto",
        kv_blocks: Annotated[int | None, typer.Option(help="KV cache blocks (default: 16 full contexts).")] = None,
        block_size: Annotated[int, typer.Option(help="Tokens per KV cache block.")] = 16,
        max_batch_tokens: Annotated[int, typer.Option(help="Most tokens one engine step runs (decodes, then "
                                                           "prefill chunks).")] = 256,
        name: Annotated[str | None, typer.Option(help="The model's name in the API (default: the folder's).")] =
        None,
        draft: Annotated[Path | None, typer.Option(help="A smaller model with the same tokenizer for speculative "
                                                        "decoding.")] = None,
        speculate: Annotated[int, typer.Option(help="Tokens the draft proposes per step.")] = 4,
        enforce_eager: Annotated[bool, typer.Option(help="Launch every step's kernels; by default, on CUDA, decode "
                                                         "steps replay CUDA graphs.")] = False,
        api_key: Annotated[str | None, typer.Option(envvar="KILN_API_KEY", show_envvar=True,
                                                    help="Require `Authorization: Bearer KEY` on every /v1 "
                                                         "route (401 otherwise).")] = None,
        max_request_bytes: Annotated[int | None, typer.Option(help="Largest request body accepted, 413 beyond it "
                                                                   "(default: 1,000,000).")] = None,
        quiet: Annotated[bool, typer.Option("--quiet", help="No line per request (method, path, status, tokens, "
                                                            "ms).")] = False,
        max_connections: Annotated[int, typer.Option(help="Open connections at once; beyond it new ones get a "
                                                          "503 (uvicorn's limit_concurrency).")] = 2048,
        keep_alive: Annotated[float, typer.Option(help="Seconds an idle keep-alive connection stays open.")] = 5.0,
        docs: Annotated[bool, typer.Option("--docs", help="Also serve the interactive API page at /docs "
                                                          "(/openapi.json is always there).")] = False,
        quantize: QuantizeOpt = None):
    """Serve a model over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) on a continuous-batching engine with a paged KV cache."""
    from kiln.pipeline.serve.server import serve

    serve(model, tokenizer, host, port, device, kv_blocks, block_size, max_batch_tokens, name, draft, speculate,
          enforce_eager, api_key, max_request_bytes, quiet, max_connections, keep_alive, docs, quantize)


QUOTES = '"""'


def read_message(read, pending=None) -> str | None:
    """The next user turn: a line; the lines between two lines of three double quotes; or, when `pending()` says
    more input is already waiting (a paste into a terminal), every line that arrived with it. None at the end of
    input."""
    try:
        first = read()
    except EOFError:
        return None
    if first.strip().startswith(QUOTES):
        lines = [first.strip()[len(QUOTES):]]
        while not lines[-1].rstrip().endswith(QUOTES) or len(lines) == 1 and first.strip() == QUOTES:
            try:
                lines.append(read())
            except EOFError:
                break
        lines[-1] = lines[-1].rstrip().removesuffix(QUOTES)
        return "\n".join(lines).strip("\n")
    lines = [first]
    while pending is not None and pending():
        try:
            lines.append(read())
        except EOFError:
            break
    return "\n".join(lines)


def pasted() -> bool:
    """Whether more of stdin is waiting to be read right now: the rest of a paste, not the next thing typed."""
    import select

    return bool(select.select([sys.stdin], [], [], 0.01)[0])

