"""GRPO's prompt/answer rows: GSM8K from ../shared/data, hand-written files, and the built-in task's generative form.

Expected values are computed here from the raw files with json/gzip, not through the code under test.
"""

import json
import re

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.chat_data import PROMPT_FORMATS, PromptAnswer, detect_format, load_prompts
from kiln.pipeline.tasks.chat_format import ROLES, ChatFormat
from kiln.pipeline.tasks.corpus_task import is_speaker, prompt_items, task_items
from kiln.pipeline.tasks.rewards import make_reward, score
from kiln.pipeline.text.bpe import load_tokenizer

from conftest import assistant, raw_rows, summary, user, write_jsonl


@pytest.mark.parametrize(("split", "n"), [("test", 1319), ("train", 7473)])
def test_every_gsm8k_row_loads_and_its_answer_scores_itself(shared_data, capsys, split, n):
    path = shared_data / f"sft/gsm8k/{split}.jsonl.gz"
    raw = raw_rows(path)
    assert len(raw) == n
    rows = load_prompts(str(path), "auto")
    assert f"grpo.data: {n:,} rows read, {n:,} used, 0 skipped" in summary(capsys)
    assert rows == [PromptAnswer([user(r["question"])], r["answer"]) for r in raw]
    # The answer is kept whole, reasoning and all, ending with GSM8K's "#### <number>".
    assert all(re.search(r"\n#### -?[\d,]+(\.\d+)?$", row.answer) for row in rows)
    rewards = score(make_reward("numeric"), [(r.prompt[-1]["content"], r.answer, r.answer) for r in rows],
                    f"gsm8k {split}")
    assert rewards == [1.0] * n
    # The number alone scores too, and any other number does not.
    final = [r.answer.rsplit("#### ", 1)[1] for r in rows[:50]]
    assert score(make_reward("numeric"), [("", f, r.answer) for f, r in zip(final, rows)], "x") == [1.0] * 50
    assert score(make_reward("numeric"), [("", f"#### {f.replace(',', '')}1", r.answer)
                                          for f, r in zip(final, rows)], "x") == [0.0] * 50


def test_gsm8k_max_rows_and_the_wrong_explicit_format(shared_data):
    spec = str(shared_data / "sft/gsm8k/test.jsonl.gz")
    assert len(load_prompts(spec, "gsm8k", max_rows=7)) == 7
    with pytest.raises(UserError, match=r"grpo\.data=.*no usable row among 1,319 \(missing field: 1,319\)"):
        load_prompts(spec, "prompt_answer")


SYSTEM = {"role": "system", "content": "Answer with a number."}


def test_prompt_answer_rows_with_string_and_message_prompts(tmp_path, capsys):
    spec = write_jsonl(tmp_path / "grpo.jsonl", [
        {"prompt": "What is 2 + 2?", "answer": "4", "id": 1},
        {"prompt": [SYSTEM, user("What is 3 + 3?")], "answer": "6"},
        {"prompt": [user("Hi"), assistant("Hello."), {"role": "user", "content": "7 * 6?", "name": "x"}],
         "answer": "42"},
        {"prompt": "Capital of France?", "answer": ""},               # empty answer
        {"answer": "5"},                                                # missing prompt
        {"prompt": [user("Q"), assistant("A")], "answer": "A"},       # the prompt ends with the answer
        {"prompt": "How many?", "answer": 3},                         # answer not a string
        {"prompt": "  ", "answer": "1"},                                # blank prompt
        {"prompt": [], "answer": "1"},                                  # no message at all
        {"prompt": [{"role": "robot", "content": "Q"}], "answer": "1"},  # not a chat role
        {"prompt": "Q", "answer": None},                                # null answer
    ])
    want = [PromptAnswer([user("What is 2 + 2?")], "4"), PromptAnswer([SYSTEM, user("What is 3 + 3?")], "6"),
            PromptAnswer([user("Hi"), assistant("Hello."), user("7 * 6?")], "42")]
    assert load_prompts(spec, "auto") == want
    assert ("grpo.data: 11 rows read, 3 used, 8 skipped (missing field: 2, bad messages: 2, empty prompt: 2, "
            "empty answer: 1, prompt not ending with a user turn: 1)") in summary(capsys)
    assert load_prompts(spec, "prompt_answer", max_rows=2, key="eval.data") == want[:2]
    assert "eval.data: 2 rows read, 2 used, 0 skipped" in summary(capsys)


def test_a_file_of_only_broken_rows_is_an_error(tmp_path):
    spec = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "answer": " "}, {"prompt": [assistant("A")],
                                                                                   "answer": "A"}])
    with pytest.raises(UserError, match=r"grpo\.data=.*no usable row among 2 \(empty answer: 1, prompt not "
                                        r"ending with a user turn: 1\)"):
        load_prompts(spec, "auto")


def test_a_line_that_is_not_json_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    good = "".join(json.dumps({"prompt": f"Q{i}", "answer": f"A{i}"}) + "\n" for i in range(4))
    path.write_text(good + '{"prompt": "Q", "answer": \n' + good, encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_prompts(str(path), "auto")
    assert str(e.value).startswith(str(path)) and "broken.jsonl:5: not JSON" in str(e.value)
    assert "\n" not in str(e.value)
    path.write_text("this is not json\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"broken\.jsonl:1: not JSON"):
        load_prompts(str(path), "auto")


# Rows of prompt/answer-like columns whose every field may be a wrong type, blank, a lone surrogate (as a file
# can spell "\\ud800") or a message list of any roles; and rows of other columns, newlines in their names.
TEXT = st.text(max_size=6) | st.sampled_from(["\ud800", "x\udfff", " ", "\n"])
OTHER = st.none() | st.booleans() | st.integers() | st.floats()
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES) | TEXT | OTHER, "content": TEXT | OTHER})
FIELD = TEXT | OTHER | st.lists(MESSAGE, max_size=3)
ROW = (st.fixed_dictionaries({}, optional={"prompt": FIELD, "question": FIELD, "answer": FIELD})
       | st.dictionaries(st.text(max_size=3), FIELD, max_size=2))


@pytest.fixture(scope="module")
def chat(tiny):
    return ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@given(rows=st.lists(ROW, max_size=4))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_json_rows_load_as_prompts_or_are_refused(tmp_path, chat, suffix, rows):
    """Either rows GRPO can sample from (a prompt that renders and ends with a user turn, a non-blank answer
    string), or a one-line UserError."""
    path = tmp_path / f"data{suffix}"
    path.write_text(json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    try:
        loaded = load_prompts(str(path), "auto")
    except UserError as e:
        assert "\n" not in str(e)
        return
    for row in loaded:
        assert row.prompt and row.prompt[-1]["role"] == "user" and row.prompt[-1]["content"].strip()
        assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in row.prompt)
        assert isinstance(row.answer, str) and row.answer.strip()
        assert chat.render(row.prompt).ids and chat.encode(row.answer)


@pytest.mark.parametrize(("row", "fmt"), [
    ({"question": "q", "answer": "a\n#### 1"}, "gsm8k"),
    ({"prompt": "p", "answer": "a"}, "prompt_answer"),
    ({"prompt": [user("p")], "answer": "a", "question": "q"}, "prompt_answer"),
])
def test_detect_prompt_format(row, fmt):
    assert fmt in PROMPT_FORMATS and detect_format(row, "prompt", "k") == fmt


def test_unknown_columns_and_formats_are_reported(tmp_path):
    spec = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q", "response": "A"}])
    with pytest.raises(UserError, match=r"grpo\.data=.*cannot tell the format from the first row's columns "
                                        r"prompt, response \(expected prompt_answer: prompt, answer; "
                                        r"gsm8k: question, answer\)"):
        load_prompts(spec, "auto")
    spec = write_jsonl(tmp_path / "odd.jsonl", [{"q\nuestion": "Q", "answer": "A"}])
    with pytest.raises(UserError, match=r"columns 'q\\nuestion', answer \(expected"):
        load_prompts(spec, "auto")
    with pytest.raises(UserError, match=r"unknown format 'alpaca' \(expected auto, prompt_answer, gsm8k\)"):
        load_prompts(spec, "alpaca")
    # An SFT set in a prompt format has no answer column: every row is broken, and that is the error.
    with pytest.raises(UserError, match=r"no usable row among 1 \(missing field: 1\)"):
        load_prompts(spec, "prompt_answer")


@pytest.mark.slow  # the whole corpus, ~10 s on 2 cores: `make test-slow`
def test_builtin_generative_items_are_speaker_questions_held_out_from_val(shakespeare):
    chat = ChatFormat(load_tokenizer(shakespeare.tokenizer, ordinary=True))
    train, val = prompt_items(shakespeare.corpus, chat, 128, 40, 30, seed=5)
    assert len(train) == 40 and len(val) == 30
    assert all(isinstance(row, PromptAnswer) and row.prompt[-1]["role"] == "user" for row in train + val)
    text = {split: "\n".join(pq.read_table(shakespeare.corpus / f"{split}.parquet").column("text").to_pylist())
            for split in ("train", "val")}
    for rows, split, other in ((train, "train", "val"), (val, "val", "train")):
        for row in rows:
            question, passage = row.prompt[0]["content"].split("\n\n", 1)
            assert question == "Who speaks first in this passage?" and len(row.prompt) == 1
            # The answer is the name that opens the passage (indented as in the source), never a heading.
            assert passage.lstrip().startswith(row.answer + ".") and is_speaker(row.answer + ".")
            lines = sorted((line for line in passage.splitlines() if len(line.strip()) > 20), key=len)
            assert lines and all(line in text[split] for line in lines)
            assert lines[-1] not in text[other], f"a {split} passage is in the {other} split"
        assert len({row.prompt[0]["content"] for row in rows}) > len(rows) // 2
    # The same items as the multiple-choice task of the same seed and kind, answers and all.
    mc_train, mc_val = task_items(shakespeare.corpus, chat, 128, 40, 30, seed=5, kinds=("speaker",))
    assert [(list(i.prompt), i.answer) for i in mc_train + mc_val] == [(r.prompt, r.answer) for r in train + val]
    assert prompt_items(shakespeare.corpus, chat, 128, 40, 30, seed=5) == (train, val)  # deterministic
    assert prompt_items(shakespeare.corpus, chat, 128, 40, 30, seed=6)[1] != val

    exact = make_reward("exact")
    assert score(exact, [(r.prompt[0]["content"], r.answer, r.answer) for r in val], "val") == [1.0] * len(val)
    # A completion as a model may write it still scores; a speaker of another scene (the MC task's wrong
    # answers, none of whom speaks in this one) does not.
    assert score(exact, [("", f" {r.answer.title()}.\n", r.answer) for r in val], "val") == [1.0] * len(val)
    for item in mc_val:
        assert score(exact, [("", wrong, item.answer) for wrong in item.wrong], "val") == [0.0] * 3


def test_builtin_generative_items_of_other_kinds(shakespeare):
    chat = ChatFormat(load_tokenizer(shakespeare.tokenizer, ordinary=True))
    train, val = prompt_items(shakespeare.corpus, chat, 128, 12, 6, seed=1, kinds=("title", "speaker"))
    titles = set(pq.read_table(shakespeare.corpus / "train.parquet").column("source").to_pylist())
    questions = [r.prompt[0]["content"].split("\n\n", 1)[0] for r in train + val]
    assert set(questions) == {"Which play is this passage from?", "Who speaks first in this passage?"}
    assert any(r.answer in titles for r in train)
    with pytest.raises(UserError, match=r"unknown kind sonnet \(expected title, speaker, continue\)"):
        prompt_items(shakespeare.corpus, chat, 128, 4, 2, seed=1, kinds=("sonnet",))


@pytest.mark.parametrize("line, speaker", [
    ("HAMLET.", True), ("  FIRST CITIZEN.", True), ("ANTIPHOLUS OF SYRACUSE.", True), ("SECOND VARRO'S SERVANT.", True),
    ("ACT II.", False), ("SCENE I.", False), ("ACT FIFTH. SCENE I.", False), ("PROLOGUE.", False),
    ("EPILOGUE.", False), ("THE ARGUMENT.", False), ("Hamlet.", False), ("HAMLET", False),
    ("THESEUS.", True),  # a name that begins like a heading word is still a name
])
def test_headings_are_not_speakers(line, speaker):
    assert is_speaker(line) is speaker
