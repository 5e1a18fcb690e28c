// The grooves dashboard page: hash routes over the JSON API. Runs and a run's curves follow the
// server's event streams while something trains (no polling from the page). Text from runs only
// ever enters the page as text (see dom.js); tests/test_dashboard_untrusted_browser.py checks.
import {Board, COLORS} from "./charts.js";
import {api, crumbs, duration, el, enc, fmt, live, main, statusBadge, when} from "./dom.js";
import {showCompare, showEvals, showReview, showSample} from "./pages.js";

let cleanup = []; // what the page on show stops when another is shown (streams, charts)
let board = null;
let streams = 0;
let navigation = 0; // counts routes: a page whose answer comes after the reader left draws nothing

function left() {
  const mine = navigation;
  return () => mine !== navigation;
}

// Follow a server-sent event stream: `event` carries the new data, `end` says nothing more will
// change (the run stopped), and the browser reconnects by itself if the server restarts.
function follow(url, event, onData) {
  const source = new EventSource(url);
  let open = true;
  streams += 1;
  live("● live");
  const close = () => {
    if (!open) return;
    open = false;
    source.close();
    streams -= 1;
    if (!streams) live("");
  };
  source.addEventListener(event, (message) => {
    live("● live");
    onData(JSON.parse(message.data));
  });
  source.addEventListener("end", close);
  source.onerror = () => { if (open) live("● live (connection lost: reconnecting…)"); };
  cleanup.push(close);
}

// --- runs list --------------------------------------------------------------------------------

async function showRuns() {
  crumbs();
  const picked = new Set();
  const overlay = el("button", {id: "overlay", disabled: true, onclick: () => {
    location.hash = "#/curves?" + [...picked].map((name) => `run=${enc(name)}`).join("&");
  }}, "overlay the chosen runs' curves");
  const table = el("div", {});
  const draw = (data) => {
    const rows = data.runs.map((r) => el("tr", {"data-run": r.name},
      el("td", {}, el("input", {type: "checkbox", "aria-label": "choose for the overlay", checked: picked.has(r.name),
        onchange: (e) => {
          if (e.target.checked) picked.add(r.name); else picked.delete(r.name);
          overlay.disabled = picked.size < 2;
        }})),
      el("td", {}, el("a", {href: `#/run/${enc(r.name)}`}, r.name)),
      el("td", {title: r.error || null}, r.status.includes("alert")
        ? el("a", {href: `#/run/${enc(r.name)}/alert`}, statusBadge(r.status)) : statusBadge(r.status),
      r.error ? el("div", {class: "error"}, r.error) : null),
      el("td", {class: "num"}, r.step === null ? "–" : (r.steps ? `${r.step} / ${r.steps}` : r.step)),
      el("td", {class: "num"}, fmt(r.reward)),
      el("td", {class: "num"}, r.val_reward === null ? "–" : `${fmt(r.val_reward)} (step ${r.val_step})`),
      el("td", {class: "num"}, r.alerts),
      el("td", {}, when(r.started)),
      el("td", {class: "num"}, duration(r.duration))));
    table.replaceChildren(data.runs.length ? el("table", {id: "runs"},
      el("thead", {}, el("tr", {}, ["", "run", "status", "step", "reward", "held-out reward", "alerts", "started",
        "duration"].map((h) => el("th", {}, h)))), el("tbody", {}, rows))
      : el("p", {}, "No runs under this root yet: grooves train CONFIG writes one."));
  };
  const gone = left();
  const data = await api("/api/runs");
  if (gone()) return;
  draw(data);
  main.replaceChildren(el("h1", {}, "Runs"), el("p", {class: "muted"}, data.root),
    el("div", {class: "toolbar"}, overlay), table);
  follow("/api/events", "runs", draw);
}

// --- one run: curves and alerts ------------------------------------------------------------------

const markText = (a, run) => `${run ? run + " · " : ""}step ${a.step}: ${a.detector} (${a.severity}) ${a.message}`;

function runSpecs(run) {
  return run.charts.map((chart) => ({title: chart.title,
    lines: chart.lines.map((line) => ({label: line.label, points: line.points,
      color: line.label === "train" ? COLORS[0] : COLORS[1], dash: line.label !== "train"})),
    marks: run.alerts.map((a) => ({step: a.step, text: markText(a)}))}));
}

function evidence(value) {
  const rows = Object.entries(value).map(([key, v]) => el("tr", {}, el("th", {}, key),
    el("td", {}, el("pre", {}, typeof v === "string" ? v : JSON.stringify(v, null, 1)))));
  return el("table", {class: "evidence"}, rows);
}

function alertList(alerts) {
  if (!alerts.length) return el("p", {class: "muted"}, "No alerts.");
  return el("ul", {class: "alerts"}, alerts.map((a, i) => el("li", {"data-testid": "alert"},
    el("span", {class: "sev"}, `step ${a.step} · ${a.detector} · ${a.severity}`), " ", a.message,
    el("details", {"data-key": `alert-${i}`}, el("summary", {}, "evidence"), evidence(a.evidence)))));
}

function haltBanner(run) {
  if (!run.halt) return null;
  const first = run.halt.alerts[0];
  return el("div", {class: "halt", "data-testid": "halt"},
    el("strong", {}, `${run.status} at step ${run.halt.step}`), `: ${first.detector} · ${first.message} `,
    el("a", {href: `#/run/${enc(run.name)}/alert`}, "the evidence and how to continue"));
}

// The other runs, to overlay on this one's charts: asked for once per page, not per update.
function otherRuns(name) {
  const others = el("select", {id: "overlay-with", onchange: (e) => {
    if (e.target.value) location.hash = `#/curves?run=${enc(name)}&run=${enc(e.target.value)}`;
  }}, el("option", {value: ""}, "overlay another run…"));
  api("/api/runs").then((data) => others.append(...data.runs.filter((r) => r.name !== name)
    .map((r) => el("option", {value: r.name}, r.name)))).catch(() => others.remove());
  return others;
}

function runHead(run, others) {
  const steps = run.review_steps.train || [];
  return [el("h1", {}, run.name, " ", statusBadge(run.status)), haltBanner(run),
    el("p", {}, [`step ${run.step ?? "–"}`, run.steps ? ` of ${run.steps}` : "", ` · reward ${fmt(run.reward)}`,
      ` · held-out ${fmt(run.val_reward)} · started ${when(run.started)} · ${duration(run.duration)}`,
      ` · checkpoints: ${run.checkpoints.join(", ") || "none"}`].join("")),
    run.skipped_lines ? el("p", {class: "error", "data-testid": "skipped"}, `${run.skipped_lines} line(s) of ` +
      "metrics.jsonl could not be read and are left out of the curves.") : null,
    el("div", {class: "toolbar"},
      steps.length ? el("a", {href: `#/run/${enc(run.name)}/review`}, "Review samples") : null,
      run.checkpoints.length ? el("a", {href: `#/run/${enc(run.name)}/compare`}, "Compare checkpoints") : null,
      others)];
}

async function showRun(name) {
  crumbs([name]);
  const head = el("div", {}), charts = el("div", {class: "charts"}), alerts = el("div", {});
  const others = otherRuns(name);
  const draw = (run, first) => {
    // A redraw while the run trains keeps the evidence the reader has open, and the scroll.
    const open = new Set([...alerts.querySelectorAll("details[open][data-key]")].map((d) => d.dataset.key));
    const scroll = window.scrollY;
    head.replaceChildren(...runHead(run, others).filter(Boolean));
    alerts.replaceChildren(el("h2", {}, `Alerts (${run.alerts.length})`), alertList(run.alerts));
    alerts.querySelectorAll("details[data-key]").forEach((d) => { d.open = open.has(d.dataset.key); });
    if (!run.charts.length) charts.replaceChildren(el("p", {class: "muted"}, "No metrics yet."));
    else if (first || !board.charts.size) board.render(charts, runSpecs(run));
    else board.update(runSpecs(run));
    window.scrollTo(0, scroll);
  };
  const gone = left();
  const run = await api(`/api/runs/${enc(name)}`);
  if (gone()) return;
  board = new Board();
  main.replaceChildren(head, el("h2", {}, "Curves"), board.controls(), charts, alerts);
  draw(run, true);
  if (run.status === "running") follow(`/api/runs/${enc(name)}/events?since=${enc(run.version)}`, "run", draw);
}

// --- a run paused (or stopped) by an alert ------------------------------------------------------

async function showHalt(name) {
  crumbs([name, `#/run/${enc(name)}`], ["alert"]);
  const run = await api(`/api/runs/${enc(name)}`);
  if (!run.halt) {
    main.replaceChildren(el("h1", {}, run.name, " ", statusBadge(run.status)),
      el("p", {}, "This run is not paused or stopped by an alert. ",
        el("a", {href: `#/run/${enc(name)}`}, "Its curves")));
    return;
  }
  const halt = run.halt;
  const command = el("pre", {id: "resume-command", class: "command"}, halt.resume);
  const copied = el("span", {class: "muted"});
  main.replaceChildren(
    el("h1", {}, run.name, " ", statusBadge(run.status)),
    el("p", {}, `The run ${halt.action === "pause" ? "paused" : "stopped"} after step ${halt.step} ` +
      "(its checkpoint is saved) because of this alert; the [alerts] policy of its config chose the action."),
    ...halt.alerts.map((a) => el("section", {class: "card halt-alert", "data-testid": "halt-alert"},
      el("h2", {}, `${a.detector} · ${a.severity} · step ${a.step}`), el("p", {}, a.message),
      el("h3", {}, "Evidence"), evidence(a.evidence))),
    el("p", {}, el("a", {href: `#/run/${enc(name)}/review?step=${halt.step}`}, `Read the samples of step ${halt.step}`),
      " before deciding: are they the hack the detector saw?"),
    el("h2", {}, "Continue the run"),
    el("p", {}, `From the folder you trained in (the config's relative paths are read from there). --ack ` +
      `${halt.alerts.map((a) => a.detector).join(", ")} accepts these alerts: that detector only warns from now ` +
      "on. Without --ack the run resumes and may pause again once the detector's cooldown is over."),
    command, el("div", {class: "toolbar"}, el("button", {id: "copy-command", onclick: async () => {
      try {
        await navigator.clipboard.writeText(halt.resume);
        copied.textContent = "copied";
      } catch (error) {
        copied.textContent = "select the command and copy it";
      }
    }}, "copy"), copied));
}

// --- runs overlaid on one chart per metric ------------------------------------------------------

function overlaySpecs(runs) {
  const titles = [...new Set(runs.flatMap((run) => run.charts.map((c) => c.title)))];
  return titles.map((title) => ({title,
    lines: runs.flatMap((run, i) => (run.charts.find((c) => c.title === title)?.lines || []).map((line) => ({
      label: `${run.name} · ${line.label}`, points: line.points, color: COLORS[i % COLORS.length],
      dash: line.label !== "train"}))),
    marks: runs.flatMap((run) => run.alerts.map((a) => ({step: a.step, text: markText(a, run.name)})))}));
}

async function showCurves(params) {
  const names = params.getAll("run");
  crumbs(["curves of " + names.join(", ")]);
  const gone = left();
  const runs = await Promise.all(names.map((name) => api(`/api/runs/${enc(name)}`)));
  if (gone()) return;
  const charts = el("div", {class: "charts"});
  board = new Board();
  main.replaceChildren(el("h1", {}, "Curves of ", names.length, " runs"),
    el("p", {class: "legend-runs"}, runs.map((run, i) => el("span", {class: "run-chip"},
      el("span", {class: "swatch", "data-color": COLORS[i % COLORS.length]}),
      el("a", {href: `#/run/${enc(run.name)}`}, run.name), " ", statusBadge(run.status)))),
    el("p", {class: "muted"}, "Solid: training; dashed: held-out. Hover to read every run's value at a step."),
    board.controls(), charts);
  main.querySelectorAll(".swatch").forEach((node) => { node.style.background = node.dataset.color; });
  board.render(charts, overlaySpecs(runs));
  runs.forEach((run, i) => {
    if (run.status !== "running") return;
    follow(`/api/runs/${enc(run.name)}/events?since=${enc(run.version)}`, "run", (fresh) => {
      runs[i] = fresh;
      board.update(overlaySpecs(runs));
    });
  });
}

// --- routing --------------------------------------------------------------------------------------

async function route() {
  navigation += 1;
  cleanup.forEach((stop) => stop());
  cleanup = [];
  if (board) board.destroy();
  board = null;
  live("");
  try {
    const [path, query] = location.hash.replace(/^#/, "").split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent); // a stray % throws: shown below
    const params = new URLSearchParams(query || "");
    if (parts[0] === "run" && parts[2] === "review") await showReview(parts[1], params);
    else if (parts[0] === "run" && parts[2] === "sample") await showSample(parts[1], parts[3]);
    else if (parts[0] === "run" && parts[2] === "compare") await showCompare(parts[1]);
    else if (parts[0] === "run" && parts[2] === "alert") await showHalt(parts[1]);
    else if (parts[0] === "run") await showRun(parts[1]);
    else if (parts[0] === "curves") await showCurves(params);
    else if (parts[0] === "evals") await showEvals();
    else await showRuns();
  } catch (error) {
    main.replaceChildren(el("p", {class: "error"}, error.message));
  }
}

window.addEventListener("hashchange", route);
window.addEventListener("resize", () => board && board.resize());
route();
