// The curves, drawn by uPlot (vendored in static/vendor/uplot, MIT). One Board holds a page's
// charts and their shared controls: EMA smoothing, a log scale, and a zoom (drag across a chart;
// double-click resets) that every chart of the board follows, as the hover cursor does.
/* global uPlot */
import {el, num} from "./dom.js";

export const COLORS = ["#2563eb", "#ea580c", "#15803d", "#9333ea", "#0891b2", "#be123c", "#854d0e", "#4b5563"];
const HEIGHT = 200;
let boards = 0;

// TensorBoard's smoothing: s_t = w s_{t-1} + (1 - w) x_t from s_0 = 0, divided by (1 - w^t) so
// the first points are not pulled towards zero. Missing points stay missing.
export function ema(values, weight) {
  if (!weight) return values;
  let smoothed = 0, seen = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    seen += 1;
    smoothed = weight * smoothed + (1 - weight) * v;
    return smoothed / (1 - weight ** seen);
  });
}

// Lines given as [[step, value], ...] on one step axis: uPlot wants one x array and, per line,
// its values at those steps (null where the line has no point).
export function align(lines) {
  const steps = [...new Set(lines.flatMap((line) => line.points.map((p) => p[0])))].sort((a, b) => a - b);
  const at = new Map(steps.map((s, i) => [s, i]));
  const columns = lines.map((line) => {
    const column = new Array(steps.length).fill(null);
    for (const [step, value] of line.points) column[at.get(step)] = value;
    return column;
  });
  return [steps, ...columns];
}

// A flat series sits in the middle of its chart with one tick, its value: a KL of 0.0 reads
// "0", never as a band from -0.5 to 0.5.
function yRange(u, lo, hi) {
  if (lo === null || hi === null) return [0, 1];
  if (lo === hi) return [lo - (Math.abs(lo) * 0.1 || 1), hi + (Math.abs(hi) * 0.1 || 1)];
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

function flatValue(columns) {
  const values = new Set(columns.flat().filter((v) => v !== null));
  return values.size === 1 ? [...values][0] : null;
}

// On a log scale a value at or below 0 cannot be placed: it is left out (the hover shows "–").
function scaled(column, log) {
  return log ? column.map((v) => (v !== null && v > 0 ? v : null)) : column;
}

const markNote = (marks) => `┆ ${marks.length} alert(s): the red dashed line; hover it to read`;

// Under the chart: the alerts of the step under the cursor, or how many there are.
function showMarks(u, marks) {
  const note = u.root.closest(".chart")?.querySelector(".marks-note");
  if (!note) return;
  const step = u.cursor.idx === null || u.cursor.idx === undefined ? null : u.data[0][u.cursor.idx];
  const here = marks.filter((m) => m.step === step);
  note.textContent = here.length ? here.map((m) => m.text).join(" · ") : markNote(marks);
}

// The steps a chart spans: its points' (first, last) and with its alerts (lo, hi).
function extent(spec) {
  const steps = spec.lines.flatMap((line) => line.points.map((p) => p[0]));
  const marks = spec.marks.map((m) => m.step);
  return {first: Math.min(...steps), last: Math.max(...steps), lo: Math.min(...steps, ...marks),
    hi: Math.max(...steps, ...marks)};
}

// The y axis's labels, also kept on the chart (data-yticks) for what reads the page as text.
function yTicks(u, splits) {
  const labels = splits.map(num);
  u.root.dataset.yticks = labels.join(" ");
  return labels;
}

function lastValue(column) {
  for (let i = column.length - 1; i >= 0; i--) if (column[i] !== null) return column[i];
  return null;
}

export class Board {
  constructor(onChange) {
    this.smooth = 0;
    this.log = false;
    this.zoom = null; // [min, max] steps, or null for the whole run
    this.charts = new Map(); // title -> {node, plot, spec}
    this.key = `board-${++boards}`;
    this.syncing = false;
    this.onChange = onChange;
  }

  controls() {
    const value = el("span", {class: "smooth-value"}, "0");
    const slider = el("input", {type: "range", min: "0", max: "0.99", step: "0.01", value: String(this.smooth),
      id: "smoothing", "aria-label": "EMA smoothing", oninput: (e) => {
        this.smooth = Number(e.target.value);
        value.textContent = String(this.smooth);
        this.redraw();
      }});
    value.textContent = String(this.smooth);
    const log = el("input", {type: "checkbox", id: "log-scale", checked: this.log, onchange: (e) => {
      this.log = e.target.checked;
      this.redraw();
    }});
    const reset = el("button", {id: "reset-zoom", onclick: () => this.setZoom(null)}, "reset zoom");
    return el("div", {class: "toolbar chart-controls"},
      el("label", {}, "smoothing (EMA) ", slider, " ", value),
      el("label", {}, log, " log scale"),
      reset, el("span", {class: "muted"}, "drag across a chart to zoom; double-click to reset"));
  }

  // specs: [{title, lines: [{label, points, color, dash}], marks: [{step, text}]}]
  render(container, specs) {
    this.destroy();
    this.container = container;
    container.replaceChildren(...specs.map((spec) => this.frame(spec)));
    for (const spec of specs) this.draw(spec);
  }

  // New data for the same page (a live update): charts keep the zoom and the controls.
  update(specs) {
    const same = specs.length === this.charts.size && specs.every((s) => this.charts.has(s.title)
      && this.charts.get(s.title).spec.marks.length === s.marks.length);
    if (!same) return this.render(this.container, specs);
    for (const spec of specs) this.draw(spec);
  }

  redraw() {
    for (const {spec} of this.charts.values()) this.draw(spec);
  }

  destroy() {
    for (const {plot} of this.charts.values()) if (plot) plot.destroy();
    this.charts.clear();
  }

  frame(spec) {
    const node = el("div", {class: "chart", "data-chart": spec.title}, el("h3", {}, spec.title),
      el("div", {class: "plot"}),
      spec.marks.length ? el("div", {class: "marks-note"}, markNote(spec.marks)) : null);
    this.charts.set(spec.title, {node, plot: null, spec});
    return node;
  }

  // A chart whose series stay the same takes new data in place (a live update keeps the zoom
  // and the element under the reader's mouse); anything else builds it again.
  draw(spec) {
    const entry = this.charts.get(spec.title);
    const [steps, ...columns] = align(spec.lines);
    // A chart with no value above 0 stays linear when the log scale is on: nothing could be drawn.
    const log = this.log && columns.some((column) => column.some((v) => v !== null && v > 0));
    const series = [], data = [steps];
    spec.lines.forEach((line, i) => {
      const style = {stroke: line.color, width: 1.8, dash: line.dash ? [6, 4] : undefined, spanGaps: true,
        value: (u, v, sidx, idx) => num(idx === null ? lastValue(u.data[sidx]) : v)};
      if (this.smooth > 0) {
        series.push({...style, label: `${line.label} (raw)`, stroke: `${line.color}40`, width: 1});
        data.push(scaled(columns[i], log));
      }
      series.push({...style, label: line.label});
      data.push(scaled(ema(columns[i], this.smooth), log));
    });
    const flat = log ? null : flatValue(data.slice(1));
    const shape = JSON.stringify([series.map((s) => [s.label, s.stroke]), log, flat]);
    entry.spec = spec;
    entry.extent = extent(spec);
    entry.node.dataset.steps = String(steps.length);
    entry.node.dataset.scale = log ? "log" : "linear";
    if (entry.plot && entry.shape === shape) {
      entry.plot.setData(data, !this.zoom);
      return;
    }
    if (entry.plot) entry.plot.destroy();
    entry.shape = shape;
    const target = entry.node.querySelector(".plot");
    const width = Math.max(200, target.clientWidth || entry.node.clientWidth - 22);
    entry.plot = new uPlot(this.options(entry, series, width, log, flat), data, target);
    if (this.zoom) entry.plot.setScale("x", {min: this.zoom[0], max: this.zoom[1]});
  }

  options(entry, series, width, log, flat) {
    return {
      width, height: HEIGHT, legend: {live: true},
      cursor: {sync: {key: this.key}, drag: {x: true, y: false}, y: false},
      scales: {
        // Asked for all the points, the axis also spans the alerts; a zoom (fewer points) is taken as is.
        x: {time: false, range: (u, min, max) => {
          const {lo, hi, first, last} = entry.extent;
          if (min > first || max < last) return [min, max];
          return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
        }},
        y: log ? {distr: 3, log: 10} : {range: yRange},
      },
      axes: [{values: (u, splits) => splits.map((s) => (Number.isInteger(s) ? String(s) : ""))},
        {size: 56, values: yTicks, splits: flat === null ? undefined : () => [flat]}],
      series: [{label: "step", value: (u, v, sidx, idx) => String(idx === null ? lastValue(u.data[0]) ?? "–" : v)},
        ...series],
      hooks: {
        draw: [(u) => this.drawMarks(u, entry.spec.marks)],
        setCursor: [(u) => showMarks(u, entry.spec.marks)],
        setScale: [(u, key) => this.followZoom(u, key, entry.extent)],
      },
    };
  }

  // Alerts: a red dashed line at their step, and a hover target that names them.
  drawMarks(u, marks) {
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = "#dc2626";
    ctx.lineWidth = 1.2 * devicePixelRatio;
    ctx.setLineDash([3 * devicePixelRatio, 3 * devicePixelRatio]);
    for (const mark of marks) {
      const x = Math.round(u.valToPos(mark.step, "x", true));
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
    u.over.querySelectorAll(".alert-mark").forEach((node) => node.remove());
    for (const mark of marks) {
      const node = el("div", {class: "alert-mark", title: mark.text, "data-step": mark.step});
      node.style.left = `${u.valToPos(mark.step, "x") - 3}px`;
      u.over.append(node);
    }
  }

  followZoom(u, key, {lo, hi}) {
    if (key !== "x" || this.syncing || !u.status) return;
    const [min, max] = [u.scales.x.min, u.scales.x.max];
    this.zoom = min <= lo && max >= hi ? null : [min, max];
    this.markZoom();
    this.syncing = true;
    for (const {plot} of this.charts.values()) if (plot && plot !== u) plot.setScale("x", {min, max});
    this.syncing = false;
  }

  resize() {
    for (const {node, plot} of this.charts.values()) {
      const width = node.querySelector(".plot").clientWidth;
      if (plot && width && width !== plot.width) plot.setSize({width, height: HEIGHT});
    }
  }

  setZoom(range) {
    this.zoom = range;
    this.redraw();
    this.markZoom();
  }

  markZoom() { // the steps on show, on every chart (data-zoom; empty: the whole run)
    for (const {node} of this.charts.values()) node.dataset.zoom = this.zoom ? this.zoom.map(num).join(" ") : "";
  }
}
