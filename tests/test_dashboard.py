"""The dashboard's JSON API on run folders built by hand: status, curves, labels, errors."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
from fastapi.testclient import TestClient

from grooves.dashboard.app import create_app
from grooves.dashboard.app import hostname
from grooves.dashboard.runs import token_spans
from grooves.policy.models import byte_tokenizer
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory


def trajectory(text: str, reward: float) -> Trajectory:
    return Trajectory([{"role": "user", "content": "Write a title."}, {"role": "assistant", "content": text}],
                      [1], [2, 3], [1, 1], [-0.1, -0.2], reward=reward, components={"quality": reward})


@pytest.fixture
def root(tmp_path):
    runs = tmp_path / "runs"
    done = RunStore(runs / "done")
    (runs / "done" / "config.toml").write_text("steps = 2\n")
    done.log_metrics(0, {"val/reward/total": 0.2, "val/reward/quality": 0.2})
    done.log_metrics(1, {"reward/total": 0.3, "reward/quality": 0.3, "kl": 0.01, "entropy": math.nan})
    done.log_metrics(2, {"reward/total": 0.5, "reward/quality": 0.5, "kl": 0.02, "val/reward/total": 0.4})
    done.record_groups(2, [Group({"id": "a"}, [trajectory("good title", 0.9), trajectory("bad", math.nan)])])
    done.close()
    paused = RunStore(runs / "paused")
    (runs / "paused" / "config.toml").write_text("steps = 10\n")
    paused.log_metrics(1, {"reward/total": 0.9})
    paused.record_alert(1, "collapse", "warn", "same output", {"text": "x", "action": "pause"})
    paused.close()
    (runs / "not-a-run").mkdir()
    return runs


@pytest.fixture
def client(root):
    return TestClient(create_app(root), base_url="http://127.0.0.1:8765")


def test_runs_list_status_and_curves(client):
    runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
    assert set(runs) == {"done", "paused"}  # a folder without metrics or run.sqlite is no run
    assert runs["done"]["status"] == "finished" and runs["done"]["step"] == 2 and runs["done"]["steps"] == 2
    assert (runs["done"]["reward"], runs["done"]["val_reward"], runs["done"]["val_step"]) == (0.5, 0.4, 2)
    assert runs["paused"]["status"] == "paused by an alert" and runs["paused"]["alerts"] == 1
    run = client.get("/api/runs/done").json()
    charts = {c["title"]: c["lines"] for c in run["charts"]}
    assert list(charts) == ["reward/total", "reward/quality", "kl"]  # entropy was only NaN: no chart
    assert charts["reward/total"] == [{"label": "train", "metric": "reward/total", "points": [[1, 0.3], [2, 0.5]]},
                                      {"label": "held-out", "metric": "val/reward/total",
                                       "points": [[0, 0.2], [2, 0.4]]}]
    assert run["review_steps"] == {"train": [2]}


def test_a_learn_run_charts_the_gate(client, root):
    """A grooves learn run: the alias's and the candidate's held-out reward, and what was rolled out."""
    learn = RunStore(root / "learner")
    (root / "learner" / "config.toml").write_text("steps = 2\n")
    learn.log_metrics(1, {"learn/reward_before": 0.2, "learn/reward_after": 0.3, "learn/gated_in": 1.0})
    learn.log_metrics(2, {"learn/reward_before": 0.3, "learn/reward_after": 0.1, "learn/gated_in": 0.0})
    learn.close()
    charts = {c["title"]: c["lines"] for c in client.get("/api/runs/learner").json()["charts"]}
    gate = charts["learn: held-out reward, served alias vs candidate"]
    assert [(line["label"], line["points"]) for line in gate] == [("alias (before)", [[1, 0.2], [2, 0.3]]),
                                                                  ("candidate", [[1, 0.3], [2, 0.1]])]
    assert charts["learn/gated_in"][0]["points"] == [[1, 1.0], [2, 0.0]]
    assert "learn: held-out reward, served alias vs candidate" not in {
        c["title"] for c in client.get("/api/runs/done").json()["charts"]}


def test_a_live_training_process_means_running(client, root):
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}
    (root / "paused" / ".lock.owner").write_text(json.dumps(owner))
    assert client.get("/api/runs/paused").json()["status"] == "running"
    (root / "paused" / ".lock.owner").write_text(json.dumps({**owner, "pid": 2 ** 22 + 1}))  # no such process
    assert client.get("/api/runs/paused").json()["status"] == "paused by an alert"


def test_labels_are_stored_like_grooves_review_labels(client, root):
    review = client.get("/api/runs/done/review?k=1").json()
    (top,) = review["lists"]["top"]
    assert (review["step"], review["count"], review["failed"], top["reward"]) == (2, 2, 1, 0.9)
    assert review["lists"]["random"][0]["reward"] is None  # a failed total is shown as failed, never 0
    assert client.post("/api/runs/done/labels", json={"id": top["id"], "label": "good", "note": " fine "}).json() == \
        {"id": top["id"], "label": "good", "note": "fine"}
    client.post("/api/runs/done/labels", json={"id": top["id"], "label": "hack"})  # relabelling replaces
    store = RunStore(root / "done")
    assert store.read_labels()[top["id"]]["label"] == "hack"
    store.close()


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), [
    ("get", "/api/runs/nope", None, 404, "no run 'nope'"),
    ("get", "/api/runs/.hidden", None, 404, "is not a run name"),
    ("get", "/api/runs/done/review?step=7", None, 400, "no trajectories recorded at step 7"),
    ("get", "/api/runs/done/review?k=0", None, 400, "k must be between 1 and 50"),
    ("get", "/api/runs/done/samples/999", None, 404, "has no sample 999"),
    ("post", "/api/runs/done/labels", {"id": 1, "label": "cheat"}, 422, "body.label"),
    ("post", "/api/runs/done/labels", {"id": 999, "label": "bad"}, 400, "no trajectory with id 999"),
    ("post", "/api/runs/done/compare", {"a": "base", "b": "oops"}, 400, "'oops' is not 'base'"),
    ("post", "/api/runs/done/compare", {"a": "base", "b": "1"}, 400, "has no complete checkpoint yet"),
])
def test_bad_requests_get_clear_errors(client, method, path, body, status, message):
    response = client.request(method.upper(), path, json=body)
    assert response.status_code == status and message in response.json()["error"]


def test_only_loopback_hosts_are_answered(root):
    stranger = TestClient(create_app(root), base_url="http://evil.example:8765")
    assert stranger.get("/api/runs").status_code == 403
    assert [hostname(h) for h in ("127.0.0.1:8765", "localhost", "[::1]:80")] == ["127.0.0.1", "localhost", "[::1]"]


def test_the_page_and_its_assets_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text and "http" not in page.text.split("<body>")[1]
    assert client.get("/static/app.js").status_code == 200 and client.get("/static/style.css").status_code == 200


def test_token_spans_split_where_training_starts_and_stops():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("ab", add_special_tokens=False) + tokenizer.encode("TOOL", add_special_tokens=False) + \
        tokenizer.encode("c", add_special_tokens=False)
    spans = token_spans(ids, [1, 1, 0, 0, 0, 0, 1], tokenizer)
    assert spans == [{"trained": True, "tokens": 2, "text": "ab"}, {"trained": False, "tokens": 4, "text": "TOOL"},
                     {"trained": True, "tokens": 1, "text": "c"}]
    assert token_spans(ids[:2], [1, 1]) == [{"trained": True, "tokens": 2, "text": None}]


def test_the_command_refuses_a_missing_root_and_a_busy_port(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["dashboard", "--runs", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "runs root" in missing.output and "does not exist" in missing.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["dashboard", "--runs", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output


def test_eval_results_are_listed(tmp_path, root):
    folder = tmp_path / "evals" / "e1"
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps({"name": "e1", "candidates": [
        {"name": "base", "model": "base", "kind": "local", "tasks": 4, "reward": 0.5, "reward_se": 0.1,
         "tokens_per_1k": 1000.0}]}))
    (tmp_path / "evals" / "broken").mkdir()
    (tmp_path / "evals" / "broken" / "eval.json").write_text("{")
    client = TestClient(create_app(root, evals=tmp_path / "evals"), base_url="http://127.0.0.1")
    (listed,) = client.get("/api/evals").json()["evals"]
    assert listed["name"] == "e1" and listed["chart"] is False and listed["candidates"][0]["reward"] == 0.5
    assert client.get("/api/evals/e1/chart").status_code == 404


def test_the_dashboard_room_loads_no_room_above_it():
    import subprocess
    import sys

    code = ("import sys, grooves.dashboard.app; "
            "print(' '.join(m for m in sys.modules if m.startswith(('grooves.cli', 'grooves.serve', 'grooves.backend'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == ""


def dashboard_imports() -> dict[str, set[str]]:
    """Which ``grooves.dashboard`` modules each of its files imports, anywhere in the file: ``from
    grooves.dashboard import runs`` imports the package (its ``__init__``) and ``runs``."""
    import ast
    from pathlib import Path

    import grooves.dashboard.app

    room = Path(grooves.dashboard.app.__file__).parent
    modules = {p.stem for p in room.glob("*.py")}
    graph = {}
    for path in room.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grooves.dashboard"):
                names = [node.module] + [f"grooves.dashboard.{a.name}" for a in node.names
                                         if node.module == "grooves.dashboard" and a.name in modules]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("grooves.dashboard")]
            found |= set(names)
        graph["grooves.dashboard" if path.stem == "__init__" else f"grooves.dashboard.{path.stem}"] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in ``graph``, each from the first module it meets."""

    def circle(node, path):
        if node in path:
            return path[path.index(node):] + [node]
        return next((found for nxt in sorted(graph.get(node, ())) if (found := circle(nxt, path + [node]))), None)

    return [found for node in sorted(graph) if (found := circle(node, []))]


def test_the_dashboard_package_and_its_modules_import_no_circle():
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["b", "a", "b"], ["a", "b", "a"]]
    graph = dashboard_imports()
    assert graph["grooves.dashboard"] == set()  # the package imports nothing: no module can import it back
    assert graph["grooves.dashboard.app"] >= {"grooves.dashboard.runs", "grooves.dashboard.compare"}
    assert circles(graph) == []


def test_the_request_filter_is_not_called_a_guard():
    import grooves.dashboard.app as app

    # A Guard in grooves is a reward component that can veto; this middleware filters requests.
    assert not hasattr(app, "Guard") and app.RequestFilter.__doc__.startswith("ASGI middleware")
