"""`kiln serve` as a client sees it: a real server process on 127.0.0.1 (the port --port 0 got), driven by the
`openai` Python client: completions and chat against greedy `generate`, streaming, 16 concurrent clients, a
client that disconnects mid-stream, log-probabilities (echo, text offsets, streamed), the bound on a request's
work, and every 4xx case."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch

from kiln.model.checkpoint import load_model, save_model
from kiln.model.config import ModelConfig
from kiln.model.generate import generate
from kiln.model.gpt import GPT
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.text.bpe import EOT, load_tokenizer


@contextlib.contextmanager
def running_server(tiny, root: Path, *args: str, env: dict | None = None, log=None):
    """`kiln serve --port 0` in a process of its own, with a random model of a 512-token context (long enough that
    a stream is still running when its client leaves) served as "tiny", its output in `log` (an open file;
    default root/serve.log): (base URL, process). The address is the one the server prints, the port the system
    gave it, which then answers /health."""
    torch.manual_seed(0)
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, d_model=128, max_seq_len=512)
    save_model(GPT(config), config, root / "tiny", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    with contextlib.ExitStack() as stack:
        log = log or stack.enter_context(open(root / "serve.log", "w"))
        process = subprocess.Popen([sys.executable, "-m", "kiln.pipeline.cli", "serve", "--model", str(root / "tiny"),
                                    "--tokenizer", str(tiny.tokenizer), "--port", "0", "--device", "cpu",
                                    "--kv-blocks", "256", "--block-size", "8", *args],
                                   stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            for _ in range(1200):
                said = re.search(r"http://127\.0\.0\.1:(\d+)/v1", Path(log.name).read_text())
                if said or process.poll() is not None:
                    break
                time.sleep(0.1)
            assert said, Path(log.name).read_text()
            base = f"http://127.0.0.1:{said.group(1)}"
            assert int(said.group(1)) > 0 and httpx.get(f"{base}/health", timeout=60).status_code == 200
            yield base, process
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    with running_server(tiny, root) as (base, _):
        model, _ = load_model(root / "tiny")
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), model.eval()


def tokenizer(tiny):
    return load_tokenizer(tiny.tokenizer, ordinary=True)


def greedy_text(tiny, model, prompt: str, n: int) -> str:
    tok = tokenizer(tiny)
    eot = tok.token_to_id(EOT)
    out = generate(model, [[eot, *tok.encode(prompt).ids]], n, temperature=0.0, stop_ids=[eot])[0]
    return tok.decode([t for t in out if t != eot])


def test_models_and_health(server):
    base, client, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["kv_blocks"] == 256


def test_completion_and_its_stream_are_greedy_generate(tiny, server):
    _, client, model = server
    done = client.completions.create(model="tiny", prompt="the king of", max_tokens=12, temperature=0)
    assert done.choices[0].text == greedy_text(tiny, model, "the king of", 12)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens <= 12
    pieces = list(client.completions.create(model="tiny", prompt="the king of", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_chat_uses_the_template_and_streams_the_same_answer(tiny, server):
    _, client, model = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "speak, queen"}]
    chat = ChatFormat(tokenizer(tiny))
    out = generate(model, [chat.prompt(messages)], 10, temperature=0.0, stop_ids=[chat.im_end, chat.eot])[0]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == chat.parse_reply(out)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_stop_strings_end_the_text_where_they_begin(tiny, server):
    _, client, model = server
    full = greedy_text(tiny, model, "doc", 30)
    cut = next(i for i in range(3, len(full)) if full[i] != " ")  # a stop string from inside the text
    stop = full[cut:cut + 2]
    done = client.completions.create(model="tiny", prompt="doc", max_tokens=30, temperature=0, stop=[stop])
    assert done.choices[0].text == full[:full.index(stop)] and done.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_get_what_each_would_alone(tiny, server):
    _, client, model = server
    prompts = [f"the {w} of" for w in ("king", "queen", "night", "day")] * 4

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [greedy_text(tiny, model, p, 8) for p in prompts]
    seeded = [client.completions.create(model="tiny", prompt="O", max_tokens=8, temperature=1.0, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_n_choices_share_one_prompt_and_each_is_its_own_seeded_draw(tiny, server):
    base, client, model = server
    prompt = "the king of " * 8  # several full blocks of 8 tokens, computed once for the three choices
    before = httpx.get(f"{base}/health").json()
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=11)
    assert [c.index for c in done.choices] == [0, 1, 2]
    # the prompt counted once (after its <|endoftext|>), each choice's tokens counted
    assert done.usage.prompt_tokens == 1 + len(tokenizer(tiny).encode(prompt).ids)
    assert 3 <= done.usage.completion_tokens <= 18
    # one request and two forks: the prompt computed once (prefix caching alone would recompute its last block)
    computed = httpx.get(f"{base}/health").json()["prefill_tokens"] - before["prefill_tokens"]
    assert computed == done.usage.prompt_tokens
    alone = [client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=11 + i)
             .choices[0].text for i in range(3)]
    assert [c.text for c in done.choices] == alone  # choice i is the request with seed + i
    assert len(set(alone)) > 1
    greedy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=11,
                                            stream=True))
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == done.choices[i].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].index == i][-1] == "length"
    assert httpx.get(f"{base}/health").json()["kv_blocks_in_use"] == before["kv_blocks_in_use"] == 0


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    base, _, _ = server
    before = httpx.get(f"{base}/health").json()["aborted"]
    body = {"model": "tiny", "prompt": "the", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # one event, then hang up
    for _ in range(100):
        health = httpx.get(f"{base}/health").json()
        if health["running"] == 0:
            break
        time.sleep(0.05)
    assert health["aborted"] == before + 1 and health["running"] == 0 and health["kv_blocks_in_use"] == 0


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda c: c.completions.create(model="nope", prompt="a"), openai.NotFoundError, "does not exist"),
    (lambda c: c.completions.create(model="tiny", prompt="a", temperature=-1), openai.BadRequestError,
     "temperature"),
    (lambda c: c.completions.create(model="tiny", prompt="a", top_p=0), openai.BadRequestError, "top_p"),
    (lambda c: c.completions.create(model="tiny", prompt="a", max_tokens=0), openai.BadRequestError,
     "max_tokens"),
    (lambda c: c.completions.create(model="tiny", prompt="a", n=0), openai.BadRequestError, "n=0"),
    (lambda c: c.completions.create(model="tiny", prompt="a", n=1000), openai.BadRequestError, "n=1000"),
    (lambda c: c.completions.create(model="tiny", prompt="a", stream=True, stream_options=1),
     openai.BadRequestError, "stream_options"),
    (lambda c: c.completions.create(model="tiny", prompt="a " * 600), openai.BadRequestError, "context length"),
    (lambda c: c.completions.create(model="tiny", prompt="a", max_tokens=600), openai.BadRequestError,
     "max_tokens=600"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}]),
     openai.BadRequestError, "role"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[]), openai.BadRequestError, "messages"),
])
def test_bad_requests_get_openai_errors(server, call, error, words):
    _, client, _ = server
    with pytest.raises(error) as raised:
        call(client)
    assert words in raised.value.message and raised.value.body["type"] in ("invalid_request_error",
                                                                           "not_found_error")


def test_a_body_that_is_not_json_is_a_400_in_openai_shape(server):
    base, _, _ = server
    response = httpx.post(f"{base}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{base}/v1/completions", content=json.dumps([1, 2]))
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# --- log-probabilities: what lm-evaluation-harness and RL tools read --------------------------------------------

def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float64 log-softmax of a plain forward over ids: row i is the next token's after ids[i]."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().log_softmax(-1)


def test_echo_scores_token_ids_exactly_as_sent(tiny, server):
    """lm-eval's `local-completions` sends context + continuation as token ids with echo, logprobs 1 and
    max_tokens 1, and sums token_logprobs[len(context):-1]: the continuation's log-likelihood. The ids are scored
    exactly as sent, nothing put before them (as vLLM does): the first has no value (null, as OpenAI's), token j's
    is the model's after ids[:j]. max_tokens 0 (with echo) scores only."""
    _, client, model = server
    tok = tokenizer(tiny)
    context, continuation = tok.encode("the king of").ids, tok.encode(" the queen").ids
    ids = context + continuation
    ref = reference_logprobs(model, ids)
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    scored = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "the king of the queen"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert "".join(lp.tokens) == "the king of the queen"
    assert lp.text_offset == [len(tok.decode(ids[:j])) for j in range(len(ids))]  # ASCII: a token is its text
    one = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = one.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert sum(lp.token_logprobs[len(context):-1]) == pytest.approx(sum(want[len(context) - 1:]), abs=1e-4)
    # the generated token is greedy here: its value is the best of its alternatives (lm-eval's is_greedy)
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)


def test_a_text_prompt_starts_a_document_and_says_so(tiny, server):
    """A string prompt is read after <|endoftext|> (a document's start): the usage counts it and echo lists it
    first, with null, so the text's first token has its value, the model's after <|endoftext|>."""
    _, client, model = server
    tok = tokenizer(tiny)
    eot, ids = tok.token_to_id(EOT), tok.encode("the king of").ids
    ref = reference_logprobs(model, [eot, *ids])
    scored = client.completions.create(model="tiny", prompt="the king of", echo=True, logprobs=2, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "the king of" and scored.usage.prompt_tokens == 1 + len(ids)
    assert lp.tokens == [EOT, *(tok.decode([t]) for t in ids)] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([ref[j, t].item() for j, t in enumerate(ids)], abs=1e-4)
    assert lp.text_offset == [0, *(len(tok.decode(ids[:j])) for j in range(len(ids)))]  # <|endoftext|> adds none
    as_ids = client.completions.create(model="tiny", prompt=[eot, *ids], echo=True, logprobs=2, max_tokens=0)
    assert as_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_text_offsets_stay_in_the_text_past_special_and_split_tokens(tiny, server):
    """text_offset is where a token's text begins in the choice's text: a special token adds nothing to the text
    (and so nothing to the offsets after it), the tokens of a character split across them point where it
    begins; never past the text's end, echoed or generated."""
    _, client, _ = server
    tok = tokenizer(tiny)
    king, of = tok.encode("the king").ids, tok.encode(" of").ids
    lp = client.completions.create(model="tiny", prompt=[*king, tok.token_to_id("<|im_start|>"), *of], echo=True,
                                   logprobs=0, max_tokens=0).choices[0].logprobs
    assert lp.tokens[len(king)] == "<|im_start|>"
    assert lp.text_offset == [0, 3, 8, 8] and [tok.id_to_token(t) for t in king + of] == ["the", "Ġking", "Ġof"]
    naive = tok.encode("naïve").ids  # ï's two bytes are two tokens of a 300-token vocabulary
    lp = client.completions.create(model="tiny", prompt=naive, echo=True, logprobs=0, max_tokens=0).choices[0].logprobs
    assert len(naive) == 6 and lp.text_offset == [0, 1, 2, 2, 3, 4]
    # generated: sampled hot from a random model, 4 choices of up to 100 tokens draw special tokens beside the text
    done = client.completions.create(model="tiny", prompt="the", max_tokens=100, temperature=2.0, seed=0, n=4,
                                     logprobs=0)
    special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"}
    assert sum(t in special - {EOT} for c in done.choices for t in c.logprobs.tokens) >= 2
    for choice in done.choices:
        offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
        assert offsets == sorted(offsets) and offsets[-1] <= len(choice.text)
        for before, at, token, after in zip(["", *tokens], offsets, tokens, [*offsets[1:], len(choice.text)]):
            if token in special and "\ufffd" not in before:  # (bytes held before it may yet form a character)
                assert after == at  # the next token's text begins where this one's would have
            elif token not in special and "\ufffd" not in token:  # whole characters: the text's there
                assert choice.text[at:at + len(token)] == token


def test_generated_tokens_report_their_logprobs_whole_and_streamed(tiny, server):
    _, client, model = server
    tok = tokenizer(tiny)
    eot = tok.token_to_id(EOT)
    done = client.completions.create(model="tiny", prompt="speak", max_tokens=6, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    prompt = [eot, *tok.encode("speak").ids]
    out = generate(model, [prompt], 6, temperature=0.0, stop_ids=[eot])[0]
    ref = reference_logprobs(model, prompt + out)
    assert lp.token_logprobs == pytest.approx([ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)],
                                              abs=1e-4)
    # three alternatives and the token itself, keyed by text (byte pieces that decode alike share a key)
    assert all(1 <= len(top) <= 4 and max(top.values()) == pytest.approx(v, abs=1e-6)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = list(client.completions.create(model="tiny", prompt="speak", max_tokens=6, temperature=0, logprobs=3,
                                              stream=True))
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed if c.choices[0].logprobs), []) == \
        pytest.approx(lp.token_logprobs, abs=1e-5)  # another request, other step shapes: float32 rounding apart


def events(base: str, body: dict) -> list:
    """A streamed completion's events, parsed, the last "[DONE]" if the stream ended as it should."""
    with httpx.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                for line in response.iter_lines() if line.startswith("data: ")]


def test_echo_with_logprobs_streams_whole_twenty_at_once(server):
    """stream + echo + logprobs: each choice's echoed prompt comes first, once its log-probabilities exist (its
    prompt computed); 20 such streams at once, of 1 to 3 choices over 1 or 2 prompts, each ends with [DONE] and
    carries what the same request answered whole does."""
    base, _, _ = server

    def body(i: int) -> dict:
        prompts = [[7 + i, 40, 41, 42, 43, 44][:2 + i % 5], [50 + i, 51, 52]][:1 + i % 2]
        return {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0,
                "n": 1 + i % 3}

    with ThreadPoolExecutor(20) as pool:
        streams = list(pool.map(lambda i: events(base, body(i)), range(20)))
    for i, stream in enumerate(streams):
        assert stream[-1] == "[DONE]", (i, stream[-3:])
        whole = httpx.post(f"{base}/v1/completions", json=body(i), timeout=60).json()
        for choice in whole["choices"]:
            mine = [e["choices"][0] for e in stream[:-1] if e["choices"][0]["index"] == choice["index"]]
            prompt = body(i)["prompt"][choice["index"] // body(i)["n"]]
            assert len(mine[0]["logprobs"]["tokens"]) == len(prompt)  # the echo, first
            assert "".join(c["text"] for c in mine) == choice["text"]
            streamed = {key: sum((c["logprobs"][key] for c in mine), []) for key in choice["logprobs"]}
            assert streamed["tokens"] == choice["logprobs"]["tokens"]
            assert streamed["text_offset"] == choice["logprobs"]["text_offset"]
            assert streamed["token_logprobs"][0] is None is choice["logprobs"]["token_logprobs"][0]
            assert streamed["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:],
                                                                   abs=1e-5)


def test_a_request_asking_for_too_much_is_a_400_naming_the_product(server):
    """The audit's 68 KB body (128 token-id prompts x n=128 x echo x 20 alternatives) asks for an answer of 35M
    token entries: refused before anything runs, the product and the limit named; the server keeps serving."""
    base, _, _ = server
    body = {"model": "tiny", "prompt": [[5 + i % 90] * 100 for i in range(128)], "n": 128, "echo": True,
            "logprobs": 20, "max_tokens": 1}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400, error
    # n x (128 prompts x (100 echoed + 1 generated) tokens) x (1 + 20 alternatives)
    assert error["message"].startswith("this request asks for 34,750,464 token entries: n=128 x 12,928 tokens (")
    assert "x (1 + logprobs=20)" in error["message"] and "at most 2,000,000" in error["message"]
    assert time.perf_counter() - started < 10 and httpx.get(f"{base}/health").json()["running"] == 0


def health_waits(base: str, send) -> tuple:
    """(what `send()` returned, the seconds each /health call took while it ran on a thread of its own)."""
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("response", send()))
    worker.start()
    waits = []
    while worker.is_alive():
        started = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        waits.append(time.perf_counter() - started)
    worker.join()
    return done["response"], waits


def test_health_answers_while_a_large_answer_is_built(server):
    """An allowed but large answer (128 prompts x n=2 x 61 tokens x 21 entries: 328K token entries, 6 MB of JSON)
    is built and encoded off the event loop: /health answers within a second all along (built on the loop, this
    one held it for 2 s on two busy cores, the audit's 35M-entry answer for 60 s)."""
    base, _, _ = server
    body = {"model": "tiny", "prompt": [[5 + i, *range(20, 79)] for i in range(128)], "n": 2, "echo": True,
            "logprobs": 20, "max_tokens": 1}
    response, waits = health_waits(base, lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=300))
    answer = response.json()
    assert len(answer["choices"]) == 256 and all(len(c["logprobs"]["tokens"]) == 61 for c in answer["choices"])
    assert len(waits) >= 3 and max(waits) < 1.0, waits


def test_several_prompts_are_a_choice_block_each(tiny, server):
    _, client, model = server
    done = client.completions.create(model="tiny", prompt=["the king of", "speak"], max_tokens=5, temperature=0,
                                     n=2)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [c.text for c in done.choices] == [greedy_text(tiny, model, "the king of", 5)] * 2 + \
        [greedy_text(tiny, model, "speak", 5)] * 2
    tok = tokenizer(tiny)
    assert done.usage.prompt_tokens == 2 + len(tok.encode("the king of").ids) + len(tok.encode("speak").ids)


def test_chat_logprobs_whole_and_streamed(tiny, server):
    _, client, model = server
    messages = [{"role": "user", "content": "speak, queen"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert b"".join(bytes(c.bytes) for c in content).decode() == done.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6)
               for c in content)  # greedy: each token is its best alternative
    chat = ChatFormat(tokenizer(tiny))
    prompt = chat.prompt(messages)
    out = generate(model, [prompt], 8, temperature=0.0, stop_ids=[chat.im_end, chat.eot])[0]
    ref = reference_logprobs(model, prompt + out)
    assert [c.logprob for c in content] == pytest.approx(
        [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out) if t not in (chat.im_end, chat.eot)], abs=1e-4)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    assert [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == pytest.approx([c.logprob for c in content], abs=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "1"}, "temperature"),  # strict: no text for a number
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "stream_options": 1}, "stream_options"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 scores a prompt only with echo
    ({"prompt": [[1, 2], "x", 3]}, "prompt[2]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
])
def test_bad_logprob_options_are_400s_naming_the_field(server, body, param):
    base, _, _ = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{base}{path}", json={"model": "tiny", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_metrics_parse_as_prometheus_and_count_what_was_served(server):
    """/metrics in Prometheus text format (parsed with prometheus-client's own parser): vLLM's names under kiln's
    prefix, counting the requests, tokens and latencies of what this test sends."""
    from prometheus_client.parser import text_string_to_metric_families

    base, client, _ = server

    def scrape() -> dict:
        text = httpx.get(f"{base}/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    done = client.completions.create(model="tiny", prompt="the king", max_tokens=5, temperature=0)
    httpx.get(f"{base}/nowhere/{'x' * 50}")  # an unknown path is counted as "other", not as a label of its own
    after = scrape()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kiln:generation_tokens_total") == done.usage.completion_tokens
    assert grew("kiln:request_success_total", finished_reason=done.choices[0].finish_reason) == 1
    assert grew("kiln:time_to_first_token_seconds_count") == 1
    assert grew("kiln:inter_token_latency_seconds_count") == done.usage.completion_tokens - 1
    assert grew("kiln:http_requests_total", path="/v1/completions", status="200") == 1
    assert grew("kiln:http_requests_total", path="other", status="404") == 1
    assert grew("kiln:prompt_tokens_total") == done.usage.prompt_tokens  # a fresh prompt: computed whole
    assert after[("kiln:num_requests_running", ())] == 0 and 0 <= after[("kiln:kv_cache_usage_perc", ())] <= 1
    assert not any("nowhere" in str(key) for key in after)


def test_openapi_lists_both_routes_with_their_fields(server):
    """/openapi.json (FastAPI's, from the request models): both routes, each with the fields the server reads and
    their bounds, no others allowed (additionalProperties: false, as the server refuses unknown fields), and the
    OpenAI fields kiln does not implement with the only values it accepts; /docs only with --docs."""
    base, _, _ = server
    spec = httpx.get(f"{base}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert {"prompt", "echo", "logprobs", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
            "stream", "user"} <= set(completion)
    assert {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools"} <= set(chat)
    assert completion["temperature"]["maximum"] == 2.0 and completion["n"]["maximum"] == 128
    assert {"logit_bias", "presence_penalty", "frequency_penalty", "response_format", "structured_outputs",
            "repetition_penalty", "min_tokens", "stop_token_ids"} <= set(completion) & set(chat)
    assert "x-kiln-unsupported" not in str(completion["presence_penalty"]) and "maximum" in str(
        completion["presence_penalty"])
    assert completion["min_p"]["x-kiln-unsupported"] == [None, 0]
    assert {"JSONSchemaFormat", "JSONObjectFormat", "TextFormat", "StructuredOutputs"} <= set(schemas)
    assert chat["tools"]["x-kiln-unsupported"] == [None, []] and "tools" not in completion
    assert all(schemas[name]["additionalProperties"] is False for name in
               ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextPart", "StreamOptions",
                "JSONSchemaFormat", "JSONSchema", "StructuredOutputs"))
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant"]
    assert httpx.get(f"{base}/docs").status_code == 404


@pytest.mark.parametrize(("path", "extra", "param", "words"), [
    ("/v1/completions", {"max_token": 5}, "max_token", "Unrecognized request argument supplied: max_token"),
    ("/v1/chat/completions", {"frobnicate": {"a": 1}}, "frobnicate", "Unrecognized request argument"),
    ("/v1/completions", {"messages": []}, "messages", "Unrecognized request argument"),  # the other route's
    ("/v1/chat/completions", {"echo": True}, "echo", "not supported by kiln serve"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra",
     "Unrecognized"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "nme": "a"}]}, "messages[0].nme",
     "Unrecognized"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0].name",
     "not supported by kiln serve"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty", "valid number"),
    ("/v1/completions", {"logit_bias": {"50": 101}}, 'logit_bias["50"]', "less than or equal to 100"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias", '"x" is not a token id'),
    ("/v1/chat/completions", {"logit_bias": {"99999": -100}}, "logit_bias", "0 to 299"),
    ("/v1/completions", {"stop_token_ids": [300]}, "stop_token_ids", "is not a token id"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens", "more than max_tokens=1"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "not supported by kiln serve"),
    ("/v1/completions", {"best_of": 3}, "best_of", "not supported by kiln serve"),
    ("/v1/completions", {"presence_penalty": False}, "presence_penalty", "valid number"),  # false is not 0
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "not supported by kiln serve"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "not supported by kiln serve"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "does not match"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "frobnicate"}}}}, "response_format.json_schema.schema", "frobnicate"),
    ("/v1/completions", {"structured_outputs": {"regex": "([a-"}}, "structured_outputs.regex", "regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ("/v1/chat/completions", {"structured_outputs": {"json_object": True}, "response_format": {
        "type": "json_object"}}, "structured_outputs", "not both"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"], "whitespace_pattern": " +"}},
     "structured_outputs.whitespace_pattern", "not supported by kiln serve"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json", "Unrecognized"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity", "not supported by kiln serve"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier", "not supported by kiln serve"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported by kiln serve"),
    ("/v1/chat/completions", {"chat_template": "{{x}}"}, "chat_template", "not supported by kiln serve"),
    ("/v1/chat/completions", {"min_p": 0.1}, "min_p", "not supported by kiln serve"),
])
def test_unknown_and_unsupported_fields_are_400s_naming_them(server, path, extra, param, words):
    """A misspelt or unknown field is refused as OpenAI's API refuses it, a field OpenAI or vLLM define that kiln
    does not implement is refused when it asks for anything: never answered as if it had been honoured."""
    base, _, _ = server
    body = {"model": "tiny", "max_tokens": 1} | ({"prompt": "x"} if path == "/v1/completions" else
                                                 {"messages": [{"role": "user", "content": "x"}]}) | extra
    response = httpx.post(f"{base}{path}", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error
    assert httpx.get(f"{base}/health").status_code == 200


def test_the_values_clients_send_as_defaults_are_accepted(server):
    """What asks for nothing passes: the openai client's own arguments at their defaults, null, an empty
    logit_bias or tool list, the assistant message the client hands back with its empty fields."""
    base, client, _ = server
    done = client.completions.create(model="tiny", prompt="the", max_tokens=2, presence_penalty=0,
                                     frequency_penalty=0.0, logit_bias={}, user="u-1", best_of=1, suffix=None)
    assert done.choices[0].finish_reason in ("length", "stop")
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           tools=[], tool_choice="none", parallel_tool_calls=False, store=False,
                                           response_format={"type": "text"}, extra_body={"top_k": 5, "min_p": 0})
    history = [{"role": "user", "content": "hi"}, reply.choices[0].message.model_dump(), {"role": "user",
                                                                                          "content": "and?"}]
    again = client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    assert again.choices[0].message.role == "assistant"
    response = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                           "presence_penalty": None, "seed": None, "n": 1,
                                                           "prompt_cache_key": "k", "safety_identifier": "s",
                                                           "metadata": {}, "service_tier": "auto"})
    assert response.status_code == 200, response.text


def test_generate_and_chat_refuse_a_temperature_past_two_in_one_line(tiny, tmp_path):
    """1e308 overflowed the sampler's float32 (numpy warnings, then uniform noise): refused, with the range."""
    from conftest import fails_in_one_line

    config = ModelConfig(vocab_size=load_tokenizer(tiny.tokenizer).get_vocab_size(), n_layer=1, n_head=2,
                         n_kv_head=2, d_model=16, max_seq_len=32)
    save_model(GPT(config), config, tmp_path / "m", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    for command in (["generate", "--prompt", "x"], ["chat"]):
        fails_in_one_line([*command, "--model", str(tmp_path / "m"), "--tokenizer", str(tiny.tokenizer), "--device",
                           "cpu", "--temperature", "1e308"], 2, "--temperature=1e+308", "0 (greedy) to 2.0")


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path):
    """The address is taken before the model loads: a port another program listens on is one line, at once."""
    import socket

    from conftest import fails_in_one_line

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fails_in_one_line(["serve", "--port", str(port), "--model", str(tmp_path / "none"), "--device", "cpu"], 2,
                          f"--port={port}", "Address already in use")
