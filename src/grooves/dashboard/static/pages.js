// The dashboard's pages over stored samples: review with labels, a transcript, two checkpoints
// compared, and grooves eval results. Model- and user-written text enters only as text nodes or
// attribute values (see dom.js).
import {api, crumbs, el, enc, fmt, main, when} from "./dom.js";

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

export async function showReview(name, params) {
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

export async function showSample(name, ident) {
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

export async function showCompare(name) {
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

export async function showEvals() {
  crumbs();
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
