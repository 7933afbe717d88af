"""`kiln serve`: the OpenAI HTTP API (completions, chat completions, models, health) on the engine.

One thread owns the engine and the model: it takes new requests and aborts from a queue, steps while anything
runs, and hands each request's new tokens to the asyncio side (`loop.call_soon_threadsafe`), where every HTTP
request waits on its own queue. So every client's tokens come from the same batched steps, and the event loop
stays free to accept connections while the model computes (torch releases the GIL inside its kernels).

Text: a completion's prompt starts a document, as every pretraining document follows `<|endoftext|>`; a chat
is rendered with the model's ChatML template (tasks/chat_format.py, what SFT taught). Tokens are decoded as they
come, holding back a character split across tokens; `stop` strings end a completion where they begin (the
string itself left out, as OpenAI does), and the engine request is aborted there. A client that disconnects
mid-stream has its request aborted, so its blocks go back at once.

Hostile input is bounded before it costs anything: a body past `--max-request-bytes` is refused (413) from its
Content-Length or as it arrives, JSON nested too deeply, an integer beyond int64 or a lone surrogate is a 400
naming the field, prompts are tokenized on a thread (and long outputs decoded on one), so one request never
stalls the others, and a client that leaves mid-body costs one log line. With `--api-key` every /v1 route wants
`Authorization: Bearer <key>` (401 otherwise), as vLLM's and OpenAI's servers do.

Log-probabilities (`logprobs: k` and `echo` on /v1/completions, `logprobs: true` with `top_logprobs: k` on
chat) are the model's log-softmax at temperature 1 over the whole vocabulary, whatever the sampling settings,
computed by the engine in the step that has the logits (serve/runner.py). An echoed prompt's first token has
none (null, as OpenAI's); `max_tokens: 0` with echo scores the prompt only: how lm-evaluation-harness's
`local-completions` model reads a served model's log-likelihoods (token_logprobs[len(context):-1]).

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a body that is not JSON
or has a bad value (naming the field), a prompt longer than the context, or an option kiln does not support
(best_of); 401 without the API key; 404 for an unknown model; 413 for a body too large.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request as HTTPRequest  # FastAPI reads handler annotations from module globals

from kiln.pipeline.errors import shown
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.graphs import GRAPH_BATCH
from kiln.pipeline.serve.request import Request, RequestStatus, SamplingParams
from kiln.pipeline.text.bpe import encode_ids, token_bytes

MAX_CHOICES = 128  # `n`: choices of one request, each an engine request
MAX_BODY_BYTES = 1_000_000  # a request body's default limit (`--max-request-bytes`): 413 beyond it
MAX_STOP_CHARS = 256  # a stop string's length: each is looked for in the text after every token
DECODE_ON_LOOP = 256  # outputs up to this many tokens are decoded on the event loop, longer ones on a thread
INT64 = 2**63  # integer fields beyond int64 are refused (numpy and torch take nothing wider)
MAX_LOGPROBS = 20  # alternatives a token's log-probabilities may list (`logprobs`, `top_logprobs`), as vLLM's
MAX_PROMPTS = 128  # prompts of one /v1/completions request (a list: a choice block each)
# OpenAI options kiln does not implement, and the values of each that ask for nothing (clients send defaults)
UNSUPPORTED = {"best_of": (None, False, 1)}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class EngineThread:
    """The engine, stepped on a thread of its own; `submit` and `abort` may be called from any thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.failure: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request, on_token, forks: list[tuple[Request, object]] = ()) -> None:
        """Queue `request`, and `forks` (more samples of its prompt, each with its own listener) as its forks;
        `on_token(request, token)` is called on the engine thread for each new token, and once more with token
        None when it has finished (or was refused: `request.status` says which)."""
        request.forks = [fork for fork, _ in forks]
        self.inbox.put(("add", request, [(request, on_token), *forks]))

    def abort(self, request: Request) -> None:
        self.inbox.put(("abort", request, None))

    def _run(self) -> None:
        listeners: dict[int, object] = {}
        while True:
            commands = [self.inbox.get()] if not self.engine.has_work() else []
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, request, group in commands:
                if kind == "add":
                    try:
                        self.engine.add(request)
                    except ValueError as e:
                        for member, on_token in group:
                            member.status, member.error = RequestStatus.FINISHED_REFUSED, str(e)
                            on_token(member, None)
                        continue
                    listeners.update((id(member), on_token) for member, on_token in group)
                elif id(request) in listeners:
                    self.engine.abort(request)
                    listeners.pop(id(request))(request, None)
            if not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
            except BaseException as e:  # a bug: every waiting client hears of it rather than hanging
                self.failure = e
                for key, on_token in list(listeners.items()):
                    on_token(None, None)
                    listeners.pop(key)
                raise
            for request, token in events:
                on_token = listeners.get(id(request))
                if on_token is None:
                    continue
                on_token(request, token)
                if request.finish_reason:
                    listeners.pop(id(request))(request, None)


@dataclass
class Job:
    """One HTTP request's generation: its engine request, the text so far and where it ends."""

    request: Request
    stops: list[str]
    decode: object  # ids -> text
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)  # generated so far, as this side received them
    text: str = ""  # released so far
    finish_reason: str | None = None
    echo: bool = False  # the prompt's text (and log-probabilities) come first in the choice
    hidden: bool = False  # `max_tokens: 0` with echo: the one token the engine generates is not the answer's
    reported: int = 0  # generated tokens whose log-probabilities a stream has sent
    fork: bool = False  # a further choice of a prompt another job already computes

    def advance(self, last: bool = False) -> str:
        """The new text to release for the tokens so far; sets finish_reason "stop" when a stop string appears.
        Until the `last` call, text that may still change is held back: a character whose bytes are not all
        there yet, and an ending that may be the start of a stop string."""
        text = self.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                self.finish_reason = "stop"
                text = text[:at]
        if self.finish_reason is None and not last:
            if text.endswith("\ufffd"):
                return ""
            hold = max((len(s) - 1 for s in self.stops), default=0)
            held = next((n for n in range(hold, 0, -1) if any(s.startswith(text[-n:]) for s in self.stops)), 0)
            text = text[:len(text) - held]
        new = text[len(self.text):]
        self.text += new
        return new


class Service:
    """What the HTTP handlers need: the model's name and limits, the tokenizer and chat format, the engine."""

    def __init__(self, name: str, engine: Engine, tokenizer, chat, eot: int, api_key: str | None = None,
                 max_body: int = MAX_BODY_BYTES):
        self.name, self.engine, self.tokenizer, self.chat, self.eot = name, engine, tokenizer, chat, eot
        self.api_key, self.max_body = api_key, max_body
        self.context = engine.model.config.max_seq_len
        self.worker = EngineThread(engine)
        self.created = int(time.time())
        self.specials = set(tokenizer.get_added_tokens_decoder())
        self.token_names: dict[int, tuple[str, bytes]] = {}

    def sampling(self, body: dict, prompt_tokens: int, stop_ids: tuple[int, ...], default_max: int | None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 score_only: bool = False) -> list[SamplingParams]:
        """One SamplingParams per choice (`n`): with a seed, choice i draws with seed + i, so the choices differ
        and each is reproducible. `score_only` (echo): `max_tokens` may be 0, and the request then generates the
        one token the engine must (its caller hides it)."""
        n = number(body.get("n", 1), "n", int, low=1, high=MAX_CHOICES)
        for key, harmless in UNSUPPORTED.items():
            if body.get(key) not in harmless:
                raise BadRequest(f"{key}: not supported by kiln serve", key)
        room = self.context + 1 - prompt_tokens
        if room < 1:
            raise BadRequest(f"prompt: {prompt_tokens} tokens; this model's maximum context length is "
                             f"{self.context} tokens", "prompt" if "prompt" in body else "messages",
                             code="context_length_exceeded")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = number(max_tokens, "max_tokens", int, low=0 if score_only else 1) if max_tokens is not None \
            else (default_max or room)
        max_tokens = max(max_tokens, 1)  # 0 (score only): one token, generated and hidden
        if max_tokens > room:
            raise BadRequest(f"max_tokens={max_tokens}: the prompt's {prompt_tokens} tokens leave room for {room} "
                             f"in this model's {self.context}-token context", "max_tokens",
                             code="context_length_exceeded")
        temperature = number(body.get("temperature", 1.0), "temperature", float, low=0.0, high=2.0)
        top_p = number(body.get("top_p", 1.0), "top_p", float, low=0.0, high=1.0, open_low=True)
        seed = body.get("seed")
        if seed is not None:  # choice i draws with seed + i: all within what torch's generators take
            seed = number(seed, "seed", int, low=-INT64, high=INT64 - 1)
        top_k = body.get("top_k")  # vLLM's extension, accepted through extra_body
        if top_k is not None and top_k != -1:
            # beyond the vocabulary cuts nothing
            top_k = min(number(top_k, "top_k", int, low=1), self.tokenizer.get_vocab_size())
        if (logprobs is not None or prompt_logprobs is not None) and self.engine.runner.draft is not None:
            raise BadRequest("logprobs: not reported by a server decoding speculatively (--draft)", "logprobs")
        return [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p if top_p < 1 else None,
                               top_k=None if top_k in (None, -1) else top_k, seed=None if seed is None else seed + i,
                               stop_ids=stop_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
                for i in range(n)]

    def completion_logprobs(self, body: dict) -> tuple[int | None, bool]:
        """/v1/completions' `logprobs` (how many alternatives per token, 0 to MAX_LOGPROBS, or none) and `echo`."""
        echo = body.get("echo", False)
        if not isinstance(echo, bool) and echo is not None:
            raise BadRequest("echo: expected true or false", "echo")
        k = body.get("logprobs")
        if k is not None and k is not False:
            k = number(k, "logprobs", int, low=0, high=MAX_LOGPROBS)
        return (None if k in (None, False) else k), bool(echo)

    def chat_logprobs(self, body: dict) -> int | None:
        """/v1/chat/completions' `logprobs: true` with `top_logprobs` alternatives (0 to MAX_LOGPROBS)."""
        wanted, k = body.get("logprobs", False), body.get("top_logprobs")
        if not isinstance(wanted, bool) and wanted is not None:
            raise BadRequest("logprobs: expected true or false", "logprobs")
        if k is not None:
            k = number(k, "top_logprobs", int, low=0, high=MAX_LOGPROBS)
            if not wanted:
                raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        return (k or 0) if wanted else None

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and raw bytes, as log-probabilities name it (a piece of a character decodes with
        U+FFFD; its bytes are exact)."""
        if token_id not in self.token_names:
            raw = token_bytes(self.tokenizer, token_id) if token_id not in self.specials else \
                self.tokenizer.id_to_token(token_id).encode()
            self.token_names[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return self.token_names[token_id]

    def stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops) \
                or len(stops) > 4:
            raise BadRequest(f"stop: expected a string of 1 to {MAX_STOP_CHARS} characters or a list of up to 4 of "
                             "them", "stop")
        return stops

    def completion_prompts(self, body: dict) -> list[list[int]]:
        """The prompts of /v1/completions, each as ids after <|endoftext|> (a document's start): a string, a list
        of token ids, or a list of either (a choice block each)."""
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_PROMPTS:
            raise BadRequest(f"prompt: expected a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of "
                             "either", "prompt")
        out = []
        for i, p in enumerate(prompts):
            where = "prompt" if single else f"prompt[{i}]"
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                if not all(0 <= t < self.tokenizer.get_vocab_size() for t in p):
                    raise BadRequest(f"{where}: token ids out of the vocabulary", where)
                out.append([self.eot, *p])
            elif isinstance(p, str):
                out.append([self.eot, *encode_ids(self.tokenizer, p)])
            else:
                raise BadRequest(f"{where}: expected a string or a non-empty list of token ids", where)
        return out

    def chat_prompt(self, body: dict) -> list[int]:
        if self.chat is None:
            raise BadRequest(f"model {self.name!r}: its tokenizer has no chat tokens; use /v1/completions", "model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list of {role, content}", "messages")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise BadRequest(f"messages[{i}].role: expected system, user or assistant", f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content: expected a string", f"messages[{i}].content")
            turns.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        return self.chat.prompt(turns)

    def start_jobs(self, ids: list[int], samplings: list[SamplingParams], stops: list[str], decode,
                   echo: bool = False, hidden: bool = False) -> list[Job]:
        """One job per choice, all on the same prompt: the first choice's request, the others its forks, so the
        engine computes the prompt once."""
        loop = asyncio.get_running_loop()
        jobs = [Job(Request(ids, sampling, id=uuid.uuid4().hex), stops, decode, echo=echo, hidden=hidden,
                    fork=i > 0) for i, sampling in enumerate(samplings)]

        def listener(job: Job):
            return lambda request, token: loop.call_soon_threadsafe(job.queue.put_nowait, (request, token))

        self.worker.submit(jobs[0].request, listener(jobs[0]), [(job.request, listener(job)) for job in jobs[1:]])
        return jobs

    async def tokens(self, job: Job):
        """The job's new text pieces as tokens arrive, until it finishes; sets job.finish_reason. Tokens that
        arrived together are decoded together, on a thread once the output is long (each decode reads the whole
        output), so no stream's text holds up the event loop."""
        while True:
            arrived = [await job.queue.get()]
            while not job.queue.empty():
                arrived.append(job.queue.get_nowait())
            for request, token in arrived:
                if request is None:
                    raise RuntimeError(f"the engine failed: {self.worker.failure!r}")
                if token is None:
                    if request.status is RequestStatus.FINISHED_REFUSED:
                        raise BadRequest(request.error)
                    if job.finish_reason is None and (piece := await self.advance(job, last=True)):
                        yield piece
                    job.finish_reason = job.finish_reason or ("length" if request.finish_reason in (None, "length")
                                                              else "stop")
                    return
                if job.finish_reason is None and not job.hidden:  # else a stop string ended it (abort on its way)
                    job.ids.append(token)
            if job.finish_reason is not None or job.hidden:
                continue
            piece = await self.advance(job)
            if job.finish_reason is not None:
                self.worker.abort(job.request)
            if piece:
                yield piece

    @staticmethod
    async def advance(job: Job, last: bool = False) -> str:
        if len(job.ids) <= DECODE_ON_LOOP:
            return job.advance(last)
        return await asyncio.to_thread(job.advance, last)


def number(value, name: str, kind: type, low: float | None = None, high: float | None = None,
           open_low: bool = False):
    """`value` as `kind`, within [low, high] ((low, high] with open_low), or a BadRequest naming the field."""
    given = value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or
                                                                                float(value).is_integer())
    if ok:
        value = kind(value)
        ok = value == value and abs(value) != float("inf") and (kind is float or abs(value) <= INT64)
        if low is not None:
            ok = ok and (value > low if open_low else value >= low)
        if high is not None:
            ok = ok and value <= high
    if not ok:
        bounds = "" if low is None else f" in {'(' if open_low else '['}{low}, {high if high is not None else 'inf'}]"
        raise BadRequest(f"{name}={shown(given)}: expected {'an integer' if kind is int else 'a number'}{bounds}",
                         name)
    return value


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class RequestLog:
    """ASGI middleware: one line per request once its response is sent (or the client left): method, path, status,
    prompt + completion tokens when it generated, milliseconds. Pure ASGI, so a stream is timed to its last chunk."""

    def __init__(self, app, log: logging.Logger):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), ["-"]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            usage = scope.get("kiln", {}).get("usage")
            tokens = ""
            if usage is not None:
                used = usage()
                tokens = f" {used['prompt_tokens']}+{used['completion_tokens']} tokens"
            note = scope.get("kiln", {}).get("note")
            self.log.info("%s %s %s%s %.0f ms%s", scope["method"], scope["path"], status[0], tokens,
                          1000 * (time.perf_counter() - started), f" ({note})" if note else "")


def create_app(service: Service, log_requests: bool = False):
    """The FastAPI app: /health, /v1/models, /v1/completions, /v1/chat/completions; `log_requests`: a line per
    request on the `kiln.serve` logger."""
    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def lifespan(_):
        service.worker.start()
        yield

    app = FastAPI(title="kiln serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    add_error_handlers(app)
    add_model_routes(app, service)
    add_completion_routes(app, service)
    if log_requests:
        app.add_middleware(RequestLog, log=logging.getLogger("kiln.serve"))
    return app


def key_check(service: Service):
    """The dependency every /v1 route has: with an API key set, `Authorization: Bearer <key>` (what the openai
    client sends) or a 401, compared in constant time."""
    import hmac

    from fastapi import Depends

    async def check(http: HTTPRequest):
        if service.api_key is None:
            return
        sent = http.headers.get("authorization", "").encode("latin-1")  # the header's bytes as sent
        if not hmac.compare_digest(sent, b"Bearer " + service.api_key.encode()):
            raise BadRequest("missing or wrong API key: send the header Authorization: Bearer <key>", status=401,
                             code="invalid_api_key")
    return Depends(check)


def add_error_handlers(app) -> None:
    """Every error in OpenAI's shape: kiln's own BadRequest, and the HTTP and validation errors FastAPI raises."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return JSONResponse(error_body(e.message, e.param, kind, e.code), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), kind="invalid_request_error" if e.status_code < 500 else
                                       "server_error"), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        return JSONResponse(error_body(f"invalid request: {e.errors()[0].get('msg', e)}"), status_code=400)

    @app.exception_handler(Disconnected)
    async def disconnected(http, _):
        # said on the request's one log line, not a traceback
        http.scope.setdefault("kiln", {})["note"] = "client left before sending its whole request"
        return JSONResponse(error_body("the client went away"), status_code=400)  # read by no one


def add_model_routes(app, service: Service) -> None:
    """GET /health, /v1/models and /v1/models/{name}."""

    @app.get("/health")
    async def health():
        engine = service.engine  # counters read across threads: a snapshot, not a transaction
        return {"status": "ok", "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_blocks_in_use": engine.pool.in_use(), "kv_blocks": engine.pool.num_blocks,
                "aborted": engine.scheduler.aborted, "prefill_tokens": engine.scheduler.prefill_tokens}

    @app.get("/v1/models", dependencies=[key_check(service)])
    async def models():
        return {"object": "list", "data": [model_card(service)]}

    @app.get("/v1/models/{name}", dependencies=[key_check(service)])
    async def model(name: str):
        if name != service.name:
            raise BadRequest(f"model {name!r} does not exist (this server has {service.name!r})", "model", 404,
                             "model_not_found")
        return model_card(service)


def add_completion_routes(app, service: Service) -> None:
    """POST /v1/completions and /v1/chat/completions: parse the body, start the job, answer whole or streamed."""

    @app.post("/v1/completions", dependencies=[key_check(service)])
    async def completions(http: HTTPRequest):
        body = await parse_body(service, http)
        prompts = await asyncio.to_thread(service.completion_prompts, body)  # a long prompt never stalls the others
        k, echo = service.completion_logprobs(body)
        stops = service.stops(body)
        # every prompt checked before any starts
        samplings = [service.sampling(body, len(ids), (service.eot,), default_max=16, logprobs=k,
                                      prompt_logprobs=k if echo else None, score_only=echo) for ids in prompts]
        hidden = echo and body.get("max_completion_tokens", body.get("max_tokens")) == 0
        decode = lambda out: service.tokenizer.decode([t for t in out if t != service.eot])  # noqa: E731
        jobs = [job for ids, sampling in zip(prompts, samplings)
                for job in service.start_jobs(ids, sampling, stops, decode, echo, hidden)]
        return await respond(service, http, body, jobs, chat=False)

    @app.post("/v1/chat/completions", dependencies=[key_check(service)])
    async def chat_completions(http: HTTPRequest):
        body = await parse_body(service, http)
        ids = await asyncio.to_thread(service.chat_prompt, body)
        chat = service.chat
        sampling = service.sampling(body, len(ids), (chat.im_end, chat.eot), default_max=None,
                                    logprobs=service.chat_logprobs(body))
        jobs = service.start_jobs(ids, sampling, service.stops(body), chat.parse_reply)
        return await respond(service, http, body, jobs, chat=True)


async def read_body(service: Service, http: HTTPRequest) -> bytes:
    """The body's bytes, refused (413) as soon as it is known to pass `service.max_body`: from its Content-Length
    before anything is read, or while it arrives."""
    from starlette.requests import ClientDisconnect

    declared = http.headers.get("content-length")
    too_large = BadRequest(f"the request body: larger than this server's limit of {service.max_body:,} bytes "
                           "(kiln serve --max-request-bytes)", status=413, code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > service.max_body:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > service.max_body:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise Disconnected() from None
    return b"".join(chunks)


class Disconnected(Exception):
    """The client went away before its request was whole: nothing to answer, nothing to log but a line."""


async def parse_body(service: Service, http: HTTPRequest) -> dict:
    """The request's JSON object, checked as far as both routes share it: the model is this one, `stream` a bool,
    every string valid Unicode."""
    raw = await read_body(service, http)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body: JSON nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more digits than Python reads
        raise BadRequest(f"the request body is not valid JSON ({shown(str(e), 200)})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body: expected a JSON object")
    if (where := unpaired_surrogate(body)) is not None:
        raise BadRequest(f"{where}: a lone surrogate (\\ud800-\\udfff) is not text", where)
    if body.get("model") != service.name:
        if not isinstance(body.get("model"), str):
            raise BadRequest("model: expected the name of a model (GET /v1/models lists them)", "model")
        raise BadRequest(f"model {body['model']!r} does not exist (this server has {service.name!r})", "model",
                         404, "model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false", "stream")
    return body


def unpaired_surrogate(body: dict) -> str | None:
    """Where in `body` a string (or key) holds a lone UTF-16 surrogate, which JSON's \\u escapes can spell but no
    tokenizer can encode: its path ("messages[0].content"), or None."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the request body"
        elif isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            stack += [(k, path or "the request body") for k in value]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return None


async def respond(service: Service, http: HTTPRequest, body: dict, jobs: list[Job], chat: bool):
    """The jobs' completion (`chat`: chat completion), one choice each, as one JSON object or, if the body asks to
    `stream`, as server-sent events; its usage is left on the request for the log line (`RequestLog`)."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        for job in jobs:
            service.worker.abort(job.request)
        raise BadRequest("stream_options: expected an object such as {\"include_usage\": true}", "stream_options")
    reply = Reply(service, jobs, chat)
    http.scope.setdefault("kiln", {})["usage"] = reply.usage
    if not body.get("stream"):
        return await reply.whole()
    return reply.streamed(include_usage=bool((options or {}).get("include_usage")))


class Reply:
    """The answer to one HTTP request in OpenAI's shape, a choice per job, named and dated when it starts."""

    def __init__(self, service: Service, jobs: list[Job], chat: bool):
        self.service, self.jobs, self.chat = service, jobs, chat
        self.created, self.id = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + jobs[0].request.id
        self.object = "chat.completion" if chat else "text_completion"
        # each prompt once, whatever the number of choices (a prompt's first job is its request, the rest forks)
        self.prompt_tokens = sum(len(job.request.prompt) for job in jobs if not job.fork)

    def usage(self) -> dict:
        completion = sum(len(job.ids) for job in self.jobs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def chunk(self, index: int, piece: str | None, finish: str | None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.service.name, "choices": [choice]}

    async def pieces(self):
        """(choice, new text) from every job as it comes, and (choice, None) when that choice has finished."""
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job: Job):
            try:
                async for piece in self.service.tokens(job):
                    arrived.put_nowait((index, piece, None))
                arrived.put_nowait((index, None, None))
            except Exception as e:  # handed to the reader, which raises it
                arrived.put_nowait((index, None, e))

        pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(self.jobs)]
        try:
            for _ in range(len(self.jobs)):
                while True:
                    index, piece, error = await arrived.get()
                    if error is not None:
                        raise error
                    yield index, piece
                    if piece is None:
                        break
        finally:
            for task in pumps:
                task.cancel()

    async def whole(self):
        """The finished completion as one JSON response."""
        from fastapi.responses import JSONResponse

        texts = [self.echoed(job) for job in self.jobs]
        try:
            async for index, piece in self.pieces():
                texts[index] += piece or ""
        finally:
            self.stop_unfinished()
        choices = []
        for index, (job, text) in enumerate(zip(self.jobs, texts)):
            entries = self.prompt_entries(job) + self.new_entries(job)
            choice = {"index": index, "logprobs": self.logprobs(job, entries, 0), "finish_reason": job.finish_reason}
            choices.append(choice | ({"message": {"role": "assistant", "content": text}} if self.chat else
                                     {"text": text}))
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.service.name, "choices": choices, "usage": self.usage()})

    def streamed(self, include_usage: bool):
        """A chunk per new piece of text, then one with the finish reason (and one with the usage, if asked)."""
        from fastapi.responses import StreamingResponse

        return StreamingResponse(self.events(include_usage), media_type="text/event-stream")

    async def events(self, include_usage: bool):
        try:
            if self.chat:
                for index in range(len(self.jobs)):
                    yield sse(self.chunk(index, None, None, role=True))
            offsets = [0] * len(self.jobs)
            for index, job in enumerate(self.jobs):
                if job.echo:  # the prompt first, with its log-probabilities
                    offsets[index] = len(text := self.echoed(job))
                    yield sse(self.chunk(index, text, None, logprobs=self.logprobs(job, self.prompt_entries(job), 0)))
            async for index, piece in self.pieces():
                job = self.jobs[index]
                finish = job.finish_reason if piece is None else None
                logprobs = self.logprobs(job, self.new_entries(job), offsets[index])
                offsets[index] += len(piece or "")
                yield sse(self.chunk(index, piece, finish, logprobs=logprobs))
            if include_usage:
                yield sse({"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                           "created": self.created, "model": self.service.name, "choices": [], "usage": self.usage()})
            yield sse("[DONE]")
        finally:  # the client went away (the generator is closed) or the jobs ended: either way, stop them
            self.stop_unfinished()

    def echoed(self, job: Job) -> str:
        """The prompt's text, when the choice echoes it (completions' `echo`), else ""."""
        return self.service.tokenizer.decode(job.request.prompt[1:]) if job.echo else ""

    def prompt_entries(self, job: Job) -> list:
        """(token, log-probability entry) of an echoed prompt's tokens, after kiln's <|endoftext|> start: the
        first has none (OpenAI's null), token p's is the engine's entry of position p - 1."""
        if not job.echo or job.request.sampling.prompt_logprobs is None:
            return []
        prompt, entries = job.request.prompt, job.request.prompt_logprobs
        return [(prompt[p], None if p == 1 else entries[p - 1]) for p in range(1, len(prompt))]

    def new_entries(self, job: Job) -> list:
        """(token, entry) of the generated tokens not reported yet; a chat leaves out the stop token that ended
        its answer (its text is not in the message)."""
        if job.request.sampling.logprobs is None:
            return []
        ids, start = job.ids, job.reported
        job.reported = len(ids)
        stops = job.request.sampling.stop_ids if self.chat else ()
        return [(t, job.request.logprobs[i]) for i, t in enumerate(ids[start:], start) if t not in stops]

    def logprobs(self, job: Job, entries: list, offset: int) -> dict | None:
        """The choice's `logprobs` in the route's shape: chat's {"content": [{token, logprob, bytes,
        top_logprobs}]}, completions' {tokens, token_logprobs, top_logprobs, text_offset}; None when not
        asked for."""
        sampling = job.request.sampling
        if sampling.logprobs is None and sampling.prompt_logprobs is None:
            return None
        name = self.service.token
        if self.chat:
            def item(token: int, value: float) -> dict:
                text, raw = name(token)
                return {"token": text, "logprob": value, "bytes": list(raw)}
            return {"content": [item(t, e[0]) | {"top_logprobs": [item(a, v) for a, v in e[1]]} for t, e in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in entries:
            text = name(token)[0]
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            out["token_logprobs"].append(None if entry is None else entry[0])
            # the alternatives, and the token itself beside them (as vLLM lists it)
            out["top_logprobs"].append(None if entry is None else
                                       {name(a)[0]: v for a, v in [*entry[1], (token, entry[0])]})
        return out

    def stop_unfinished(self) -> None:
        for job in self.jobs:
            if job.finish_reason is None:
                self.service.worker.abort(job.request)


def model_card(service: Service) -> dict:
    return {"id": service.name, "object": "model", "created": service.created, "owned_by": "kiln",
            "max_model_len": service.context}


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
          max_body: int | None = None, quiet: bool = False) -> None:
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
                          ("--max-request-bytes", max_body)):
        if value < 1:
            raise UserError(f"{option}={value}: expected a positive integer")
    if not 0 <= port < 65536:
        raise UserError(f"--port={port}: expected 0..65535")
    lm = TextModel(model_dir, tokenizer_path, pick_device(device))
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
    service = Service(name or Path(model_dir).name, engine, lm.tokenizer, chat, lm.eot, api_key, max_body)
    megabytes = kv_blocks * engine.cache.bytes_per_block() / 1e6
    console.print(f"kiln serve: model {service.name!r} ({context}-token context) on {engine.cache.device}, KV cache "
                  f"{kv_blocks:,} blocks of {block_size} tokens ({megabytes:.1f} MB), steps of up to "
                  f"{max_batch_tokens} tokens" + (f", {speculate} tokens drafted by {draft_dir}" if draft else "")
                  + (", decode steps as CUDA graphs" if engine.runner.graphs else "")
                  + f"; http://{host}:{port}/v1" + (", API key required" if api_key else ""), highlight=False)
    if api_key is None and not loopback(host):
        console.print(f"kiln serve: warning: listening on {host} without an API key: anyone who can reach this "
                      "port can use the model (set --api-key or KILN_API_KEY)", highlight=False)
    if not quiet:  # a line per request, after uvicorn's own warnings
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s kiln serve: %(message)s", "%H:%M:%S"))
        logging.getLogger("kiln.serve").addHandler(handler)
        logging.getLogger("kiln.serve").setLevel(logging.INFO)
    uvicorn.run(create_app(service, log_requests=not quiet), host=host, port=port, log_level="warning")


def loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False
