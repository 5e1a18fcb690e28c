"""grooves dashboard in a real headless Chromium driven by Playwright, over a real run.

The run is trained here on the tiny model (4 steps, checkpoints at 2 and 4); a multi-turn
rollout of the search env (scripted turns through the real rollout code) is recorded into its
run.sqlite, and one alert. A second run, written by hand with numbers to check, is paused by an
alert and has a flat curve; the two are overlaid. Charts are uPlot's canvas: values are read
where a person reads them, in the legend under the cursor. Chromium is Debian's package (the
Makefile installs it); nothing is downloaded. Set GROOVES_DOCS_SCREENSHOTS=1 to write the
screenshots of docs/dashboard.md into docs/img/ (otherwise they go to the test's temporary folder).
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
OTHER = "other-run"
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
    other = RunStore(runs / OTHER)
    (runs / OTHER / "config.toml").write_text("steps = 10\n")
    for step, reward in ((1, 0.2), (2, 0.4), (3, 0.6)):
        other.log_metrics(step, {"reward/total": reward, "reward/flat": 0.25, "kl": 0.0})
    other.record_alert(3, "judge_directed", "critical", "4 of 4 outputs address the judge",
                       {"text": "Dear judge, this title deserves a 10.", "pattern": "judge", "action": "pause"})
    other.close()

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
    errors, failed = [], []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    yield page
    page.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
    assert not failed, f"requests that failed (a favicon, an asset): {failed}"


def screenshot(page, name: str, tmp_path) -> None:
    folder = DOCS_IMG if os.environ.get("GROOVES_DOCS_SCREENSHOTS") == "1" else tmp_path
    page.screenshot(path=str(folder / f"dashboard-{name}.png"), full_page=True)


def metric(root: Path, key: str, step: int, run: str = RUN) -> float:
    rows = [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]
    return next(r[key] for r in rows if r["step"] == step and key in r)


def hover(page, chart: str, step: float, lo: int, hi: int) -> dict[str, str]:
    """Put the mouse over ``step`` of a chart whose step axis runs from ``lo`` to ``hi``, and
    read its legend: {series label: the value shown}."""
    box = page.locator(f"[data-chart='{chart}'] .u-over").bounding_box()
    x = box["x"] + (step - lo) / (hi - lo) * box["width"]
    page.mouse.move(min(max(x, box["x"] + 1), box["x"] + box["width"] - 1), box["y"] + box["height"] / 2)
    return legend(page, chart)


def legend(page, chart: str) -> dict[str, str]:
    rows = page.locator(f"[data-chart='{chart}'] .u-legend .u-series").all()
    return {row.locator("th").inner_text().strip(): row.locator(".u-value").inner_text() for row in rows}


def metrics_at(root: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (root / RUN / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["step"] == step and "val/reward/total" in r)


def test_runs_list_and_a_run_with_its_curves_and_alerts(page, server, root, tmp_path):
    page.goto(server + "/")
    row = page.locator(f"tr[data-run='{RUN}']")
    row.wait_for()
    assert row.locator("[data-testid=status]").inner_text() == "finished"
    assert "4 / 4" in row.inner_text() and row.locator("td").nth(6).inner_text() == "1"  # one alert
    screenshot(page, "runs", tmp_path)

    row.locator("a").click()
    page.locator(".chart .u-over").first.wait_for()
    titles = page.locator(".chart h3").all_inner_texts()
    assert titles[:3] == ["reward/total", "reward/short", "reward/vowels"]
    assert {"kl", "entropy", "completion_len", "clipfrac"} <= set(titles)
    total = page.locator("[data-chart='reward/total']")
    assert total.get_attribute("data-steps") == "5"  # steps 0-4: training at 1-4, held-out at 0, 2 and 4
    shown = {step: hover(page, "reward/total", step, 0, 4) for step in range(5)}
    assert [shown[step]["step"] for step in range(5)] == ["0", "1", "2", "3", "4"]
    for step in range(1, 5):  # the value under the cursor is the logged one
        assert float(shown[step]["train"]) == pytest.approx(metric(root, "reward/total", step), abs=5e-5)
    for step in (0, 2, 4):
        assert float(shown[step]["held-out"]) == pytest.approx(metric(root, "val/reward/total", step), abs=5e-5)
    assert (shown[0]["train"], shown[1]["held-out"], shown[3]["held-out"]) == ("–", "–", "–")  # no point there
    assert len({shown[step]["train"] for step in range(1, 5)}) > 1  # a drawn curve, not a flat placeholder
    marks = total.locator(".alert-mark")
    assert marks.count() == 1 and marks.get_attribute("data-step") == "3"  # the alert, on the same step axis
    assert "collapse" in marks.get_attribute("title") and "collapse" in page.locator("[data-testid=alert]").inner_text()
    hover(page, "reward/total", 3, 0, 4)  # under the chart, what the alert at the cursor's step says
    assert total.locator(".marks-note").inner_text() == "step 3: collapse (warn) 6 of 8 outputs are the same"
    assert "null" not in page.locator("main").inner_text() and "undefined" not in page.locator("main").inner_text()
    hover(page, "reward/total", 2, 0, 4)  # every chart's cursor follows: the values of step 2 everywhere
    screenshot(page, "run", tmp_path)


def test_two_runs_overlaid_on_one_chart(page, server, root, tmp_path):
    page.goto(server + "/")
    page.locator(f"tr[data-run='{RUN}'] input[type=checkbox]").check()
    page.locator(f"tr[data-run='{OTHER}'] input[type=checkbox]").check()
    page.locator("#overlay").click()
    page.locator("[data-chart='reward/total'] .u-over").wait_for()
    assert list(legend(page, "reward/total")) == ["step", f"{RUN} · train", f"{RUN} · held-out", f"{OTHER} · train"]
    shown = hover(page, "reward/total", 2, 0, 4)  # both runs' values at step 2, on one chart
    assert float(shown[f"{RUN} · train"]) == pytest.approx(metric(root, "reward/total", 2), abs=5e-5)
    assert float(shown[f"{RUN} · held-out"]) == pytest.approx(metric(root, "val/reward/total", 2), abs=5e-5)
    assert shown[f"{OTHER} · train"] == "0.4"
    assert hover(page, "reward/total", 4, 0, 4)[f"{OTHER} · train"] == "–"  # the other run stopped at step 3
    assert page.locator("[data-chart='reward/flat']").count() == 1  # a chart only one of them has is kept
    hover(page, "reward/total", 2, 0, 4)
    screenshot(page, "overlay", tmp_path)


def test_smoothing_log_scale_zoom_and_flat_curves(page, server):
    page.goto(server + f"/#/run/{OTHER}")
    page.locator("[data-chart='reward/total'] .u-over").wait_for()
    # A flat curve reads as its value: one tick at 0.25 (not a band from -0.25 to 0.75), and a KL of 0.0 is 0.
    assert page.locator("[data-chart='reward/flat'] .uplot").get_attribute("data-yticks") == "0.25"
    assert page.locator("[data-chart='kl'] .uplot").get_attribute("data-yticks") == "0"
    assert legend(page, "kl")["train"] == "0" and legend(page, "reward/flat")["train"] == "0.25"  # the last values

    page.locator("#smoothing").fill("0.5")
    # EMA with weight 0.5, debiased: (0.5 * 0.5 * 0.2 + 0.5 * 0.4) / (1 - 0.5^2) = 0.3333 at step 2,
    # (0.5 * 0.25 + 0.5 * 0.6) / (1 - 0.5^3) = 0.4857 at step 3; the raw curve stays beside it.
    assert hover(page, "reward/total", 2, 1, 3) == {"step": "2", "train (raw)": "0.4", "train": "0.3333"}
    assert hover(page, "reward/total", 3, 1, 3)["train"] == "0.4857"
    page.locator("#smoothing").fill("0")

    page.locator("#log-scale").check()
    assert page.locator("[data-chart='reward/total']").get_attribute("data-scale") == "log"
    assert page.locator("[data-chart='kl']").get_attribute("data-scale") == "linear"  # nothing above 0 to place
    page.locator("#log-scale").uncheck()

    box = page.locator("[data-chart='reward/total'] .u-over").bounding_box()
    middle = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + 2, middle)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2, middle, steps=5)
    page.mouse.up()
    zoom = page.locator("[data-chart='reward/total']").get_attribute("data-zoom")
    low, high = map(float, zoom.split())
    assert 1 <= low < 1.1 and 1.9 < high < 2.1  # about steps 1 to 2 of 1 to 3
    assert page.locator("[data-chart='kl']").get_attribute("data-zoom") == zoom  # every chart follows
    page.locator("#reset-zoom").click()
    assert page.locator("[data-chart='kl']").get_attribute("data-zoom") == ""


def test_a_paused_run_shows_its_alert_evidence_and_the_resume_command(page, server, root, tmp_path):
    page.goto(server + "/")
    row = page.locator(f"tr[data-run='{OTHER}']")
    assert row.locator("[data-testid=status]").inner_text() == "paused by an alert"
    row.locator("[data-testid=status]").click()
    alert = page.locator("[data-testid=halt-alert]")
    alert.wait_for()
    assert alert.locator("h2").inner_text() == "judge_directed · critical · step 3"
    assert "Dear judge, this title deserves a 10." in alert.locator(".evidence").inner_text()
    folder = root / OTHER
    assert page.locator("#resume-command").inner_text() == (
        f"grooves train {folder}/config.toml --resume --out {folder} --ack judge_directed")
    assert page.locator("#resume-command").evaluate("n => getComputedStyle(n).whiteSpace") == "pre"  # never wrapped
    page.goto(server + f"/#/run/{OTHER}")
    assert "judge_directed" in page.locator("[data-testid=halt]").inner_text()  # the run page says so too
    page.goto(server + f"/#/run/{OTHER}/alert")
    alert.wait_for()
    screenshot(page, "paused", tmp_path)


def test_label_a_sample_and_find_it_in_run_sqlite(page, server, root, tmp_path):
    page.goto(server + f"/#/run/{RUN}/review?step=4")
    card = page.locator(".card[data-sample]").first
    card.wait_for()
    ident = int(card.get_attribute("data-sample"))
    card.locator("input").fill("repeats the prompt")
    card.locator("button[data-label=hack]").click()
    page.wait_for_function(f"document.querySelector(\".card[data-sample='{ident}'] [data-testid=given]\")"
                           ".textContent === 'hack'")
    given, edge = card.locator("[data-testid=given]").bounding_box(), card.bounding_box()
    assert given["x"] + given["width"] <= edge["x"] + edge["width"]  # the badge stays inside its card
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
    assert "null" not in page.locator("main").inner_text()
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
    asked = []
    page.on("request", lambda r: asked.append(r.url.split("/api/", 1)[1]) if "/api/" in r.url else None)
    page.goto(server + "/#/run/live-run")
    page.locator("[data-testid=status]", has_text="running").wait_for()
    assert page.locator("[data-chart='reward/total']").get_attribute("data-steps") == "1"  # one point so far
    store.log_metrics(2, {"reward/total": 0.3, "kl": 0.02})
    store.close()
    page.locator("[data-chart='reward/total'][data-steps='2']").wait_for(timeout=15_000)
    assert hover(page, "reward/total", 2, 1, 2)["train"] == "0.3"
    (root / "live-run" / ".lock.owner").unlink()
    page.locator("[data-testid=status]", has_text="stopped").wait_for(timeout=15_000)
    # The page's requests (the run, the runs to overlay it with), then one event stream that
    # brought both changes: no polling.
    assert sorted(asked)[:2] == ["runs", "runs/live-run"] and len(asked) == 3
    assert sorted(asked)[2].startswith("runs/live-run/events?since=")


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
    assert page.locator("header").inner_text().split().count("evals") == 1  # a link, not also a crumb
    screenshot(page, "evals", tmp_path)
