// collabopt status page: reads /api/state every refresh interval and draws it (plots are plain SVG, no library).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let refreshMs = 2000;
let lastUpdate = null;

function $(id) { return document.getElementById(id); }

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return Number(value).toFixed(digits === undefined ? 1 : digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

function shortId(id) { return id.length > 16 ? `${id.slice(0, 8)}…${id.slice(-6)}` : id; }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// A line plot of ys over times (seconds), gaps where a value is null.
function plot(svg, times, ys, digits) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 360, H = 160, left = 44, right = 8, top = 8, bottom = 20;
  const points = times.map((t, i) => [t, ys[i]]).filter(([, y]) => y !== null && y !== undefined);
  svg.appendChild(svgEl("line", { class: "axis", x1: left, y1: H - bottom, x2: W - right, y2: H - bottom }));
  svg.appendChild(svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: H - bottom }));
  if (points.length === 0) {
    svg.appendChild(svgEl("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
    return;
  }
  const t0 = times[0], t1 = Math.max(times[times.length - 1], t0 + 1);
  let lo = Math.min(...points.map(p => p[1])), hi = Math.max(...points.map(p => p[1]));
  if (hi - lo < 1e-9) { hi += Math.max(1, Math.abs(hi)) * 0.5; lo -= Math.max(1, Math.abs(lo)) * 0.5; }
  if (lo > 0 && lo < (hi - lo)) lo = 0;
  const x = t => left + (t - t0) / (t1 - t0) * (W - left - right);
  const y = v => H - bottom - (v - lo) / (hi - lo) * (H - top - bottom);
  let segment = [];
  const flush = () => {
    if (segment.length) svg.appendChild(svgEl("polyline", { class: "series", points: segment.join(" ") }));
    segment = [];
  };
  times.forEach((t, i) => {
    const v = ys[i];
    if (v === null || v === undefined) { flush(); return; }
    segment.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
  });
  if (segment.length === 1) segment.push(segment[0]);  // one point: still a visible dot-line
  flush();
  svg.appendChild(svgEl("text", { class: "tick", x: left - 4, y: top + 8, "text-anchor": "end" }, fmt(hi, digits)));
  svg.appendChild(svgEl("text", { class: "tick", x: left - 4, y: H - bottom, "text-anchor": "end" }, fmt(lo, digits)));
  svg.appendChild(svgEl("text", { class: "tick", x: left, y: H - 4 }, `-${duration(t1 - t0)}`));
  svg.appendChild(svgEl("text", { class: "tick", x: W - right, y: H - 4, "text-anchor": "end" }, "now"));
}

function badge(text) { return el("span", { class: `badge ${text.replace(" ", "-")}` }, text); }

function render(state) {
  refreshMs = Math.max(500, state.interval * 1000);
  $("run-id").textContent = state.run_id;
  const verdict = $("verdict");
  verdict.textContent = state.verdict;
  verdict.className = `verdict ${state.verdict}`;
  $("verdict-reason").textContent = state.verdict_reason + (state.error ? ` (last read failed: ${state.error})` : "");
  $("global-epoch").textContent = state.global_epoch;
  $("eta").textContent = state.eta_seconds === null ? "ETA –" : `next in ${duration(state.eta_seconds)}`;
  $("sps").textContent = fmt(state.samples_per_second);
  $("accumulated").textContent = state.target_batch_size
    ? `${state.samples_accumulated} / ${state.target_batch_size} samples this epoch`
    : `${state.samples_accumulated} samples this epoch`;
  $("num-peers").textContent = state.num_peers;
  $("peers-known").textContent = `${state.peers_known} seen`;
  $("loss").textContent = fmt(state.loss, 4);
  $("rejected").textContent = state.rejected.total;
  const kinds = Object.entries(state.rejected.by_kind).map(([k, n]) => `${k}: ${n}`).join(", ");
  $("rejected-detail").textContent = kinds || "unsigned, forged, malformed, oversized";

  const body = $("peers").querySelector("tbody");
  while (body.firstChild) body.removeChild(body.firstChild);
  for (const p of state.peers) {
    const row = el("tr", { class: p.live ? "peer" : "peer gone", "data-peer": p.id, "data-sync": p.sync });
    const id = el("td"); id.appendChild(el("code", { title: p.id }, shortId(p.id))); row.appendChild(id);
    row.appendChild(el("td", { class: "num" }, p.epoch));
    row.appendChild(el("td", { class: "num" }, fmt(p.samples_per_second)));
    const share = el("td");
    if (p.share !== null && p.share !== undefined) {
      const bar = el("span", { class: "share" }); const fill = el("span");
      fill.style.width = `${Math.round(p.share * 100)}%`; bar.appendChild(fill);
      share.appendChild(bar); share.appendChild(document.createTextNode(`${(p.share * 100).toFixed(0)}%`));
    } else share.textContent = "–";
    row.appendChild(share);
    row.appendChild(el("td", { class: "num" }, fmt(p.loss, 4)));
    row.appendChild(el("td", { class: "round" }, p.last_round || "–"));
    row.appendChild(el("td", { class: "num" }, `${duration(p.last_seen)} ago`));
    const sync = el("td"); sync.appendChild(badge(p.sync)); row.appendChild(sync);
    const net = el("td"); net.appendChild(badge(p.reachability)); row.appendChild(net);
    const v = p.versions || {};
    row.appendChild(el("td", { class: "versions" },
      v.collabopt ? `collabopt ${v.collabopt} · hivemind ${v.hivemind} · torch ${v.torch}` : "hivemind peer"));
    body.appendChild(row);
  }
  const h = state.history;
  plot($("plot-sps"), h.time, h.samples_per_second, 0);
  plot($("plot-loss"), h.time, h.loss, 3);
  plot($("plot-peers"), h.time, h.num_peers, 0);
  lastUpdate = Date.now();
}

async function refresh() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    document.body.dataset.ready = "1";
  } catch (error) {
    $("verdict-reason").textContent = `cannot reach the monitor: ${error}`;
  }
  setTimeout(refresh, refreshMs);
}

setInterval(() => {
  if (lastUpdate !== null) $("updated").textContent = `updated ${Math.round((Date.now() - lastUpdate) / 1000)} s ago`;
}, 1000);
refresh();
