"""GRPO rewards on real GSM8K rows from ../shared/data and on hand-written completions.

Expected values are worked out here from the raw file (the text after `####`, read with json/gzip), not through
the code under test.
"""

import gzip
import json
import math
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.rewards import make_reward, normalize, score


@pytest.fixture(scope="module")
def gsm8k(shared_data):
    """GSM8K's test split, each row with its gold number parsed independently of the module under test."""
    with gzip.open(shared_data / "sft" / "gsm8k" / "test.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        row["gold"] = int(row["answer"].split("####")[1].strip().replace(",", ""))
    return rows


def one(spec, completion, answer, pattern=None, prompt="q"):
    return score(make_reward(spec, pattern), [(prompt, completion, answer)], "test")[0]


def error(spec, rows, pattern=None, what="rollouts"):
    with pytest.raises(UserError) as info:
        score(make_reward(spec, pattern), rows, what)
    message = str(info.value)
    assert "\n" not in message
    return message


# numeric


def test_numeric_reference_answers_score_themselves(gsm8k):
    rows = [(row["question"], row["answer"], row["answer"]) for row in gsm8k]
    assert score(make_reward("numeric"), rows, "gsm8k") == [1.0] * len(gsm8k)


def test_numeric_reference_answers_against_other_golds(gsm8k):
    # Each solution scored against the next row's gold: 1.0 exactly where the two gold numbers coincide.
    pairs = list(zip(gsm8k, gsm8k[1:]))
    rows = [(a["question"], a["answer"], b["answer"]) for a, b in pairs]
    expected = [float(a["gold"] == b["gold"]) for a, b in pairs]
    assert 0.0 in expected
    assert score(make_reward("numeric"), rows, "gsm8k") == expected


def test_numeric_final_sentence_against_real_golds(gsm8k):
    rows = [(row["question"], f"Let me work it out. The answer is {row['gold']}.", row["answer"]) for row in gsm8k]
    assert score(make_reward("numeric"), rows, "gsm8k") == [1.0] * len(gsm8k)
    wrong = [(row["question"], f"The answer is {row['gold'] + 1}.", row["answer"]) for row in gsm8k]
    assert score(make_reward("numeric"), wrong, "gsm8k") == [0.0] * len(gsm8k)


def test_numeric_thousands_and_currency_on_real_golds(gsm8k):
    big = [row for row in gsm8k if row["gold"] >= 1000]
    assert big, "GSM8K's test split has answers of 1000 and more"
    for row in big:
        for completion in (f"So she earns ${row['gold']:,} in total.", f"#### {row['gold']:,}", f"{row['gold']}.0"):
            assert one("numeric", completion, row["answer"]) == 1.0, completion


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is 72.", "#### 72", 1.0),
    ("The answer is 72.0", "#### 72", 1.0),
    ("It costs $72.", "#### 72", 1.0),
    ("72.00", "72", 1.0),
    ("The answer is 71.", "#### 72", 0.0),
    ("1,000", "#### 1000", 1.0),
    ("1000", "#### 1,000", 1.0),
    ("1,000,000 apples", "#### 1000000", 1.0),
    ("I do not know.", "#### 72", 0.0),
    ("", "#### 72", 0.0),
    ("First 5 then 7", "#### 7", 1.0),          # the last number counts...
    ("First 5 then 7", "#### 5", 0.0),
    ("#### 5\nand later 7", "#### 5", 1.0),     # ...unless there is a ####, whose number counts
    ("#### 5\nand later 7", "#### 7", 0.0),
    ("It is 72.\n#### seventy-two", "#### 72", 0.0),  # a non-numeric final answer, no fallback to an earlier one
    ("16-3-4=9", "#### 9", 1.0),               # a hyphen between digits is a minus sign of an operation
    ("The temperature is -5.", "#### -5", 1.0),
    ("The temperature is 5.", "#### -5", 0.0),
    ("0.1000000000000000001", "0.1", 0.0),     # exact decimal comparison: these two are one float
    ("9007199254740993", "#### 9007199254740992", 0.0),
    ("She lays 10-12 eggs.", "#### 12", 1.0),  # a hyphen after a digit is not a minus sign
    ("0.1", "#### .10", 1.0),
])
def test_numeric_cases(completion, answer, expected):
    assert one("numeric", completion, answer) == expected


def test_numeric_answer_without_a_number_is_an_error_naming_the_row():
    message = error("numeric", [("q", "72", "#### 72"), ("q", "72", "seventy-two")], what="gsm8k")
    assert message.startswith("gsm8k: grpo.reward='numeric': row 1: ")
    assert "'seventy-two' holds no number" in message


# exact and contains


@pytest.mark.parametrize("completion, answer, expected", [
    ("Paris", "paris", 1.0),
    ("  PARIS.  ", "Paris", 1.0),
    ('"Paris"', "Paris", 1.0),
    ("\u201cParis!\u201d", "Paris", 1.0),
    ("New   York\n", "new york", 1.0),
    ("Stra\u00dfe", "STRASSE", 1.0),
    ("cafe\u0301", "caf\u00e9", 1.0),          # decomposed and precomposed é
    ("new-york", "new york", 0.0),
    ("(a)", "a", 0.0),                          # brackets can be the answer itself
    ("-3", "3", 0.0),
    (".5", "5", 0.0),
    ("Paris, France", "Paris", 0.0),
])
def test_exact_cases(completion, answer, expected):
    assert one("exact", completion, answer) == expected


def test_normalize_spells_out_the_rules():
    assert normalize('  "The  Answer\tis (B)."\n') == "the answer is (b)"
    assert normalize("'\u00abOK?!\u00bb'") == "ok"


def test_exact_on_real_questions(gsm8k):
    rows = [(r["question"], f"  {r['question'].upper()}  ", r["question"]) for r in gsm8k[:200]]
    assert score(make_reward("exact"), rows, "gsm8k") == [1.0] * 200
    rows = [(a["question"], a["question"], b["question"]) for a, b in zip(gsm8k[:200], gsm8k[1:201])]
    assert score(make_reward("exact"), rows, "gsm8k") == [0.0] * 200


@given(st.text(), st.text())
def test_exact_is_symmetric(a, b):
    assert one("exact", a, b) == one("exact", b, a)


@given(st.text())
def test_normalize_is_idempotent(text):
    assert normalize(normalize(text)) == normalize(text)


@given(st.text(st.characters(codec="ascii")), st.sampled_from(["", " ", '"', "'", "\n"]), st.sampled_from(["", "."]))
def test_exact_ignores_case_and_surrounding_quotes(text, quote, stop):
    assert one("exact", f"{quote}{text.upper()}{stop}{quote}", text) == 1.0


@pytest.mark.parametrize("completion, answer, expected", [
    ("The capital of France is Paris.", "paris", 1.0),
    ("THE CAPITAL IS \u201cPARIS\u201d", '"Paris"', 1.0),
    ("It is Lyon.", "Paris", 0.0),
    ("the new   york times", "New York", 1.0),
])
def test_contains_cases(completion, answer, expected):
    assert one("contains", completion, answer) == expected


def test_contains_on_real_rows(gsm8k):
    rows = [(r["question"], r["answer"], r["answer"].split("####")[1]) for r in gsm8k]
    assert score(make_reward("contains"), rows, "gsm8k") == [1.0] * len(gsm8k)
    rows = [(r["question"], r["question"], r["answer"]) for r in gsm8k[:50]]
    assert score(make_reward("contains"), rows, "gsm8k") == [0.0] * 50


def test_contains_refuses_an_empty_answer():
    # An empty answer occurs in every completion; rewarding all of them would be a silent failure.
    message = error("contains", [("q", "anything", ' "." ')])
    assert "row 0" in message and "empty" in message


# regex


def test_regex_without_placeholder_on_real_rows(gsm8k):
    reward = make_reward("regex", r"####\s*-?[\d,]+\s*$")
    assert score(reward, [(r["question"], r["answer"], "") for r in gsm8k], "gsm8k") == [1.0] * len(gsm8k)
    assert score(reward, [(r["question"], r["question"], "") for r in gsm8k], "gsm8k") == [0.0] * len(gsm8k)


def test_regex_placeholder_on_real_rows(gsm8k):
    reward = make_reward("regex", r"####\s*{answer}$")
    golds = [r["answer"].split("####")[1].strip() for r in gsm8k]
    assert score(reward, [("q", r["answer"], g) for r, g in zip(gsm8k, golds)], "gsm8k") == [1.0] * len(gsm8k)
    assert score(reward, [("q", r["answer"], g + "0") for r, g in zip(gsm8k, golds)], "gsm8k") == [0.0] * len(gsm8k)


@pytest.mark.parametrize("completion, answer, expected", [
    ("answer: 3.5", "3.5", 1.0),
    ("answer: 3x5", "3.5", 0.0),      # unescaped, "." would match any character
    ("answer: (a)", "(a)", 1.0),
    ("answer: a", "(a)", 0.0),        # unescaped, "(a)" would be a group matching "a"
    ("answer: a+b", "a+b", 1.0),
    ("answer: aab", "a+b", 0.0),
])
def test_regex_placeholder_escapes_the_answer(completion, answer, expected):
    assert one("regex", completion, answer, pattern=r"^answer: {answer}$") == expected


def test_regex_without_placeholder_ignores_the_answer():
    assert one("regex", "x = 42", "unused", pattern=r"\d+") == 1.0
    assert one("regex", "x = y", "unused", pattern=r"\d+") == 0.0


@pytest.mark.parametrize("pattern", [None, ""])
def test_regex_needs_a_pattern(pattern):
    with pytest.raises(UserError, match=r"^params: grpo\.reward_pattern=.*grpo\.reward='regex'"):
        make_reward("regex", pattern)


@pytest.mark.parametrize("pattern", ["([a-z]", "{answer}(", "*x"])
def test_regex_invalid_pattern_names_the_key_and_the_error(pattern):
    with pytest.raises(UserError) as info:
        make_reward("regex", pattern)
    message = str(info.value)
    assert message.startswith(f"params: grpo.reward_pattern={pattern!r}: not a valid regular expression (")
    assert any(words in message for words in ("missing )", "unterminated", "nothing to repeat"))


def test_a_pattern_with_another_reward_is_refused():
    with pytest.raises(UserError, match=r"grpo\.reward_pattern='\\\\d\+': only used with grpo\.reward='regex'"):
        make_reward("numeric", r"\d+")


# module:function

USER_MODULE = '''
import math

def score(prompt, completion, answer):
    return 1 if answer in completion else 0

def flag(prompt, completion, answer):
    return completion == answer

def boom(prompt, completion, answer):
    if completion == "boom":
        raise ValueError("bad\\ninput")
    return 0.5

def nan(prompt, completion, answer):
    return math.nan

def inf(prompt, completion, answer):
    return -math.inf

def text(prompt, completion, answer):
    return "1.0"

def nothing(prompt, completion, answer):
    pass

def two(prompt, completion):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module in tmp_path with a name of its own (imported modules stay in sys.modules between tests)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return name, path


ROWS = [("p", "the answer is 42", "42"), ("p", "no idea", "42")]


def test_user_function_from_a_file_path(user_module):
    name, path = user_module
    for spec in (f"{path}:score", f"{name}.py:score", f"./{name}.py:score"):
        rewards = score(make_reward(spec), ROWS, "rollouts")
        assert rewards == [1.0, 0.0] and all(type(r) is float for r in rewards)


def test_user_function_from_sys_path(user_module, monkeypatch, tmp_path):
    name, _ = user_module
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score(make_reward(f"{name}:score"), ROWS, "rollouts") == [1.0, 0.0]


def test_user_function_from_a_package_module():
    # pkg.mod:fn, here the module's own exact reward reached by its dotted path.
    reward = make_reward("kiln.pipeline.tasks.rewards:exact_reward")
    assert score(reward, [("q", " Paris. ", "paris"), ("q", "Lyon", "paris")], "rollouts") == [1.0, 0.0]


def test_user_function_may_return_a_bool(user_module):
    name, _ = user_module
    assert score(make_reward(f"{name}.py:flag"), [("p", "a", "a"), ("p", "a", "b")], "rollouts") == [1.0, 0.0]


def test_user_function_that_raises_names_the_row(user_module):
    name, _ = user_module
    message = error(f"{name}.py:boom", [("p", "fine", "a"), ("p", "fine", "a"), ("p", "boom", "a")])
    assert message == f"rollouts: grpo.reward='{name}.py:boom': row 2 raised ValueError: bad input"


@pytest.mark.parametrize("fn, returned", [
    ("nan", "returned nan; expected a finite number"),
    ("inf", "returned -inf; expected a finite number"),
    ("text", "returned '1.0' (str); expected a finite number"),
    ("nothing", "returned None (NoneType); expected a finite number"),
])
def test_user_function_returning_a_non_number_is_an_error(user_module, fn, returned):
    name, _ = user_module
    assert error(f"{name}.py:{fn}", [("p", "c", "a")]) == f"rollouts: grpo.reward='{name}.py:{fn}': row 0 {returned}"


def test_scores_are_finite_floats(user_module):
    name, _ = user_module
    rewards = score(make_reward(f"{name}.py:boom"), [("p", "c", "a")] * 3, "rollouts")
    assert rewards == [0.5] * 3 and all(math.isfinite(r) for r in rewards)


@pytest.mark.parametrize("spec, expected", [
    ("f1", "expected one of exact, numeric, regex, contains, or module:function"),
    ("", "expected one of exact, numeric, regex, contains, or module:function"),
    ("Exact", "expected one of exact, numeric, regex, contains, or module:function"),
    ("no_such_module_kiln_test:fn", "cannot import 'no_such_module_kiln_test': ModuleNotFoundError"),
    ("missing_file.py:fn", "no such file 'missing_file.py'"),
    ("{name}.py:absent", "has no attribute 'absent'; expected a function (prompt, completion, answer) -> number"),
    ("{name}:absent", "has no attribute 'absent'; expected a function (prompt, completion, answer) -> number"),
    ("{name}.py:NOT_A_FUNCTION", "is a int, not callable; expected a function"),
    ("{name}.py:two", "cannot be called with three arguments; expected a function"),
    ("{name}.py:", "expected module:function"),
    (":score", "expected module:function"),
])
def test_bad_reward_specs_name_grpo_reward(user_module, monkeypatch, tmp_path, spec, expected):
    name, _ = user_module
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = spec.format(name=name)
    with pytest.raises(UserError) as info:
        make_reward(spec)
    message = str(info.value)
    assert message.startswith(f"params: grpo.reward={spec!r}: ") and expected in message
    assert "\n" not in message


def test_a_module_that_fails_to_import_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU\\nhere')\n", encoding="utf-8")
    (tmp_path / "syntax.py").write_text("def f(:\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"^params: grpo\.reward='broken\.py:f': cannot import 'broken\.py': "
                                        r"RuntimeError: no GPU here$"):
        make_reward("broken.py:f")
    with pytest.raises(UserError, match=r"^params: grpo\.reward='syntax\.py:f': cannot import 'syntax\.py': "
                                        r"SyntaxError"):
        make_reward("syntax.py:f")


def test_key_names_the_setting_in_every_message(user_module):
    """An eval task's reward names its own entry (`eval.tasks[1].reward`), never `grpo.*`, in every message."""
    name, _ = user_module
    key = "eval.tasks[1]"
    cases = [(("f1", None), f"params: {key}.reward='f1': expected one of"),
             (("numeric", r"\d"), f"params: {key}.reward_pattern='\\\\d': only used with {key}.reward='regex'"),
             (("regex", ""), f"params: {key}.reward_pattern='': expected a regular expression, which "
                             f"{key}.reward='regex' needs (with {{answer}} for the escaped answer)"),
             (("regex", "("), f"params: {key}.reward_pattern='(': not a valid regular expression"),
             ((f"{name}.py:absent", None), f"params: {key}.reward='{name}.py:absent': module"),
             (("nowhere.py:f", None), f"params: {key}.reward='nowhere.py:f': no such file")]
    for (spec, pattern), start in cases:
        with pytest.raises(UserError) as info:
            make_reward(spec, pattern, key=key)
        assert str(info.value).startswith(start) and "grpo" not in str(info.value), str(info.value)
    for spec, pattern, label in [("exact", None, f"{key}.reward='exact'"),
                                 ("regex", "{answer}", f"{key}.reward='regex' ({key}.reward_pattern='{{answer}}')"),
                                 (f"{name}.py:boom", None, f"{key}.reward='{name}.py:boom'")]:
        reward = make_reward(spec, pattern, key=key)
        assert reward.label == label
    with pytest.raises(UserError) as info:
        score(make_reward(f"{name}.py:boom", key=key), [("p", "c", "a")] * 2 + [("p", "boom", "a")], "eval speaker")
    assert str(info.value) == f"eval speaker: {key}.reward='{name}.py:boom': row 2 raised ValueError: bad input"


# Rewards that attack the stage's own process (third hostile round): each is one line naming the reward and the
# row, the worker is gone after it, and the stage's process goes on.
HOSTILE_MODULE = '''
import os, signal, sys, time

def exits(prompt, completion, answer):
    sys.exit(3)

def hard_exit(prompt, completion, answer):
    os._exit(7)

def crash(prompt, completion, answer):
    os.kill(os.getpid(), signal.SIGSEGV)

def stubborn(prompt, completion, answer):
    for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    while True:
        pass

def forks(prompt, completion, answer):
    # a daemon's double fork: a child in a session of its own forks, then ends, and its child lives on orphaned
    if os.fork() == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(120)
            os._exit(0)
        with open(prompt, "a") as f:
            f.write(f"{grandchild}\\n")
        os._exit(0)
    print("a print goes to stderr, not into the replies")
    return 1.0
'''


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.parametrize("fn, said", [
    ("exits", "row 0 raised SystemExit: 3"),
    ("hard_exit", "row 0: the reward's process exited with code 7"),
    ("crash", "row 0: the reward's process was killed by SIGSEGV"),
    ("stubborn", "row 0 did not return within 0.5 s (its prompt: 'p'); the limit is grpo.reward_timeout"),
])
def test_a_reward_that_attacks_its_process_is_one_line(tmp_path, monkeypatch, fn, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostile.py").write_text(HOSTILE_MODULE, encoding="utf-8")
    reward = make_reward(f"hostile.py:{fn}", timeout=0.5)
    with pytest.raises(UserError) as info:
        score(reward, [("p", "c", "a")], "rollouts")
    assert str(info.value).startswith(f"rollouts: grpo.reward='hostile.py:{fn}': {said}"), str(info.value)
    # the worker is gone, killed if it had to be (sys.exit is an exception it caught: it still serves)
    assert (reward.process.proc.poll() is None) == (fn == "exits")
    assert score(make_reward("exact"), [("p", "a", "a")], "after") == [1.0]  # and this process goes on


def test_a_reward_s_forks_end_with_its_worker(tmp_path, tmp_path_factory, monkeypatch):
    """Even one that left the worker's process group and session (setsid): the worker's supervisor adopts them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostile.py").write_text(HOSTILE_MODULE, encoding="utf-8")
    pids = tmp_path_factory.mktemp("pids") / "children"  # outside the project, which the reward cannot write
    pids.touch()
    reward = make_reward("hostile.py:forks", timeout=5)
    assert score(reward, [(str(pids), "c", "a")] * 2, "rollouts") == [1.0, 1.0]
    deadline = time.monotonic() + 5
    while len(pids.read_text().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    daemons = [int(pid) for pid in pids.read_text().split()]
    assert len(daemons) == 2 and all(map(alive, daemons))
    reward.process.close()
    deadline = time.monotonic() + 5
    while any(map(alive, daemons)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, daemons))
