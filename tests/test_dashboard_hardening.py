"""The dashboard as an attacker and a new user meet it: cross-site and malformed writes, path
tricks, links, a label while the trainer writes, half-written runs, and the command itself."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from grooves.dashboard.app import create_app
from grooves.dashboard.app import MAX_BODY, is_loopback
from grooves.dashboard.runs import thin
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory

ORIGIN = "http://127.0.0.1:8765"


def trajectory(text: str, reward: float) -> Trajectory:
    return Trajectory([{"role": "user", "content": "Write a title."}, {"role": "assistant", "content": text}],
                      [1], [2, 3], [1, 1], [-0.1, -0.2], reward=reward, components={"quality": reward})


def make_run(folder, texts=("a title", "another")) -> int:
    """A run with one metrics row and a recorded group; the first trajectory's id."""
    store = RunStore(folder)
    store.log_metrics(1, {"reward/total": 0.5})
    store.record_groups(1, [Group({"id": "t"}, [trajectory(t, 0.5) for t in texts])])
    (ident,) = store.db.execute("SELECT MIN(id) FROM trajectories").fetchone()
    store.close()
    return ident


def labels(folder) -> list:
    with sqlite3.connect(folder / "run.sqlite") as db:
        return db.execute("SELECT trajectory_id, label FROM labels").fetchall()


@pytest.fixture
def root(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs / "r")
    return runs


@pytest.fixture
def client(root):
    return TestClient(create_app(root), base_url=ORIGIN)


# --- writes: only the page's own JSON, bounded, into the run's own file --------------------------


@pytest.mark.parametrize(("headers", "status", "message"), [
    ({"Origin": "http://evil.example", "Content-Type": "application/json"}, 403, "origin 'http://evil.example'"),
    ({"Origin": "http://127.0.0.1:9999", "Content-Type": "application/json"}, 403, "may not post here"),
    ({"Origin": "null", "Content-Type": "application/json"}, 403, "may not post here"),
    ({"Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"}, 403, "cross-site request"),
    ({"Content-Type": "text/plain"}, 415, "must be JSON"),  # what a cross-site form or fetch can send unasked
    ({}, 415, "no Content-Type was declared"),  # fetch with a Blob body sends no Content-Type at all
])
def test_a_post_that_is_not_the_pages_own_json_writes_nothing(client, root, headers, status, message):
    body = json.dumps({"id": 1, "label": "hack"}).encode()
    response = client.post("/api/runs/r/labels", content=body, headers=headers)
    assert response.status_code == status and message in response.json()["error"]
    assert labels(root / "r") == []
    same_site = client.post("/api/runs/r/labels", content=body, headers={
        "Origin": ORIGIN, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json; charset=utf-8"})
    assert same_site.status_code == 200 and labels(root / "r") == [(1, "hack")]


def test_huge_and_malformed_bodies_get_a_4xx_and_the_server_stays_up(client, root):
    huge = json.dumps({"id": 1, "label": "bad", "note": "x" * (MAX_BODY + 1)})
    assert client.post("/api/runs/r/labels", content=huge, headers={"Content-Type": "application/json"}
                       ).status_code == 413
    chunks = iter([b'{"id": 1, "label": "bad", "note": "', b"y" * MAX_BODY, b'"}'])  # chunked: no length
    assert client.post("/api/runs/r/labels", content=chunks, headers={"Content-Type": "application/json"}
                       ).status_code == 413
    for body, status, message in [
            ('{"id": 1, "label": ', 422, "JSON decode error"), ("[1, 2]", 422, "body"),
            ('{"id": 100000000000000000000000000000, "label": "bad"}', 422, "body.id"),
            ('{"id": -1, "label": "bad"}', 422, "body.id"), ('{"id": "1; DROP", "label": "bad"}', 422, "body.id"),
            ('{"id": 1, "label": "bad", "note": "' + "z" * 2001 + '"}', 422, "body.note"),
            ('{"id": 1, "label": "bad", "extra": 1}', 422, "body.extra"),
            ('{"id": 424242, "label": "bad"}', 400, "no trajectory with id 424242")]:
        response = client.post("/api/runs/r/labels", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == status and message in response.json()["error"], (body, response.text)
    huge_id = 10**30
    assert client.get(f"/api/runs/r/samples/{huge_id}").status_code == 422  # an OverflowError in SQLite before
    assert client.get(f"/api/runs/r/review?step={huge_id}").status_code == 422
    assert client.get("/api/runs/r/review?seed=-1").status_code == 422
    assert labels(root / "r") == [] and client.get("/api/runs").status_code == 200


@pytest.mark.parametrize("name", ["..", "%2E%2E", ".r", "r%00", "%2Fetc", "..%5Cr", "x" * 300])
def test_run_names_cannot_reach_outside_the_root(client, root, name):
    response = client.post(f"/api/runs/{name}/labels", json={"id": 1, "label": "bad"})
    assert response.status_code in (404, 405) and labels(root / "r") == []
    assert client.get(f"/api/runs/{name}").status_code in (404, 405)


def test_a_run_sqlite_that_links_elsewhere_is_never_written(tmp_path, root, client):
    outside = tmp_path / "elsewhere"
    ident = make_run(outside)
    (root / "linked").mkdir()
    (root / "linked" / "metrics.jsonl").write_text('{"step": 1, "reward/total": 0.5}\n')
    (root / "linked" / "run.sqlite").symlink_to(outside / "run.sqlite")
    response = client.post("/api/runs/linked/labels", json={"id": ident, "label": "hack"})
    assert response.status_code == 400 and "is a link" in response.json()["error"]
    assert labels(outside) == []


def test_reading_a_run_without_a_database_creates_none(client, root):
    (root / "young").mkdir()
    (root / "young" / "metrics.jsonl").write_text('{"step": 1, "reward/total": 0.5}\n')
    for path in ("/api/runs/young/review", "/api/runs/young/samples/1"):
        response = client.get(path)
        assert response.status_code == 400 and "no run.sqlite yet" in response.json()["error"]
    assert client.post("/api/runs/young/labels", json={"id": 1, "label": "bad"}).status_code == 400
    assert sorted(p.name for p in (root / "young").iterdir()) == ["metrics.jsonl"]


WRITER = """
import sys, time
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory

store = RunStore(sys.argv[1])  # as the trainer opens it: the default 5 s busy timeout
t = Trajectory([{"role": "user", "content": "q"}], [1], [2], [1], [-0.1], reward=0.1, components={"q": 0.1})
store.db.execute("BEGIN IMMEDIATE")  # a long write: the dashboard's label has to wait for it
store.db.execute("INSERT INTO alerts (step, detector, severity, message, evidence, created) "
                 "VALUES (2, 'd', 'warn', 'm', '{}', 0)")
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
store.db.commit()
for step in range(2, 17):  # then steps as fast as it can, while labels go in
    store.record_groups(step, [Group({"id": f"s{step}"}, [t] * 8)])
    store.log_metrics(step, {"reward/total": 0.1})
print("done", flush=True)
"""


@pytest.mark.slow
def test_a_label_while_the_trainer_writes_waits_and_neither_side_fails(tmp_path, root, client):
    ident = make_run(root / "training")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root / "training"), "6"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ)
    assert writer.stdout.readline().strip() == "holding"
    answers = []

    def post_labels():
        for index in range(12):  # the first one waits past SQLite's default 5 s for the long write
            label = ("hack", "good", "bad")[index % 3]
            answers.append((label, client.post("/api/runs/training/labels", json={"id": ident, "label": label})))

    poster = threading.Thread(target=post_labels)
    poster.start()
    out, err = writer.communicate(timeout=300)
    poster.join(timeout=300)
    assert writer.returncode == 0 and "done" in out, err  # the trainer never saw "database is locked"
    assert [r.status_code for _, r in answers] == [200] * 12, [r.text for _, r in answers]
    assert labels(root / "training") == [(ident, answers[-1][0])]  # the last label is the one kept
    with sqlite3.connect(root / "training" / "run.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 2 + 15 * 8


# --- a half-written run still lists and opens ---------------------------------------------------


def test_a_half_written_run_lists_and_opens(client, root):
    crashed = root / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_bytes(
        b'{"step": 1, "time": 10.0, "reward/total": 0.25, "kl": 0.01}\n'
        b'{"step": 2, "rew\n'                          # a line cut by a crash, then more lines
        b'["not", "a", "row"]\n'
        b'{"time": 11.0, "reward/total": 9}\n'          # no step
        b'{"step": "3", "reward/total": 9}\n'          # a step that is no number
        b'{"step": 3, "time": 12.0, "reward/total": 0.5, "note": "\xff\xfe"}\n'
        b'{"step": 4, "time": 13.0, "reward/tot')       # being written right now
    (crashed / ".lock.owner").write_text("[1, 2]")  # not what a trainer writes
    with sqlite3.connect(crashed / "run.sqlite") as db:
        db.execute("CREATE TABLE alerts (id INTEGER PRIMARY KEY, step INTEGER, detector TEXT, severity TEXT, "
                   "message TEXT, evidence TEXT, created REAL)")
        db.execute("INSERT INTO alerts (step, detector, severity, message, evidence, created) VALUES "
                   "(3, 'collapse', 'warn', 'same', '{\"action\": \"pa', 1.0), (3, 'x', 'warn', 'm', '[1]', 2.0)")
    (root / "empty-db").mkdir()
    (root / "empty-db" / "run.sqlite").write_bytes(b"")
    (root / "garbage-db").mkdir()
    (root / "garbage-db" / "run.sqlite").write_bytes(b"this is not a database" * 100)
    (root / "garbage-db" / "metrics.jsonl").write_text("")

    listed = client.get("/api/runs")
    assert listed.status_code == 200
    runs = {r["name"]: r for r in listed.json()["runs"]}
    assert set(runs) == {"r", "crashed", "empty-db", "garbage-db"}
    assert (runs["crashed"]["step"], runs["crashed"]["reward"], runs["crashed"]["alerts"]) == (3, 0.5, 2)
    assert runs["crashed"]["status"] == "stopped" and runs["crashed"]["skipped_lines"] == 4
    run = client.get("/api/runs/crashed").json()
    charts = {c["title"]: c["lines"][0]["points"] for c in run["charts"]}
    assert charts == {"reward/total": [[1, 0.25], [3, 0.5]], "kl": [[1, 0.01]]}
    assert [a["evidence"] for a in run["alerts"]] == [{"unreadable": '{"action": "pa'}, {"value": [1]}]
    for name in ("empty-db", "garbage-db"):
        detail = client.get(f"/api/runs/{name}")
        assert detail.status_code == 200 and detail.json()["charts"] == [] and detail.json()["alerts"] == []


def test_long_curves_are_thinned_to_what_a_chart_can_show(client, root):
    assert thin(list(range(10)), 4) == [0, 3, 6, 9] and thin([1, 2], 4) == [1, 2]
    rows = "".join(json.dumps({"step": s, "time": float(s), "reward/total": s / 5000}) + "\n" for s in range(5000))
    (root / "long").mkdir()
    (root / "long" / "metrics.jsonl").write_text(rows)
    (points,) = [c["lines"][0]["points"] for c in client.get("/api/runs/long").json()["charts"]]
    assert len(points) == 1000 and points[0] == [0, 0.0] and points[-1] == [4999, 4999 / 5000]


def test_every_answer_forbids_other_scripts_and_framing(client):
    for path in ("/", "/static/app.js", "/api/runs", "/api/runs/nope"):
        headers = client.get(path).headers
        policy = headers["content-security-policy"]
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, path
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in client.post("/api/runs/r/labels", content=b"x").headers[
        "content-security-policy"]  # refused answers too


# --- not on loopback: a token ------------------------------------------------------------------


def test_off_loopback_every_request_needs_the_token(root):
    app = create_app(root, check_host=False, token="s3cret")
    stranger = TestClient(app, base_url="http://192.168.1.20:8765")
    assert stranger.get("/api/runs").status_code == 401 and stranger.get("/").status_code == 401
    assert stranger.post("/api/runs/r/labels", json={"id": 1, "label": "hack"}).status_code == 401
    assert stranger.get("/?token=wrong", follow_redirects=False).status_code == 401
    assert labels(root / "r") == []
    user = TestClient(app, base_url="http://192.168.1.20:8765")
    entry = user.get("/?token=s3cret", follow_redirects=False)
    assert entry.status_code == 303 and entry.headers["location"] == "/"
    assert "HttpOnly" in entry.headers["set-cookie"] and "SameSite=Strict" in entry.headers["set-cookie"]
    assert user.get("/api/runs").status_code == 200  # the cookie carries the token from here on
    assert user.post("/api/runs/r/labels", json={"id": 1, "label": "good"}).status_code == 200


def test_loopback_means_the_whole_loopback_range():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "[::1]", "::1")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "192.168.1.2", "localhost.evil.example", "")] == [False] * 4


# --- the command, as a new user starts it ------------------------------------------------------


def test_help_says_what_it_reads_writes_and_where(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["dashboard", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    text = " ".join(shown.output.split())
    assert "http://127.0.0.1:8765" in text and "writes only review labels" in text and "token" in text
    (tmp_path / "file").write_text("")
    result = runner.invoke(app, ["dashboard", "--runs", str(tmp_path / "file")])
    assert result.exit_code == 2 and "is not a folder" in result.output and "Traceback" not in result.output
    run = tmp_path / "runs" / "my-run"  # a common slip: the run's own folder given as the root
    make_run(run)
    result = runner.invoke(app, ["dashboard", "--runs", str(run)], terminal_width=300)
    assert result.exit_code == 2 and f"is a run, not a runs root: use --runs {run.parent}" in result.output


def start(args: list[str], cwd) -> tuple[subprocess.Popen, str]:
    """``grooves dashboard ARGS`` in a process; it and the lines it printed up to the address."""
    process = subprocess.Popen([sys.executable, "-m", "grooves.cli", "dashboard", *args], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    lines = []
    while not lines or "grooves dashboard on" not in lines[-1]:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the dashboard did not start: {''.join(lines)}")
        lines.append(line)
    return process, "".join(lines)


def stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    return rest


@pytest.mark.slow
def test_the_command_serves_the_address_it_prints_and_stops_cleanly(tmp_path, root):
    process, printed = start(["--runs", str(root), "--port", "0"], tmp_path)
    try:
        url = printed.split("grooves dashboard on ")[1].split()[0]
        assert not url.endswith(":0/")  # port 0 asked for any port; the one printed is the one served
        assert [r["name"] for r in httpx.get(url + "api/runs").json()["runs"]] == ["r"]
    finally:
        rest = stop(process)
    assert process.returncode in (0, 130) and "Traceback" not in rest, rest  # 130: uvicorn re-raises SIGINT

    process, printed = start(["--runs", str(root), "--port", "0", "--host", "0.0.0.0"], tmp_path)
    try:
        assert "warning: listening on 0.0.0.0, not loopback" in printed
        url = printed.split("grooves dashboard on ")[1].split()[0]
        port = url.split(":")[2].split("/")[0]
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs").status_code == 401
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=True) as browser:
            assert browser.get("/" + url.split("/", 3)[3]).status_code == 200  # ?token=... then the page
            assert browser.get("/api/runs").status_code == 200
    finally:
        stop(process)
