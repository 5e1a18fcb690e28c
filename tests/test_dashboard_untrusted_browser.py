"""Text that models and users wrote stays text in a real Chromium, and a page on another origin
cannot label a run.

A run is built by hand with markup everywhere a model or a user writes: its name, a reward
component's name, the prompt, the completion, the task id, tool calls and results, the judge's
reasons, a veto, an alert, a label's note and an evaluation's candidate. Every page is opened;
nothing may run (no dialog, no flag set by a planted handler) and the markup must show as
the characters it is. Chromium is Debian's package; nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]' installs playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make install puts it there)")]

IMG = '<img src=x onerror="window.__pwned=1;alert(1)">'
SCRIPT = "</script><script>window.__pwned=2;alert(2)</script>"
QUOTE = '"><svg onload="window.__pwned=3;alert(3)">'
RUN = f"run {IMG}"  # a folder name may hold all of it but a slash
COMPONENT = "<b onmouseover=alert(4)>vowels"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from grooves.policy.models import byte_tokenizer
    from grooves.runs.store import RunStore
    from grooves.types import Group, Trajectory

    folder = tmp_path_factory.mktemp("untrusted")
    runs = folder / "runs"
    store = RunStore(runs / RUN)
    (runs / RUN / "config.toml").write_text('steps = 4\n[model]\nspec = "tiny"\n')
    store.log_metrics(1, {"reward/total": 0.2, f"reward/{COMPONENT}": 0.1})
    store.log_metrics(2, {"reward/total": 0.4, f"reward/{COMPONENT}": 0.3, "val/reward/total": 0.3})
    tokenizer = byte_tokenizer()
    completion = f"{IMG} {SCRIPT}"
    ids = tokenizer.encode(completion, add_special_tokens=False)
    messages = [{"role": "user", "content": f"Title this: {SCRIPT}"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": f"search{QUOTE}", "arguments": json.dumps({"q": IMG})}}]},
                {"role": "tool", "name": f"search{IMG}", "content": f"result {SCRIPT} {QUOTE}"},
                {"role": "assistant", "content": completion}]
    trajectory = Trajectory(messages, [1, 2], ids, [1] * len(ids), [-0.1] * len(ids), reward=0.4,
                            components={COMPONENT: 0.4}, metadata={"reasons": {COMPONENT: f"judge says {IMG}"},
                                                                   "vetoes": {}})
    vetoed = Trajectory(messages[:1] + [{"role": "assistant", "content": QUOTE}], [1], [2], [1], [-0.1],
                        reward=0.0, components={COMPONENT: 0.0},
                        metadata={"reasons": {}, "vetoes": {COMPONENT: f"veto {SCRIPT}"}})
    store.record_groups(2, [Group({"id": f"task{QUOTE}"}, [trajectory, vetoed])])
    store.record_alert(2, f"det{IMG}", "warn", f"message {SCRIPT}", {"text": QUOTE, "action": "warn"})
    (ident,) = store.db.execute("SELECT MIN(id) FROM trajectories").fetchone()
    store.record_labels([(ident, "hack", f"note {IMG}")])
    store.close()

    evals = folder / "evals" / f"e{IMG}"
    evals.mkdir(parents=True)
    (evals / "eval.json").write_text(json.dumps({"candidates": [
        {"name": f"cand {SCRIPT}", "model": QUOTE, "kind": "local", "tasks": 1, "reward": 0.5, "reward_se": 0.1,
         "success": None, "tokens_per_1k": None}]}))
    return runs


@pytest.fixture(scope="module")
def server(root):
    from grooves.dashboard.app import create_app
    from grooves.serve.app import ServerThread

    with ServerThread(create_app(root, evals=root.parent / "evals")) as thread:
        yield thread.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    dialogs, errors, refused = [], [], []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: refused.append(m.text) if m.text.startswith("Refused to") else None)  # CSP
    yield page
    assert page.evaluate("window.__pwned") is None, "a planted handler ran"
    assert not dialogs, f"planted script opened dialogs: {dialogs}"
    assert not errors, f"JavaScript errors on the page: {errors}"
    assert not refused, f"the page's own policy refused: {refused}"
    page.close()


def settle(page) -> None:
    """Give planted handlers their chance: images fail to load, every element is moused over."""
    page.wait_for_load_state("networkidle")
    page.evaluate("document.querySelectorAll('main *').forEach((node) => "
                  "node.dispatchEvent(new MouseEvent('mouseover', {bubbles: true})))")
    page.wait_for_timeout(300)


def planted_elements(page) -> int:
    return page.evaluate("document.querySelectorAll('main img, main script, main b, main svg[onload], "
                         "main [onerror], main [onload], main [onmouseover]').length")


def ident(root) -> int:
    with sqlite3.connect(root / RUN / "run.sqlite") as db:
        return db.execute("SELECT MIN(id) FROM trajectories").fetchone()[0]


def test_the_runs_list_and_a_run_show_markup_as_text(page, server, root):
    page.goto(server + "/")
    row = page.locator("#runs tbody tr").first
    row.wait_for()
    assert row.get_attribute("data-run") == RUN  # the attribute holds the name whole: no breakout
    assert row.locator("a").inner_text() == RUN
    row.locator("a").click()
    page.locator(".chart").first.wait_for()
    assert page.locator("h1").inner_text().startswith(RUN)
    assert f"reward/{COMPONENT}" in page.locator(".chart h3").all_inner_texts()
    assert page.locator(f".chart[data-chart='reward/{COMPONENT}']").count() == 1
    assert f"det{IMG}" in page.locator("[data-testid=alert]").inner_text()
    marks = page.locator(".chart .alert-mark").all()  # the hover text of the alert marks
    assert marks and all(m.get_attribute("title") == f"step 2: det{IMG} (warn) message {SCRIPT}" for m in marks)
    assert f"reward/{COMPONENT}" in page.locator(f".chart[data-chart='reward/{COMPONENT}'] h3").inner_text()
    page.locator(".u-legend").first.wait_for()
    assert "train" in page.locator(".u-legend").first.inner_text()
    settle(page)
    assert planted_elements(page) == 0

    from urllib.parse import quote

    page.goto(server + f"/#/curves?run={quote(RUN, safe='')}&run={quote(RUN, safe='')}")  # the overlay page
    page.locator(".chart .u-legend").first.wait_for()
    labels = page.locator("[data-chart='reward/total'] .u-legend th").all_inner_texts()
    assert f"{RUN} · train" in [label.strip() for label in labels]  # the run's name, as text, in the legend
    settle(page)
    assert planted_elements(page) == 0


def test_review_and_transcript_show_markup_as_text(page, server, root):
    from urllib.parse import quote

    page.goto(server + f"/#/run/{quote(RUN, safe='')}/review?step=2")
    card = page.locator(f".card[data-sample='{ident(root)}']").first
    card.wait_for()
    assert card.locator("pre.completion").inner_text() == f"{IMG} {SCRIPT}"
    assert f"task task{QUOTE}" in card.inner_text() and f"judge says {IMG}" in card.inner_text()
    assert card.locator("input").input_value() == f"note {IMG}"  # the stored note, as the input's value
    assert f"veto: veto {SCRIPT}" in page.locator("main").inner_text()
    card.locator("details summary").first.click()
    assert f"Title this: {SCRIPT}" in card.locator("details pre").inner_text()
    settle(page)
    assert planted_elements(page) == 0

    card.locator("a", has_text="transcript").click()
    page.locator("#turns").wait_for()
    assert page.locator("[data-testid=tool-call] strong").inner_text() == f"call search{QUOTE}"
    assert json.loads(page.locator("[data-testid=tool-call] pre").inner_text()) == {"q": IMG}
    assert page.locator(".turn.tool .role").text_content() == f"tool result · search{IMG}"
    assert "".join(page.locator("#tokens span").all_inner_texts()) == f"{IMG} {SCRIPT}"  # decoded tokens
    settle(page)
    assert planted_elements(page) == 0


def test_evaluations_show_markup_as_text(page, server):
    page.goto(server + "/#/evals")
    page.locator("main table").wait_for()
    assert page.locator("main h2").inner_text().startswith(f"e{IMG} ·")
    cells = page.locator("main tbody td").all_inner_texts()
    assert cells[:2] == [f"cand {SCRIPT}", QUOTE] and cells[7] == "–"  # no tokens figure: a dash, not 0
    settle(page)
    assert planted_elements(page) == 0


EVIL_PAGE = """<!doctype html><body><iframe name="sink"></iframe><iframe id="framed" src="DASH/"></iframe>
<form id="f" method="POST" enctype="text/plain" target="sink" action="DASH/api/runs/RUN/labels">
<input name='{"id": ID, "label": "hack", "note": "' value='form"}'></form>
<script>
async function attack() {
  const url = "DASH/api/runs/RUN/labels", body = JSON.stringify({id: ID, label: "hack", note: "fetch"});
  await fetch(url, {method: "POST", mode: "no-cors", body: new Blob([body])});  // no Content-Type at all
  await fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body});
  await new Promise((done) => {
    document.querySelector("iframe").onload = done;
    document.getElementById("f").submit();
  });
  return "sent";
}
</script></body>"""


def test_a_page_on_another_origin_cannot_label_nor_frame_the_dashboard(page, server, root):
    from urllib.parse import quote

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    from grooves.serve.app import ServerThread

    target = ident(root)
    html = EVIL_PAGE.replace("DASH", server).replace("RUN", quote(RUN, safe="")).replace("ID", str(target))
    evil = FastAPI()
    evil.get("/", response_class=HTMLResponse)(lambda: html)
    answered = []
    page.on("response", lambda r: answered.append(r.status) if "/labels" in r.url else None)
    with ServerThread(evil) as other:  # 127.0.0.1 on another port: another origin
        page.goto(other.base_url.removesuffix("/v1") + "/")
        assert page.evaluate("attack()") == "sent"
        framed = page.frame_locator("#framed")
        page.wait_for_timeout(500)
        assert framed.locator("#crumbs").count() == 0  # refused: nothing to click a label on
    with sqlite3.connect(root / RUN / "run.sqlite") as db:
        stored = db.execute("SELECT label, note FROM labels WHERE trajectory_id = ?", (target,)).fetchall()
    assert stored == [("hack", f"note {IMG}")]  # the label the fixture stored, untouched
    assert sorted(answered) == [403, 403, 403]  # each attempt reached the dashboard and was refused



def test_a_live_redraw_keeps_the_evidence_the_reader_opened(page, server, root):
    import os
    import socket

    from grooves.runs.store import RunStore

    store = RunStore(root / "live")
    store.log_metrics(1, {"reward/total": 0.1})
    store.record_alert(1, "collapse", "warn", "same outputs", {"text": "aaaa", "action": "warn"})
    (root / "live" / ".lock.owner").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    try:
        page.goto(server + "/#/run/live")
        page.locator("[data-testid=alert] summary").click()
        assert page.locator("[data-testid=alert] details[open]").count() == 1
        store.log_metrics(2, {"reward/total": 0.3})  # the trainer writes a step: the page redraws
        page.locator("[data-chart='reward/total'][data-steps='2']").wait_for(timeout=15_000)
        assert page.locator("[data-testid=alert] details[open]").count() == 1
    finally:
        store.close()
        (root / "live" / ".lock.owner").unlink()
