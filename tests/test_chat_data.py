"""SFT and preference adapters on the real samples in ../shared/data and on small hand-written files.

Expected values are computed here from the raw files with json/gzip, not through the code under test.
"""

import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.chat_data import Pair, detect_format, load_conversations, load_pairs, read_rows
from kiln.pipeline.tasks.chat_format import ROLES, ChatFormat
from kiln.pipeline.text.bpe import load_tokenizer

from conftest import assistant, raw_rows, summary, user, write_jsonl


def joined(first, more):
    return first + "\n\n" + more if more else first


SFT_SAMPLES = {
    "sft/torchtune/alpaca_tiny.json": ("alpaca", lambda r: [user(joined(r["instruction"], r["input"])),
                                                           assistant(r["output"])]),
    "sft/litgpt/alpaca.json": ("alpaca", lambda r: [user(joined(r["instruction"], r["input"])),
                                                    assistant(r["output"])]),
    "sft/litgpt/dolly.json": ("dolly", lambda r: [user(joined(r["instruction"], r["context"])),
                                                  assistant(r["response"])]),
    "sft/cs336-a5/sft_sample.jsonl": ("prompt_response", lambda r: [user(r["prompt"]), assistant(r["response"])]),
    "sft/llm-foundry/dolly_hhrlhf_train_small.jsonl": ("prompt_response",
                                                       lambda r: [user(r["prompt"]), assistant(r["response"])]),
}


@pytest.mark.parametrize("name", SFT_SAMPLES)
def test_sft_samples_load_with_auto_detection(shared_data, capsys, name):
    fmt, expected = SFT_SAMPLES[name]
    raw = raw_rows(shared_data / name)
    assert detect_format(raw[0], "sft", "sft.data") == fmt
    want = [expected(r) for r in raw if expected(r)[-1]["content"].strip()]
    conversations = load_conversations(str(shared_data / name), "auto")
    assert conversations == want
    assert f"{len(raw):,} rows read, {len(want):,} used" in summary(capsys)


def test_alpaca_input_follows_the_instruction_after_a_blank_line(shared_data):
    raw = raw_rows(shared_data / "sft/torchtune/alpaca_tiny.json")
    i = next(i for i, r in enumerate(raw) if r["input"])
    conversation = load_conversations(str(shared_data / "sft/torchtune/alpaca_tiny.json"), "alpaca")[i]
    assert conversation[0]["content"] == raw[i]["instruction"] + "\n\n" + raw[i]["input"]
    assert conversation[1]["content"] == raw[i]["output"]


def test_the_wrong_explicit_format_uses_no_row(shared_data):
    with pytest.raises(UserError, match=r"no usable row among 100 \(missing field: 100\)"):
        load_conversations(str(shared_data / "sft/torchtune/alpaca_tiny.json"), "dolly")


def render(messages):
    return "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages)


def squeeze(text):
    return "".join(text.split())


def test_hh_transcripts_split_into_prompt_and_answers(shared_data, capsys):
    path = shared_data / "preference/hh-rlhf/harmless-base/test.jsonl.gz"
    raw = raw_rows(path)
    assert len(raw) == 2312
    # A few chosen transcripts end in an empty "Assistant:" turn; nothing else in this file is malformed.
    usable = [r for r in raw if all(r[k].rsplit("\n\nAssistant:", 1)[1].strip() for k in ("chosen", "rejected"))]
    assert 0 < len(raw) - len(usable) < 10

    pairs = load_pairs(str(path), "auto")
    assert len(pairs) == len(usable)
    assert (f"2,312 rows read, {len(usable):,} used, {len(raw) - len(usable)} skipped "
            f"(empty answer: {len(raw) - len(usable)})") in summary(capsys)
    for pair, r in zip(pairs, usable):
        assert pair.prompt and pair.prompt[-1]["role"] == "user"
        assert pair.chosen != pair.rejected
        assert pair.chosen[0]["role"] == pair.rejected[0]["role"] == "assistant"
        assert squeeze(render(pair.prompt + pair.chosen)) == squeeze(r["chosen"])
        assert squeeze(render(pair.prompt + pair.rejected)) == squeeze(r["rejected"])
    # The first pair, turn by turn.
    turns = re.split(r"\n\n(?:Human|Assistant): ", raw[0]["chosen"])[1:]
    assert [m["content"] for m in pairs[0].prompt] == [t.strip() for t in turns[:-1]]
    assert pairs[0].chosen == [assistant(turns[-1].strip())]


def test_stack_exchange_pairs(shared_data):
    path = shared_data / "preference/torchtune/stack_exchange_paired_tiny.json"
    raw = raw_rows(path)
    assert detect_format(raw[0], "preference", "dpo.data") == "stack_exchange"
    assert load_pairs(str(path), "auto") == [
        Pair([user(r["question"])], [assistant(r["response_j"])], [assistant(r["response_k"])]) for r in raw]


def test_message_list_pairs_without_prompt_split_the_shared_prefix(shared_data):
    path = shared_data / "preference/torchtune/hh_rlhf_tiny.json"
    [raw] = raw_rows(path)
    assert detect_format(raw, "preference", "dpo.data") == "pairs"
    assert load_pairs(str(path), "auto") == [Pair([user(raw["chosen"][0]["content"])],
                                                  [assistant(raw["chosen"][1]["content"])],
                                                  [assistant(raw["rejected"][1]["content"])])]


def test_bad_message_rows_are_counted_and_skipped(tmp_path, capsys):
    good = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "x"},
            {"role": "assistant", "content": "Hello."}]
    spec = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": good},
        {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "boop"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]},
        {"id": 4},
        {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]},
        {"messages": good[1:]},
    ])
    assert load_conversations(spec, "auto") == [[good[0], user("Hi"), good[2]], [user("Hi"), good[2]]]
    assert ("6 rows read, 2 used, 4 skipped (empty answer: 2, bad messages: 1, missing field: 1)"
            in summary(capsys))
    assert load_conversations(spec, "messages", max_rows=1) == [[good[0], user("Hi"), good[2]]]


def test_a_file_of_only_bad_rows_is_an_error(tmp_path):
    spec = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "response": ""}, {"prompt": "Q", "response": None}])
    with pytest.raises(UserError, match=r"sft\.data=.*no usable row among 2 \(empty answer: 1, missing field: 1\)"):
        load_conversations(spec, "auto")


def test_string_pairs_with_a_prompt(tmp_path, capsys):
    spec = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Q1", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q2", "chosen": "same", "rejected": "same"},
        {"prompt": "Q3", "chosen": "good"},
        {"prompt": "Q4", "chosen": " ", "rejected": "bad"},
        # Transcript-looking answers beside a prompt column are plain strings, not HH.
        {"prompt": "Q5", "chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "c"},
    ])
    assert load_pairs(spec, "auto") == [
        Pair([user("Q1")], [assistant("good")], [assistant("bad")]),
        Pair([user("Q5")], [assistant("\n\nHuman: a\n\nAssistant: b")], [assistant("c")]),
    ]
    assert "5 rows read, 2 used, 3 skipped" in summary(capsys)


def test_message_pairs_with_a_prompt_drop_a_repeated_prompt(tmp_path):
    prompt = [{"role": "system", "content": "S"}, user("Q")]
    spec = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": prompt, "chosen": prompt + [assistant("good")], "rejected": [assistant("bad")]},
        {"prompt": prompt, "chosen": [assistant("same")], "rejected": prompt + [assistant("same")]},
    ])
    assert load_pairs(spec, "pairs") == [Pair(prompt, [assistant("good")], [assistant("bad")])]


def test_hh_transcripts_written_by_hand(tmp_path, capsys):
    spec = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "Human: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant:  a good one ",
         "rejected": "Human: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: no"},
        {"chosen": "preamble\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"},
        {"chosen": "\n\nHuman: hi\n\nAssistant: same", "rejected": "\n\nHuman: hi\n\nAssistant: same "},
        {"chosen": "\n\nHuman: hi\n\nAssistant: more", "rejected": "\n\nHuman: hi\n\nAssistant: more\n\nAssistant: x"},
    ])
    assert load_pairs(spec, "auto") == [
        Pair([user("hi"), assistant("hello"), user("joke?")], [assistant("a good one")], [assistant("no")])]
    assert ("4 rows read, 1 used, 3 skipped (bad messages: 1, chosen == rejected: 1, empty answer: 1)"
            in summary(capsys))


@pytest.mark.parametrize(("row", "kind", "fmt"), [
    ({"messages": [], "prompt": "x"}, "sft", "messages"),
    ({"instruction": "i", "input": "", "output": "o"}, "sft", "alpaca"),
    ({"instruction": "i", "context": "", "response": "r"}, "sft", "dolly"),
    ({"prompt": "p", "response": "r"}, "sft", "prompt_response"),
    ({"question": "q", "response_j": "j", "response_k": "k"}, "preference", "stack_exchange"),
    ({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}, "preference", "hh"),
    ({"chosen": "Human: a\n\nAssistant: b", "rejected": "Human: a\n\nAssistant: c"}, "preference", "hh"),
    ({"prompt": "\n\nHuman: a", "chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "x"}, "preference", "pairs"),
    ({"chosen": "b", "rejected": "c"}, "preference", "pairs"),
    ({"chosen": [assistant("b")], "rejected": [assistant("c")]}, "preference", "pairs"),
])
def test_detect_format(row, kind, fmt):
    assert detect_format(row, kind, "k") == fmt


def test_unknown_columns_are_reported(tmp_path):
    spec = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"sft\.data.*columns question, answer .*alpaca: instruction, output"):
        load_conversations(spec, "auto")
    with pytest.raises(UserError, match=r"dpo\.data.*columns question, answer .*stack_exchange"):
        load_pairs(spec, "auto")


@pytest.mark.parametrize(("name", "message"), [
    ("x.csv", "sft.data='.*x.csv': unsupported file type"),
    ("data.jsonl.zip", "unsupported file type"),
    ("missing.jsonl", "sft.data='.*missing.jsonl': no such file"),
    ("missing.json.gz", "no such file"),
])
def test_bad_specs(tmp_path, name, message):
    with pytest.raises(UserError, match=message):
        load_conversations(str(tmp_path / name), "auto")


def test_bad_files_and_formats(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="no rows"):
        load_conversations(str(tmp_path / "empty.jsonl"), "auto")
    spec = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(UserError, match="unknown format 'sharegpt'"):
        load_conversations(spec, "sharegpt")
    with pytest.raises(UserError, match="unknown format 'alpaca'"):
        load_pairs(spec, "alpaca")
    with pytest.raises(UserError, match="expected hf:<dataset>"):
        read_rows("hf:", "train", "sft.data")


def test_gzipped_json_list(tmp_path):
    rows = [{"instruction": f"i{n}", "input": "", "output": f"o{n}"} for n in range(5)]
    path = tmp_path / "list.json.gz"
    path.write_bytes(gzip.compress(json.dumps(rows).encode()))
    assert list(read_rows(str(path), "train", "sft.data")) == rows


def test_max_rows_caps_the_result(shared_data):
    path = shared_data / "sft/llm-foundry/dolly_hhrlhf_train_small.jsonl"
    raw = raw_rows(path)[:7]
    assert load_conversations(str(path), "auto", max_rows=7) == [
        [user(r["prompt"]), assistant(r["response"])] for r in raw]
    assert len(load_pairs(str(shared_data / "preference/hh-rlhf/harmless-base/test.jsonl.gz"), "hh",
                          max_rows=3)) == 3


def parquet_bytes(rows):
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


# Rows both readers take: prompt_response for SFT, pairs for DPO.
GOOD = [{"prompt": f"Q{i}", "response": f"A{i}", "chosen": "good", "rejected": "bad"} for i in range(20)]
GOOD_LINES = "".join(json.dumps(row) + "\n" for row in GOOD)


@pytest.mark.parametrize(("name", "content", "where"), [
    # One broken line among good ones refuses the file, naming the line: a damaged file, not a broken row.
    ("broken.jsonl", GOOD_LINES + '{"prompt": "p", "response": \n' + GOOD_LINES, "broken.jsonl:21: not JSON"),
    ("cut.jsonl", GOOD_LINES + '{"prompt": "p", "resp', "cut.jsonl:21: not JSON"),
    ("list.jsonl", GOOD_LINES + '["p", "r"]\n', "list.jsonl:21: expected a JSON object"),
    ("latin1.jsonl", GOOD_LINES.encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"), "latin1.jsonl:21: not UTF-8"),
    ("array.json", json.dumps(GOOD, indent=1)[:-3] + ",\n}]", "array.json: not JSON"),
    ("cut.jsonl.gz", gzip.compress(GOOD_LINES.encode())[:-30], "cut.jsonl.gz: cannot read it"),
    ("cut.parquet", parquet_bytes(GOOD)[:-100], "cut.parquet: not a readable Parquet file"),
])
def test_damaged_files_are_refused_naming_the_file_and_line(tmp_path, name, content, where):
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    for load in (load_conversations, load_pairs):
        with pytest.raises(UserError) as e:
            load(str(path), "auto")
        assert str(e.value).startswith(f"{path}") and where in str(e.value) and "\n" not in str(e.value)
    if name == "array.json":  # the line and column of the syntax error, counted in the file
        assert re.search(rf"line {len(json.dumps(GOOD, indent=1).splitlines())}\b.*column 1\b", str(e.value))


def test_fields_of_the_wrong_type_are_skipped_and_counted(tmp_path, capsys):
    """Every field checked by type; a wrong one is a broken row, counted as the other broken rows are."""
    spec = write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": [user("Q"), assistant("A")]},
        {"messages": "Q? A."},
        {"messages": [user("Q"), ["assistant", "A"]]},
        {"messages": [user("Q"), {"role": "assistant", "content": 42}]},
        {"messages": [user("Q"), {"role": ["assistant"], "content": "A"}]},
        {"messages": [user("Q"), {"role": {"assistant": 1}, "content": "A"}]},
        {"messages": [user("Q"), assistant("bad \ud800 surrogate")]},
        {"messages": {"role": "assistant", "content": "A"}},
    ])
    assert load_conversations(spec, "auto") == [[user("Q"), assistant("A")]]
    assert "8 rows read, 1 used, 7 skipped (bad messages: 7)" in summary(capsys)
    spec = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "I", "input": "", "output": "O"},
        {"instruction": ["I"], "output": "O"},
        {"instruction": "I", "input": {"x": 1}, "output": "O"},
        {"instruction": "I", "output": 3.5},
        {"instruction": "I\udfff", "output": "O"},
    ])
    assert load_conversations(spec, "auto") == [[user("I"), assistant("O")]]
    assert "5 rows read, 1 used, 4 skipped (bad messages: 4)" in summary(capsys)
    spec = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Q", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q", "chosen": 1, "rejected": "bad"},
        {"prompt": 7, "chosen": "good", "rejected": "bad"},
        {"prompt": {"role": "user", "content": "Q"}, "chosen": "good", "rejected": "bad"},
        {"prompt": "Q", "chosen": ["good"], "rejected": "bad"},
        {"prompt": "Q", "chosen": "good", "rejected": [{"role": "assistant", "content": None}]},
        {"prompt": "Q", "chosen": "good \ud83d", "rejected": "bad"},
    ])
    assert load_pairs(spec, "auto") == [Pair([user("Q")], [assistant("good")], [assistant("bad")])]
    assert "7 rows read, 1 used, 6 skipped (bad messages: 6)" in summary(capsys)
    spec = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"},
        {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": ["\n\nHuman: a\n\nAssistant: c"]},
        {"chosen": "\n\nHuman: a\ud800\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"},
    ])
    assert load_pairs(spec, "hh") == [Pair([user("a")], [assistant("b")], [assistant("c")])]
    assert "3 rows read, 1 used, 2 skipped (bad messages: 2)" in summary(capsys)


# Rows with the columns of each format (and others), every field a string, a message list or any other JSON
# value: lone surrogates included, as a file can spell them ("\\ud800"), so that the readers meet a wrong type or
# an unencodable string in every field of rows that are otherwise well formed.
COLUMNS = ["messages", "instruction", "input", "output", "context", "response", "prompt", "question", "response_j",
           "response_k", "chosen", "rejected"]
FORMATS = [("messages",), ("instruction", "output"), ("instruction", "response"), ("prompt", "response"),
           ("question", "response_j", "response_k"), ("chosen", "rejected"), ("prompt", "chosen", "rejected")]
TEXT = st.text(max_size=6) | st.sampled_from(["\ud800", "x\udfff", "\n\nHuman: a\n\nAssistant: b", "Human: a"])
OTHER = st.none() | st.booleans() | st.integers() | st.floats()
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES) | TEXT | OTHER, "content": TEXT | OTHER})
ANY = st.recursive(TEXT | OTHER | MESSAGE, lambda inner: st.lists(inner, max_size=2)
                   | st.dictionaries(st.sampled_from(COLUMNS) | st.text(max_size=3), inner, max_size=2), max_leaves=4)
FIELD = TEXT | st.lists(MESSAGE, max_size=3) | ANY
ROW = st.one_of(*(st.fixed_dictionaries(dict.fromkeys(columns, FIELD),
                                         optional=dict.fromkeys([c for c in COLUMNS if c not in columns], FIELD))
                  for columns in FORMATS), ANY)
ROWS = st.lists(ROW, max_size=4)


def loads_or_refuses(path, chat):
    """Either rows every later step can use (they render in the chat format), or a one-line UserError."""
    for load in (load_conversations, load_pairs):
        try:
            rows = load(str(path), "auto")
        except UserError as e:
            assert "\n" not in str(e)
            continue
        for row in rows:
            for messages in [row] if isinstance(row, list) else [row.prompt + row.chosen, row.prompt + row.rejected]:
                assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in messages)
                assert chat.render(messages).ids


@pytest.fixture(scope="module")
def chat(tiny):
    return ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@given(rows=ROWS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_json_rows_load_or_are_refused(tmp_path, chat, suffix, rows):
    path = tmp_path / f"data{suffix}"
    path.write_text(json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    loads_or_refuses(path, chat)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz", ".parquet"])
@given(data=st.binary(max_size=200) | st.sampled_from([b'{"prompt": "p", "response": "r"}\n[{}]\n', b"[{}, 1]",
                                                          b'\xef\xbb\xbf{"prompt": "p", "response": "r"}']))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_bytes_load_or_are_refused(tmp_path, chat, suffix, data):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(data)
    loads_or_refuses(path, chat)
