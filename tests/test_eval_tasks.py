"""Benchmark adapters on the real samples in ../shared/data/eval and on small hand-written files.

Expected values come from the raw files read here with json/csv/gzip, or are written out by hand, never from the
code under test.
"""

import csv
import gzip
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.pipeline.errors import UserError
from kiln.pipeline.tasks.tasks import TASK_FORMATS, MCItem, TaskSpec, detect_task_format, load_task

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


def load(data, **kwargs):
    return load_task(TaskSpec(name="task", data=str(data), **kwargs), KEY)


def query_item(row):
    choices = tuple(row["choices"])
    return MCItem((row["query"],) * len(choices), tuple(" " + c for c in choices), row["gold"], choices)


def partial_item(row):
    options = tuple(row["context_options"])  # the harness's choices for WinoGrande are the options
    return MCItem(options, (" " + row["continuation"],) * len(options), row["gold"], options)


def lambada_item(row):
    return MCItem((row["context"],), (" " + row["continuation"],), 0, (row["continuation"],))


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
def test_llm_foundry_files_load_with_auto_detection(foundry, name):
    fmt, count, expected = FOUNDRY[name]
    raw = raw_rows(foundry / name)
    assert len(raw) == count
    task = load(foundry / name)
    assert (task.name, task.format, task.skipped) == ("task", fmt, {})
    assert [item.gold for item in task.items] == [row.get("gold", 0) for row in raw]
    assert task.items == [expected(row) for row in raw]
    assert all(item.n_choices == len(row.get("choices", row.get("context_options", [0]))) and item.n_choices >= 1
               for item, row in zip(task.items, raw))
    assert task.summary() == f"task: {count:,} items"


def test_one_item_per_format_written_out(foundry):
    copa = load(foundry / "commonsense_reasoning/copa.jsonl", limit=1).items[0]
    assert copa == MCItem(("The man turned on the faucet, therefore",) * 2,
                          (" the toilet filled with water.", " water flowed from the spout."), 1,
                          ("the toilet filled with water.", "water flowed from the spout."))
    wsc = load(foundry / "language_understanding/winograd_wsc.jsonl", limit=1).items[0]
    assert wsc == MCItem(("The city councilmen refused the demonstrators a permit because the city councilmen",
                          "The city councilmen refused the demonstrators a permit because the demonstrators"),
                         (" feared violence.",) * 2, 0,
                         ("The city councilmen refused the demonstrators a permit because the city councilmen",
                          "The city councilmen refused the demonstrators a permit because the demonstrators"))
    lambada = load(foundry / "language_understanding/lambada_openai.jsonl.gz", limit=1).items[0]
    assert lambada.continuations == (" signs",) and lambada.choices == ("signs",) and lambada.n_choices == 1
    assert lambada.contexts[0].endswith("his mouth curved in a confident grin, I don't care about")


def test_the_delimiter_goes_between_context_and_choice(foundry):
    # hellaswag_small's choices start with punctuation (", the man ..."), which wants no delimiter.
    raw = raw_rows(foundry / "hellaswag_small.jsonl")
    task = load(foundry / "hellaswag_small.jsonl", delimiter="")
    assert [item.continuations for item in task.items] == [tuple(row["choices"]) for row in raw]
    assert [item.choices for item in task.items] == [tuple(row["choices"]) for row in raw]


def test_limit_counts_usable_items(foundry, tmp_path):
    raw = raw_rows(foundry / "commonsense_reasoning/copa.jsonl")
    task = load(foundry / "commonsense_reasoning/copa.jsonl", limit=10)
    assert task.items == [query_item(row) for row in raw[:10]]
    assert task.summary() == "task: 10 items"
    good = {"query": "q", "choices": ["a", "b"], "gold": 1}
    spec = write_jsonl(tmp_path / "mixed.jsonl", [good, good, {"query": "q", "choices": [], "gold": 0}])
    assert len(load(spec, limit=2).items) == 2  # the bad third row is never read
    with pytest.raises(UserError, match=r"mixed\.jsonl:3: choices: "):
        load(spec, limit=3)


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
                                 (" A", " B", " C", " D"), LETTERS.index(row[-1]), tuple(LETTERS))
                          for subject, row in raw]


def test_mmlu_zero_shot_prompt_written_out(mmlu_val):
    assert mmlu_val.items[0] == MCItem(
        ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
         "The cyclic subgroup of Z_24 generated by 18 has order\nA. 4\nB. 8\nC. 12\nD. 6\nAnswer:",) * 4,
        (" A", " B", " C", " D"), 0, ("A", "B", "C", "D"))


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
    with pytest.raises(UserError, match=r"shots=5 needs 6 dev questions of subject 'abstract_algebra'"):
        load(mmlu, split="dev", shots=5)


def test_mmlu_more_shots_than_dev_rows(mmlu):
    with pytest.raises(UserError, match=rf"{KEY_RE}=.*shots=6 needs 6 dev questions .* found 5"):
        load(mmlu, split="val", shots=6)


def test_mmlu_bad_rows_and_missing_folders(tmp_path):
    good = ["What is 1+1?", "1", "2", "3", "4", "B"]
    write_csv(tmp_path / "m/test/basic_math_test.csv", [good, good])
    task = load(tmp_path / "m")
    assert len(task.items) == 2 and task.skipped == {}
    assert task.items[0].gold == 1 and task.items[0].contexts[0].startswith(MMLU_HEADER.format("basic math"))
    with pytest.raises(UserError, match=r"needs .*basic_math_dev\.csv\[\.gz\]"):
        load(tmp_path / "m", shots=1)
    with pytest.raises(UserError, match=r"no <subject>_val\.csv\[\.gz\] files"):
        load(tmp_path / "m", split="val")
    with pytest.raises(UserError, match=rf"{KEY_RE}=.*nowhere.*no such file or directory"):
        load(tmp_path / "nowhere", format="mmlu")
    # A bad row stops the task, named by file and line; a quoted cell over two lines counts both.
    path = tmp_path / "m/test/basic_math_test.csv"
    for rows, line, message in [
        ([good, good[:-1] + ["E"]], 2, "answer: expected a letter A to D, got 'E'"),
        ([good, ["Two\nlines", *good[1:]], good[:4] + ["C"]], 4,
         "expected 6 cells (question, A, B, C, D, answer letter), got 5"),
        ([good, ["  ", *good[1:]]], 2, "question: empty"),
    ]:
        write_csv(path, rows)
        with pytest.raises(UserError, match=re.escape(f"{path}:{line}: {message}")):
            load(tmp_path / "m")
    write_csv(tmp_path / "m/dev/basic_math_dev.csv", [good, good[:-1] + ["b"]])
    write_csv(path, [good])
    with pytest.raises(UserError, match=re.escape(f"basic_math_dev.csv:2: answer: expected a letter A to D, got 'b'")):
        load(tmp_path / "m", shots=1)


def test_mmlu_rows_in_hugging_face_shape(tmp_path):
    rows = [{"question": "Q1 ", "subject": "college_physics", "choices": ["a", "b", "c", "d"], "answer": 3}]
    task = load(write_jsonl(tmp_path / "mmlu.jsonl", rows))
    assert task.format == "mmlu" and task.skipped == {}
    assert task.items == [MCItem((MMLU_HEADER.format("college physics") + "Q1\nA. a\nB. b\nC. c\nD. d\nAnswer:",) * 4,
                                 (" A", " B", " C", " D"), 3, ("A", "B", "C", "D"))]
    with pytest.raises(UserError, match="shots=1 needs an MMLU directory"):
        load(tmp_path / "mmlu.jsonl", shots=1)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, {**rows[0], "answer": 4}])
    with pytest.raises(UserError, match=re.escape(f"{bad}:2: answer: expected an int in 0..3, got 4")):
        load(bad)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, {**rows[0], "choices": ["a", "b", "c"]}])
    with pytest.raises(UserError, match=re.escape(f"{bad}:2: choices: expected 4 (A to D), got 3")):
        load(bad)


# HellaSwag in its original schema, as Rowan/hellaswag on the Hugging Face hub has it.

def test_hellaswag_original_schema(tmp_path):
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
                " , the man puts on a christmas coat.", " , the man continues removing the snow on his car."), 3,
               (", the man adds wax to the windshield and cuts it.", ", a person board a ski lift.",
                ", the man puts on a christmas coat.", ", the man continues removing the snow on his car.")),
        # ctx_b is capitalized the way str.capitalize does (the rest lowered), as lm-evaluation-harness does.
        MCItem(("Home and Garden: How to plant a garden bed. Choose a sunny spot. Pick a spot",) * 4,
               (" Dig the soil.. Water it.", " Buy a shovel.", " Wait.", " Sing."), 0,
               ("Dig the soil.. Water it.", "Buy a shovel.", "Wait.", "Sing.")),
    ]
    assert task.summary() == "task: 2 items, skipped 1 (no gold label: 1)"


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
    assert detect_task_format(row, "t.jsonl:1") == fmt


def test_unknown_columns_name_the_file_and_the_columns(tmp_path):
    with pytest.raises(UserError, match=r"t\.jsonl:1: cannot tell the task format from the columns prompt, answer"):
        detect_task_format({"prompt": "p", "answer": "a"}, "t.jsonl:1")
    spec = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(UserError, match=re.escape(f"{spec}:1: cannot tell the task format from the columns prompt, "
                                                  "answer (expected query: query, choices;")):
        load(spec)


GOOD = {"query": "Q1", "choices": ["a", "b"], "gold": 1}


@pytest.mark.parametrize("bad, message", [
    ({"query": "q", "choices": ["a", "b"]}, "gold: missing"),
    ({"query": "q", "choices": ["a", "b"], "gold": None}, "gold: missing"),
    ({"query": "q", "choices": ["a", "b"], "gold": 2}, "gold: expected an int in 0..1, got 2"),
    ({"query": "q", "choices": ["a", "b"], "gold": -1}, "gold: expected an int in 0..1, got -1"),
    ({"query": "q", "choices": ["a", "b"], "gold": "one"}, "gold: expected an int in 0..1, got 'one'"),
    ({"query": "q", "choices": ["a", "b"], "gold": 1.0}, "gold: expected an int in 0..1, got 1.0"),
    ({"query": "q", "choices": ["a", "b"], "gold": True}, "gold: expected an int in 0..1, got True"),
    ({"query": "q", "choices": [], "gold": 0}, "choices: expected a list of at least 2 strings, got []"),
    ({"query": "q", "choices": "ab", "gold": 0}, "choices: expected a list of at least 2 strings, got 'ab'"),
    ({"query": "q", "choices": ["a"], "gold": 0}, "choices: expected a list of at least 2 strings, got ['a']"),
    ({"query": "q", "choices": ["a", 3], "gold": 0}, "choices[1]: expected a string, got 3"),
    ({"query": "q", "choices": ["a", " "], "gold": 0}, "choices[1]: empty"),
    ({"query": "q", "choices": ["a", "b\ud800"], "gold": 0}, "choices[1]: not valid Unicode (a lone surrogate)"),
    ({"query": " ", "choices": ["a", "b"], "gold": 0}, "query: empty"),
    ({"query": ["q"], "choices": ["a", "b"], "gold": 0}, "query: expected a string, got ['q']"),
    ({"choices": ["a", "b"], "gold": 0}, "query: missing"),
    ({"query": "q" * 100, "choices": ["a", "b"], "gold": "x" * 100}, "gold: expected an int in 0..1, got 'xxxxx"),
])
def test_a_bad_row_is_an_error_naming_file_line_and_field(tmp_path, bad, message):
    spec = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(UserError) as e:
        load(spec)
    assert str(e.value).startswith(f"{spec}:2: {message}") and "\n" not in str(e.value)
    assert len(str(e.value)) < len(spec) + 80


def test_bad_partial_lambada_and_hellaswag_rows(tmp_path):
    wino = {"context_options": ["A did", "B did"], "continuation": "it.", "gold": 1}
    for bad, message in [({"context_options": ["A did", ""]}, "context_options[1]: empty"),
                         ({"continuation": ""}, "continuation: empty"),
                         ({"gold": True}, "gold: expected an int in 0..1, got True")]:
        spec = write_jsonl(tmp_path / "wino.jsonl", [wino, {**wino, **bad}])
        with pytest.raises(UserError, match=re.escape(f"{spec}:2: {message}")):
            load(spec, format="partial")
    spec = write_jsonl(tmp_path / "lambada.jsonl", [{"context": "He said", "continuation": "hi"},
                                                    {"context": "He said", "continuation": None}])
    with pytest.raises(UserError, match=re.escape(f"{spec}:2: continuation: missing")):
        load(spec)
    assert load(spec, delimiter="_", limit=1).items == [MCItem(("He said",), ("_hi",), 0, ("hi",))]
    swag = {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d", "e"], "label": "1"}
    for bad, message in [({"label": "x"}, "label: expected an int in 0..1, got 'x'"),
                         ({"label": "2"}, "label: expected an int in 0..1, got 2"),
                         ({"endings": ["[title]", "e"]}, "endings[0]: empty"),
                         ({"ctx_a": 5}, "ctx_a: expected a string, got 5")]:
        spec = write_jsonl(tmp_path / "swag.jsonl", [swag, {**swag, **bad}])
        with pytest.raises(UserError, match=re.escape(f"{spec}:2: {message}")):
            load(spec)


def test_a_file_of_only_unlabelled_rows_is_an_error_naming_the_key(tmp_path):
    row = {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d", "e"], "label": ""}
    spec = write_jsonl(tmp_path / "test.jsonl", [row, row])
    with pytest.raises(UserError, match=rf"params: {KEY_RE}='.*test\.jsonl': no usable row among 2 "
                                        r"\(no gold label: 2\)"):
        load(spec)


def test_the_wrong_explicit_format_stops_at_the_first_row(foundry):
    with pytest.raises(UserError, match=r"copa\.jsonl:1: context_options: missing"):
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


# The file readers: every local format gives the same rows, and anything unreadable is one UserError naming the file.

ROWS = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}, {"query": "Q2", "choices": ["c", "d", "e"], "gold": 2}]


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.json", "lines.json", "t.parquet", "t.parquet.gz"])
def test_every_row_format_reads_the_same_items(tmp_path, name):
    path = tmp_path / name
    if name.startswith("t.parquet"):
        write_parquet(tmp_path / "t.parquet", ROWS)
        if name.endswith(".gz"):
            path.write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
    else:
        text = json.dumps(ROWS, indent=1) if name == "t.json" else "\n\n".join(json.dumps(r) for r in ROWS)
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    assert load(path).items == [query_item(row) for row in ROWS]
    bad = [ROWS[0], {**ROWS[1], "gold": 3}]
    if name.startswith("t.parquet"):
        write_parquet(tmp_path / "t.parquet", bad)
        if name.endswith(".gz"):
            path.write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
        where = f"{path}: row 2"
    elif name == "t.json":
        path.write_text(json.dumps(bad))
        where = f"{path}: row 2"
    else:
        text = "\n\n".join(json.dumps(r) for r in bad)  # the blank line counts: the bad row is on line 3
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
        where = f"{path}:3"
    with pytest.raises(UserError, match=re.escape(f"{where}: gold: expected an int in 0..2, got 3")):
        load(path)


def test_unreadable_files_are_named(tmp_path):
    good = json.dumps(ROWS[0]) + "\n"
    cut = gzip.compress((good * 200).encode())
    cases = [
        ("cut.jsonl.gz", cut[:len(cut) // 2], "cut.jsonl.gz: cannot read it (", "a truncated or corrupt gzip file"),
        ("notgz.jsonl.gz", good.encode(), "notgz.jsonl.gz: cannot read it (", "a truncated or corrupt gzip file"),
        ("latin.jsonl", (good + '{"query": "caf\xe9"}\n').encode("latin-1"), "latin.jsonl:2: not UTF-8", ""),
        ("syntax.jsonl", (good + good[:-5] + "\n").encode(), "syntax.jsonl:2: not JSON: ", "(column "),
        ("list.jsonl", (good + "[1, 2]\n").encode(), "list.jsonl:2: expected a JSON object (one row), got list", ""),
        ("deep.jsonl", ("[" * 100_000 + "\n").encode(), "deep.jsonl:1: JSON nested too deeply", ""),
        ("array.json", json.dumps([ROWS[0], 5]).encode(), "array.json: row 2: expected a JSON object (one row), got int",
         ""),
        ("bad.json", b'[{"query": "q"},\n oops]', "bad.json: not JSON: ", "(line 2, column 2)"),
        ("text.parquet", good.encode(), "text.parquet: not a readable Parquet file (", ""),
        ("odd.txt", good.encode(), "unsupported file type", ""),
    ]
    for name, data, start, inside in cases:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError) as e:
            load(tmp_path / name)
        message = str(e.value)
        assert start in message and inside in message and "\n" not in message, message
    mmlu = gzip.compress(("q,1,2,3,4,A\n" * 500).encode())
    (tmp_path / "cut_test.csv.gz").write_bytes(mmlu[:len(mmlu) // 2])
    with pytest.raises(UserError, match=r"cut_test\.csv\.gz: cannot read it \(.*a truncated or corrupt gzip file\)"):
        load(tmp_path / "cut_test.csv.gz")
    (tmp_path / "latin_test.csv").write_bytes("caf\xe9,1,2,3,4,A\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin_test\.csv: not UTF-8 text"):
        load(tmp_path / "latin_test.csv")


def check_reads_or_refuses(path):
    """Reading a task file gives items or a one-line UserError, never another exception."""
    try:
        task = load(path)
    except UserError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
    else:
        assert task.items and all(isinstance(item, MCItem) for item in task.items)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.just(json.dumps(ROWS[0])), st.just(json.dumps(ROWS[1])), st.text(max_size=40),
                       st.builds(json.dumps, st.dictionaries(st.sampled_from(["query", "choices", "gold"]),
                                                             st.one_of(st.integers(-2, 3), st.text(max_size=3),
                                                                       st.lists(st.text(max_size=3), max_size=3),
                                                                       st.none(), st.floats())))),
             max_size=5).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass"))))
def test_any_bytes_in_a_jsonl_task_file_give_items_or_a_user_error(tmp_path, data):
    path = tmp_path / "any.jsonl"
    path.write_bytes(data)
    check_reads_or_refuses(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(gzip.compress),
                      st.lists(st.lists(st.sampled_from(["q", "1", "A", "E", "", " ", '"', "\n", "\x00", "é"]),
                                        max_size=7).map(",".join), max_size=5)
                      .map(lambda rows: gzip.compress("\n".join(rows).encode()))),
       cut=st.integers(0, 400))
def test_any_bytes_in_a_csv_gz_task_file_give_items_or_a_user_error(tmp_path, data, cut):
    path = tmp_path / "any_test.csv.gz"
    path.write_bytes(data[:cut])
    check_reads_or_refuses(path)


def test_builtin_cloze_choices_are_the_lines_without_the_delimiter(shakespeare):
    # acc_norm divides by len(choice) in characters with no delimiter (lm-evaluation-harness,
    # lm_eval/api/task.py, ConfigurableTask.process_results): the built-in task must say what its choices are.
    from kiln.pipeline.tasks.chat_format import ChatFormat
    from kiln.pipeline.tasks.corpus_task import cloze_items
    from kiln.pipeline.text.bpe import load_tokenizer

    chat = ChatFormat(load_tokenizer(shakespeare.tokenizer, ordinary=True))
    items = cloze_items(shakespeare.corpus, chat, 128, 8, seed=0)
    assert len(items) == 8
    for item in items:
        assert item.continuations == tuple("\n" + c for c in item.choices)
        assert not any(c.startswith("\n") for c in item.choices)
