"""grooves dashboard in a real headless Chromium driven by Playwright, over a real run.

The run is trained here on the tiny model (4 steps, checkpoints at 2 and 4); a multi-turn
rollout of the search env (scripted turns through the real rollout code) is recorded into its
run.sqlite, and one alert. Chromium is Debian's package (the Makefile installs it); nothing is
downloaded. Set GROOVES_DOCS_SCREENSHOTS=1 to write the screenshots of docs/dashboard.md into
docs/img/ (otherwise they go to the test's temporary folder).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
from pathlib import Path

import pytest

from helpers import tiny_config

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]' installs playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make install puts it there)")]
RUN = "tiny-run"
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from grooves.envs.rollout import Turn, env_groups
    from grooves.envs.search import Search
    from grooves.policy import Policy
    from grooves.training.api import run_config
    from grooves.training.config import load_config
    from grooves.runs.store import RunStore

    folder = tmp_path_factory.mktemp("dash")
    runs = folder / "runs"
    run_config(load_config(tiny_config(folder, steps=4)), runs=runs, progress=False)

    policy, env = Policy.load("tiny"), Search()
    turns = [call("search", query="plain text calendar like the UNIX program cal", k=3),
             call("read", doc_id="calendar.TextCalendar"), call("answer", text="0")]

    def generate(prompts, budgets, pasts=None):
        text = turns.pop(0)
        ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
        return [Turn(text, ids, [0.0] * len(ids), "stop")]

    task = dict(next(t for t in env.question_pool
                     if t["id"] == "search/described_default/calendar.TextCalendar/firstweekday"))
    (group,) = env_groups(policy, env, [task], n=1, generate=generate, turn_tokens=64)
    trajectory = group.trajectories[0]
    trajectory.components = dict(trajectory.metadata["env_scores"])
    trajectory.reward = sum(trajectory.components.values()) / len(trajectory.components)
    store = RunStore(runs / RUN)
    store.record_groups(4, [group])
    store.record_alert(3, "collapse", "warn", "6 of 8 outputs are the same", {"text": "aaaa", "action": "warn"})
    store.close()

    from typer.testing import CliRunner

    from grooves.cli import app

    config = folder / "eval.toml"
    config.write_text(f'name = "tiny"\nrun = "{RUN}"\nlatency_tasks = 1\n[[candidates]]\nname = "base"\n'
                      f'model = "base"\n[[candidates]]\nname = "trained"\nmodel = "{RUN}@4"\nprice_in = 0.1\n'
                      f'price_out = 0.4\n')
    result = CliRunner().invoke(app, ["eval", str(config), "--runs", str(runs), "--out", str(folder / "evals" / "tiny")])
    assert result.exit_code == 0, result.output
    return runs


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def server(root):
    from grooves.dashboard.app import create_app
    from grooves.serve.app import ServerThread

    with ServerThread(create_app(root, evals=root.parent / "evals")) as thread:
        yield thread.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def browser(root):
    # After the run is built: Playwright's sync API keeps an event loop running on this thread,
    # and env rollouts refuse to start inside one.
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    # bypass_csp: wait_for_function evaluates a string, which the dashboard's policy forbids a page
    # (tests/test_dashboard_untrusted_browser.py runs under the policy).
    page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    page.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def screenshot(page, name: str, tmp_path) -> None:
    folder = DOCS_IMG if os.environ.get("GROOVES_DOCS_SCREENSHOTS") == "1" else tmp_path
    page.screenshot(path=str(folder / f"dashboard-{name}.png"), full_page=True)


def metrics_at(root: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (root / RUN / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["step"] == step and "val/reward/total" in r)


def test_runs_list_and_a_run_with_its_curves_and_alerts(page, server, root, tmp_path):
    page.goto(server + "/")
    row = page.locator(f"tr[data-run='{RUN}']")
    row.wait_for()
    assert row.locator("[data-testid=status]").inner_text() == "finished"
    assert "4 / 4" in row.inner_text() and row.locator("td").nth(5).inner_text() == "1"  # one alert
    screenshot(page, "runs", tmp_path)

    row.locator("a").click()
    page.locator(".chart").first.wait_for()
    titles = page.locator(".chart h3").all_inner_texts()
    assert titles[:3] == ["reward/total", "reward/short", "reward/vowels"]
    assert {"kl", "entropy", "completion_len", "clipfrac"} <= set(titles)
    total = page.locator("[data-chart='reward/total']")
    train_points = total.locator("polyline.line-train").get_attribute("points").split()
    heldout_points = total.locator("polyline.line-heldout").get_attribute("points").split()
    assert len(train_points) == 4 and len(heldout_points) == 3  # steps 1-4; held-out at 0, 2, 4
    assert len({p.split(",")[1] for p in train_points}) > 1  # a drawn curve, not a flat placeholder
    assert total.locator("line.alert-mark").count() == 1  # the alert at step 3, on the same axis
    assert "collapse" in page.locator("[data-testid=alert]").inner_text()
    screenshot(page, "run", tmp_path)


def test_label_a_sample_and_find_it_in_run_sqlite(page, server, root, tmp_path):
    page.goto(server + f"/#/run/{RUN}/review?step=4")
    card = page.locator(".card[data-sample]").first
    card.wait_for()
    ident = int(card.get_attribute("data-sample"))
    card.locator("input").fill("repeats the prompt")
    card.locator("button[data-label=hack]").click()
    page.wait_for_function(f"document.querySelector(\".card[data-sample='{ident}'] [data-testid=given]\")"
                           ".textContent === 'hack'")
    with sqlite3.connect(root / RUN / "run.sqlite") as db:
        assert db.execute("SELECT label, note, step FROM labels WHERE trajectory_id = ?", (ident,)).fetchall() == [
            ("hack", "repeats the prompt", 4)]
    from grooves.workflows.review import summarise_labels
    from grooves.runs.store import RunStore

    store = RunStore(root / RUN)
    assert summarise_labels(store).total["hack"] == 1  # what grooves review and guard suggest read
    store.close()
    screenshot(page, "review", tmp_path)


def test_a_multi_turn_transcript_shows_tools_and_trained_tokens(page, server, root, tmp_path):
    with sqlite3.connect(root / RUN / "run.sqlite") as db:
        (ident,) = db.execute("SELECT id FROM trajectories WHERE task_id LIKE 'search/%'").fetchone()
    page.goto(server + f"/#/run/{RUN}/review?step=4&k=5")
    page.locator(f".card[data-sample='{ident}'] a", has_text="3 turns").click()
    page.locator("#turns").wait_for()
    roles = page.locator("#turns .turn").evaluate_all("nodes => nodes.map(n => n.dataset.role)")
    assert roles.count("assistant") == 3 and roles.count("tool") == 3  # the answer tool replies too
    calls = page.locator("[data-testid=tool-call]").all_inner_texts()
    assert [c.split("\n")[0] for c in calls] == ["call search", "call read", "call answer"]
    assert "calendar.TextCalendar" in page.locator(".turn.tool").first.inner_text()
    trained = page.locator("#tokens .trained").all_inner_texts()
    untrained = page.locator("#tokens .untrained").all_inner_texts()
    assert len(trained) == 3 and len(untrained) >= 2  # model turns trained; tool results not
    assert "answer" in trained[-1] and any("calendar.TextCalendar" in text for text in untrained)
    screenshot(page, "transcript", tmp_path)


def test_compare_two_checkpoints_on_the_heldout_tasks(page, server, root, tmp_path):
    page.goto(server + f"/#/run/{RUN}/compare")
    page.locator("#side-a").select_option("2")
    page.locator("#side-b").select_option("4")
    page.locator("#compare").click()
    page.locator("#compare-summary").wait_for(timeout=240_000)
    means = page.locator("#compare-summary .side-mean").all_inner_texts()
    # Evaluated as the run validated: each mean is the held-out reward the run logged at that step.
    assert means == [f"{metrics_at(root, 2)['val/reward/total']:.3f}", f"{metrics_at(root, 4)['val/reward/total']:.3f}"]
    assert page.locator("#compare-tasks tbody tr").count() == 4  # val_size held-out tasks, side by side
    screenshot(page, "compare", tmp_path)


def test_live_updates_while_a_run_trains(page, server, root):
    from grooves.runs.store import RunStore

    store = RunStore(root / "live-run")
    store.log_metrics(1, {"reward/total": 0.1, "kl": 0.01})
    (root / "live-run" / ".lock.owner").write_text(json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}))  # as a training process writes
    page.goto(server + "/#/run/live-run")
    page.locator("[data-testid=status]", has_text="running").wait_for()
    assert page.locator("[data-chart='reward/total'] circle").count() == 1  # one point so far
    store.log_metrics(2, {"reward/total": 0.3, "kl": 0.02})
    store.close()
    page.wait_for_function("(document.querySelector(\"[data-chart='reward/total'] polyline\") || {})"
                           ".getAttribute && document.querySelector(\"[data-chart='reward/total'] polyline\")"
                           ".getAttribute('points').split(' ').length === 2", timeout=15_000)
    (root / "live-run" / ".lock.owner").unlink()
    page.locator("[data-testid=status]", has_text="stopped").wait_for(timeout=15_000)


def test_eval_results_are_shown(page, server, root, tmp_path):
    page.goto(server + "/")
    page.locator("#evals-link").click()
    table = page.locator("table[data-eval=tiny]")
    table.wait_for()
    cells = [row.split("\t") for row in table.locator("tbody tr").all_inner_texts()]
    assert [row[0] for row in cells] == ["base", "trained"]
    report = json.loads((root.parent / "evals" / "tiny" / "eval.json").read_text())
    assert cells[1][2] == f"{report['candidates'][1]['reward']:.3f} ± {report['candidates'][1]['reward_se']:.3f}"
    page.wait_for_function("document.querySelector('img.eval-chart').naturalWidth > 0")  # the PNG loaded
    screenshot(page, "evals", tmp_path)
