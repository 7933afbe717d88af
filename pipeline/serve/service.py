"""What the HTTP handlers share: the model's name and limits, the tokenizer and chat format, the engine thread;
reading a request body into prompts and sampling settings, and starting a choice's job on the engine.

Prompts: a completion's prompt given as token ids is used exactly as sent, as vLLM does: a client that tokenizes
itself (lm-evaluation-harness) is scored on exactly its ids, and puts <|endoftext|> first itself if it wants a
document's start. A prompt given as text starts a document, as every pretraining document follows
<|endoftext|> (kiln generate and kiln evaluate read text so too): the server puts it first, as a tokenizer adds
its BOS, and says so: the usage counts it and echo's log-probabilities list it (with null, the first token's),
so that the next token, the text's first, has its log-probability. A chat is rendered with the model's ChatML
template (tasks/chat_format.py, what SFT taught). Prompts are tokenized on a thread, so one long prompt never
stalls the others; a choice's text is decoded a token at a time (detokenizer.py), the same cost for every token
however long the output.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path

from kiln.pipeline.serve.detokenizer import Job
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.engine_thread import EngineThread, call_each
from kiln.pipeline.serve.grammar import KINDS, Grammar, GrammarError, Grammars
from kiln.pipeline.serve.metrics import ServeMetrics
from kiln.pipeline.serve.protocol import (
    MAX_BODY_BYTES,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_WORK,
    BadRequest,
)
from kiln.pipeline.serve.request import Request, RequestStatus, SamplingParams
from kiln.pipeline.text.bpe import encode_ids, token_bytes


class Service:
    """What the HTTP handlers need: the model's name and limits, the tokenizer and chat format, the engine."""

    def __init__(self, name: str, engine: Engine, tokenizer, chat, eot: int, api_key: str | None = None,
                 max_body: int = MAX_BODY_BYTES, tokenizer_path: Path | None = None):
        self.name, self.engine, self.tokenizer, self.chat, self.eot = name, engine, tokenizer, chat, eot
        self.api_key, self.max_body, self.tokenizer_path = api_key, max_body, tokenizer_path
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.context = engine.model.config.max_seq_len
        self.worker = EngineThread(engine)
        self.metrics = ServeMetrics(engine)
        self.created = int(time.time())
        self.token_names: dict[int, tuple[str, bytes]] = {}
        # tokens a completion's text leaves out (decoded with skip_special_tokens): they add nothing to its text
        self.special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    def sampling(self, body: dict, prompt_tokens: int, stop_ids: tuple[int, ...], default_max: int | None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 score_only: bool = False) -> list[SamplingParams]:
        """One SamplingParams per choice (`n`) of a validated `body` (protocol.py: types and bounds): with a seed,
        choice i draws with seed + i, so the choices differ and each is reproducible. `score_only` (echo):
        `max_tokens` may be 0, and the request then generates the one token the engine must (its caller hides
        it)."""
        n = body.get("n", 1)
        room = self.context + 1 - prompt_tokens
        if room < 1:
            raise BadRequest(f"prompt: {prompt_tokens} tokens; this model's maximum context length is "
                             f"{self.context} tokens", "prompt" if "prompt" in body else "messages",
                             code="context_length_exceeded")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens == 0 and not score_only:
            raise BadRequest("max_tokens=0: expected at least 1 (0 scores a prompt only, with echo)", "max_tokens")
        max_tokens = max(max_tokens, 1) if max_tokens is not None else (default_max or room)  # 0: one, hidden
        if max_tokens > room:
            raise BadRequest(f"max_tokens={max_tokens}: the prompt's {prompt_tokens} tokens leave room for {room} "
                             f"in this model's {self.context}-token context", "max_tokens",
                             code="context_length_exceeded")
        temperature, top_p, seed = body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("seed")
        top_k = body.get("top_k")  # vLLM's extension, accepted through extra_body
        if top_k is not None and top_k != -1:
            if top_k < 1:
                raise BadRequest(f"top_k={top_k}: expected -1 (none) or at least 1", "top_k")
            top_k = min(top_k, self.tokenizer.get_vocab_size())  # beyond the vocabulary cuts nothing
        if (logprobs is not None or prompt_logprobs is not None) and self.engine.runner.draft is not None:
            raise BadRequest("logprobs: not reported by a server decoding speculatively (--draft)", "logprobs")
        processing = self.processing(body, max_tokens)
        stop_ids = (*stop_ids, *self.token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
        return [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p if top_p < 1 else None,
                               top_k=None if top_k in (None, -1) else top_k, seed=None if seed is None else seed + i,
                               stop_ids=stop_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **processing)
                for i in range(n)]

    def processing(self, body: dict, max_tokens: int) -> dict:
        """SamplingParams' logits processing (serve/logits_processors.py) as the body asks for it."""
        bias = body.get("logit_bias") or {}
        ids = self.token_ids(bias, "logit_bias")
        asks = {"logit_bias": tuple(zip(ids, bias.values()))}
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if (value := body.get(name)) is not None:  # null: the default
                asks[name] = value
        if asks.get("min_tokens", 0) > max_tokens:
            raise BadRequest(f"min_tokens={asks['min_tokens']}: more than max_tokens={max_tokens}", "min_tokens")
        if self.engine.runner.draft is not None:
            for name, value in asks.items():
                if value != SamplingParams.__dataclass_fields__[name].default:  # what asks for nothing passes
                    raise BadRequest(f"{name}: not applied by a server decoding speculatively (--draft)", name)
        return asks

    def token_ids(self, keys, field: str) -> list[int]:
        """Token ids as a field lists them (ints, or a dict's decimal string keys), each within the vocabulary."""
        vocab = self.tokenizer.get_vocab_size()
        ids = []
        for key in keys:
            token = int(key) if isinstance(key, int) or key.isdecimal() else -1
            if not 0 <= token < vocab:
                raise BadRequest(f"{field}: {json.dumps(key)} is not a token id of this model's vocabulary (0 to "
                                 f"{vocab - 1})", field)
            ids.append(token)
        return ids

    def grammar(self, body: dict) -> Grammar | None:
        """The grammar the body's output must follow (`response_format`, or vLLM's `structured_outputs`), compiled
        (or found in the cache); None when it asks for none. Run on a thread: compiling a large schema takes
        milliseconds."""
        asked = structured(body)
        if asked is None:
            return None
        where, kind, spec = asked
        if self.engine.runner.draft is not None:
            raise BadRequest(f"{where}: structured outputs are not applied by a server decoding speculatively "
                             "(--draft)", where)
        try:
            grammar, hit = self.grammars().compile(kind, spec)
        except GrammarError as e:
            raise BadRequest(f"{where}: {e}", where) from None
        self.metrics.grammars.labels("hit" if hit else "miss").inc()
        return grammar

    def grammars(self) -> Grammars:
        """The compiler for this server's tokenizer, made at the first request that asks for a grammar."""
        with self._grammars_lock:
            if self._grammars is None:
                ends = [self.eot] + ([self.chat.im_end] if self.chat is not None else [])
                self._grammars = Grammars(self.tokenizer_path, ends, self.engine.runner.vocab_size)
            return self._grammars

    def check_work(self, body: dict, prompts: list[list[int]], max_tokens: int, echo: bool, alternatives: str) -> None:
        """Refuse (400) a request whose answer would hold more than MAX_WORK token entries: each choice's tokens
        (max_tokens, and its prompt's with echo), each with its log-probability alternatives (the field named
        `alternatives`)."""
        n, k = body.get("n", 1), body.get(alternatives) or 0
        tokens = sum(max_tokens + (len(ids) if echo else 0) for ids in prompts)
        work = n * tokens * (1 + k)
        if work > MAX_WORK:
            echoed = f", and {tokens - max_tokens * len(prompts):,} echoed" if echo else ""
            raise BadRequest(f"this request asks for {work:,} token entries: n={n} x {tokens:,} tokens (max_tokens="
                             f"{max_tokens} for each of {len(prompts)} prompts{echoed}) x (1 + {alternatives}={k}); "
                             f"kiln serve answers at most {MAX_WORK:,} per request: ask for fewer prompts, n, tokens "
                             f"or {alternatives}")  # no one field: the product is the fault

    def completion_logprobs(self, body: dict) -> tuple[int | None, bool]:
        """/v1/completions' `logprobs` (how many alternatives per token, or none) and `echo`."""
        return body.get("logprobs"), body.get("echo", False)

    def chat_logprobs(self, body: dict) -> int | None:
        """/v1/chat/completions' `logprobs: true` with `top_logprobs` alternatives."""
        wanted, k = body.get("logprobs", False), body.get("top_logprobs")
        if k is not None and not wanted:
            raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        return (k or 0) if wanted else None

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and raw bytes, as log-probabilities name it (a piece of a character decodes with
        U+FFFD; its bytes are exact)."""
        if token_id not in self.token_names:
            raw = token_bytes(self.tokenizer, token_id)  # once per token id: the answer is kept
            self.token_names[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return self.token_names[token_id]

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to a completion's text: none for a special token (left out of the text)."""
        return b"" if token_id in self.special else self.token(token_id)[1]

    def stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops) or len(stops) > 4:
            raise BadRequest(f"stop: expected a string of 1 to {MAX_STOP_CHARS} characters or a list of up to 4 of "
                             "them", "stop")
        return stops

    def completion_prompts(self, body: dict) -> list[list[int]]:
        """The prompts of /v1/completions as the engine reads them: a list of token ids as sent, a string after
        <|endoftext|> (a document's start), or a list of either (a choice block each)."""
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
                out.append(p)
            elif isinstance(p, str):
                out.append([self.eot, *encode_ids(self.tokenizer, p)])
            else:
                raise BadRequest(f"{where}: expected a string or a non-empty list of token ids", where)
        return out

    def chat_prompt(self, body: dict) -> list[int]:
        if self.chat is None:
            raise BadRequest(f"model {self.name!r}: its tokenizer has no chat tokens; use /v1/completions", "model")
        turns = []
        for m in body["messages"]:  # roles and content parts checked by protocol.ChatMessage
            content = m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
            turns.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        return self.chat.prompt(turns)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine's notifications on `loop`: one callback a step for every token of every stream."""
        self.worker.deliver = lambda notifications: loop.call_soon_threadsafe(call_each, notifications)

    def start_jobs(self, ids: list[int], samplings: list[SamplingParams], stops: list[str], chat: bool = False,
                   echo: bool = False, hidden: bool = False, grammar: Grammar | None = None) -> list[Job]:
        """One job per choice, all on the same prompt: the first choice's request, the others its forks, so the
        engine computes the prompt once; with a `grammar`, each its own copy of it."""
        # a chat's answer ends at <|im_end|> and keeps special tokens' text (ChatFormat.parse_reply); a completion's
        # special tokens decode to nothing
        ends = frozenset((self.chat.im_end, self.chat.eot)) if chat else frozenset((self.eot,))
        jobs = [Job(Request(ids, sampling, id=uuid.uuid4().hex), stops, self.tokenizer, ends, keep_special=chat,
                    echo=echo, hidden=hidden, fork=i > 0) for i, sampling in enumerate(samplings)]
        if grammar is not None:
            for job in jobs:
                job.request.grammar = grammar.copy()

        def listener(job: Job):  # called on the event loop (`bind`), a step's tokens at once
            return lambda request, token: job.queue.put_nowait((request, token))

        self.worker.submit(jobs[0].request, listener(jobs[0]), [(job.request, listener(job)) for job in jobs[1:]])
        return jobs

    async def tokens(self, job: Job):
        """The job's new text pieces as tokens arrive, until it finishes; sets job.finish_reason. Tokens that
        arrived together are released together."""
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
                    if job.finish_reason is None and (piece := job.advance(last=True)):
                        yield piece
                    job.finish_reason = job.finish_reason or ("length" if request.finish_reason in (None, "length")
                                                              else "stop")
                    self.metrics.request_success.labels(job.finish_reason).inc()
                    return
                if job.finish_reason is None and not job.hidden:  # else a stop string ended it (abort on its way)
                    job.feed(token)
                    job.last_token = self.metrics.token(job.started, job.last_token)
            if job.finish_reason is not None or job.hidden:
                continue
            piece = job.advance()
            if job.finish_reason is not None:
                self.worker.abort(job.request)
            if piece:
                yield piece




def structured(body: dict) -> tuple[str, str, object] | None:
    """(the field, the grammar's kind, its spec) of what a validated body's output must follow: OpenAI's
    `response_format` (json_object, or json_schema: its schema, any JSON object without one) or vLLM's
    `structured_outputs` (exactly one of grammar.py's KINDS); None for neither (or a text format)."""
    asked = []
    fmt = body.get("response_format") or {"type": "text"}
    if fmt["type"] == "json_object":
        asked.append(("response_format", "json_object", None))
    elif fmt["type"] == "json_schema":
        schema = fmt["json_schema"].get("schema")
        asked.append(("response_format.json_schema.schema", "json_object" if schema is None else "json", schema))
    if (outputs := body.get("structured_outputs")) is not None:
        named = [k for k in KINDS if outputs.get(k) not in (None, False)]
        if len(named) != 1:
            raise BadRequest(f"structured_outputs: expected exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(named) or 'none'}", "structured_outputs")
        asked.append((f"structured_outputs.{named[0]}", named[0], outputs[named[0]]))
    if len(asked) > 1:
        raise BadRequest("response_format and structured_outputs: expected one of them, not both", "structured_outputs")
    return asked[0] if asked else None
