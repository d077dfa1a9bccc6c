// Ethen gateway dashboard: the Candidates, Canaries and Mesh tabs. Reads /api/admin/v1/observe/* with the
// session cookie through app.js's api() (loaded first; its helpers $, el, row, num are shared).
// Data goes into the page with textContent only (never as HTML).
"use strict";
const OBS_COLORS = ["#2f6fde", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0b7285", "#a61e4d", "#5c940d"];
let obsCharts = [];
let obsData = null;

// unit: a rate or a fraction (success, circuit open), drawn on a fixed 0-100% axis (uPlot's own padding drew
// all-1 data, every attempt a success, on 0-200%)
function obsLine(target, title, d, names, ys, fmt, stepped, unit) {
  const xs = d.buckets.map((t) => t + d.bucket_s / 2);  // each bucket's middle, over the whole window
  target.replaceChildren();
  if (!names.length) { target.appendChild(el("p", "no attempts in this window", "muted")); return; }
  const color = (i) => OBS_COLORS[i % OBS_COLORS.length];
  const series = [{}, ...names.map((label, i) => ({  // filled points: a bucket alone is still seen
    label, stroke: color(i), width: 2, spanGaps: false, points: { show: true, size: 8, fill: color(i) },
    ...(stepped ? { paths: uPlot.paths.stepped({ align: 1 }) } : {}) }))];
  const scales = { x: { time: true, range: [d.since, d.until] } };
  if (unit) scales.y = { range: () => [0, 1] };
  const opts = { width: chartWidth(target), height: 200, title, series, scales,
    axes: [{}, { size: 70, values: (u, vals) => vals.map(fmt) }] };
  obsCharts.push(new uPlot(opts, [xs, ...ys], target));
}

function drawObserve() {
  const d = obsData;
  if (!d) return;
  for (const c of obsCharts) c.destroy();
  obsCharts = [];
  const level = $("o-level").value;
  const entries = d[level];
  const traffic = entries.filter((e) => e.attempts > 0);
  const names = traffic.map((e) => e.key);
  const pct = (v) => Math.round(v * 100) + "%";
  const ms = (v) => Number(v.toPrecision(3)) + " ms";
  const per = `per ${Math.round(d.bucket_s)} s`;
  obsLine($("chart-success"), `success rate ${per}`, d, names,
          traffic.map((e) => e.series.success_rate), pct, false, true);
  obsLine($("chart-p50"), `latency p50 ${per}`, d, names, traffic.map((e) => e.series.p50_ms), ms);
  obsLine($("chart-p95"), `latency p95 ${per}`, d, names, traffic.map((e) => e.series.p95_ms), ms);
  const circuits = entries.filter((e) => e.series.circuit_open.some((v) => v > 0));
  const circuitTarget = $("chart-circuit");
  if (!circuits.length) {
    circuitTarget.replaceChildren(el("p", "circuit state: every circuit closed over this window", "muted"));
  } else {
    obsLine(circuitTarget, `circuit open (fraction of each bucket)`, d, circuits.map((e) => e.key),
            circuits.map((e) => e.series.circuit_open), pct, true, true);
  }
  $("o-rows").replaceChildren(...entries.map((e) => {
    const live = e.live || {};
    const state = live.circuit || "closed";
    return row([e.key, e.attempts, e.success_rate === null ? "-" : pct(e.success_rate), num(e.p50_ms, 1),
      num(e.p95_ms, 1), live.samples ?? "-", live.success_rate == null ? "-" : pct(live.success_rate),
      num(live.latency_ms_mean, 1), state], state === "closed" ? "" : "err");
  }));
  $("o-info").textContent = `${d.rows} logged requests` + (d.truncated ? " (the newest only)" : "");
}

async function loadObserve() {
  try {
    obsData = await api(`/observe/providers?window_s=${$("o-window").value}&buckets=24`);
    $("o-error").textContent = "";
    drawObserve();
  } catch (e) { $("o-error").textContent = e.message; }
}

async function loadCanaries() {
  try {
    const d = await api("/observe/canaries");
    $("c-rows").replaceChildren(...(d.data.length ? d.data.map((c) => row([c.alias, c.candidate,
      c.percent + "%", c.requests, c.hits, c.samples,
      c.success_rate === null ? "-" : Math.round(c.success_rate * 1000) / 10 + "%",
      `>= ${c.min_samples} samples, >= ${Math.round(c.min_success_rate * 1000) / 10}% success`,
      c.acceptance_met ? "yes" : "no"], c.acceptance_met ? "ok" : "err"))
      : [row([wide("no [[canaries]] configured", 9)])]));
    $("c-error").textContent = "";
  } catch (e) { $("c-error").textContent = e.message; }
}

function layerMap(node, n, stages) {
  const cells = el("div", null, "layers");
  const held = (i) => node.layers.some(([a, b]) => a <= i && i <= b);
  const used = (i) => stages.some((s) => s.node_id === node.node_id && s.first <= i && i <= s.last);
  for (let i = 0; i < n; i++) {
    const c = el("span", null, used(i) ? "used" : held(i) ? "held" : "");
    c.title = `layer ${i}`;
    cells.appendChild(c);
  }
  return cells;
}

// a table in a card: it scrolls inside the card when the window is too narrow, never the page
function scroller(table) {
  const wrap = el("div", null, "scroll");
  wrap.appendChild(table);
  return wrap;
}

// issue 44: the mesh's queue and predicted wait over the last minutes, and the share spilled to the cloud
let meshCharts = [];
function meshLoad(box, m) {
  const l = m.load;
  if (!l) return;
  box.appendChild(el("h4", "Load and predicted wait"));
  const share = l.spilled_share === null ? "-" : `${num(100 * l.spilled_share, 1)}%`;
  box.appendChild(el("p", `now: ${l.prefilling} waiting for a first token (${l.queued_tokens} prompt tokens ` +
    `queued), ${l.decoding} decoding (batches of ${l.batch_limit}) · step ${num(l.step_ms, 1)} ms · prefill ` +
    `${num(l.prefill_ms_per_token, 2)} ms/token · predicted wait for a ${m.prompt_tokens}-token prompt ` +
    `${num(l.predicted_wait_ms, 0)} ms · spilled elsewhere: ${l.spilled} of ${l.spilled + l.started} (${share})`,
    "load"));
  if (l.chains && l.chains.length) {  // per chain (a route's workers in order): its own queue and wait
    const t = el("table", null, "mesh");
    const head = el("thead");
    head.appendChild(row(["chain", "waiting", "decoding", "queued tokens", "session cap (busiest worker)",
      `predicted wait (${m.prompt_tokens} tokens)`].map((h) => el("th", h))));
    t.appendChild(head);
    const body = el("tbody");
    for (const c of l.chains) {
      body.appendChild(row([c.nodes.join(" → ") || "-", c.prefilling, c.decoding, c.queued_tokens,
        c.max_sessions, `${num(c.predicted_wait_ms, 0)} ms`]));
    }
    t.appendChild(body);
    box.appendChild(scroller(t));
  }
  const h = l.history;
  if (!h.length) { box.appendChild(el("p", "no generation yet", "muted")); return; }
  const xs = h.map((s) => s.at);
  const spill = el("div");
  const queue = el("div");
  box.appendChild(queue);
  box.appendChild(spill);
  const common = (title, names, colors) => ({ width: chartWidth(queue), height: 180, title,
    series: [{}, ...names.map((label, i) => ({ label, stroke: colors[i], width: 2,
      paths: uPlot.paths.stepped({ align: 1 }) }))], scales: { x: { time: true } } });
  const keys = [...new Set(h.flatMap((s) => (s.chains || []).map((c) => c.nodes.join(" → "))))].slice(0, 6);
  const perChain = keys.map((k) => h.map((s) => {
    const c = (s.chains || []).find((x) => x.nodes.join(" → ") === k);
    return c ? c.queue_ms : null;
  }));
  meshCharts.push(new uPlot(common("predicted wait before the own prefill (ms)", ["least of the chains", ...keys],
    [OBS_COLORS[1], ...keys.map((_, i) => OBS_COLORS[(i + 2) % OBS_COLORS.length])]),
    [xs, h.map((s) => s.queue_ms), ...perChain], queue));
  meshCharts.push(new uPlot(common("sessions and queued prompt tokens",
    ["waiting for first token", "decoding", "queued tokens / 100"], OBS_COLORS),
    [xs, h.map((s) => s.prefilling), h.map((s) => s.decoding), h.map((s) => s.queued_tokens / 100)], spill));
}

function meshBlock(m) {
  const box = el("div", null, "card");
  box.appendChild(el("h3", `${m.provider}` + (m.model ? ` · ${m.model} · ${m.n_layers} layers` : "")));
  if (!m.loaded) { box.appendChild(el("p", m.error, "err")); return box; }
  const r = m.route;
  const stages = r ? r.stages : [];
  box.appendChild(el("p", r ? `route now: ${r.nodes.join(" → ")} · cost ${num(r.cost, 1)} · ${r.hops} hop(s)` +
    (r.degraded ? " · degraded" : "") + ` · weights latency ${r.weights.latency}, load ${r.weights.load}, ` +
    `capacity ${r.weights.capacity}, hop ${r.weights.hop}, prompt ${r.weights.prompt}`
    : "no route: " + m.error, r ? "route" : "err"));
  const t = el("table", null, "mesh");
  const head = el("thead");
  head.appendChild(row(["node", "layers (blue: in the route)", "alive", "latency EWMA ms", "load", "capacity",
    "worker ms", "sessions now", "routed", "failovers", "node cost (latency + load + capacity)"]
    .map((h) => el("th", h))));
  t.appendChild(head);
  const body = el("tbody");
  for (const n of m.nodes) {
    const map = el("td"); map.appendChild(layerMap(n, m.n_layers, stages));
    const cost = el("td", n.node_cost === null ? "-" : num(n.node_cost, 1));
    if (n.cost_terms) {
      cost.appendChild(el("span", ` = ${num(n.cost_terms.latency, 1)} + ${num(n.cost_terms.load, 1)} + ` +
        `${num(n.cost_terms.capacity, 1)}`, "muted"));
    }
    body.appendChild(row([n.node_id, map, n.alive ? "yes" : "no", num(n.latency_ms_ewma, 1), num(n.load, 2),
      num(n.capacity_score, 2), num(n.worker_latency_ms, 1), n.active_sessions ?? "-", n.sessions, n.failovers,
      cost], n.alive ? (n.in_route ? "ok" : "") : "err"));
  }
  t.appendChild(body);
  box.appendChild(scroller(t));
  if (r) {
    box.appendChild(el("h4", "Route cost breakdown"));
    const s = el("table", null, "mesh");
    const sh = el("thead");
    sh.appendChild(row(["stage", "node", "layers", "node", "hop", "prefill", "stage total"].map((h) => el("th", h))));
    s.appendChild(sh);
    const sb = el("tbody");
    stages.forEach((st, i) => sb.appendChild(row([i + 1, st.node_id, `${st.first}-${st.last}`,
      num(st.node_cost, 2), num(st.hop_cost, 2), num(st.prefill_cost, 3), num(st.cost, 2)])));
    sb.appendChild(row(["", "total", "", "", "", "", num(r.cost, 2)]));
    s.appendChild(sb);
    box.appendChild(scroller(s));
    const rej = Object.entries(r.rejected).filter(([, ids]) => ids.length)
      .map(([why, ids]) => `${why.replace("_", " ")}: ${ids.join(", ")}`);
    if (rej.length) box.appendChild(el("p", "not in the route: " + rej.join(" · "), "muted"));
  }
  meshLoad(box, m);
  return box;
}

async function loadMesh() {
  try {
    const d = await api("/observe/mesh?prompt_tokens=64");
    for (const c of meshCharts) c.destroy();
    meshCharts = [];
    $("m-body").replaceChildren(...(d.data.length ? d.data.map(meshBlock)
      : [el("p", "no mesh provider in this gateway's config", "muted")]));
    fitCharts(meshCharts);  // drawn before the cards were in the page: now each takes its card's width
    $("m-error").textContent = "";
  } catch (e) { $("m-error").textContent = e.message; }
}

const OBS_TABS = { providers: loadObserve, canaries: loadCanaries, mesh: loadMesh };
for (const b of document.querySelectorAll("nav button")) {
  const load = OBS_TABS[b.dataset.tab];
  if (load) b.addEventListener("click", () => { fitCharts(obsCharts); load(); });
}
$("o-level").addEventListener("change", drawObserve);
let obsFitting = 0;
window.addEventListener("resize", () => {  // the charts keep their card's full width (app.js's fitCharts)
  clearTimeout(obsFitting);
  obsFitting = setTimeout(() => { fitCharts(obsCharts); fitCharts(meshCharts); }, 100);
});
$("o-window").addEventListener("change", loadObserve);
// canaries and mesh every 5 s; the candidates' charts (a scan of the window's log rows) every 30 s
let obsTick = 0;
setInterval(() => {
  obsTick++;
  for (const [name, load] of Object.entries(OBS_TABS)) {
    if ($(name).classList.contains("on") && (name !== "providers" || obsTick % 6 === 0)) load();
  }
}, 5000);
