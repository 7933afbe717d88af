"""The answer to one HTTP request in OpenAI's shape: one JSON object, or server-sent events as the tokens come
(`stream`), a choice per job, with log-probabilities where asked (chat's `content` list, completions'
tokens / token_logprobs / top_logprobs / text_offset)."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request as HTTPRequest  # FastAPI reads handler annotations from module globals

from kiln.pipeline.serve.detokenizer import Job
from kiln.pipeline.serve.service import Service


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def respond(service: Service, http: HTTPRequest, body: dict, jobs: list[Job], chat: bool):
    """The jobs' completion (`chat`: chat completion), one choice each, as one JSON object or, if the body asks to
    `stream`, as server-sent events; its usage is left on the request for the log line (`RequestLog`)."""
    options = body.get("stream_options")
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
        if len(self.jobs) == 1:  # one choice (most requests): its pieces straight from its job, no task between
            async for piece in self.service.tokens(self.jobs[0]):
                yield 0, piece
            yield 0, None
            return
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
