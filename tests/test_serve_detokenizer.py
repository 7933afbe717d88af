"""A choice's text as its tokens arrive (serve/detokenizer.py): the same text and stop as decoding the whole
output at the end, at a cost per token that does not grow with the output."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.pipeline.serve.detokenizer import Job
from kiln.pipeline.serve.request import Request, SamplingParams
from kiln.pipeline.text.bpe import EOT, load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny.tokenizer, ordinary=True)


def stream(tok, ids: list[int], stops: list[str], ends: frozenset, keep_special: bool) -> tuple[str, str | None]:
    """Feed `ids` one at a time as the server does, releasing after each; (the text released, finish)."""
    job = Job(Request([0], SamplingParams(1)), stops, tok, ends, keep_special)
    out = ""
    for token in ids:
        job.feed(token)
        out += job.advance()
        if job.finish_reason:
            return out, job.finish_reason
    return out + job.advance(last=True), job.finish_reason


def whole(tok, ids: list[int], stops: list[str], ends: frozenset, keep_special: bool) -> tuple[str, str | None]:
    """The reference, as the server once computed it: after each token, decode everything up to it (an end token
    ends the text) and cut at the earliest stop string found, so the first stop to complete ends the choice (a
    longer stop that would have begun earlier is not waited for: OpenAI's and vLLM's rule); a prefix that ends
    inside a character is not looked at."""
    ids = ids[:next((i for i, t in enumerate(ids) if t in ends), len(ids))]
    text = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=not keep_special)
        if k < len(ids) and text.endswith("\ufffd"):
            continue
        cut = min((at for s in stops if (at := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            return text[:cut], "stop"
    return text, None


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 60), chat=st.booleans(), data=st.data())
def test_streamed_text_and_stops_equal_decoding_the_whole(tok, seed, n, chat, data):
    """Any tokens (byte pieces that never form a character, special tokens, an end token mid-way) and any stop
    strings, taken from the text itself or not."""
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    ids = [rng.randrange(vocab) for _ in range(n)]
    eot, im_end = tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")
    ends = frozenset((im_end, eot)) if chat else frozenset((eot,))
    text = tok.decode(ids, skip_special_tokens=not chat)
    stops = data.draw(st.lists(st.one_of(st.text(min_size=1, max_size=4),
                                         st.integers(0, max(len(text) - 1, 0)).map(lambda i: text[i:i + 3] or "x")),
                               max_size=3))
    assert stream(tok, ids, stops, ends, chat) == whole(tok, ids, stops, ends, chat)


def test_a_long_output_costs_the_same_per_token(tok):
    """4,000 tokens: after each, the text searched for a stop (and held back) is the unreleased tail, bounded by
    the longest stop and token, not by the output; the decoder stream holds only what a character needs. (The
    whole output is decoded once, at the end: `Job.advance(last=True)`.)"""
    rng = random.Random(0)
    words = [t for w in ("Ġthe", "Ġking", "Ġof", "Ġmy", "Ġlord") if (t := tok.token_to_id(w)) is not None]
    assert words
    ids = [rng.choice(words) for _ in range(4000)]
    stops = ["QUEEN", "zz top"]
    job = Job(Request([0], SamplingParams(1)), stops, tok, frozenset((tok.token_to_id(EOT),)))
    longest = max(len(tok.decode([t])) for t in words)
    for token in ids:
        job.feed(token)
        job.advance()
        assert len(job.pending) <= max(map(len, stops)) + longest
    job.advance(last=True)
    assert job.text == tok.decode(ids) and job.finish_reason is None
