"""Benchmark adapters on the real samples in ../shared/data/eval and on small hand-written files.

Expected values come from the raw files read here with json/csv/gzip, or are written out by hand, never from the
code under test.
"""

import csv
import gzip
import json
import re

import pytest

from kiln.pipeline.errors import UserError
from kiln.pipeline.evals.tasks import TASK_FORMATS, MCItem, TaskSpec, detect_task_format, load_task

KEY = "eval.tasks[2]"
KEY_RE = re.escape(KEY)
LETTERS = "ABCD"
MMLU_HEADER = "The following are multiple choice questions (with answers) about {}.\n\n"


def raw_rows(path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def csv_rows(path):
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        return list(csv.reader(f))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(rows)


def summary(capsys):
    """The printed summary line, with rich's wrapping at the console width undone."""
    return " ".join(capsys.readouterr().err.split())


def load(data, **kwargs):
    return load_task(TaskSpec(name="task", data=str(data), **kwargs), KEY)


def query_item(row):
    return MCItem((row["query"],) * len(row["choices"]), tuple(" " + c for c in row["choices"]), row["gold"])


def partial_item(row):
    options = row["context_options"]
    return MCItem(tuple(options), (" " + row["continuation"],) * len(options), row["gold"])


def lambada_item(row):
    return MCItem((row["context"],), (" " + row["continuation"],), 0)


FOUNDRY = {
    "commonsense_reasoning/piqa.jsonl": ("query", 1838, query_item),
    "world_knowledge/arc_easy.jsonl": ("query", 2376, query_item),
    "world_knowledge/arc_challenge.jsonl": ("query", 1172, query_item),
    "commonsense_reasoning/copa.jsonl": ("query", 100, query_item),
    "commonsense_reasoning/openbook_qa.jsonl": ("query", 500, query_item),
    "commonsense_reasoning/siqa.jsonl": ("query", 1954, query_item),
    "commonsense_reasoning/commonsense_qa.jsonl": ("query", 1221, query_item),
    "reading_comprehension/boolq.jsonl.gz": ("query", 3270, query_item),
    "hellaswag_small.jsonl": ("query", 4, query_item),
    "language_understanding/winogrande.jsonl": ("partial", 1267, partial_item),
    "language_understanding/winograd_wsc.jsonl": ("partial", 273, partial_item),
    "language_understanding/lambada_openai.jsonl.gz": ("lambada", 5153, lambada_item),
}


@pytest.fixture(scope="module")
def foundry(shared_data):
    return shared_data / "eval/llm-foundry"


@pytest.fixture(scope="module")
def mmlu(shared_data):
    return shared_data / "eval/mmlu"


@pytest.mark.parametrize("name", FOUNDRY)
def test_llm_foundry_files_load_with_auto_detection(foundry, capsys, name):
    fmt, count, expected = FOUNDRY[name]
    raw = raw_rows(foundry / name)
    assert len(raw) == count
    task = load(foundry / name)
    assert (task.name, task.format, task.skipped) == ("task", fmt, {})
    assert [item.gold for item in task.items] == [row.get("gold", 0) for row in raw]
    assert task.items == [expected(row) for row in raw]
    assert all(item.n_choices == len(row.get("choices", row.get("context_options", [0]))) and item.n_choices >= 1
               for item, row in zip(task.items, raw))
    assert summary(capsys) == f"{KEY} task: {count:,} items"


def test_one_item_per_format_written_out(foundry):
    copa = load(foundry / "commonsense_reasoning/copa.jsonl", limit=1).items[0]
    assert copa == MCItem(("The man turned on the faucet, therefore",) * 2,
                          (" the toilet filled with water.", " water flowed from the spout."), 1)
    wsc = load(foundry / "language_understanding/winograd_wsc.jsonl", limit=1).items[0]
    assert wsc == MCItem(("The city councilmen refused the demonstrators a permit because the city councilmen",
                          "The city councilmen refused the demonstrators a permit because the demonstrators"),
                         (" feared violence.",) * 2, 0)
    lambada = load(foundry / "language_understanding/lambada_openai.jsonl.gz", limit=1).items[0]
    assert lambada.continuations == (" signs",) and lambada.n_choices == 1
    assert lambada.contexts[0].endswith("his mouth curved in a confident grin, I don't care about")


def test_the_delimiter_goes_between_context_and_choice(foundry):
    # hellaswag_small's choices start with punctuation (", the man ..."), which wants no delimiter.
    raw = raw_rows(foundry / "hellaswag_small.jsonl")
    task = load(foundry / "hellaswag_small.jsonl", delimiter="")
    assert [item.continuations for item in task.items] == [tuple(row["choices"]) for row in raw]


def test_limit_counts_usable_items(foundry, tmp_path, capsys):
    raw = raw_rows(foundry / "commonsense_reasoning/copa.jsonl")
    task = load(foundry / "commonsense_reasoning/copa.jsonl", limit=10)
    assert task.items == [query_item(row) for row in raw[:10]]
    assert summary(capsys) == f"{KEY} task: 10 items"
    good = {"query": "q", "choices": ["a", "b"], "gold": 1}
    spec = write_jsonl(tmp_path / "mixed.jsonl", [good, {"query": "q", "choices": [], "gold": 0}, good, good])
    task = load(spec, limit=2)
    assert len(task.items) == 2 and task.skipped == {"empty choice list": 1}


# MMLU: header-less CSVs, one per subject and split.

def mmlu_block(row):
    question, *choices, _ = row
    return question.strip() + "".join(f"\n{letter}. {c}" for letter, c in zip(LETTERS, choices)) + "\nAnswer:"


def mmlu_raw(folder):
    """(subject, row) for every row of every CSV in `folder`, files in name order."""
    return [(f.name.rsplit("_", 1)[0], row) for f in sorted(folder.glob("*.csv.gz")) for row in csv_rows(f)]


@pytest.fixture(scope="module")
def mmlu_val(mmlu):
    return load(mmlu, format="mmlu", split="val")


@pytest.mark.parametrize("split, count", [("dev", 285), ("val", 1531)])
def test_mmlu_directories(mmlu, split, count):
    raw = mmlu_raw(mmlu / split)
    assert len(raw) == count and len({subject for subject, _ in raw}) == 57
    task = load(mmlu, split=split)
    assert (task.format, len(task.items), task.skipped) == ("mmlu", count, {})
    assert [item.gold for item in task.items] == [LETTERS.index(row[-1]) for _, row in raw]
    assert task.items == [MCItem((MMLU_HEADER.format(subject.replace("_", " ")) + mmlu_block(row),) * 4,
                                 (" A", " B", " C", " D"), LETTERS.index(row[-1])) for subject, row in raw]


def test_mmlu_zero_shot_prompt_written_out(mmlu_val):
    assert mmlu_val.items[0] == MCItem(
        ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
         "The cyclic subgroup of Z_24 generated by 18 has order\nA. 4\nB. 8\nC. 12\nD. 6\nAnswer:",) * 4,
        (" A", " B", " C", " D"), 0)


def test_mmlu_five_shot_prompts(mmlu, mmlu_val):
    task = load(mmlu, split="val", shots=5)
    assert [item.gold for item in task.items] == [item.gold for item in mmlu_val.items]
    dev = {subject: [] for subject, _ in mmlu_raw(mmlu / "dev")}
    for subject, row in mmlu_raw(mmlu / "dev"):
        dev[subject].append(row)
    for (subject, row), item, zero in zip(mmlu_raw(mmlu / "val"), task.items, mmlu_val.items):
        shots = [shot for shot in dev[subject] if shot != row]  # a val question equal to a dev one is left out
        assert item.contexts[0] == (MMLU_HEADER.format(subject.replace("_", " "))
                                    + "".join(f"{mmlu_block(shot)} {shot[-1]}\n\n" for shot in shots)
                                    + mmlu_block(row))
        assert item.contexts[0].endswith("\n\n" + mmlu_block(row)) and zero.contexts[0].endswith(mmlu_block(row))
    first = task.items[0].contexts[0]
    questions = [row[0] for row in dev["abstract_algebra"]]
    assert [first.index(q) for q in questions] == sorted(first.index(q) for q in questions)
    assert "Find the characteristic of the ring 2Z.\nA. 0\nB. 3\nC. 12\nD. 30\nAnswer: A\n\n" in first
    # The real data has one such repeat: it gets 4 examples, every other question 5.
    assert sorted(item.contexts[0].count("\nAnswer:") for item in task.items) == [5] + [6] * 1530


def test_mmlu_single_file_takes_shots_from_the_sibling_dev_folder(mmlu):
    path = mmlu / "val/abstract_algebra_val.csv.gz"
    raw = csv_rows(path)
    task = load(path, shots=2)
    dev = csv_rows(mmlu / "dev/abstract_algebra_dev.csv.gz")
    assert (task.format, len(task.items)) == ("mmlu", len(raw))
    assert task.items[3].contexts[0] == (MMLU_HEADER.format("abstract algebra") + f"{mmlu_block(dev[0])} {dev[0][-1]}"
                                         f"\n\n{mmlu_block(dev[1])} {dev[1][-1]}\n\n{mmlu_block(raw[3])}")


def test_mmlu_dev_split_scored_with_shots_never_shows_a_question_its_own_answer(mmlu):
    task = load(mmlu, split="dev", shots=4, limit=5)
    dev = csv_rows(mmlu / "dev/abstract_algebra_dev.csv.gz")
    for i, item in enumerate(task.items):
        assert item.contexts[0].count(dev[i][0].strip()) == 1
        assert item.contexts[0].count("\nAnswer:") == 5
    with pytest.raises(UserError, match=r"shots=5 needs 6 usable dev questions of subject 'abstract_algebra'"):
        load(mmlu, split="dev", shots=5)


def test_mmlu_more_shots_than_dev_rows(mmlu):
    with pytest.raises(UserError, match=rf"{KEY_RE}=.*shots=6 needs 6 usable dev questions .* found 5"):
        load(mmlu, split="val", shots=6)


def test_mmlu_bad_rows_and_missing_folders(tmp_path, capsys):
    good = ["What is 1+1?", "1", "2", "3", "4", "B"]
    write_csv(tmp_path / "m/test/basic_math_test.csv", [good, good[:-1] + ["E"], good[:4] + ["C"], good])
    task = load(tmp_path / "m")
    assert len(task.items) == 2 and task.skipped == {"answer letter not in ABCD": 1, "not 4 choices": 1}
    assert task.items[0].gold == 1 and task.items[0].contexts[0].startswith(MMLU_HEADER.format("basic math"))
    assert "task: 2 items, skipped 2 (answer letter not in ABCD: 1, not 4 choices: 1)" in summary(capsys)
    with pytest.raises(UserError, match=r"needs .*basic_math_dev\.csv\[\.gz\]"):
        load(tmp_path / "m", shots=1)
    with pytest.raises(UserError, match=r"no <subject>_val\.csv\[\.gz\] files"):
        load(tmp_path / "m", split="val")
    with pytest.raises(UserError, match=rf"{KEY_RE}=.*nowhere.*no such file or directory"):
        load(tmp_path / "nowhere", format="mmlu")


def test_mmlu_rows_in_hugging_face_shape(tmp_path):
    spec = write_jsonl(tmp_path / "mmlu.jsonl", [
        {"question": "Q1 ", "subject": "college_physics", "choices": ["a", "b", "c", "d"], "answer": 3},
        {"question": "Q2", "subject": "college_physics", "choices": ["a", "b", "c", "d"], "answer": 4},
    ])
    task = load(spec)
    assert task.format == "mmlu" and task.skipped == {"gold out of range": 1}
    assert task.items == [MCItem((MMLU_HEADER.format("college physics") + "Q1\nA. a\nB. b\nC. c\nD. d\nAnswer:",) * 4,
                                 (" A", " B", " C", " D"), 3)]
    with pytest.raises(UserError, match="shots=1 needs an MMLU directory"):
        load(spec, shots=1)


# HellaSwag in its original schema, as Rowan/hellaswag on the Hugging Face hub has it.

def test_hellaswag_original_schema(tmp_path, capsys):
    spec = write_jsonl(tmp_path / "hellaswag.jsonl", [
        {"ind": 4, "activity_label": "Removing ice from car",
         "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter "
                  "clothes smiles.", "ctx_b": "then", "ctx": "...", "split": "val", "split_type": "indomain",
         "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift.",
                     ", the man puts on a christmas coat.", ", the man continues removing the snow on his car."],
         "source_id": "activitynet~v_-1IBHYS3L-Y", "label": "3"},
        {"ind": 9, "activity_label": "Home and Garden",
         "ctx_a": "[header] How to plant a garden bed [title] Choose a sunny spot.", "ctx_b": "pick a SPOT",
         "ctx": "...", "endings": ["Dig the soil. [title] Water it.", " Buy a [step] shovel. ", "Wait.", "Sing."],
         "label": 0},
        {"ind": 12, "activity_label": "Baking cookies", "ctx_a": "A chef shows a pan.", "ctx_b": "she",
         "ctx": "...", "endings": ["a", "b", "c", "d"], "label": ""},
    ])
    task = load(spec)
    assert task.format == "hellaswag" and task.skipped == {"no gold label": 1}
    assert task.items == [
        MCItem(("Removing ice from car: Then, the man writes over the snow covering the window of a car, and a woman "
                "wearing winter clothes smiles. Then",) * 4,
               (" , the man adds wax to the windshield and cuts it.", " , a person board a ski lift.",
                " , the man puts on a christmas coat.", " , the man continues removing the snow on his car."), 3),
        # ctx_b is capitalized the way str.capitalize does (the rest lowered), as lm-evaluation-harness does.
        MCItem(("Home and Garden: How to plant a garden bed. Choose a sunny spot. Pick a spot",) * 4,
               (" Dig the soil.. Water it.", " Buy a shovel.", " Wait.", " Sing."), 0),
    ]
    assert f"{KEY} task: 2 items, skipped 1 (no gold label: 1)" == summary(capsys)


# Formats, detection and bad rows.

@pytest.mark.parametrize("row, fmt", [
    ({"query": "q", "choices": ["a", "b"], "gold": 0}, "query"),
    ({"query": "q", "choices": ["a", "b"]}, "query"),
    ({"context_options": ["a", "b"], "continuation": "c", "gold": 0}, "partial"),
    ({"ctx_a": "a", "ctx_b": "b", "ctx": "a b", "activity_label": "x", "endings": ["1", "2"], "label": "1"},
     "hellaswag"),
    ({"context": "c", "continuation": "word"}, "lambada"),
    ({"question": "q", "subject": "s", "choices": ["a", "b", "c", "d"], "answer": 0}, "mmlu"),
])
def test_detect_task_format(row, fmt):
    assert detect_task_format(row, KEY) == fmt


def test_unknown_columns_name_the_key_and_the_columns(tmp_path):
    with pytest.raises(UserError, match=rf"{KEY_RE}: cannot tell the task format from the columns prompt, answer"):
        detect_task_format({"prompt": "p", "answer": "a"}, KEY)
    with pytest.raises(UserError, match="columns prompt, answer"):
        load(write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "p", "answer": "a"}]))


def test_bad_query_rows_are_counted_and_the_good_ones_kept(tmp_path, capsys):
    good = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}, {"query": "Q2", "choices": ["c", "d", "e"], "gold": 2}]
    spec = write_jsonl(tmp_path / "bad.jsonl", [
        good[0],
        {"query": "q", "choices": ["a", "b"]},
        {"query": "q", "choices": ["a", "b"], "gold": None},
        {"query": "q", "choices": ["a", "b"], "gold": 2},
        {"query": "q", "choices": ["a", "b"], "gold": -1},
        {"query": "q", "choices": [], "gold": 0},
        {"query": "q", "choices": ["a", "b"], "gold": "one"},
        {"query": "q", "choices": ["a", "b"], "gold": 1.5},
        {"query": "q", "choices": ["a"], "gold": 0},
        {"query": "q", "choices": ["a", 3], "gold": 0},
        {"query": " ", "choices": ["a", "b"], "gold": 0},
        {"choices": ["a", "b"], "gold": 0},
        good[1],
    ])
    task = load(spec)
    assert task.items == [query_item(row) for row in good]
    assert task.skipped == {"missing field 'gold'": 2, "gold out of range": 2, "gold not an int": 2,
                            "empty choice list": 1, "fewer than 2 choices": 1, "choice not a string": 1,
                            "empty context": 1, "missing field 'query'": 1}
    assert summary(capsys) == (f"{KEY} task: 2 items, skipped 11 (missing field 'gold': 2, gold out of range: 2, "
                               "gold not an int: 2, empty choice list: 1, fewer than 2 choices: 1, "
                               "choice not a string: 1, empty context: 1, missing field 'query': 1)")


def test_bad_partial_and_lambada_rows(tmp_path):
    spec = write_jsonl(tmp_path / "wino.jsonl", [
        {"context_options": ["A did", "B did"], "continuation": "it.", "gold": 1},
        {"context_options": ["A did", ""], "continuation": "it.", "gold": 1},
        {"context_options": ["A did", "B did"], "continuation": "", "gold": 1},
        {"context_options": ["A did", "B did"], "continuation": "it.", "gold": True},
    ])
    task = load(spec, format="partial")
    assert task.items == [MCItem(("A did", "B did"), (" it.", " it."), 1)]
    assert task.skipped == {"empty context": 1, "empty continuation": 1, "gold not an int": 1}
    spec = write_jsonl(tmp_path / "lambada.jsonl", [{"context": "He said", "continuation": "hi"},
                                                    {"context": "He said", "continuation": None}])
    task = load(spec, delimiter="_")
    assert task.items == [MCItem(("He said",), ("_hi",), 0)]
    assert task.skipped == {"missing field 'continuation'": 1}


def test_a_file_of_only_bad_rows_is_an_error_naming_the_key(tmp_path):
    spec = write_jsonl(tmp_path / "bad.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 5},
                                                {"query": "q", "choices": [], "gold": 0}])
    with pytest.raises(UserError, match=rf"params: {KEY_RE}='.*bad\.jsonl': no usable row among 2 "
                                        r"\(gold out of range: 1, empty choice list: 1\)"):
        load(spec)


def test_the_wrong_explicit_format_uses_no_row(foundry):
    with pytest.raises(UserError, match=r"no usable row among 100 \(missing field 'context_options': 100\)"):
        load(foundry / "commonsense_reasoning/copa.jsonl", format="partial")


def test_bad_specs(tmp_path):
    expected = ", ".join(TASK_FORMATS)
    with pytest.raises(UserError, match=rf"{KEY_RE}: unknown format 'arc' \(expected auto, {expected}\)"):
        load(tmp_path / "x.jsonl", format="arc")
    with pytest.raises(UserError, match=rf"{KEY_RE}=.*missing\.jsonl.*no such file or directory"):
        load(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="no rows"):
        load(tmp_path / "empty.jsonl")
