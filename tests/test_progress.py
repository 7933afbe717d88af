"""Progress and summaries as a log (DVC, a pipe) shows them: complete lines at a steady rate, one counter and one
ETA, never wrapped; a phase without a count says when it starts and ends; a summary is an aligned table."""

import re
import time

from kiln.pipeline.commands.shared import print_metrics
from kiln.pipeline.progress import Progress, clock


def test_a_slow_step_still_prints_lines_at_a_steady_rate(capsys):
    with Progress("pretrain", unit="steps", total=4, interval=0.1) as progress:
        time.sleep(0.55)  # one long first step: the log must not go quiet
        progress.advance(1, loss=4.123456, **{"tok/s now": 12345})
    lines = capsys.readouterr().err.splitlines()
    ticks = [line for line in lines if line.startswith("pretrain: 0/4 steps")]
    assert len(ticks) >= 3, lines  # ~5 expected at 0.1 s; a busy machine may lose some
    assert re.match(r"pretrain: done in 0:00:0\d \| 1/4 steps \| ", lines[-1]) and "tok/s now 12,345" in lines[-1]
    assert "loss 4.123" in lines[-1] and "eta" not in lines[-1]


def test_one_counter_and_one_eta_per_line_and_no_wrapping(capsys):
    fields = {f"field_{i}": 1.5 for i in range(12)}  # a line far wider than the 80 columns rich assumes in a log
    with Progress("sft", unit="steps", total=10, interval=0.05, start=2) as progress:
        progress.advance(3, **fields)
        time.sleep(0.2)
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("sft: done")]
    assert lines
    for line in lines:
        assert len(line) > 80 and line.startswith("sft: 5/10 steps  0:00:0")
        assert len(re.findall(r"\d+/10 steps", line)) == 1 and line.count("eta ") == 1
        assert line.endswith("field_11 1.5")  # the whole line, on one line


def test_a_phase_without_a_count_says_what_it_is_doing_and_when_it_ends(capsys):
    with Progress("dpo: scoring the start model on the held-out data", interval=0.05):
        time.sleep(0.12)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "dpo: scoring the start model on the held-out data: 0:00:00"
    assert lines[-1] == "dpo: scoring the start model on the held-out data: done in 0:00:00"


def test_a_job_that_fails_at_once_prints_nothing_before_its_error(capsys):
    """Bad input is one line: a phase that stops before its first timed line leaves that line alone."""
    try:
        with Progress("sft: loading base and the data"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert capsys.readouterr().err == ""


def test_progress_is_quiet_on_every_rank_but_the_first(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with Progress("pretrain", unit="steps", total=2, interval=0.02) as progress:
        progress.advance(2)
        time.sleep(0.06)
    assert capsys.readouterr().err == ""


def test_clock():
    assert [clock(s) for s in (0, 59.4, 61, 3600 * 25 + 62)] == ["0:00:00", "0:00:59", "0:01:01", "25:01:02"]


def test_the_summary_is_an_aligned_table_with_averages_labelled(capsys):
    print_metrics("pretrain", {"val_loss": 4.01205, "steps": 400, "tokens_per_s": 16479.0,
                               "size_auto": {"n_layer": 2, "tokens": 1_600_000, "flops": 1e21},
                               "logps": -12.91322, "note": "a [bold] word"})
    assert capsys.readouterr().err.splitlines() == [
        "pretrain:",
        "  val_loss           4.01205",
        "  steps              400",
        "  tokens_per_s       16,479.0  (stage average)",
        "  size_auto.n_layer  2",
        "  size_auto.tokens   1,600,000",
        "  size_auto.flops    1e+21",
        "  logps              -12.91322",  # every digit the metrics file has
        "  note               a [bold] word",
    ]


def test_user_text_prints_as_it_is():
    """rich markup ate user text: `[sft]` vanished from a hand run's closing line, `:x:` became an emoji. The
    console reads neither unless a call asks (the error prefix does, its message escaped)."""
    from kiln.pipeline.progress import console

    with console.capture() as captured:
        console.print("a hand run (--set tag=[sft] :x: [bold]b[/])")
    assert captured.get() == "a hand run (--set tag=[sft] :x: [bold]b[/])\n"
