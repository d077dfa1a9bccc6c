// The Shadows tab (issue 27): the [[shadows]] candidates' summaries from GET /api/admin/v1/shadows, the
// newest pairs, and a Promote button per candidate (POST /shadows/promote: 409 promotion_refused says why).
// Uses app.js's helpers ($, el, row, wide, num, api). Data goes into the page with textContent only.
"use strict";

// a ratio with 3 significant digits (0.0031, 1.5, 12.3): 2 fixed decimals showed 0.0031 as 0.00 (issue 42)
function ratio(v) { return v === null || v === undefined ? "-" : String(Number(Number(v).toPrecision(3))); }

function pct(v) { return v === null || v === undefined ? "-" : Math.round(v * 1000) / 10 + "%"; }

function promoteCell(s) {
  const td = el("td");
  const pick = el("select");
  for (const p of [1, 5, 20, 50, 100]) {
    const o = el("option", p + "%"); o.value = String(p); if (p === 5) o.selected = true; pick.appendChild(o);
  }
  const go = el("button", "Promote");
  go.addEventListener("click", () => promoteShadow(s.alias, s.candidate, Number(pick.value)));
  td.append(pick, go);
  return td;
}

async function loadShadows() {
  try {
    const d = await api("/shadows?limit=50");
    $("s-rows").replaceChildren(...(d.data.length ? d.data.map((s) => {
      const m = s.summary;
      return row([s.alias, s.candidate, s.percent + "%", m.n, pct(m.success_rate), ratio(m.latency_ratio),
        ratio(m.cost_ratio), pct(m.exact_rate), num(m.mean_similarity, 3), pct(m.tool_calls_equal_rate),
        pct(m.schema_valid_rate), s.canary === null ? "-" : s.canary + "%",
        s.promotable ? "yes" : "no: " + s.promotion, promoteCell(s)], s.promotable ? "ok" : "");
    }) : [row([wide("no [[shadows]] rule matches", 14)])]));
    $("s-pairs").replaceChildren(...(d.pairs.length ? d.pairs.map((p) => row([p.at, p.request_id, p.alias,
      p.primary_candidate, p.candidate, p.candidate_status, num(p.primary_latency_ms, 1),
      num(p.candidate_latency_ms, 1), p.exact === null ? "-" : (p.exact ? "yes" : "no"),
      num(p.similarity, 3), p.tool_calls_equal === null ? "-" : String(p.tool_calls_equal),
      p.schema_valid === null ? "-" : String(p.schema_valid)], p.candidate_status === "ok" ? "" : "err"))
      : [row([wide("no pairs recorded yet", 12)])]));
    $("s-error").textContent = "";
  } catch (e) { $("s-error").textContent = e.message; }
}

async function promoteShadow(alias, candidate, percent) {
  $("s-result").textContent = "";
  try {
    const out = await api("/shadows/promote", "POST", { alias: alias, candidate: candidate, percent: percent });
    $("s-result").textContent = `promoted: ${out.canary.candidate} is a canary of ${out.canary.alias} at ` +
      `${out.canary.percent}% in this gateway (not written to its config file)`;
    $("s-error").textContent = "";
    await loadShadows();
  } catch (e) { $("s-error").textContent = e.message; }
}

for (const b of document.querySelectorAll("nav button")) {
  if (b.dataset.tab === "shadows") b.addEventListener("click", loadShadows);
}
setInterval(() => { if ($("shadows").classList.contains("on")) loadShadows(); }, 5000);
