"""What the HTTP handlers share: the model's name and limits, the tokenizer and chat format, the engine thread;
reading a request body into prompts and sampling settings, and starting a choice's job on the engine.

Text: a completion's prompt starts a document, as every pretraining document follows `<|endoftext|>`; a chat
is rendered with the model's ChatML template (tasks/chat_format.py, what SFT taught). Prompts are tokenized on
a thread, so one long prompt never stalls the others; a choice's text is decoded a token at a time
(detokenizer.py), the same cost for every token however long the output.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from kiln.pipeline.serve.detokenizer import Job
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.engine_thread import EngineThread
from kiln.pipeline.serve.metrics import ServeMetrics
from kiln.pipeline.serve.protocol import (
    INT64,
    MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    UNSUPPORTED,
    BadRequest,
    number,
)
from kiln.pipeline.serve.request import Request, RequestStatus, SamplingParams
from kiln.pipeline.text.bpe import encode_ids, token_bytes


class Service:
    """What the HTTP handlers need: the model's name and limits, the tokenizer and chat format, the engine."""

    def __init__(self, name: str, engine: Engine, tokenizer, chat, eot: int, api_key: str | None = None,
                 max_body: int = MAX_BODY_BYTES):
        self.name, self.engine, self.tokenizer, self.chat, self.eot = name, engine, tokenizer, chat, eot
        self.api_key, self.max_body = api_key, max_body
        self.context = engine.model.config.max_seq_len
        self.worker = EngineThread(engine)
        self.metrics = ServeMetrics(engine)
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

    def start_jobs(self, ids: list[int], samplings: list[SamplingParams], stops: list[str], chat: bool = False,
                   echo: bool = False, hidden: bool = False) -> list[Job]:
        """One job per choice, all on the same prompt: the first choice's request, the others its forks, so the
        engine computes the prompt once."""
        loop = asyncio.get_running_loop()
        # a chat's answer ends at <|im_end|> and keeps special tokens' text (ChatFormat.parse_reply); a completion's
        # special tokens decode to nothing
        ends = frozenset((self.chat.im_end, self.chat.eot)) if chat else frozenset((self.eot,))
        jobs = [Job(Request(ids, sampling, id=uuid.uuid4().hex), stops, self.tokenizer, ends, keep_special=chat,
                    echo=echo, hidden=hidden, fork=i > 0) for i, sampling in enumerate(samplings)]

        def listener(job: Job):
            return lambda request, token: loop.call_soon_threadsafe(job.queue.put_nowait, (request, token))

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

