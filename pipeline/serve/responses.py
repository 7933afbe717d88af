"""The answer to one HTTP request in OpenAI's shape: one JSON object, or server-sent events as the tokens come
(`stream`), a choice per job, with log-probabilities where asked (chat's `content` list, completions'
tokens / token_logprobs / top_logprobs / text_offset).

An answer may hold up to MAX_WORK token entries (protocol.py): a whole one is built and encoded on a thread, and
a stream gives the event loop back at least every SLICE seconds, so /health and the other clients are answered
while it is.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time

from starlette.requests import Request as HTTPRequest  # FastAPI reads handler annotations from module globals

from kiln.pipeline.serve.detokenizer import Job
from kiln.pipeline.serve.service import Service


SLICE = 0.01  # the longest a stream's burst of chunks keeps the event loop (seconds)


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
        self.offsets: list[Offsets | None] = [None] * len(jobs)  # each completion's generated tokens', once asked

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
        from fastapi.responses import Response

        try:
            async for _ in self.pieces():  # each job keeps its released text
                pass
        finally:
            self.stop_unfinished()
        return Response(await asyncio.to_thread(self.encoded), media_type="application/json")

    def encoded(self) -> bytes:
        """The finished completion's JSON, built on a thread (the jobs are done: nothing else touches them). Each
        choice is encoded on its own: one json.dumps holds the GIL throughout, and the event loop's thread would
        wait for all of it (1.5 s for 10 MB on a busy core)."""
        choices = []
        for index, job in enumerate(self.jobs):
            entries = self.prompt_entries(job) + self.new_entries(index)
            text = self.echoed(job) + job.text
            choice = {"index": index, "logprobs": self.logprobs(job, entries), "finish_reason": job.finish_reason}
            choices.append(json.dumps(choice | ({"message": {"role": "assistant", "content": text}} if self.chat
                                                else {"text": text}), ensure_ascii=False, separators=(",", ":")))
        head = json.dumps({"id": self.id, "object": self.object, "created": self.created, "model": self.service.name},
                          separators=(",", ":"))
        usage = json.dumps(self.usage(), separators=(",", ":"))
        return f'{head[:-1]},"choices":[{",".join(choices)}],"usage":{usage}}}'.encode()

    def streamed(self, include_usage: bool):
        """A chunk per new piece of text, then one with the finish reason (and one with the usage, if asked)."""
        from fastapi.responses import StreamingResponse

        return StreamingResponse(self.events(include_usage), media_type="text/event-stream")

    async def events(self, include_usage: bool):
        try:
            if self.chat:
                for index in range(len(self.jobs)):
                    yield sse(self.chunk(index, None, None, role=True))
            echoing = {index for index, job in enumerate(self.jobs) if job.echo}
            due = time.perf_counter() + SLICE
            async for index, piece in self.pieces():
                job = self.jobs[index]
                if index in echoing:  # the prompt first: its log-probabilities exist once its first token came
                    echoing.remove(index)
                    yield sse(self.chunk(index, self.echoed(job), None,
                                         logprobs=self.logprobs(job, self.prompt_entries(job))))
                finish = job.finish_reason if piece is None else None
                yield sse(self.chunk(index, piece, finish, logprobs=self.logprobs(job, self.new_entries(index))))
                if time.perf_counter() > due:  # chunks that were all ready at once: let the loop serve others
                    await asyncio.sleep(0)
                    due = time.perf_counter() + SLICE
            if include_usage:
                yield sse({"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                           "created": self.created, "model": self.service.name, "choices": [], "usage": self.usage()})
            yield sse("[DONE]")
        finally:  # the client went away (the generator is closed) or the jobs ended: either way, stop them
            self.stop_unfinished()

    def echoed(self, job: Job) -> str:
        """The prompt's text, when the choice echoes it (completions' `echo`), else "": special tokens left out,
        as from a completion's text (so a string prompt's text, without the <|endoftext|> kiln put first)."""
        return self.service.tokenizer.decode(job.request.prompt) if job.echo else ""

    def prompt_entries(self, job: Job) -> list:
        """(token, log-probability entry, text offset) of an echoed prompt's tokens: the first has none (OpenAI's
        null), token p's is the engine's entry of position p - 1."""
        if not job.echo or job.request.sampling.prompt_logprobs is None:
            return []
        prompt, entries, offsets = job.request.prompt, job.request.prompt_logprobs, Offsets(0)
        return [(t, entries[p - 1] if p else None, offsets.next(self.service.text_bytes(t)))
                for p, t in enumerate(prompt)]

    def new_entries(self, index: int) -> list:
        """(token, entry, text offset) of choice `index`'s generated tokens not reported yet; a chat leaves out
        the stop token that ended its answer (its text is not in the message) and has no offsets."""
        job = self.jobs[index]
        if job.request.sampling.logprobs is None:
            return []
        ids, start = job.ids, job.reported
        job.reported = len(ids)
        if self.chat:
            stops = job.request.sampling.stop_ids
            return [(t, job.request.logprobs[i], None) for i, t in enumerate(ids[start:], start) if t not in stops]
        if self.offsets[index] is None:  # the generated text follows the echoed prompt's
            self.offsets[index] = Offsets(len(self.echoed(job)))
        offsets, text_bytes = self.offsets[index], self.service.text_bytes
        return [(t, job.request.logprobs[i], offsets.next(text_bytes(t))) for i, t in enumerate(ids[start:], start)]

    def logprobs(self, job: Job, entries: list) -> dict | None:
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
            return {"content": [item(t, e[0]) | {"top_logprobs": [item(a, v) for a, v in e[1]]}
                                for t, e, _ in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry, offset in entries:
            out["tokens"].append(name(token)[0])
            out["text_offset"].append(offset)
            out["token_logprobs"].append(None if entry is None else entry[0])
            # the alternatives, and the token itself beside them (as vLLM lists it)
            out["top_logprobs"].append(None if entry is None else
                                       {name(a)[0]: v for a, v in [*entry[1], (token, entry[0])]})
        return out

    def stop_unfinished(self) -> None:
        for job in self.jobs:
            if job.finish_reason is None:
                self.service.worker.abort(job.request)


class Offsets:
    """Where each token's text begins in a choice's text (completions' `text_offset`), its tokens' bytes decoded
    as one stream, as the text is: a special token adds nothing (the text leaves it out), and the tokens of a
    character split across them all point where it begins, so no offset passes the text's end."""

    def __init__(self, start: int):
        self.at, self.decoder = start, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`, the next in the choice."""
        held, at = self.decoder.getstate()[0], self.at
        if held and raw and not 0x80 <= raw[0] < 0xC0:  # held bytes that never formed a character: their U+FFFD
            at += len(held.decode("utf-8", errors="replace"))  # come first, then this token's text
        self.at += len(self.decoder.decode(raw))
        return at


def model_card(service: Service) -> dict:
    return {"id": service.name, "object": "model", "created": service.created, "owned_by": "kiln",
            "max_model_len": service.context}
