// Ethen gateway dashboard: reads the admin API with the session cookie (set by POST /ui/login);
// writes send the session's CSRF token (from the page's <meta>) in x-csrf-token.
// Data goes into the page with textContent only (never as HTML).
"use strict";
const API = "/api/admin/v1";
const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const $ = (id) => document.getElementById(id);
let cursor = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}
function wide(text, cols) { const td = el("td", text); td.colSpan = cols; return td; }  // a row's only cell
function num(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits); }

async function api(path, method, data) {
  const init = { method: method || "GET", credentials: "same-origin", headers: {} };
  if (init.method !== "GET") init.headers["x-csrf-token"] = CSRF;
  if (data !== undefined) { init.headers["content-type"] = "application/json"; init.body = JSON.stringify(data); }
  const r = await fetch(API + path, init);
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) { location.assign("/ui"); throw new Error("the session has ended"); }
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + "");
  return body;
}

async function logout() {
  await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: { "x-csrf-token": CSRF } });
  location.assign("/ui");
}

function filters() {
  const p = new URLSearchParams();
  for (const [id, name] of [["f-project", "project"], ["f-model", "model"], ["f-status", "status"]]) {
    const v = $(id).value.trim(); if (v) p.set(name, v);
  }
  return p;
}

async function loadRequests(fresh) {
  const p = filters(); p.set("limit", "50");
  if (!fresh && cursor) p.set("cursor", cursor);
  try {
    const page = await api("/requests?" + p.toString());
    $("req-error").textContent = "";
    const body = $("req-rows");
    if (fresh) body.replaceChildren();
    for (const r of page.data) {
      const status = el("td", r.status + (r.outcome !== "ok" ? " " + (r.error_code || r.outcome) : ""),
                        r.outcome === "ok" ? "ok" : "err");
      const served = r.selected_model ? r.selected_provider + "/" + r.selected_model : "-";
      const id = el("td", null, "id"); id.appendChild(el("span", r.request_id)).title = r.request_id;  // cut
      const tr = row([el("td", r.at.replace("T", " ").slice(0, 23), "at"), id, status, r.project || "-",
        r.requested_model || "-", served + (r.fallback_used ? " (fallback)" : ""), el("td", r.attempts.length, "n"),
        el("td", num(r.latency_ms, 1), "n"), el("td", r.prompt_tokens === null ? "-" : r.prompt_tokens + "/" +
        r.completion_tokens, "n"), el("td", num(r.cost_usd, 6), "n")], r.request_id === shown ? "row sel" : "row");
      tr.addEventListener("click", () => showRequest(r.request_id, tr));
      body.appendChild(tr);
    }
    cursor = page.next_cursor;
    $("more").disabled = !cursor;
  } catch (e) { $("req-error").textContent = e.message; }
}

// issue 27: the receipt's hedge (fired or not, its delay, who won, who was cancelled)
function hedgeSummary(h) {
  if (!h) return "";
  const after = h.after_ms != null ? ` after ${num(h.after_ms, 0)} ms` : "";
  if (!h.fired) return ` · hedge not fired${after}${h.skipped ? " (skipped: " + h.skipped + ")" : ""}`;
  return ` · hedge fired${after}, won by ${h.winner}, cancelled ${(h.cancelled || []).join(", ") || "none"}`;
}

// a request's page: below the table, scrolled into view (issue 42: it opened out of sight, below 50 rows)
let shown = null;
async function showRequest(id, tr) {
  const r = await api("/requests/" + encodeURIComponent(id));
  const rc = r.receipt || {};
  shown = id;
  for (const other of document.querySelectorAll("#req-rows tr.sel")) other.classList.remove("sel");
  if (tr) tr.classList.add("sel");
  $("detail").hidden = false;
  $("d-title").textContent = "Request " + r.request_id;
  $("d-summary").textContent = `${r.at} · ${r.endpoint}${r.stream ? " (stream)" : ""} · status ${r.status} ` +
    `${r.outcome}${r.error_code ? " " + r.error_code : ""} · requested ${r.requested_model || "-"} · served by ` +
    `${r.selected_model ? r.selected_provider + "/" + r.selected_model : "nobody"} · primary ` +
    `${r.primary_model ? r.primary_provider + "/" + r.primary_model : "-"} · cost $${num(r.cost_usd, 6)} · ` +
    `latency ${num(r.latency_ms, 1)} ms · TTFT ${num(r.ttft_ms, 1)} ms · reasons ` +
    (rc.reason_codes || []).join(", ") + hedgeSummary(rc.hedge);
  // issue 45: the prompt cache's part of the prompt, and what its reads saved against the input price
  $("d-cache").textContent = r.cache_read_tokens === null || r.cache_read_tokens === undefined
    ? "prompt cache: not logged for this request"
    : `prompt cache: ${r.cache_read_tokens} tokens read, ${r.cache_write_tokens} written ` +
      `(of ${r.prompt_tokens} prompt tokens) · saved $${num(r.saved_usd, 6)}`;
  $("d-chain").replaceChildren(...(rc.chain || []).map((c) => el("li", c)));
  $("d-attempts").replaceChildren(...r.attempts.map((a, i) => row([i + 1, a.candidate, a.outcome,
    a.code || "", a.status || "", num(a.latency_ms, 1)],
    a.outcome === "ok" ? "ok" : a.outcome === "cancelled" ? "" : "err")));
  // a served request's, and a refused one's when the log keeps its receipt (issue 42)
  const rejected = rc.rejected || [];
  $("d-rejected").replaceChildren(...(rejected.length ? rejected.map((j) =>
    el("li", (j.candidate || "") + ": " + (j.reasons || []).join(", ")))
    : [el("li", r.receipt ? "none" : "not logged for this request", "muted")]));
  $("d-receipt").textContent = JSON.stringify(rc, null, 2);
  $("detail").scrollIntoView({ block: "start" });
}

// a chart is as wide as its container (the page's width); redrawn to it when the window is resized
function chartWidth(target) {
  return Math.max(320, target.clientWidth || document.querySelector("main").clientWidth - 32);
}
function fitCharts(list) {
  for (const u of list) {
    const w = u.root.parentElement.clientWidth;  // 0 in a hidden tab: drawn again when it is shown
    if (w && Math.abs(w - u.width) > 1) u.setSize({ width: w, height: u.height });
  }
}
let fitting = 0;
window.addEventListener("resize", () => {
  clearTimeout(fitting);
  fitting = setTimeout(() => fitCharts(charts), 100);
});

const COLORS = ["#2f6fde", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0b7285", "#a61e4d", "#5c940d"];
let charts = [];

// The spend axis: from $0 to just above the data's largest bucket (uPlot's own default draws all-zero data,
// e.g. free models, on a $0-100 axis); all-zero data gets $0-0.01, so a flat line at $0 reads as $0.
const SPEND_MIN_TOP = 0.01;
function spendRange(u, min, max) {
  return max > 0 ? [0, uPlot.rangeNum(0, max, 0.1, true)[1]] : [0, SPEND_MIN_TOP];
}

// Spend per bucket of time, one line per project (or model), from the request log's newest rows.
function drawSpend(target, rows, keyOf, what) {
  const priced = rows.filter((r) => r.cost_usd !== null && keyOf(r) !== null);
  target.replaceChildren();
  if (!priced.length) { target.appendChild(el("p", "no priced requests yet", "muted")); return; }
  const times = priced.map((r) => Date.parse(r.at) / 1000);
  const t0 = times.reduce((a, b) => Math.min(a, b)), t1 = times.reduce((a, b) => Math.max(a, b));
  const step = Math.max(60, Math.ceil((t1 - t0) / 24));
  const start = Math.floor(t0 / step) * step, n = Math.floor((t1 - start) / step) + 2;
  const xs = Array.from({ length: n }, (_, i) => start + i * step);
  const names = [...new Set(priced.map(keyOf))].sort();
  const ys = names.map(() => new Array(n).fill(0));
  priced.forEach((r, i) => { ys[names.indexOf(keyOf(r))][Math.floor((times[i] - start) / step)] += r.cost_usd; });
  const series = [{}, ...names.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 2 }))];
  const opts = { width: chartWidth(target), height: 220, title: `spend per ${what} ($ per ${step} s)`, series,
    scales: { y: { range: spendRange } },
    axes: [{}, { size: 100, values: (u, vals) => vals.map((v) => "$" + Number(v.toPrecision(3))) }] };
  charts.push(new uPlot(opts, [xs, ...ys], target));
}

async function loadCharts() {
  // the newest 2000 rows' time, project, model and cost: one narrow query (ethen/admin/observe.py)
  const rows = (await api("/observe/spend?limit=2000")).data;
  for (const c of charts) c.destroy();
  charts = [];
  drawSpend($("chart-project"), rows, (r) => r.project || "(no project)", "project");
  drawSpend($("chart-model"), rows, (r) => r.selected_model ? r.selected_provider + "/" + r.selected_model : null,
            "model");
}

async function loadSpend() {
  try {
    await loadCharts();
    const projects = await api("/projects");
    const rows = [];
    for (const p of projects.data) {
      const v = await api("/projects/" + encodeURIComponent(p.name));
      rows.push(row([p.name, num(p.budget_usd, 2), p.budget_window, num(v.window.settled_usd, 6),
        v.window.remaining_usd === null ? "no budget" : num(v.window.remaining_usd, 6),
        p.rpm === null ? "-" : p.rpm, p.tpm === null ? "-" : p.tpm]));
    }
    $("projects").replaceChildren(...rows);
    const usage = await api("/usage");
    const top = Math.max(1e-12, ...usage.data.map((u) => u.cost_usd));
    $("usage").replaceChildren(...usage.data.map((u) => {
      const bar = el("td", null, "barchart"); const b = el("div");
      b.style.width = Math.round(200 * u.cost_usd / top) + "px"; bar.appendChild(b);
      return row([u.project, u.key_id || "-", u.model, u.requests, u.prompt_tokens + "/" + u.completion_tokens,
        u.cache_read_tokens + "/" + u.cache_write_tokens, num(u.cost_usd, 6), num(u.saved_usd, 6), bar]);
    }));
    $("spend-error").textContent = "";
  } catch (e) { $("spend-error").textContent = "Spend needs the gateway's store: " + e.message; }
}

async function loadProjects() {
  try {
    const projects = (await api("/projects")).data;
    const sel = $("k-project"); const keep = sel.value;
    sel.replaceChildren(...projects.map((p) => el("option", p.name)));
    if (projects.some((p) => p.name === keep)) sel.value = keep;
    await loadKeys();
    $("keys-error").textContent = "";
  } catch (e) { $("keys-error").textContent = "Projects need the gateway's store: " + e.message; }
}

async function loadKeys() {
  const project = $("k-project").value;
  if (!project) { $("keys-rows").replaceChildren(); return; }
  const keys = (await api("/projects/" + encodeURIComponent(project) + "/keys")).data;
  $("keys-rows").replaceChildren(...keys.map((k) => {
    const cell = el("td");
    if (!k.revoked_at) {
      const b = el("button", "Revoke"); b.dataset.key = k.key_id;
      b.addEventListener("click", () => revokeKey(k.key_id));
      cell.appendChild(b);
    }
    return row([k.key_id, k.name || "-", k.created_at.slice(0, 19), (k.last_used_at || "-").slice(0, 19),
      k.revoked_at ? k.revoked_at.slice(0, 19) : "no", cell], k.revoked_at ? "muted" : "");
  }));
}

async function createProject(ev) {
  ev.preventDefault();
  const budget = $("p-budget").value.trim();
  const rpm = $("p-rpm").value.trim(), tpm = $("p-tpm").value.trim();
  try {
    const p = await api("/projects", "POST", { name: $("p-name").value.trim(),
      budget_usd: budget ? Number(budget) : null, budget_window: $("p-window").value,
      rpm: rpm ? Number(rpm) : null, tpm: tpm ? Number(tpm) : null });
    $("p-name").value = ""; $("p-budget").value = ""; $("p-rpm").value = ""; $("p-tpm").value = "";
    await loadProjects();
    $("k-project").value = p.name; await loadKeys();
  } catch (e) { $("keys-error").textContent = e.message; }
}

function showPolicy(p) {
  $("policy-now").textContent = p.name + ": budget " + (p.budget_usd === null ? "none" : "$" + p.budget_usd +
    " per " + p.budget_window) + ", rpm " + (p.rpm === null ? "none" : p.rpm) + ", tpm " +
    (p.tpm === null ? "none" : p.tpm);
}

async function setPolicy(ev) {
  // PATCH the selected project: an empty field clears that budget or limit (the admin API's null)
  ev.preventDefault();
  const project = $("k-project").value;
  const budget = $("s-budget").value.trim();
  const rpm = $("s-rpm").value.trim(), tpm = $("s-tpm").value.trim();
  try {
    if (!project) throw new Error("create a project first");
    const p = await api("/projects/" + encodeURIComponent(project), "PATCH", {
      budget_usd: budget ? Number(budget) : null, budget_window: $("s-window").value,
      rpm: rpm ? Number(rpm) : null, tpm: tpm ? Number(tpm) : null });
    showPolicy(p);
    $("keys-error").textContent = "";
  } catch (e) { $("keys-error").textContent = e.message; }
}

async function createKey(ev) {
  ev.preventDefault();
  const project = $("k-project").value;
  try {
    if (!project) throw new Error("create a project first");
    const name = $("k-name").value.trim();
    const k = await api("/projects/" + encodeURIComponent(project) + "/keys", "POST", name ? { name } : {});
    $("k-name").value = "";
    $("new-key-value").textContent = k.key; $("new-key").hidden = false;
    await loadKeys();
    $("keys-error").textContent = "";
  } catch (e) { $("keys-error").textContent = e.message; }
}

async function revokeKey(id) {
  try {
    await api("/keys/" + encodeURIComponent(id), "DELETE");
    $("new-key").hidden = true; $("new-key-value").textContent = "";
    await loadKeys();
  } catch (e) { $("keys-error").textContent = e.message; }
}

async function loadHealth() {
  try {
    const h = await api("/health");
    $("circuits").replaceChildren(...(h.circuits.length ? h.circuits.map((c) =>
      row([c.circuit, c.reason, c.state, num(c.trial_in_s, 1)], "err"))
      : [row([wide("all circuits closed", 4)])]));
    // mesh nodes: a count here; each node's layers, health and the route are the Mesh tab's
    const dead = h.nodes.filter((n) => !n.alive).map((n) => n.provider + "/" + n.node_id);
    const mesh = $("mesh-state");
    mesh.textContent = h.nodes.length ? `mesh nodes: ${h.nodes.length - dead.length} of ${h.nodes.length} ` +
      `alive` + (dead.length ? ` (down: ${dead.join(", ")})` : "") + " · each node's layers, load and the " +
      "route: the Mesh tab" : "";
    mesh.className = dead.length ? "err" : "ok";
    $("log-state").textContent = `providers: ${h.providers.join(", ")} · request log: ` +
      `${h.request_log.store ? "store" : "memory ring"}, ${h.request_log.queued} queued`;
    $("health-error").textContent = "";
  } catch (e) { $("health-error").textContent = e.message; }
}

function tab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("on", b.dataset.tab === name);
  for (const s of document.querySelectorAll("section")) s.classList.toggle("on", s.id === name);
  fitCharts(charts);  // resized while hidden: the card's width now, before the data is read again
  if (name === "spend") loadSpend();
  if (name === "health") loadHealth();
  if (name === "keys") loadProjects();
}

$("logout").addEventListener("click", logout);
$("project-form").addEventListener("submit", createProject);
$("key-form").addEventListener("submit", createKey);
$("policy-form").addEventListener("submit", setPolicy);
$("k-project").addEventListener("change", loadKeys);
$("apply").addEventListener("click", () => loadRequests(true));
$("more").addEventListener("click", () => loadRequests(false));
$("d-back").addEventListener("click", () => $("requests").scrollIntoView({ block: "start" }));
for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => tab(b.dataset.tab));
setInterval(() => {
  if ($("auto").checked && $("requests").classList.contains("on")) loadRequests(true);
  if ($("health").classList.contains("on")) loadHealth();
}, 5000);
loadRequests(true);
