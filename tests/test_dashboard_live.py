"""Live pages without polling (server-sent events over a real server on 127.0.0.1), a run paused
by an alert (its evidence and the command that continues it, run for real), the vendored chart
library and the favicon."""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from grooves.dashboard.app import create_app
from grooves.runs.store import RunStore
from grooves.serve.app import ServerThread
from helpers import tiny_config

STATIC = Path(__file__).resolve().parents[1] / "src" / "grooves" / "dashboard" / "static"


@pytest.fixture
def root(tmp_path):
    runs = tmp_path / "runs"
    store = RunStore(runs / "live")
    store.log_metrics(1, {"reward/total": 0.1})
    store.close()
    paused = RunStore(runs / "paused")
    paused.log_metrics(3, {"reward/total": 0.9})
    paused.record_alert(2, "collapse", "warn", "earlier", {"text": "x", "action": "warn"})
    paused.record_alert(3, "judge_directed", "critical", "addresses the judge",
                        {"text": "Dear judge", "pattern": "judge", "action": "pause"})
    paused.close()
    return runs


def hold(folder: Path) -> None:
    """What a training process writes while it holds the run."""
    (folder / ".lock.owner").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def events(lines, count: int, timeout: float = 10.0) -> list[tuple[str, dict]]:
    """The next ``count`` events of an event stream's lines, as (name, data)."""
    found, name, deadline = [], None, time.monotonic() + timeout
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            found.append((name, json.loads(line[len("data: "):])))
            if len(found) == count:
                return found
        assert time.monotonic() < deadline, f"only {found} within {timeout} s"
    return found


def test_a_training_run_is_pushed_when_it_writes_and_the_stream_ends_with_it(root):
    hold(root / "live")
    store = RunStore(root / "live")  # the trainer holds its store open (opening it touches run.sqlite)
    with ServerThread(create_app(root)) as server, httpx.Client(base_url=server.base_url.removesuffix("/v1")) as http:
        shown = http.get("/api/runs/live").json()
        assert shown["status"] == "running" and shown["version"].endswith("/training")
        with http.stream("GET", "/api/runs/live/events", params={"since": shown["version"]}, timeout=20) as stream:
            lines = stream.iter_lines()
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert "default-src 'self'" in stream.headers["content-security-policy"]
            store.log_metrics(2, {"reward/total": 0.3})  # the trainer writes a step
            store.close()
            ((name, run),) = events(lines, 1)  # nothing was sent for the version the page already had
            assert name == "run" and run["charts"][0]["lines"][0]["points"] == [[1, 0.1], [2, 0.3]]
            (root / "live" / ".lock.owner").unlink()  # the process ends
            (name, ended), end = events(lines, 2)
            assert (name, ended["status"], ended["charts"], end) == ("run", "stopped", run["charts"],
                                                                     ("end", {"status": "stopped"}))


def test_a_stream_of_a_run_that_is_not_training_sends_it_once_and_ends(root):
    with ServerThread(create_app(root)) as server, httpx.Client(base_url=server.base_url.removesuffix("/v1")) as http:
        with http.stream("GET", "/api/runs/live/events", timeout=20) as stream:
            (name, run), end = events(stream.iter_lines(), 2)
            assert (name, run["status"], end) == ("run", "stopped", ("end", {"status": "stopped"}))
        assert http.get("/api/runs/nope/events").status_code == 404


def test_the_runs_list_stream_tells_of_a_new_run(root):
    with ServerThread(create_app(root)) as server, httpx.Client(base_url=server.base_url.removesuffix("/v1")) as http:
        with http.stream("GET", "/api/events", timeout=20) as stream:
            store = RunStore(root / "new")
            store.log_metrics(1, {"reward/total": 0.5})
            store.close()
            ((name, data),) = events(stream.iter_lines(), 1)
            assert name == "runs" and sorted(r["name"] for r in data["runs"]) == ["live", "new", "paused"]


def test_a_paused_run_names_its_alert_and_the_command_that_continues_it(root):
    client = TestClient(create_app(root), base_url="http://127.0.0.1:8765")
    run = client.get("/api/runs/paused").json()
    assert run["status"] == "paused by an alert"
    folder = root / "paused"
    assert run["halt"] == {
        "action": "pause", "step": 3,
        "alerts": [{"step": 3, "detector": "judge_directed", "severity": "critical", "message": "addresses the judge",
                    "evidence": {"text": "Dear judge", "pattern": "judge", "action": "pause"},
                    "created": run["alerts"][1]["created"]}],  # the warning of step 2 did not pause it
        "resume": f"grooves train {folder}/config.toml --resume --out {folder} --ack judge_directed"}
    assert client.get("/api/runs/live").json()["halt"] is None


PLANTED = '''
[monitors.judge_directed]
extra_patterns = ["[\\\\s\\\\S]"]

[alerts]
policy = "pause"
'''


def test_the_resume_command_shown_for_a_paused_run_continues_it(tmp_path):
    """A real run (tiny model) paused by a real detector at step 1; the command the dashboard
    shows, run as a user would paste it, finishes the run."""
    from typer.testing import CliRunner

    from grooves.cli import app
    from grooves.training import load_config, run_config

    config = tiny_config(tmp_path, steps=2)
    config.write_text(config.read_text() + PLANTED)
    runs = tmp_path / "runs"
    run = run_config(load_config(config), runs=runs, progress=False)
    assert (run.step, run.halted_by) == (1, "pause")
    client = TestClient(create_app(runs), base_url="http://127.0.0.1:8765")
    halt = client.get(f"/api/runs/{run.name}").json()["halt"]
    words = shlex.split(halt["resume"])
    assert words[:2] == ["grooves", "train"] and words[-2:] == ["--ack", "judge_directed"]
    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, result.output
    shown = client.get(f"/api/runs/{run.name}").json()
    assert (shown["status"], shown["step"], shown["halt"]) == ("finished", 2, None)


def test_the_chart_library_is_vendored_with_its_licence_and_nothing_is_fetched_elsewhere(tmp_path):
    client = TestClient(create_app(tmp_path), base_url="http://127.0.0.1:8765")
    page = client.get("/").text
    for asset in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/uPlot.min.css"):
        assert asset in page and client.get(asset).status_code == 200
    assert "MIT License" in (STATIC / "vendor" / "uplot" / "LICENSE").read_text()
    assert client.get("/static/vendor/uplot/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot")
    for path in [p for p in STATIC.glob("*") if p.suffix in (".html", ".js", ".css")]:
        text = path.read_text()
        assert "http://" not in text and "https://" not in text, path  # no CDN: the page works offline
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"


def test_every_static_file_is_package_data_so_a_wheel_carries_it():
    """setuptools' ``package-data`` globs do not descend into folders: the vendored library needs
    its own line, or an installed (not editable) dashboard has no charts."""
    import tomllib
    from fnmatch import fnmatchcase

    project = tomllib.loads((STATIC.parents[3] / "pyproject.toml").read_text())
    globs = [g.split("/") for g in project["tool"]["setuptools"]["package-data"]["grooves"]]
    files = [p.relative_to(STATIC.parents[1]).parts for p in STATIC.rglob("*") if p.is_file()]
    shipped = [f for f in files if any(len(g) == len(f) and all(map(fnmatchcase, f, g)) for g in globs)]
    assert ("dashboard", "static", "vendor", "uplot", "uPlot.iife.min.js") in files
    assert sorted(set(files) - set(shipped)) == []
