"""`kiln serve`: the OpenAI HTTP API (completions, chat completions, models, health) on the engine.

This module starts it (the model and engine built, the options checked, uvicorn run); the server's parts are
named for what they do, each testable without HTTP:

- protocol.py: the limits, OpenAI's error shape, the checks of every value (numbers, surrogates);
- engine_thread.py: the engine stepped on a thread of its own, its tokens handed to listeners;
- service.py: the shared state, a request body read into prompts and sampling settings, a choice's job started;
- detokenizer.py: a choice's text as its tokens arrive, with stop strings;
- responses.py: the answer, whole or as server-sent events, with log-probabilities where asked;
- http.py: the FastAPI app, its routes, the API key, error handlers, body limit and request log.

Log-probabilities (`logprobs: k` and `echo` on /v1/completions, `logprobs: true` with `top_logprobs: k` on
chat) are the model's log-softmax at temperature 1 over the whole vocabulary, whatever the sampling settings,
computed by the engine in the step that has the logits (serve/runner.py). An echoed prompt's first token has
none (null, as OpenAI's); `max_tokens: 0` with echo scores the prompt only: how lm-evaluation-harness's
`local-completions` model reads a served model's log-likelihoods (token_logprobs[len(context):-1]) of the token
ids it sent, exactly as sent.

The address is taken before the model loads, so a port in use is said at once, and the line that says the
server is up names the port it got (`--port 0`: whichever is free).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.graphs import GRAPH_BATCH
from kiln.pipeline.serve.http import create_app
from kiln.pipeline.serve.protocol import MAX_BODY_BYTES
from kiln.pipeline.serve.service import Service


def check_cache_fits(configs, kv_blocks: int, block_size: int, like) -> None:
    """Refuse (UserError) a KV cache (the model's and a draft's: keys and values of every layer, one scratch block
    more) larger than the free memory of the device the parameters `like` are on, before allocating it."""
    from kiln.model.config import memory_available
    from kiln.pipeline.errors import UserError

    need = sum(2 * c.n_layer * (kv_blocks + 1) * block_size * c.n_kv_head * c.head_dim for c in configs) \
        * like.element_size()
    free = memory_available(like.device)
    if need > free:
        raise UserError(f"--kv-blocks={kv_blocks} x --block-size={block_size}: the KV cache needs {need / 1e9:,.1f} "
                        f"GB, {like.device} has {free / 1e9:,.1f} GB free; expected fewer or smaller blocks")


def serve(model_dir: Path, tokenizer_path: Path, host: str, port: int, device: str, kv_blocks: int | None,
          block_size: int, max_batch_tokens: int, name: str | None = None, draft_dir: Path | None = None,
          speculate: int = 4, enforce_eager: bool = False, api_key: str | None = None,
          max_body: int | None = None, quiet: bool = False, max_connections: int = 2048,
          keep_alive: float = 5.0, docs: bool = False, quantize: str | None = None) -> None:
    """Load the model, build the engine and run the HTTP server until interrupted."""
    import uvicorn

    from kiln.pipeline.errors import UserError
    from kiln.pipeline.progress import console
    from kiln.pipeline.runtime import pick_device
    from kiln.pipeline.serve.text_model import TextModel
    from kiln.pipeline.tasks.chat_format import ChatFormat

    max_body = MAX_BODY_BYTES if max_body is None else max_body
    for option, value in (("--block-size", block_size), ("--max-batch-tokens", max_batch_tokens),
                          ("--kv-blocks", kv_blocks if kv_blocks is not None else 1), ("--speculate", speculate),
                          ("--max-request-bytes", max_body), ("--max-connections", max_connections)):
        if value < 1:
            raise UserError(f"{option}={value}: expected a positive integer")
    if not 0 < keep_alive <= 3600:
        raise UserError(f"--keep-alive={keep_alive}: expected seconds in (0, 3600]")
    if not 0 <= port < 65536:
        raise UserError(f"--port={port}: expected 0..65535")
    listener = listen(host, port)
    port = listener.getsockname()[1]  # --port 0: the one the system picked
    lm = TextModel(model_dir, tokenizer_path, pick_device(device), quantize)
    lm.model.eval()
    context = lm.model.config.max_seq_len
    if block_size > context:
        raise UserError(f"--block-size={block_size}: expected at most the model's context, {context} tokens")
    # by default room for 16 requests that fill the whole context at once; shorter ones share it
    kv_blocks = kv_blocks or 16 * -(-context // block_size)
    draft = None
    if draft_dir is not None:  # checked against the same tokenizer, so it speaks the same vocabulary
        draft = TextModel(draft_dir, tokenizer_path, lm.model.tok_emb.weight.device).model.eval()
    check_cache_fits([m.config for m in (lm.model, draft) if m is not None], kv_blocks, block_size,
                     next(lm.model.parameters()))
    try:
        engine = Engine(lm.model, kv_blocks, block_size, max_batch_tokens, draft=draft, speculate=speculate,
                        graph_batch=0 if enforce_eager else GRAPH_BATCH)
    except ValueError as e:
        raise UserError(f"--draft {draft_dir}: {e}") from None
    try:
        chat = ChatFormat(lm.tokenizer)
    except UserError:
        chat = None
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key: expected a non-empty key")
    service = Service(name or Path(model_dir).name, engine, lm.tokenizer, chat, lm.eot, api_key, max_body,
                      tokenizer_path)
    config = uvicorn.Config(create_app(service, log_requests=not quiet, docs=docs), log_level="warning",
                            limit_concurrency=max_connections, timeout_keep_alive=keep_alive)
    listener.listen(config.backlog)  # from here a client that read the address below waits for uvicorn
    megabytes = kv_blocks * engine.cache.bytes_per_block() / 1e6
    console.print(f"kiln serve: model {service.name!r} ({context}-token context"
                  + (f", {quantize} weights" if quantize else "") + f") on {engine.cache.device}, KV cache "
                  f"{kv_blocks:,} blocks of {block_size} tokens ({megabytes:.1f} MB), steps of up to "
                  f"{max_batch_tokens} tokens" + (f", {speculate} tokens drafted by {draft_dir}" if draft else "")
                  + (", decode steps as CUDA graphs" if engine.runner.graphs else "")
                  + f"; http://{f'[{host}]' if ':' in host else host}:{port}/v1"
                  + (", API key required" if api_key else ""), highlight=False)
    if api_key is None and not loopback(host):
        console.print(f"kiln serve: warning: listening on {host} without an API key: anyone who can reach this "
                      "port can use the model (set --api-key or KILN_API_KEY)", highlight=False)
    if not quiet:  # a line per request, after uvicorn's own warnings
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s kiln serve: %(message)s", "%H:%M:%S"))
        logging.getLogger("kiln.serve").addHandler(handler)
        logging.getLogger("kiln.serve").setLevel(logging.INFO)
    uvicorn.Server(config).run(sockets=[listener])


def listen(host: str, port: int):
    """A socket bound to `host`:`port`, before the model loads: an address that cannot be had is said at once
    (UserError), and the port the system picks for --port 0 is known, to be printed."""
    import socket

    from kiln.pipeline.errors import UserError

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server rebinds at once
    try:
        listener.bind((host, port))
    except OSError as e:  # in use, not this machine's address, or a name that does not resolve
        listener.close()
        raise UserError(f"--host={host} --port={port}: cannot listen there ({e.strerror or e})") from None
    return listener


def loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False
