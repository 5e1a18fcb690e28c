"""Long work shows its phase, step timing and time left: plain lines in a log, a bar on a terminal."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console
from typer.testing import CliRunner

from grooves.cli import app
from grooves.progress import Reporter, duration
from helpers import tiny_config


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plain_reporter(**kwargs) -> tuple[Reporter, io.StringIO, FakeClock]:
    log, clock = io.StringIO(), FakeClock()
    return Reporter(Console(file=log, width=60), clock=clock, **kwargs), log, clock


def test_duration_reads_at_a_glance():
    assert [duration(s) for s in (0, 44.6, 60, 252, 3599, 3720, 90061)] == \
        ["0s", "45s", "1m00s", "4m12s", "59m59s", "1h02m", "25h01m"]


def test_a_log_gets_phase_lines_and_one_line_per_step_with_an_eta_from_the_second():
    reporter, log, clock = plain_reporter()
    reporter.phase("validating", "8 held-out tasks (step 0)")
    with reporter.counting(30):
        for step, seconds in ((1, 12.0), (2, 10.0), (3, 8.0)):
            reporter.phase("sampling", log=False)  # inside a step: the bar's business, not the log's
            clock.now += seconds
            reporter.advance(step, {"reward": "0.412", "heldout": "0.510 (step 0)"})
    # The ETA leaves out the first (warm-up) step: (10 + 8) / 2 s per step for 28, then 27 steps.
    assert log.getvalue().splitlines() == [
        "validating: 8 held-out tasks (step 0)",
        "step 1/30  reward 0.412  heldout 0.510 (step 0)  12.0 s",
        "step 2/30  reward 0.412  heldout 0.510 (step 0)  10.0 s  eta 4m40s",
        "step 3/30  reward 0.412  heldout 0.510 (step 0)  8.0 s  eta 4m03s",
    ]


def test_a_resumed_count_a_throttled_log_and_quiet():
    reporter, log, clock = plain_reporter()
    with reporter.counting(100, unit="texts", done=20, every=3.0):
        for done in range(40, 101, 20):  # batches of 20 texts, 2 s each
            clock.now += 2.0
            reporter.advance(done)
        assert reporter.timing() == "spent 8s  eta 0s  2.0 s/batch"  # 20 texts an advance: not 2 s a text
    # At most one line per 3 s, and always the last, each with the seconds since the line before;
    # the ETA counts only what is left after a resume.
    assert log.getvalue().splitlines() == ["texts 40/100  2.0 s", "texts 80/100  4.0 s  eta 2s",
                                           "texts 100/100  2.0 s  eta 0s"]
    quiet, log, clock = plain_reporter(enabled=False)
    quiet.phase("loading", "model tiny")
    with quiet.counting(3):
        quiet.advance(1, {"reward": "0.5"})
    assert log.getvalue() == ""


def test_a_terminal_gets_a_bar_with_phase_values_and_a_countdown():
    screen, clock = io.StringIO(), FakeClock()
    reporter = Reporter(Console(file=screen, force_terminal=True, width=160), clock=clock)
    assert reporter.live
    with reporter.counting(10):
        clock.now += 30.0
        reporter.advance(1, {"reward": "0.250"})
        clock.now += 20.0
        reporter.advance(2, {"reward": "0.300"})
        reporter.phase("validating", "4 held-out tasks (step 2)")  # on the bar, no line
        clock.now += 5.0
        assert reporter.timing() == "spent 55s  eta 2m35s  20.0 s/step"  # 8 steps x 20 s, 5 s gone
        assert reporter.status() == "validating 4 held-out tasks (step 2)  reward 0.300"
        assert reporter.counter() == "step 2/10"
    assert "validating:" not in screen.getvalue()
    last = screen.getvalue().rsplit("\r", 1)[-1]  # the bar's final drawing
    assert "step 2/10" in last and "eta 2m35s" in last and "reward 0.300" in last


def test_train_to_a_file_prints_one_line_per_step_matching_metrics(tmp_path):
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["train", str(tiny_config(tmp_path, steps=3)), "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    rows = {row["step"]: row for row in map(json.loads, (runs / "tiny-run" / "metrics.jsonl").read_text().splitlines())}
    lines = result.stdout.splitlines()
    # The phases that can take minutes get a line, before the steps they belong to.
    assert lines[:2] == ["loading: model tiny", "validating: 4 held-out tasks (step 0)"]
    assert "validating: 4 held-out tasks (step 2)" in lines
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3
    pattern = re.compile(r"step (\d)/3  reward (\S+)  heldout (\S+) \(step (\d)\)  (\d+\.\d) s(  eta \S+)?$")
    for number, line in enumerate(steps, start=1):
        match = pattern.match(line)
        assert match, line
        step, reward, heldout, heldout_step = int(match[1]), match[2], match[3], int(match[4])
        assert step == number and reward == f"{rows[step]['reward/total']:.3f}"
        assert heldout_step == (0 if step == 1 else step)  # val_every = 2, and the last step
        assert heldout == f"{rows[heldout_step]['val/reward/total']:.3f}"
        assert float(match[5]) > 0
        assert (match[6] is not None) == (step > 1)  # the ETA appears from the second step
    assert steps[-1].endswith("eta 0s")


def test_the_demo_shows_its_progress_on_the_console_it_is_given(tmp_path, monkeypatch):
    import grooves.demo as demo

    config = tiny_config(tmp_path, steps=2)
    monkeypatch.setattr(demo, "demo_config_path", lambda: config)  # the demo's wiring on the tiny model
    log = io.StringIO()
    result = demo.run_demo(runs=tmp_path / "runs", console=Console(file=log, width=60))
    lines = log.getvalue().splitlines()
    assert lines[:2] == ["loading: model tiny", "validating: 4 held-out tasks (step 0)"]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split("  ")[:2] for line in steps] == [
        ["step 1/2", f"reward {result.run.metrics[1]['reward/total']:.3f}"],
        ["step 2/2", f"reward {result.run.metrics[2]['reward/total']:.3f}"]]


def test_sample_says_what_it_is_doing_on_stderr_and_keeps_stdout_for_completions():
    result = CliRunner().invoke(app, ["sample", "tiny", "hi", "-n", "2", "--max-tokens", "4", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["loading: model tiny", "generating: 2 completions of at most 4 new tokens"]
    assert "loading" not in result.stdout and result.stdout.count("tokens)") == 2
    quiet = CliRunner().invoke(app, ["sample", "tiny", "hi", "--max-tokens", "4", "--seed", "1", "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_rm_train_logs_its_phases_and_the_feature_count(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("text,score\n" + "".join(f"text number {i},{i % 7}\n" for i in range(100)))
    result = CliRunner().invoke(app, ["rm", "train", str(data), "--text-col", "text", "--target-col", "score",
                                      "--backbone", "tiny", "--batch-size", "16", "--out", str(tmp_path / "rm")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:2] == ["loading: backbone tiny", "features: 100 texts, 16 per batch"]
    # Seven batches take well under the 10 s between log lines: the first and the last are shown.
    assert re.fullmatch(r"texts 16/100  \d+\.\d s", lines[2]) and re.fullmatch(r"texts 100/100  \d+\.\d s  eta 0s",
                                                                                lines[3])
    assert lines[4] == "fitting: ridge head" and lines[5].startswith("held-out pearson")
