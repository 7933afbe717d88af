"""`kiln serve` as a client sees it: a real server process on 127.0.0.1 (a free port), driven by the `openai`
Python client: completions and chat against greedy `generate`, streaming, 16 concurrent clients, a client that
disconnects mid-stream, and every 4xx case."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tiny, root: Path, *args: str, env: dict | None = None, log=subprocess.PIPE):
    """`kiln serve` in a process of its own on a free port, with a random model of a 512-token context (long
    enough that a stream is still running when its client leaves) served as "tiny": (base URL, process)."""
    torch.manual_seed(0)
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, d_model=128, max_seq_len=512)
    save_model(GPT(config), config, root / "tiny", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kiln.pipeline.cli", "serve", "--model", str(root / "tiny"),
                                "--tokenizer", str(tiny.tokenizer), "--port", str(port), "--device", "cpu",
                                "--kv-blocks", "256", "--block-size", "8", *args],
                               stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stdout.read() if process.stdout else "the server exited"
            time.sleep(0.1)
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


def test_echo_scores_a_prompt_as_lm_eval_reads_it(tiny, server):
    """lm-eval's `local-completions` sends context + continuation as token ids with echo, logprobs 1 and
    max_tokens 1, and sums token_logprobs[len(context):-1]: the continuation's log-likelihood. max_tokens 0 (with
    echo) scores only. The first prompt token has no value (null, as OpenAI's); every other is the model's."""
    _, client, model = server
    tok = tokenizer(tiny)
    eot = tok.token_to_id(EOT)
    context, continuation = tok.encode("the king of").ids, tok.encode(" the queen").ids
    ids = context + continuation
    ref = reference_logprobs(model, [eot, *ids])
    want = [ref[j, ids[j]].item() for j in range(len(ids))]  # ids[j] sits at position j + 1, after eot
    scored = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == tok.decode(ids) and scored.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert "".join(lp.tokens) == tok.decode(ids) and lp.text_offset[0] == 0
    one = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = one.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert sum(lp.token_logprobs[len(context):-1]) == pytest.approx(sum(want[len(context):]), abs=1e-4)
    # the generated token is greedy here: its value is the best of its alternatives (lm-eval's is_greedy)
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)


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
    their bounds; unknown fields in a request are ignored, as OpenAI's API does; /docs only with --docs."""
    base, _, _ = server
    spec = httpx.get(f"{base}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert {"prompt", "echo", "logprobs", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
            "stream"} <= set(completion)
    assert {"messages", "logprobs", "top_logprobs", "max_completion_tokens"} <= set(chat)
    assert completion["temperature"]["maximum"] == 2.0 and completion["n"]["maximum"] == 128
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant"]
    assert httpx.get(f"{base}/docs").status_code == 404
    response = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                           "user": "u", "frobnicate": {"a": 1}})
    assert response.status_code == 200, response.text
