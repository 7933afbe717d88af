"""The HTTP side of `kiln serve` (FastAPI): the routes, the API key, the error handlers, the body limit and the
request log.

/health, /metrics, /v1/models, /v1/completions and /v1/chat/completions. With `--api-key` every /v1 route and
/metrics want `Authorization: Bearer <key>` (401 otherwise), as vLLM's and OpenAI's servers do for /v1, and /health
without it says only that the server is up. Hostile input is bounded before it costs anything: a body past `--max-request-bytes` is refused (413) from its Content-Length or as it
arrives, JSON nested too deeply, an integer beyond int64 or a lone surrogate is a 400 naming the field, so is a
field the route does not know (protocol.py), a request whose answer would pass protocol.MAX_WORK token entries
is a 400 naming the product, and a client that leaves mid-body costs one log line; a client that disconnects
mid-stream has its requests aborted, so their blocks go back at once. 404 for an unknown model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.requests import Request as HTTPRequest  # FastAPI reads handler annotations from module globals

from kiln.pipeline.errors import shown
from kiln.pipeline.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unpaired_surrogate,
    validated,
)
from kiln.pipeline.serve.responses import model_card, respond
from kiln.pipeline.serve.service import Service


ROUTES = frozenset(("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"))


class RequestLog:
    """ASGI middleware: each request counted on /metrics by route and status, and with a `log`, one line per
    request once its response is sent (or the client left): method, path, status, prompt + completion tokens
    when it generated, milliseconds. Pure ASGI, so a stream is timed to its last chunk."""

    def __init__(self, app, metrics, log: logging.Logger | None):
        self.app, self.metrics, self.log = app, metrics, log

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
            # any other path counts as "other": a client must not grow the label set without bound
            path = scope["path"]
            route = "/v1/models" if path.startswith("/v1/models/") else path if path in ROUTES else "other"
            self.metrics.http_requests.labels(route, str(status[0])).inc()
            if self.log is None:
                return
            usage = scope.get("kiln", {}).get("usage")
            tokens = ""
            if usage is not None:
                used = usage()
                tokens = f" {used['prompt_tokens']}+{used['completion_tokens']} tokens"
            note = scope.get("kiln", {}).get("note")
            self.log.info("%s %s %s%s %.0f ms%s", scope["method"], scope["path"], status[0], tokens,
                          1000 * (time.perf_counter() - started), f" ({note})" if note else "")


def create_app(service: Service, log_requests: bool = False, docs: bool = False):
    """The FastAPI app: /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions, /openapi.json (and
    with `docs`, the interactive /docs page); `log_requests`: a line per request on the `kiln.serve` logger."""
    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def lifespan(_):
        service.bind(asyncio.get_running_loop())
        service.worker.start()
        yield

    app = FastAPI(title="kiln serve", docs_url="/docs" if docs else None, redoc_url=None, lifespan=lifespan)
    add_error_handlers(app)
    add_model_routes(app, service)
    add_completion_routes(app, service)
    use_models(app, (CompletionRequest, ChatCompletionRequest))
    app.add_middleware(RequestLog, metrics=service.metrics,
                       log=logging.getLogger("kiln.serve") if log_requests else None)
    return app


def key_check(service: Service):
    """The dependency every /v1 route and /metrics have: with an API key set, `Authorization: Bearer <key>` (what
    the openai client sends) or a 401."""
    from fastapi import Depends

    async def check(http: HTTPRequest):
        if not authorized(service, http):
            raise BadRequest("missing or wrong API key: send the header Authorization: Bearer <key>", status=401,
                             code="invalid_api_key")
    return Depends(check)


def authorized(service: Service, http: HTTPRequest) -> bool:
    """No key set, or `Authorization: Bearer <key>` sent (compared in constant time)."""
    import hmac

    if service.api_key is None:
        return True
    sent = http.headers.get("authorization", "").encode("latin-1")  # the header's bytes as sent
    return hmac.compare_digest(sent, b"Bearer " + service.api_key.encode())


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
    """GET /health, /metrics, /v1/models and /v1/models/{name}."""

    # With a key set, a load balancer's probe still gets its answer without one, but the engine's counters go
    # only to holders of the key: prompt tokens computed, read before and after a request of one's own, tell
    # whether someone else's prompt is in the prefix cache.
    @app.get("/health")
    async def health(http: HTTPRequest):
        if not authorized(service, http):
            return {"status": "ok"}
        engine = service.engine  # counters read across threads: a snapshot, not a transaction
        return {"status": "ok", "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_blocks_in_use": engine.pool.in_use(), "kv_blocks": engine.pool.num_blocks,
                "aborted": engine.scheduler.aborted, "prefill_tokens": engine.scheduler.prefill_tokens}

    @app.get("/metrics", dependencies=[key_check(service)])
    async def metrics():  # Prometheus text format (a scrape config's `authorization: {credentials: KEY}`)
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

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

    @app.post("/v1/completions", dependencies=[key_check(service)], openapi_extra=schema_of(CompletionRequest))
    async def completions(http: HTTPRequest):
        body = validated(CompletionRequest, await parse_body(service, http))
        prompts = await asyncio.to_thread(service.completion_prompts, body)  # a long prompt never stalls the others
        grammar = await asyncio.to_thread(service.grammar, body)  # nor a large schema's compiling
        k, echo = service.completion_logprobs(body)
        stops = service.stops(body)
        # every prompt checked before any starts
        samplings = [service.sampling(body, len(ids), (service.eot,), default_max=16, logprobs=k,
                                      prompt_logprobs=k if echo else None, score_only=echo) for ids in prompts]
        service.check_work(body, prompts, samplings[0][0].max_tokens, echo, "logprobs")
        hidden = echo and body.get("max_completion_tokens", body.get("max_tokens")) == 0
        jobs = [job for ids, sampling in zip(prompts, samplings)
                for job in service.start_jobs(ids, sampling, stops, echo=echo, hidden=hidden, grammar=grammar)]
        return await respond(service, http, body, jobs, chat=False)

    @app.post("/v1/chat/completions", dependencies=[key_check(service)],
              openapi_extra=schema_of(ChatCompletionRequest))
    async def chat_completions(http: HTTPRequest):
        body = validated(ChatCompletionRequest, await parse_body(service, http))
        ids = await asyncio.to_thread(service.chat_prompt, body)
        grammar = await asyncio.to_thread(service.grammar, body)
        chat = service.chat
        sampling = service.sampling(body, len(ids), (chat.im_end, chat.eot), default_max=None,
                                    logprobs=service.chat_logprobs(body))
        service.check_work(body, [ids], sampling[0].max_tokens, False, "top_logprobs")
        jobs = service.start_jobs(ids, sampling, service.stops(body), chat=True, grammar=grammar)
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


def schema_of(kind) -> dict:
    """The route's request body for /openapi.json: the model's JSON schema (its nested models under
    components, where `use_models` puts them). The body itself is read by `parse_body`, not by FastAPI, so that
    its size and nesting are bounded before it is parsed."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{kind.__name__}"}}}}}


def use_models(app, kinds) -> None:
    """Put the request models' schemas (and the models they nest) in the app's OpenAPI components."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for kind in kinds:
                schema = kind.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[kind.__name__] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


async def parse_body(service: Service, http: HTTPRequest) -> dict:
    """The request's JSON object, checked as far as both routes share it (the model is this one, every string
    valid Unicode) before its route's model validates the rest (protocol.py)."""
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
    return body
