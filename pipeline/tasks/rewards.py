"""Verifiable rewards for GRPO: a function of (prompt, completion, answer) that scores one sampled completion.

GRPO learns only from differences in reward between completions of the same prompt, so a reward must be
deterministic and must never fail quietly: a reward that silently returns 0 for a row it could not judge looks
exactly like a wrong answer and teaches the model the wrong thing. Hence the built-in rewards are pure string
functions, and `score` refuses (with a one-line `UserError` naming the row) any reward that raises or returns
something other than a finite real number within +-1e6 (GRPO divides by a group's spread: 1e308 overflows the
advantages and then the loss). A reward of the user's own runs in a worker process (tasks/user_reward.py) and
gets `reward_timeout` seconds a call: one that never returns, exits or crashes stops the run naming it and the
row, and the worker is killed with all it started, whatever the function did to signals. The worker's memory and
processes are bounded, and the project is read-only to it where the kernel allows (tasks/user_reward.py).

`grpo.reward` picks the reward: `exact`, `numeric`, `contains`, `regex` (with `grpo.reward_pattern`), or
`module:function` / `path/to/file.py:function` for a reward of your own. A generative eval task
(`eval.tasks[i].reward`) names its reward the same way; `key` makes every message name the setting it came from.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from kiln.pipeline.errors import UserError, shown
from kiln.pipeline.tasks.user_reward import Limits, Reward, RewardProcess, judge

CHOICES = "exact, numeric, regex, contains, or module:function (a module on sys.path or a .py file)"

# Quotes stripped from both ends of an answer: straight, typographic and guillemets.
QUOTES = "\"'`\u2018\u2019\u201a\u201b\u201c\u201d\u201e\u201f\u00ab\u00bb\u2039\u203a"
# Sentence punctuation stripped from the end only: "Paris." and "Paris" are one answer, but a leading "." or "-"
# is part of a number (".5", "-3"), and brackets are kept because "(a)" can be the answer itself.
TRAILING = ".,;:!?\u2026"

# A number as people write answers: an optional sign (not a hyphen glued to a word or a digit, so "16-3" is 16
# and 3, not 16 and -3), an optional currency sign, then either thousands groups ("1,000,000") or plain digits,
# with an optional decimal part. "72." ends a sentence, so a decimal point needs a digit after it.
NUMBER = re.compile(r"(?<![\w.])(?P<sign>[-+\u2212]?)[$\u20ac\u00a3\u00a5]?"
                    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?|\.\d+)")
GSM8K_MARK = "####"

MAX_REWARD = 1e6  # the largest |reward| taken


@dataclass(frozen=True)
class NamedReward:
    """A reward and the setting it came from, which every error about it quotes: kiln's own (`fn`, called here)
    or the user's (`process`, called in its worker within `timeout` seconds)."""

    label: str
    fn: Reward | None = None
    process: RewardProcess | None = None
    timeout: float | None = None

    def outcome(self, row: tuple[str, str, str]) -> dict:
        return self.process.judge(row) if self.process is not None else judge(self.fn, row)


def normalize(text: str) -> str:
    """The form `exact` and `contains` compare, so that formatting differences that do not change the answer
    do not change the reward. In order:

    1. Unicode NFKC, casefold, NFKC again: full-width letters, ligatures and the two encodings of "é" become one
       string, and "Paris"/"PARIS"/"paris" compare equal (casefold also maps German "ß" to "ss").
    2. Whitespace runs (any Unicode whitespace, newlines included) become one space.
    3. Repeatedly until nothing changes: strip surrounding spaces, strip the quotes in `QUOTES` from both ends,
       strip the sentence punctuation in `TRAILING` (. , ; : ! ? ...) from the end only.

    Nothing inside the text is touched, so "new york" and "new-york" stay different. The result is a fixed
    point: normalize(normalize(s)) == normalize(s)."""
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    text = " ".join(text.split())
    previous = None
    while text != previous:
        previous = text
        text = text.strip(" ").strip(QUOTES).rstrip(TRAILING)
    return text


def exact_reward(prompt: str, completion: str, answer: str) -> float:
    return float(normalize(completion) == normalize(answer))


def contains_reward(prompt: str, completion: str, answer: str) -> float:
    gold = normalize(answer)
    # The empty string occurs in every completion: rewarding everything would be a silent failure.
    if not gold:
        raise UserError(f"answer {shown(answer)} is empty once normalised; nothing to look for")
    return float(gold in normalize(completion))


def final_number(text: str) -> Decimal | None:
    """The answer's number in `text`: the first number after the first `####` when there is one (GSM8K's
    convention, and a model that has written its final answer gains nothing by rambling on), else the last
    number in the text. None when there is no such number: "#### " followed by no number is None, not a fall
    back to an earlier number, since the model did commit to a (non-numeric) final answer."""
    head, mark, tail = text.partition(GSM8K_MARK)
    if mark:
        match = NUMBER.search(tail)
    else:
        matches = list(NUMBER.finditer(head))
        match = matches[-1] if matches else None
    if match is None:
        return None
    sign = "-" if match["sign"] in ("-", "\u2212") else ""
    return Decimal(sign + match["digits"].replace(",", ""))


def numeric_reward(prompt: str, completion: str, answer: str) -> float:
    gold = final_number(answer)
    if gold is None:
        raise UserError(f"answer {shown(answer)} holds no number")
    # Decimal compares values exactly: 72 == 72.0 == 72.00, and no float rounding makes 2**53 + 1 "equal" 2**53.
    return float(final_number(completion) == gold)


def regex_reward(pattern: str, key: str = "grpo") -> Reward:
    """re.search of `pattern` in the raw completion; `{answer}` in the pattern stands for the answer, escaped,
    so an answer like "3.5" or "(a)" matches only itself."""
    where = f"params: {key}.reward_pattern={pattern!r}"
    try:
        # With a placeholder, check the pattern once with a stand-in answer, so a typo fails before any sampling.
        compiled = re.compile(pattern.replace("{answer}", re.escape("0")))
    except re.error as e:
        raise UserError(f"{where}: not a valid regular expression ({e})") from None
    if "{answer}" not in pattern:
        return lambda prompt, completion, answer: float(compiled.search(completion) is not None)
    return lambda prompt, completion, answer: float(
        re.search(pattern.replace("{answer}", re.escape(answer)), completion) is not None)


BUILTIN = {"exact": exact_reward, "numeric": numeric_reward, "contains": contains_reward}


def make_reward(spec: str, pattern: str | None = None, key: str = "grpo", timeout: float | None = None,
                limits: Limits = Limits()) -> NamedReward:
    """The reward `<key>.reward=spec` names (`pattern` is `<key>.reward_pattern`, used only by `regex`); `key`
    is the params entry every message names (`grpo`, `eval.tasks[1]`); a function of the user's own gets
    `timeout` seconds a call, and its processes `limits`."""
    if spec not in BUILTIN and spec != "regex" and ":" not in spec:
        raise UserError(f"params: {key}.reward={spec!r}: expected one of {CHOICES}")
    # A pattern that would be ignored is most likely a reward switched without its pattern: say so.
    if spec != "regex" and pattern is not None:
        raise UserError(f"params: {key}.reward_pattern={pattern!r}: only used with {key}.reward='regex', "
                        f"not {spec!r}; expected null")
    if spec == "regex":
        if not pattern:  # an empty pattern matches every completion
            raise UserError(f"params: {key}.reward_pattern={pattern!r}: expected a regular expression, which "
                            f"{key}.reward='regex' needs (with {{answer}} for the escaped answer)")
        return NamedReward(f"{key}.reward='regex' ({key}.reward_pattern={pattern!r})", regex_reward(pattern, key))
    if spec in BUILTIN:
        return NamedReward(f"{key}.reward={spec!r}", BUILTIN[spec])
    label = f"{key}.reward={spec!r}"
    return NamedReward(label, process=RewardProcess(spec, key, timeout, label, limits), timeout=timeout)


def score(reward: NamedReward, rows: Sequence[tuple[str, str, str]], what: str) -> list[float]:
    """The reward of every (prompt, completion, answer) row, as floats. `what` names the rows in errors (a data
    set, a rollout batch). A bool counts as 1.0/0.0, since a pass/fail predicate is a natural reward; any other
    non-real value (None, a string, a tensor), nan or inf, or an exception is a `UserError` naming the row."""
    rewards = []
    for i, row in enumerate(rows):
        where = f"{what}: {reward.label}: row {i}"
        got = reward.outcome(row)
        if "timeout" in got:
            raise UserError(f"{where} did not return within {got['timeout']:g} s (its prompt: {shown(row[0])}); "
                            f"the limit is {reward.label.split('.reward=')[0]}.reward_timeout")
        if "died" in got:
            raise UserError(f"{where}: the reward's process {got['died']} (a reward must return a number, not "
                            "end its process)")
        if "limit" in got:
            raise UserError(f"{where}: the reward's process {got['limit']}")
        if "broken" in got:
            raise UserError(f"{where}: {got['broken']}")
        if "user_error" in got:
            raise UserError(f"{where}: {got['user_error']}")
        if "raised" in got:
            raise UserError(f"{where} raised {got['raised']}: {got['message']}")
        if "returned" in got:
            raise UserError(f"{where} returned {got['returned']} ({got['type']}); expected a finite number")
        value = got["value"]
        if not math.isfinite(value):
            raise UserError(f"{where} returned {value}; expected a finite number")
        if abs(value) > MAX_REWARD:
            raise UserError(f"{where} returned {value:g}; expected a reward within +-{MAX_REWARD:g} (larger ones "
                            "overflow the group advantages and the loss)")
        rewards.append(value)
    return rewards
