// Small helpers the dashboard's pages share: building elements, calling the API, formatting.
// Text from runs is written by models and users: it only ever enters the page as a text node or
// an attribute value set with setAttribute, never as HTML (no innerHTML anywhere).

export const main = document.getElementById("main");
export const enc = encodeURIComponent;

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export async function api(path, body) {
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

export const fmt = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

// A chart value: four decimals without trailing zeros (12, 0.0625, -0.5); very large or very
// small magnitudes in exponent form, so a KL of 3e-6 does not read as 0.
export function num(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const size = Math.abs(v);
  if (size !== 0 && (size >= 1e5 || size < 1e-3)) return v.toExponential(3);
  return v.toFixed(4).replace(/\.?0+$/, "").replace(/^-0$/, "0");
}

export const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");

export function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

export function statusBadge(status) {
  const kind = status === "running" ? "running" : status === "finished" ? "finished"
    : status.includes("alert") ? "paused" : "";
  return el("span", {class: `status ${kind}`, "data-testid": "status"}, status);
}

export function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(el("a", {href: "#/"}, "runs"),
    ...parts.map(([label, href]) => (href ? el("a", {href}, "/ " + label) : el("span", {}, "/ " + label))));
  document.getElementById("evals-link").classList.toggle("here", location.hash.startsWith("#/evals"));
}

export function live(text) {
  document.getElementById("live").textContent = text || "";
}
