// The dashboard's one page (GET /): HTML, CSS and JavaScript in one string, built into the binary;
// no network, no CDN. It reads /api/jobs and /api/jobs/ID every two seconds and draws the curves
// as SVG with the session cookie that /login set (http_server.h); `#job=ID` opens a job.
#pragma once

namespace ltrain::launcher {

inline constexpr const char* kDashboardPage = R"PAGE(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ltrain</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:16px;align-items:baseline}
header h1{font-size:17px;margin:0}header a{color:#9cc3ff}
main{padding:14px 18px;display:grid;gap:14px}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:12px 14px}
h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eef0f3;white-space:nowrap}
th{font-weight:600;color:#5a6375}tr[data-job]{cursor:pointer}tr[data-job]:hover{background:#f0f5ff}
.RUNNING{color:#0a7d32}.FAILED{color:#c0262d}.SUCCEEDED{color:#225fc4}.STOPPED,.PENDING,.RESTARTING{color:#a26500}
.figures{display:flex;gap:26px;flex-wrap:wrap}.figures div b{display:block;font-size:19px}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}
svg{width:100%;height:220px;background:#fbfcfd;border:1px solid #eef0f3}
.straggler{color:#c0262d;font-weight:600}
pre{margin:0;max-height:260px;overflow:auto;font:12px/1.35 ui-monospace,monospace;background:#fbfcfd;padding:6px}
.muted{color:#7a8294}
</style></head>
<body>
<header><h1>ltrain</h1><a href="#" id="home">jobs</a><span id="updated" class="muted"></span></header>
<main id="main"><section><h2>Jobs</h2><div id="jobs">loading</div></section></main>
<script>
"use strict";
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const num = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d);
const when = ms => new Date(ms).toLocaleTimeString();
const label = y => Math.abs(y) >= 1000 ? String(Math.round(y)) : y.toPrecision(4);
async function get(path) {
  const r = await fetch(path, {credentials: "same-origin"});
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}
function jobFromHash() { const m = location.hash.match(/job=([^&]+)/); return m ? decodeURIComponent(m[1]) : ""; }

function chart(id, title, series, color2) {
  // series: [{name, points: [[x, y]...], color}]
  const W = 600, H = 220, L = 56, R = 12, T = 22, B = 28;
  const all = series.flatMap(s => s.points);
  let count = 0; series.forEach(s => count += s.points.length);
  let body = "";
  if (all.length) {
    let x0 = Math.min(...all.map(p => p[0])), x1 = Math.max(...all.map(p => p[0]));
    let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
    const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    for (let i = 0; i <= 4; i++) {
      const y = y0 + (y1 - y0) * i / 4;
      body += `<line x1="${L}" x2="${W - R}" y1="${Y(y)}" y2="${Y(y)}" stroke="#eef0f3"/>` +
              `<text x="${L - 6}" y="${Y(y) + 4}" text-anchor="end" font-size="11" fill="#7a8294">${label(y)}</text>`;
    }
    body += `<text x="${L}" y="${H - 8}" font-size="11" fill="#7a8294">step ${x0}</text>` +
            `<text x="${W - R}" y="${H - 8}" text-anchor="end" font-size="11" fill="#7a8294">step ${x1}</text>`;
    for (const s of series) {
      if (!s.points.length) continue;
      const d = s.points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join(" ");
      body += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="1.6"/>`;
      if (s.points.length < 60) body += s.points.map(p => `<circle cx="${X(p[0])}" cy="${Y(p[1])}" r="2.2" fill="${s.color}"/>`).join("");
    }
  } else {
    body = `<text x="${W / 2}" y="${H / 2}" text-anchor="middle" fill="#7a8294">no steps yet</text>`;
  }
  const legend = series.map((s, i) => `<text x="${L + 4 + i * 110}" y="14" font-size="12" fill="${s.color}">${esc(s.name)}</text>`).join("");
  return `<div><h2>${esc(title)}</h2><svg id="${id}" data-points="${count}" viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">${legend}${body}</svg></div>`;
}

function renderJobs(jobs) {
  const rows = jobs.map(j => `<tr data-job="${esc(j.id)}"><td>${esc(j.id)}</td><td class="${j.state}">${j.state}</td>` +
    `<td>${j.step}${j.total_steps ? " / " + j.total_steps : ""}</td><td>${j.step ? num(j.loss, 4) : "-"}</td>` +
    `<td>${j.val_step ? num(j.val_loss, 4) : "-"}</td><td>${j.tokens_per_s ? Math.round(j.tokens_per_s) : "-"}</td>` +
    `<td>${j.restarts}</td><td>${j.world_size}</td></tr>`).join("");
  document.getElementById("main").innerHTML = `<section><h2>Jobs</h2><table id="job-list"><tr><th>job</th><th>state</th>` +
    `<th>step</th><th>loss</th><th>val loss</th><th>tok/s</th><th>restarts</th><th>ranks</th></tr>${rows}</table></section>`;
  document.querySelectorAll("tr[data-job]").forEach(tr => tr.onclick = () => { location.hash = "job=" + encodeURIComponent(tr.dataset.job); });
}

function renderJob(j) {
  const s = j.series;
  const loss = chart("loss-chart", "Loss", [{name: "train", color: "#225fc4", points: s.steps.map(p => [p[0], p[2]])},
                                            {name: "validation", color: "#c2410c", points: s.val}]);
  const tps = chart("tokens-chart", "Tokens/s", [{name: "tokens/s", color: "#0a7d32", points: s.steps.map(p => [p[0], p[3]])}]);
  const mfuPoints = s.steps.filter(p => p[5] > 0).map(p => [p[0], 100 * p[5]]);
  const mfu = mfuPoints.length ? chart("mfu-chart", "MFU (%)", [{name: "MFU", color: "#7c3aed", points: mfuPoints}]) : "";
  const gib = b => num(b / 1073741824, 2) + " GiB";
  const ranks = j.ranks.map(r => `<tr><td>${r.rank}</td><td>${esc(r.node)}</td><td>${esc(r.state)}</td><td>${r.step}</td>` +
    `<td>${esc(r.phase || "-")}</td><td>${num(r.progress_age_s, 1)}s</td><td>${r.compute_ms ? num(r.compute_ms, 1) + " ms" : "-"}</td>` +
    `<td>${r.memory_bytes ? gib(r.memory_bytes) : "-"}</td>` +
    `<td>${r.straggler ? '<span class="straggler">straggler</span>' : ""}</td><td class="muted">${esc(r.work || "")}</td></tr>`).join("");
  const nodes = j.nodes.map(n => `<tr><td>${esc(n.node)}</td><td>${n.connected ? "up" : "lost"}</td><td>${num(n.heartbeat_age_s, 1)}s ago</td></tr>`).join("");
  const events = j.events.map(e => `${when(e.unix_ms)} ${e.rank >= 0 ? "[rank " + e.rank + "] " : ""}${esc(e.message)}`).join("\n");
  const logs = j.logs.map(e => `[rank ${e.rank}] ${esc(e.message)}`).join("\n");
  document.getElementById("main").innerHTML =
    `<section><h2>${esc(j.id)} <span id="job-state" class="${j.state}">${j.state}</span></h2><div class="figures">` +
    `<div>step<b id="job-step">${j.step}${j.total_steps ? " / " + j.total_steps : ""}</b></div>` +
    `<div>loss<b>${j.step ? num(j.loss, 4) : "-"}</b></div><div>val loss<b>${j.val_step ? num(j.val_loss, 4) : "-"}</b></div>` +
    `<div>tokens/s<b>${j.tokens_per_s ? Math.round(j.tokens_per_s) : "-"}</b></div>` +
    (j.mfu ? `<div>MFU<b>${num(100 * j.mfu, 1)}%</b></div>` : "") + `<div>ETA<b>${j.eta_s ? Math.round(j.eta_s) + " s" : "-"}</b></div>` +
    (j.checkpoint_save_s ? `<div>last save<b>${num(j.checkpoint_save_s, 1)} s</b></div>` : "") +
    `<div>generation<b>${j.generation}</b></div><div>restarts<b>${j.restarts}</b></div><div>committed<b>${j.committed_step || "-"}</b></div></div>` +
    (j.last_failure ? `<p class="FAILED">${esc(j.last_failure)}</p>` : "") + `</section>` +
    `<section class="charts">${loss}${tps}${mfu}</section>` +
    `<section><h2>Ranks</h2><table id="ranks"><tr><th>rank</th><th>node</th><th>state</th><th>step</th><th>phase</th><th>progress</th>` +
    `<th>compute</th><th>memory</th><th></th><th></th></tr>${ranks}</table></section>` +
    `<section><h2>Nodes</h2><table id="nodes"><tr><th>node</th><th></th><th>heartbeat</th></tr>${nodes}</table></section>` +
    `<section><h2>Events</h2><pre id="events">${events}</pre></section>` +
    `<section><h2>Log</h2><pre id="log">${logs}</pre></section>`;
  for (const id of ["events", "log"]) { const el = document.getElementById(id); el.scrollTop = el.scrollHeight; }
}

async function refresh() {
  try {
    const id = jobFromHash();
    if (id) renderJob(await get("/api/jobs/" + encodeURIComponent(id)));
    else renderJobs(await get("/api/jobs"));
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("updated").textContent = String(e.message || e);
  }
}
document.getElementById("home").onclick = e => { e.preventDefault(); location.hash = ""; };
window.addEventListener("hashchange", refresh);
refresh();
setInterval(refresh, 2000);
</script></body></html>
)PAGE";

}  // namespace ltrain::launcher
