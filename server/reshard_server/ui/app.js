// reshard-server dashboard: jobs, one job (live), a checkpoint and its layouts.
// Plain JavaScript, served from the package; every call carries the bearer token kept in
// this tab's sessionStorage. Text from the server is always inserted as text, never HTML.
"use strict";

const $ = (sel) => document.querySelector(sel);
const token = () => sessionStorage.getItem("reshard-token") || "";
let timer = null;
let stream = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

async function api(path, options = {}) {
  const resp = await fetch(path, {
    ...options,
    headers: { Authorization: `Bearer ${token()}`, "content-type": "application/json", ...(options.headers || {}) },
  });
  if (resp.status === 401) { logout("Your token was refused (revoked or wrong). Log in again."); throw new Error("401"); }
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(typeof body.detail === "string" ? body.detail : `HTTP ${resp.status}`);
  return body;
}

function size(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function pct(p) { return p.bytes_total ? Math.floor((100 * p.bytes_done) / p.bytes_total) : 0; }

function bar(p) {
  const value = pct(p);
  return el("span", {}, el("span", { class: "bar", role: "progressbar", "aria-valuenow": value },
    el("span", { style: `width:${value}%` })), ` ${value}%`);
}

function eta(job) {
  const rate = job.throughput_bytes_per_s;
  if (!rate || ["succeeded", "failed", "cancelled"].includes(job.state)) return "";
  const left = (job.progress.bytes_total - job.progress.bytes_done) / rate;
  return left > 0 ? `${Math.ceil(left)} s` : "";
}

function stop() {
  if (timer) clearInterval(timer);
  timer = null;
  if (stream) stream.abort();
  stream = null;
}

function logout(message = "") {
  sessionStorage.removeItem("reshard-token");
  stop();
  $("#nav").hidden = true;
  $("#view").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message;
}

// ---- views

async function jobsView(view) {
  view.replaceChildren(el("h1", {}, "Jobs"), el("p", { class: "muted", id: "jobs-count" }, "…"));
  const table = el("table", { id: "jobs" });
  view.append(table);
  async function refresh() {
    const page = await api("/v1/jobs?limit=100");
    $("#jobs-count").textContent = `${page.total} job(s), newest first`;
    const head = el("tr", {}, ...["id", "owner", "state", "progress", "rate", "ETA", "source → target", "created"].map((h) => el("th", {}, h)));
    const rows = page.items.map((j) => el("tr", { "data-id": j.id },
      el("td", {}, el("a", { href: `#/job/${j.id}` }, j.id)),
      el("td", {}, j.owner || "-"),
      el("td", { class: `state-${j.state}` }, j.reason ? `${j.state} (${j.reason})` : j.state),
      el("td", {}, bar(j.progress)),
      el("td", {}, j.throughput_bytes_per_s ? `${size(j.throughput_bytes_per_s)}/s` : ""),
      el("td", {}, eta(j)),
      el("td", {}, `${j.source} → ${j.target}`),
      el("td", {}, new Date(j.created_at).toLocaleString())));
    table.replaceChildren(head, ...rows);
  }
  await refresh();
  timer = setInterval(() => refresh().catch(() => {}), 2000);
}

async function jobView(view, id) {
  const job = await api(`/v1/jobs/${encodeURIComponent(id)}`);
  const state = el("span", { id: "job-state", class: `state-${job.state}` }, job.state);
  const progress = el("span", { id: "job-progress" }, bar(job.progress));
  const detail = el("p", { id: "job-detail", class: "muted" });
  const cancel = el("button", { id: "cancel", type: "button" }, "Cancel");
  const logs = el("pre", { id: "job-logs" }, "");
  const workers = el("div", { id: "job-workers", class: "muted" }, "planning…");
  // where each worker reads and what it sends: the server's dry run of the same spec
  const { source: planSource, target: _target, ...options } = job.spec;
  api("/v1/plans", { method: "POST", body: JSON.stringify({ ...options, source: planSource }) })
    .then((plan) => workers.replaceChildren(workerTable(plan)))
    .catch((e) => { workers.textContent = `no plan: ${e.message}`; });
  const show = (j) => {
    state.textContent = j.reason ? `${j.state} (${j.reason})` : j.state;
    state.className = `state-${j.state}`;
    progress.replaceChildren(bar(j.progress));
    detail.textContent = `${size(j.progress.bytes_done)} / ${size(j.progress.bytes_total)}, ` +
      `${j.progress.tensors_done}/${j.progress.tensors_total} tensors` +
      (j.throughput_bytes_per_s ? `, ${size(j.throughput_bytes_per_s)}/s` : "") +
      (eta(j) ? `, ETA ${eta(j)}` : "") + (j.error ? ` — ${j.error}` : "");
    cancel.disabled = ["succeeded", "failed", "cancelled"].includes(j.state);
  };
  cancel.addEventListener("click", async () => {
    if (!window.confirm(`Cancel job ${id}? Nothing it wrote is committed.`)) return;
    try { show(await api(`/v1/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" })); }
    catch (e) { detail.textContent = `cancel failed: ${e.message}`; }
  });
  view.replaceChildren(
    el("h1", {}, `Job ${id}`),
    el("p", {}, "State: ", state, "  ", progress, "  ", cancel), detail,
    el("h2", {}, "Workers (planned)"), workers,
    el("h2", {}, "Log (tail)"), logs,
    el("h2", {}, "Spec"), el("pre", { id: "job-spec" }, JSON.stringify(job.spec, null, 2)));
  show(job);
  // live progress: the server-sent event stream, read with fetch (it carries the token)
  stream = new AbortController();
  (async () => {
    const resp = await fetch(`/v1/jobs/${encodeURIComponent(id)}/events`,
      { headers: { Authorization: `Bearer ${token()}` }, signal: stream.signal });
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const message = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = message.split("\n").find((l) => l.startsWith("data: "));
        if (data) show(JSON.parse(data.slice(6)));
      }
    }
  })().catch(() => {});
  async function tail() {
    const out = await api(`/v1/jobs/${encodeURIComponent(id)}/logs?tail=200`);
    logs.textContent = out.text || "(no output yet)";
  }
  await tail().catch(() => {});
  timer = setInterval(() => tail().catch(() => {}), 2000);
}

function layoutText(layout) {
  if (!layout || !layout.mesh) return "-";
  const names = layout.mesh.names || layout.mesh.shape.map((_, i) => `d${i}`);
  return `${names.map((n, i) => `${n}=${layout.mesh.shape[i]}`).join(",")} | ${(layout.placements || []).join(",")}`;
}

function workerTable(plan) {
  const per = plan.per_worker || {};
  const head = el("tr", {}, ...["worker", "reads from storage", "sends", "receives"].map((h) => el("th", {}, h)));
  const rows = (per.read || []).map((_, w) => el("tr", {}, el("td", {}, `rank ${w}`),
    el("td", {}, size(per.read[w])), el("td", {}, size(per.sent[w])), el("td", {}, size(per.received[w]))));
  return el("div", {},
    el("p", {}, `${plan.world} workers, strategy ${plan.strategy}, ${plan.waves} wave(s), ${plan.storage_requests} storage requests; ` +
      `peak in flight ${size(plan.peak_memory.max)} per worker (budget ${size(plan.budget)})`),
    el("table", { id: "worker-table" }, head, ...rows));
}

function colour(k) { return `hsl(${(k * 137.508) % 360}, 62%, 45%)`; }

function drawLayout(pic) {
  const rows = pic.grid.length, cols = pic.grid[0].length;
  const cell = Math.max(4, Math.min(24, Math.floor(720 / cols)));
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "layout");
  svg.setAttribute("id", "layout-svg");
  svg.setAttribute("width", cols * cell);
  svg.setAttribute("height", rows * cell);
  pic.grid.forEach((row, i) => row.forEach((k, j) => {
    const r = document.createElementNS(svg.namespaceURI, "rect");
    r.setAttribute("x", j * cell); r.setAttribute("y", i * cell);
    r.setAttribute("width", cell); r.setAttribute("height", cell);
    r.setAttribute("fill", k >= 0 ? colour(k) : "#eee");
    r.setAttribute("data-box", k);
    const title = document.createElementNS(svg.namespaceURI, "title");
    title.textContent = k >= 0 ? `box ${k}` : "no box";
    r.append(title);
    svg.append(r);
  }));
  const legend = el("div", { class: "legend", id: "layout-legend" });
  pic.boxes.slice(0, 256).forEach((b, k) => {
    const range = `[${b.offsets.map((o, d) => `${o}:${o + b.sizes[d]}`).join(", ")}]`;
    const who = b.holders.length
      ? (b.holders.length === 1 ? `rank ${b.holders[0]}` : `${b.holders.length} replicas: ranks ${b.holders.slice(0, 8).join(", ")}${b.holders.length > 8 ? "…" : ""}`) +
        ` (${b.coords.slice(0, 8).map((c) => Object.entries(c).map(([n, v]) => `${n}=${v}`).join(",")).join("; ")})`
      : (b.file || "");
    legend.append(el("span", { class: "swatch", style: `background:${colour(k)}` }, k), el("span", {}, `${range} ${who}`));
  });
  const dims = pic.dims_drawn.length === 2 ? "rows: dim 0, columns: dim 1" : pic.dims_drawn.length ? "one row: dim 0" : "a scalar";
  return el("div", {}, el("p", { class: "muted" }, `${pic.tensor} ${pic.dtype} [${pic.shape.join(", ")}] ${pic.layout || "(no layout recorded)"}; ${dims}${pic.note ? "; " + pic.note : ""}`), svg, legend);
}

async function checkpointView(view, params) {
  const uri = params.get("uri") || "";
  const input = el("input", { type: "text", id: "uri", value: uri, placeholder: "/data/ckpt or s3://bucket/ckpt" });
  const form = el("form", { id: "uri-form" }, input, " ", el("button", { type: "submit" }, "Open"));
  form.addEventListener("submit", (e) => { e.preventDefault(); location.hash = `#/checkpoint?uri=${encodeURIComponent(input.value)}`; });
  const body = el("div", { id: "checkpoint" });
  view.replaceChildren(el("h1", {}, "Checkpoint"), form, body);
  if (!uri) return;
  let info;
  try { info = await api(`/v1/checkpoints?uri=${encodeURIComponent(uri)}`); }
  catch (e) { body.replaceChildren(el("p", { class: "error" }, e.message)); return; }
  const picture = el("div", { id: "layout" });
  const table = el("table", { id: "tensors" },
    el("tr", {}, ...["tensor", "dtype", "shape", "layout", "chunks"].map((h) => el("th", {}, h))));
  for (const [name, t] of Object.entries(info.tensors)) {
    const link = el("span", { class: "clickable", "data-tensor": name }, name);
    link.addEventListener("click", async () => {
      try {
        const pic = await api(`/v1/checkpoints/layout?uri=${encodeURIComponent(uri)}&tensor=${encodeURIComponent(name)}`);
        picture.replaceChildren(el("h2", {}, `Layout of ${name}`), drawLayout(pic));
      } catch (e) { picture.replaceChildren(el("p", { class: "error" }, e.message)); }
    });
    table.append(el("tr", {}, el("td", {}, link), el("td", {}, t.dtype), el("td", {}, (t.shape || []).join("×") || "scalar"),
      el("td", {}, layoutText(t.layout)), el("td", {}, (t.chunks || []).length)));
  }
  body.replaceChildren(el("p", { class: "muted" }, `${Object.keys(info.tensors).length} tensors (${info.source || ""})`), table, picture);
}

async function route() {
  stop();
  if (!token()) { logout(); return; }
  $("#login").hidden = true;
  $("#nav").hidden = false;
  api("/v1/me").then((me) => { $("#who").textContent = `${me.name} (${me.scopes.join(", ")})`; }).catch(() => {});
  const view = $("#view");
  view.hidden = false;
  const [path, query] = (location.hash.slice(1) || "/jobs").split("?");
  const params = new URLSearchParams(query || "");
  try {
    if (path.startsWith("/job/")) await jobView(view, decodeURIComponent(path.slice(5)));
    else if (path === "/checkpoint") await checkpointView(view, params);
    else await jobsView(view);
  } catch (e) {
    if (e.message !== "401") view.replaceChildren(el("p", { class: "error" }, e.message));
  }
}

$("#login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  sessionStorage.setItem("reshard-token", $("#token").value.trim());
  $("#token").value = "";
  try { await api("/v1/jobs?limit=1"); } catch { return; }
  route();
});
$("#logout").addEventListener("click", () => logout());
window.addEventListener("hashchange", route);
route();
