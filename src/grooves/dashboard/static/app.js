// The grooves dashboard page: hash routes over the JSON API, charts drawn as inline SVG.
// Text from runs (completions, prompts, tool results, task ids, run names, notes) is written by
// models and users: it only ever enters the page as a text node or an attribute value set with
// setAttribute, never as HTML (no innerHTML anywhere); tests/test_dashboard_untrusted_browser.py checks.
"use strict";

const main = document.getElementById("main");
let timer = null; // the live-update poll of the page on show

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

async function api(path, body) {
  const options = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  let data;
  try {
    data = await response.json();
  } catch (error) {
    throw new Error(`${response.status} ${response.statusText}: not a dashboard answer`);
  }
  if (!response.ok) {
    const detail = data.error || (data.detail && JSON.stringify(data.detail)) || response.statusText;
    throw new Error(detail);
  }
  return data;
}

const fmt = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");
function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
function statusBadge(status) {
  const kind = status === "running" ? "running" : status === "finished" ? "finished"
    : status.includes("alert") ? "paused" : "";
  return el("span", {class: `status ${kind}`, "data-testid": "status"}, status);
}
function extent(values) { // Math.min(...values) overflows the call stack on long runs
  let [lo, hi] = [Infinity, -Infinity];
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}
const enc = encodeURIComponent;

function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(el("a", {href: "#/"}, "runs"),
    ...parts.map(([label, href]) => (href ? el("a", {href}, "/ " + label) : el("span", {}, "/ " + label))));
}

function live(on) {
  document.getElementById("live").textContent = on ? "● live" : "";
}

// --- runs list --------------------------------------------------------------------------------

async function showRuns() {
  crumbs();
  const data = await api("/api/runs");
  const rows = data.runs.map((r) => el("tr", {"data-run": r.name},
    el("td", {}, el("a", {href: `#/run/${enc(r.name)}`}, r.name)),
    el("td", {title: r.error || null}, statusBadge(r.status), r.error ? el("div", {class: "error"}, r.error) : null),
    el("td", {class: "num"}, r.step === null ? "–" : (r.steps ? `${r.step} / ${r.steps}` : r.step)),
    el("td", {class: "num"}, fmt(r.reward)),
    el("td", {class: "num"}, r.val_reward === null ? "–" : `${fmt(r.val_reward)} (step ${r.val_step})`),
    el("td", {class: "num"}, r.alerts),
    el("td", {}, when(r.started)),
    el("td", {class: "num"}, duration(r.duration))));
  main.replaceChildren(el("h1", {}, "Runs"), el("p", {class: "muted"}, data.root),
    data.runs.length ? el("table", {id: "runs"},
      el("thead", {}, el("tr", {}, ["run", "status", "step", "reward", "held-out reward", "alerts", "started",
        "duration"].map((h) => el("th", {}, h)))), el("tbody", {}, rows))
      : el("p", {}, "No runs under this root yet: grooves train CONFIG writes one."));
  return data.runs.some((r) => r.status === "running");
}

// --- one run: curves and alerts ------------------------------------------------------------------

function chart(spec, alerts) {
  const W = 380, H = 190, L = 44, R = 10, T = 10, B = 24;
  const points = spec.lines.flatMap((line) => line.points);
  const steps = points.map((p) => p[0]).concat(alerts.map((a) => a.step));
  const values = points.map((p) => p[1]);
  let [x0, x1] = extent(steps);
  let [y0, y1] = extent(values);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const x = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - R);
  const y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const plot = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.title},
    svg("line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}),
    svg("line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}),
    svg("text", {x: L - 4, y: T + 8, "text-anchor": "end"}, fmt(y1, 3)),
    svg("text", {x: L - 4, y: H - B, "text-anchor": "end"}, fmt(y0, 3)),
    svg("text", {x: L, y: H - 8}, `step ${x0}`),
    svg("text", {x: W - R, y: H - 8, "text-anchor": "end"}, `step ${x1}`));
  for (const alert of alerts) {
    const mark = svg("line", {class: "alert-mark", x1: x(alert.step), x2: x(alert.step), y1: T, y2: H - B});
    mark.append(svg("title", {}, `step ${alert.step}: ${alert.detector} (${alert.severity}) ${alert.message}`));
    plot.append(mark);
  }
  for (const line of spec.lines) {
    const cls = line.label === "train" ? "line-train" : "line-heldout";
    const path = line.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    const shape = line.points.length > 1 ? svg("polyline", {class: cls, points: path})
      : svg("circle", {class: cls, cx: x(line.points[0][0]), cy: y(line.points[0][1]), r: 3});
    shape.append(svg("title", {}, `${line.metric}: last ${fmt(line.points[line.points.length - 1][1])}`));
    plot.append(shape);
  }
  const legend = el("div", {class: "legend"}, spec.lines.map((line) => el("span",
    {class: line.label === "train" ? "train" : "heldout"}, `— ${line.label} `)),
    alerts.length ? el("span", {class: "sev"}, ` ┆ ${alerts.length} alert(s)`) : null);
  return el("div", {class: "chart", "data-chart": spec.title}, el("h3", {}, spec.title), plot, legend);
}

function alertList(alerts) {
  if (!alerts.length) return el("p", {class: "muted"}, "No alerts.");
  return el("ul", {class: "alerts"}, alerts.map((a, i) => el("li", {"data-testid": "alert"},
    el("span", {class: "sev"}, `step ${a.step} · ${a.detector} · ${a.severity}`), " ", a.message,
    el("details", {"data-key": `alert-${i}`}, el("summary", {}, "evidence"), el("pre", {class: "evidence"}, JSON.stringify(a.evidence, null, 1))))));
}

async function showRun(name) {
  crumbs([name]);
  let version = null;
  const draw = async () => {
    const run = await api(`/api/runs/${enc(name)}`);
    if (run.version === version) return run.status === "running";
    version = run.version;
    // A redraw while the run trains keeps the evidence the reader has open, and the scroll.
    const open = new Set([...main.querySelectorAll("details[open][data-key]")].map((d) => d.dataset.key));
    const scroll = window.scrollY;
    const steps = run.review_steps.train || [];
    main.replaceChildren(
      el("h1", {}, run.name, " ", statusBadge(run.status)),
      el("p", {}, `step ${run.step ?? "–"}${run.steps ? " of " + run.steps : ""} · reward ${fmt(run.reward)} · ` +
        `held-out ${fmt(run.val_reward)} · started ${when(run.started)} · ${duration(run.duration)} · ` +
        `checkpoints: ${run.checkpoints.join(", ") || "none"}`),
      run.skipped_lines ? el("p", {class: "error", "data-testid": "skipped"}, `${run.skipped_lines} line(s) of ` +
        "metrics.jsonl could not be read and are left out of the curves.") : null,
      el("div", {class: "toolbar"},
        steps.length ? el("a", {href: `#/run/${enc(name)}/review`}, "Review samples") : null,
        run.checkpoints.length ? el("a", {href: `#/run/${enc(name)}/compare`}, "Compare checkpoints") : null),
      el("h2", {}, "Curves"),
      run.charts.length ? el("div", {class: "charts"}, run.charts.map((c) => chart(c, run.alerts)))
        : el("p", {class: "muted"}, "No metrics yet."),
      el("h2", {}, `Alerts (${run.alerts.length})`), alertList(run.alerts));
    main.querySelectorAll("details[data-key]").forEach((d) => { d.open = open.has(d.dataset.key); });
    window.scrollTo(0, scroll);
    return run.status === "running";
  };
  const running = await draw();
  return running ? draw : false;
}

// --- review and labels --------------------------------------------------------------------------

function components(sample) {
  return el("table", {}, Object.entries(sample.components).map(([name, value]) => el("tr", {},
    el("td", {}, name), el("td", {class: "num"}, value === null ? "failed" : fmt(value)),
    el("td", {}, sample.vetoes[name] ? el("span", {class: "veto"}, `veto: ${sample.vetoes[name]}`) : null,
      sample.reasons[name] && !sample.vetoes[name] ? el("span", {class: "muted"}, sample.reasons[name]) : null))));
}

function labeller(run, sample) {
  const note = el("input", {type: "text", placeholder: "note (optional)", value: sample.label ? sample.label.note : ""});
  const given = el("span", {class: `given ${sample.label ? sample.label.label : ""}`, "data-testid": "given"},
    sample.label ? sample.label.label : "");
  const buttons = ["hack", "good", "bad"].map((label) => el("button", {
    class: `${label}${sample.label && sample.label.label === label ? " active" : ""}`, "data-label": label,
    onclick: async () => {
      try {
        const stored = await api(`/api/runs/${enc(run)}/labels`, {id: sample.id, label, note: note.value});
        sample.label = stored;
        given.className = `given ${stored.label}`;
        given.textContent = stored.label;
        buttons.forEach((b) => b.classList.toggle("active", b.dataset.label === stored.label));
      } catch (error) {
        given.className = "error";
        given.textContent = error.message;
      }
    }}, label));
  return el("div", {class: "label-row"}, buttons, note, given);
}

function sampleCard(run, sample, kind) {
  return el("div", {class: "card", "data-sample": sample.id},
    el("div", {class: "head"}, el("strong", {}, `#${sample.id} · ${kind}`),
      el("span", {}, `reward ${sample.reward === null ? "failed" : fmt(sample.reward)}`)),
    el("div", {class: "muted"}, `task ${sample.task_id ?? "–"} · `,
      el("a", {href: `#/run/${enc(run)}/sample/${sample.id}`},
        sample.turns > 1 ? `transcript (${sample.turns} turns)` : "transcript")),
    el("details", {}, el("summary", {}, "prompt"), el("pre", {}, sample.prompt)),
    sample.completion ? el("pre", {class: "completion"}, sample.completion)
      : el("p", {class: "muted"}, sample.turns > 1 ? "(ends in a tool call: read the transcript)" : "(empty)"),
    components(sample), labeller(run, sample));
}

async function showReview(name, params) {
  crumbs([name, `#/run/${enc(name)}`], ["review"]);
  const split = params.get("split") || "train";
  const query = new URLSearchParams({split, k: params.get("k") || "3", seed: params.get("seed") || "0"});
  if (params.get("step")) query.set("step", params.get("step"));
  const [run, data] = await Promise.all([api(`/api/runs/${enc(name)}`), api(`/api/runs/${enc(name)}/review?${query}`)]);
  const steps = run.review_steps[split] || [];
  const picker = el("select", {id: "step", onchange: (e) => {
    location.hash = `#/run/${enc(name)}/review?split=${split}&step=${e.target.value}`; }},
    steps.map((s) => el("option", {value: s, ...(s === data.step ? {selected: ""} : {})}, `step ${s}`)));
  const splitLink = split === "train" ? "val" : "train";
  main.replaceChildren(el("h1", {}, `Review ${name} · step ${data.step} (${data.split})`),
    el("div", {class: "toolbar"}, picker,
      (run.review_steps[splitLink] || []).length ? el("a", {href: `#/run/${enc(name)}/review?split=${splitLink}`},
        `show ${splitLink === "val" ? "held-out" : "train"} samples`) : null,
      el("span", {class: "muted"}, `${data.count} samples, ${data.failed} failed · labels go to run.sqlite, as grooves review --label writes them`)),
    ...["top", "bottom", "random"].map((kind) => [el("h2", {}, kind),
      data.lists[kind].length ? el("div", {class: "cards"}, data.lists[kind].map((s) => sampleCard(name, s, kind)))
        : el("p", {class: "muted"}, "none")]).flat());
  return false;
}

// --- a transcript ---------------------------------------------------------------------------------

function messageBlock(message) {
  const role = message.role || "?";
  const calls = (message.tool_calls || []).map((call) => {
    const fn = call.function || call;
    let args = fn.arguments;
    if (typeof args !== "string") args = JSON.stringify(args);
    return el("div", {class: "tool-call", "data-testid": "tool-call"}, el("strong", {}, `call ${fn.name}`),
      el("pre", {}, args || ""));
  });
  const header = role === "tool" && message.name ? `tool result · ${message.name}` : role;
  const content = typeof message.content === "string" ? message.content : JSON.stringify(message.content);
  return el("div", {class: `turn ${role}`, "data-role": role}, el("div", {class: "role"}, header),
    content ? el("pre", {}, content) : null, calls);
}

async function showSample(name, ident) {
  crumbs([name, `#/run/${enc(name)}`], ["review", `#/run/${enc(name)}/review`], [`#${ident}`]);
  const t = await api(`/api/runs/${enc(name)}/samples/${ident}`);
  const trained = t.spans.filter((s) => s.trained).reduce((n, s) => n + s.tokens, 0);
  const total = t.spans.reduce((n, s) => n + s.tokens, 0);
  const sample = {...t, turns: 0};
  main.replaceChildren(
    el("h1", {}, `Sample #${t.id} · ${name} step ${t.step} (${t.split})`),
    el("p", {}, `task ${t.task_id ?? "–"} · reward ${t.reward === null ? "failed" : fmt(t.reward)} · finished: ${t.finish_reason}`),
    components(sample), labeller(name, sample),
    el("h2", {}, `Turns (${t.messages.filter((m) => m.role === "assistant").length} from the model)`),
    el("div", {id: "turns"}, t.messages.map(messageBlock)),
    el("h2", {}, "Which tokens were trained"),
    el("p", {class: "muted"}, `${t.prompt_tokens} prompt tokens (never trained), then ${total} completion tokens: ` +
      `${trained} trained (the model's own, highlighted), ${total - trained} inserted by the environment (grey).`),
    el("div", {class: "tokens card", id: "tokens"}, t.spans.map((s) => el("span", {
      class: s.trained ? "trained" : "untrained", title: `${s.tokens} tokens, ${s.trained ? "trained" : "not trained"}`},
    s.text === null ? `[${s.tokens} ${s.trained ? "trained" : "untrained"} tokens]` : s.text))));
  return false;
}

// --- compare two checkpoints --------------------------------------------------------------------

async function showCompare(name) {
  crumbs([name, `#/run/${enc(name)}`], ["compare"]);
  const run = await api(`/api/runs/${enc(name)}`);
  const options = ["base", ...run.checkpoints.map(String)];
  const pick = (id, chosen) => el("select", {id}, options.map((o) => el("option",
    {value: o, ...(o === chosen ? {selected: ""} : {})}, o === "base" ? "base model" : `${name}@${o}`)));
  const a = pick("side-a", run.checkpoints.length > 1 ? String(run.checkpoints[0]) : "base");
  const b = pick("side-b", String(run.checkpoints[run.checkpoints.length - 1]));
  const result = el("div", {id: "compare-result"});
  const go = el("button", {id: "compare", onclick: async () => {
    result.replaceChildren(el("p", {class: "muted"}, "sampling both on the held-out tasks…"));
    try {
      renderComparison(result, await api(`/api/runs/${enc(name)}/compare`, {a: a.value, b: b.value}));
    } catch (error) {
      result.replaceChildren(el("p", {class: "error"}, error.message));
    }
  }}, "Compare");
  main.replaceChildren(el("h1", {}, `Compare checkpoints of ${name}`),
    el("p", {class: "muted"}, "Both sides answer the run's held-out tasks with its held-out sampling settings " +
      "and are scored by its reward, as the run's validation is."),
    el("div", {class: "toolbar"}, a, "vs", b, go), result);
  return false;
}

function renderComparison(target, data) {
  const [a, b] = data.sides;
  const names = [...new Set([...Object.keys(a.components), ...Object.keys(b.components)])];
  const summary = el("table", {id: "compare-summary"},
    el("thead", {}, el("tr", {}, el("th", {}, ""), el("th", {}, a.name), el("th", {}, b.name))),
    el("tbody", {}, el("tr", {}, el("td", {}, "reward (mean)"), el("td", {class: "num side-mean"}, fmt(a.mean)),
      el("td", {class: "num side-mean"}, fmt(b.mean))),
    names.map((c) => el("tr", {}, el("td", {}, c), el("td", {class: "num"}, fmt(a.components[c])),
      el("td", {class: "num"}, fmt(b.components[c]))))));
  const cell = (s) => el("td", {}, el("pre", {class: "completion"}, s.completion),
    el("div", {class: "muted"}, `reward ${s.reward === null ? "failed" : fmt(s.reward)} · ` +
      Object.entries(s.components).map(([k, v]) => `${k} ${v === null ? "failed" : fmt(v)}`).join(", ")));
  const rows = data.tasks.map((task, i) => el("tr", {"data-task": task.task_id},
    el("td", {}, el("strong", {}, task.task_id), el("pre", {class: "muted"}, task.prompt)), cell(a.samples[i]), cell(b.samples[i])));
  target.replaceChildren(summary, el("h2", {}, "Task by task"),
    el("table", {id: "compare-tasks"}, el("thead", {}, el("tr", {}, el("th", {}, "held-out task"),
      el("th", {}, a.name), el("th", {}, b.name))), el("tbody", {}, rows)));
}

// --- grooves eval results -------------------------------------------------------------------

async function showEvals() {
  crumbs(["evals"]);
  const data = await api("/api/evals");
  const table = (e) => el("table", {"data-eval": e.name},
    el("thead", {}, el("tr", {}, ["candidate", "model", "reward ± s.e.", "success", "p50 s", "p95 s", "tok/s",
      "tokens / 1k tasks", "$ / 1k tasks"].map((h) => el("th", {}, h)))),
    el("tbody", {}, e.candidates.map((c) => el("tr", {},
      el("td", {}, c.name), el("td", {class: "muted"}, c.model),
      el("td", {class: "num"}, c.reward === null ? "failed" : `${fmt(c.reward)} ± ${fmt(c.reward_se)}`),
      el("td", {class: "num"}, c.success === null ? "–" : `${Math.round(c.success * 100)}%`),
      el("td", {class: "num"}, fmt(c.latency_p50, 2)), el("td", {class: "num"}, fmt(c.latency_p95, 2)),
      el("td", {class: "num"}, fmt(c.tokens_per_s, 1)), el("td", {class: "num"}, fmt(c.tokens_per_1k, 0)),
      el("td", {class: "num"}, fmt(c.cost_per_1k, 4))))));
  main.replaceChildren(el("h1", {}, "Evaluations"), el("p", {class: "muted"}, `grooves eval results in ${data.root}`),
    ...(data.evals.length ? data.evals.map((e) => el("section", {},
      el("h2", {}, `${e.name} · ${when(e.written)}`), table(e),
      e.chart ? el("img", {src: `/api/evals/${enc(e.name)}/chart`, alt: `${e.name}: quality vs cost and latency`,
        class: "eval-chart"}) : null))
      : [el("p", {}, "No results yet: grooves eval CONFIG writes evals/<name>/eval.json.")]));
  return false;
}

// --- routing --------------------------------------------------------------------------------------

async function route() {
  clearInterval(timer);
  live(false);
  try {
    const [path, query] = location.hash.replace(/^#/, "").split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent); // a stray % throws: shown below
    const params = new URLSearchParams(query || "");
    let refresh;
    if (parts[0] === "run" && parts[2] === "review") refresh = await showReview(parts[1], params);
    else if (parts[0] === "run" && parts[2] === "sample") refresh = await showSample(parts[1], parts[3]);
    else if (parts[0] === "run" && parts[2] === "compare") refresh = await showCompare(parts[1]);
    else if (parts[0] === "run") refresh = await showRun(parts[1]);
    else if (parts[0] === "evals") refresh = await showEvals();
    else refresh = (await showRuns()) ? showRuns : false;
    if (refresh) {
      live(true);
      const mine = setInterval(async () => {
        try {
          if (!(await refresh())) { clearInterval(mine); live(false); }
          else live(true);
        } catch (error) { // the server restarting, say: keep the page, say so, try again
          if (mine === timer) document.getElementById("live").textContent = `● live (update failed: ${error.message})`;
        }
      }, 2000);
      timer = mine;
    }
  } catch (error) {
    main.replaceChildren(el("p", {class: "error"}, error.message));
  }
}

window.addEventListener("hashchange", route);
route();
