"""Text in, text out: a model folder plus the tokenizer it was trained with (`kiln generate`, `kiln chat`, eval
samples), run on the serving engine (`pipeline/serve/engine.py`), as `kiln serve` is.

The model folder records the sha256 of its tokenizer; a different tokenizer would decode the ids into other
text without any error, so the two are checked against each other before anything runs.

On the engine each prompt is a request of its own: prompts of any lengths run side by side without padding,
each finished one leaves the batch at once, and a request's sampled tokens depend on its own seed only (prompt
i gets `seed + i`), never on which other prompts share its steps. Greedy output is `generate`'s, token for
token (tests/test_serve_engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.model.checkpoint import load_model
from kiln.model.quantize import check_quantize
from kiln.model.quantize import quantize as quantize_model
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.serve.engine import Engine, complete
from kiln.pipeline.serve.grammar import GrammarError, Grammars
from kiln.pipeline.serve.request import (
    MAX_TEMPERATURE,
    TOOLS_TEMPERATURE,
    TOOLS_TOP_K,
    TOOLS_TOP_P,
    Request,
    SamplingParams,
)
from kiln.pipeline.text.bpe import EOT, load_tokenizer
from kiln.pipeline.text.corpus import SURROGATE


@dataclass
class Sampling:
    max_new_tokens: int | None = None  # None: fill the model's context window
    temperature: float = TOOLS_TEMPERATURE  # 0: greedy
    top_k: int | None = TOOLS_TOP_K
    top_p: float | None = TOOLS_TOP_P
    seed: int | None = None

    @classmethod
    def with_defaults(cls, max_new_tokens=None, temperature=None, top_k=None, top_p=None, seed=None) -> Sampling:
        """The command-line tools' sampling: every option left unset takes this class's default."""
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        return cls(max_new_tokens, seed=seed, **{k: v for k, v in given.items() if v is not None})

    def request(self, ids: list[int], max_tokens: int, stop_ids: list[int], index: int = 0) -> Request:
        """A request of `ids` for the engine, sampled with these settings; the `index`th of a call."""
        seed = None if self.seed is None else self.seed + index
        return Request(ids, SamplingParams(max_tokens, self.temperature, self.top_k, self.top_p, seed,
                                            tuple(stop_ids)))

    def check(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens={self.max_new_tokens}: expected at least 1")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise UserError(f"--temperature={self.temperature}: expected 0 (greedy) to {MAX_TEMPERATURE}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k={self.top_k}: expected at least 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p={self.top_p}: expected a number in (0, 1]")


class TextModel:
    """A loaded model and its tokenizer, checked to belong together; with `quantize` (model/quantize.py: kiln's
    int8, TorchAO's int4 and fp8), its blocks' linear layers quantized after loading, a kind the device cannot
    run refused before."""

    def __init__(self, model_dir: Path, tokenizer_path: Path, device: torch.device | str = "cpu",
                 quantize: str | None = None):
        check_quantize(quantize, device)
        try:
            self.model, meta = load_model(model_dir, device)
        except ValueError as e:
            raise UserError(str(e)) from None
        if not tokenizer_path.is_file():
            raise UserError(f"{tokenizer_path}: tokenizer not found")
        want, got = meta.get("tokenizer_sha256"), sha256_file(tokenizer_path)
        if want is not None and want != got:
            raise UserError(f"{tokenizer_path}: not the tokenizer {model_dir} was trained with "
                            f"(sha256 {got[:12]}..., the model expects {want[:12]}...)")
        self.meta = meta  # config.json beside the model config: tokenizer_sha256, chat_format, init, ...
        quantize_model(self.model, quantize)
        self.tokenizer = load_tokenizer(tokenizer_path, ordinary=True)
        self.tokenizer_path = tokenizer_path
        self.eot = self.tokenizer.token_to_id(EOT)

    def complete(self, prompts: list[str], sampling: Sampling,
                 structure: tuple[str, str, object] | None = None) -> list[str]:
        """The continuation of each prompt, up to `<|endoftext|>` (not included) or max_new_tokens; with a
        `structure` (the option that asked, a grammar's kind and spec: serve/grammar.py), one that follows it."""
        sampling.check()
        grammar = None
        if structure is not None:
            where, kind, spec = structure
            try:
                grammar = Grammars(self.tokenizer_path, [self.eot], self.model.config.vocab_size).compile(kind, spec)[0]
            except GrammarError as e:
                raise UserError(f"{where}: {e}") from None
        for prompt in prompts:
            check_text(prompt, "--prompt")
        # A prompt starts a document, and in the shards every document follows <|endoftext|>.
        ids = [[self.eot, *self.tokenizer.encode(p).ids] for p in prompts]
        context, longest = self.model.config.max_seq_len, max(map(len, ids))
        if longest > context:
            raise UserError(f"--prompt: {longest - 1} tokens do not fit the model's max_seq_len={context}")
        new = sampling.max_new_tokens or context + 1 - longest
        if longest + new - 1 > context:
            raise UserError(f"--prompt: {longest - 1} tokens + --max-new-tokens={new} do not fit the model's "
                            f"max_seq_len={context}")
        requests = [sampling.request(p, new, [self.eot], i) for i, p in enumerate(ids)]
        for r in requests if grammar is not None else ():
            r.grammar = grammar.copy()
        complete(self.model, requests)
        return [self.tokenizer.decode([t for t in r.output if t != self.eot]) for r in requests]


def check_text(text: str, what: str) -> None:
    """Refuse text that is not Unicode: bytes that were not UTF-8 (which Python's stdin and argv hand over as
    surrogates \udc80-\udcff, by PEP 383), or a lone surrogate typed as such."""
    if bad := SURROGATE.search(text):
        char = ord(bad.group()[0])
        if 0xDC80 <= char <= 0xDCFF:
            raise UserError(f"{what}: not valid UTF-8 (byte 0x{char - 0xDC00:02x} at character {bad.start()})")
        raise UserError(f"{what}: not valid Unicode (lone surrogate at character {bad.start()})")


class ChatSession:
    """A conversation with a chat model (SFT or DPO): the whole history is the prompt of every reply, the
    oldest turns (after a system message) dropped when it no longer fits the context window."""

    def __init__(self, lm: TextModel, sampling: Sampling, system: str | None = None):
        from kiln.pipeline.tasks.chat_format import ChatFormat

        sampling.check()
        self.lm, self.sampling, self.chat = lm, sampling, ChatFormat(lm.tokenizer)
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []

    def reply(self, text: str) -> Iterator[str]:
        """Stream the answer to `text` as pieces of text; the answer joins the history when it is complete."""
        check_text(text, "message")
        context = self.lm.model.config.max_seq_len
        turns = [*self.turns, {"role": "user", "content": text}]
        room = self.sampling.max_new_tokens or max(1, context // 4)
        while len(ids := self.chat.prompt(self.system + turns)) + room - 1 > context and len(turns) > 1:
            turns = turns[2:]  # the oldest exchange: a user turn and its answer
        if len(ids) >= context:
            raise UserError(f"message: {len(ids)} tokens with the chat markers; the model's context is {context}")
        new, shown = [], ""
        s = self.sampling
        request = s.request(ids, min(room, context + 1 - len(ids)), [self.chat.im_end, self.chat.eot])
        engine = Engine.sized_for(self.lm.model.eval(), [request])
        engine.add(request)
        while engine.has_work():
            for _, token in engine.step():
                new.append(token)
                text_so_far = self.chat.parse_reply(new)
                if not text_so_far.endswith("\ufffd"):  # a character split across tokens waits for its last byte
                    yield text_so_far[len(shown):]
                    shown = text_so_far
        answer = self.chat.parse_reply(new)
        if answer != shown:
            yield answer[len(shown):]
        self.turns = [*turns, {"role": "assistant", "content": answer}]
