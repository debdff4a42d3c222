// npu-gateway console: reads the gateway's JSON and redraws every few
// seconds. No build step, no framework; uPlot (vendored, MIT) draws the
// plots. Data from the server is put into the page as text only (never
// as HTML). The session is an HttpOnly cookie: this script never sees it.
(function () {
  "use strict";

  const params = new URLSearchParams(location.search);
  const REFRESH_MS = Math.max(500, Number(params.get("refresh") || 2) * 1000);
  const USAGE_EVERY = Math.max(1, Math.round(10000 / REFRESH_MS)); // the ledger: every ~10 s
  const $ = (id) => document.getElementById(id);

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function fill(tableId, rows, empty) {
    const body = $(tableId).tBodies[0];
    const out = [];
    for (const cells of rows) {
      const tr = el("tr");
      for (const c of cells) {
        const td = el("td");
        if (c instanceof Node) td.appendChild(c);
        else td.textContent = c === null || c === undefined ? "-" : String(c);
        tr.appendChild(td);
      }
      out.push(tr);
    }
    if (!out.length && empty) {
      const tr = el("tr");
      const td = el("td", empty, "muted");
      td.colSpan = $(tableId).tHead.rows[0].cells.length;
      tr.appendChild(td);
      out.push(tr);
    }
    body.replaceChildren(...out);
  }

  const fmtInt = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));
  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = n;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(i ? 1 : 0) + " " + u[i];
  }
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "-";
    return s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s";
  }
  function fmtDuration(s) {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return h ? `${h} h ${m} min` : m ? `${m} min` : `${Math.floor(s)} s`;
  }

  function bar(fraction, text) {
    const wrap = el("span", null, "bar");
    const fillEl = el("span", null, "bar-fill" + (fraction >= 0.9 ? " hot" : ""));
    fillEl.style.width = Math.min(100, Math.max(0, fraction * 100)).toFixed(1) + "%";
    wrap.appendChild(fillEl);
    const box = el("span", null, "bar-box");
    box.appendChild(wrap);
    if (text) box.appendChild(el("span", text, "bar-text"));
    return box;
  }

  function chip(text, cls, title) {
    const c = el("span", text, "chip " + cls);
    if (title) c.title = title;
    return c;
  }

  class Unauthorized extends Error {}

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (r.status === 401 || r.status === 403) throw new Unauthorized(url);
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return r;
  }

  // ---------------------------------------------------------------- plots

  const COLORS = ["#2f7ed8", "#e4a11b", "#c0392b"];
  const plots = {};

  function makePlot(id, series, unit) {
    const target = $(id);
    const opts = {
      width: Math.max(300, target.clientWidth || 600),
      height: 190,
      scales: { x: { time: true } },
      axes: [{}, { values: (u, vals) => vals.map((v) => v + unit), size: 76 }],
      series: [{}].concat(series.map((s, i) => ({
        label: s, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false,
        points: { show: true, size: 4 },
      }))),
      legend: { show: true },
    };
    const data = [[]].concat(series.map(() => []));
    // eslint-disable-next-line no-undef
    plots[id] = new uPlot(opts, data, target);
  }

  function setupPlots() {
    makePlot("plot-ttft", ["p50", "p90", "p99"], " ms");
    makePlot("plot-itl", ["p50", "p90", "p99"], " ms");
    makePlot("plot-tps", ["tokens/s"], "");
    window.addEventListener("resize", () => {
      for (const [id, p] of Object.entries(plots)) p.setSize({ width: Math.max(300, $(id).clientWidth), height: 190 });
    });
  }

  const ms = (arr) => arr.map((v) => (v === null ? null : v * 1000));

  function setPlot(id, data) {
    plots[id].setData(data);
    // how many points it draws (non-null, non-zero), for a test or a person reading the DOM
    const points = data.slice(1).reduce((n, ys) => n + ys.filter((y) => y !== null && y !== 0).length, 0);
    $(id).dataset.points = String(points);
  }

  const MIN_BUCKETS = 60; // the plots span at least 10 minutes, at most the hour

  function drawHistory(h) {
    // from the first bucket with traffic (a young gateway's plots are not a
    // sliver at the right edge of an empty hour)
    const first = h.requests.findIndex((n) => n > 0);
    const from = Math.max(0, Math.min(first < 0 ? h.t.length : first, h.t.length - MIN_BUCKETS));
    const cut = (arr) => arr.slice(from);
    const t = cut(h.t);
    setPlot("plot-ttft", [t, ms(cut(h.ttft.p50)), ms(cut(h.ttft.p90)), ms(cut(h.ttft.p99))]);
    setPlot("plot-itl", [t, ms(cut(h.itl.p50)), ms(cut(h.itl.p90)), ms(cut(h.itl.p99))]);
    setPlot("plot-tps", [t, cut(h.tokens_per_second)]);
    $("n-requests").textContent = fmtInt(h.totals.requests);
    $("n-errors").textContent = fmtInt(h.totals.errors);
    $("n-tokens").textContent = fmtInt(h.totals.completion_tokens);
    const w = h.last_minute_tokens_per_second;
    $("n-tps").textContent = w === null || w === undefined ? "-" : w.toFixed(1);
    $("n-ttft").textContent = fmtSeconds(h.recent.ttft_p50);
  }

  // ------------------------------------------------------------- overview

  function drawOverview(o) {
    const status = $("status");
    status.textContent = o.status;
    status.className = "pill " + (o.status === "serving" ? "ok" : "warn");
    $("uptime").textContent = "up " + fmtDuration(o.uptime_s);
    let running = 0, queued = 0;
    fill("models", o.models.map((m) => {
      running += m.running;
      queued += m.queue_depth;
      const workers = el("span");
      for (const w of m.workers) {
        workers.appendChild(chip(`#${w.index} ${w.state}`, w.state,
          `${w.in_flight}/${w.slots} slots in use, ${w.restarts} restarts`));
      }
      const prios = Object.entries(m.queue_by_priority);
      const queue = prios.length ? prios.map(([p, n]) => `p${p}: ${n}`).join(", ") : "empty";
      const rej = Object.entries(m.rejected).filter(([, n]) => n).map(([r, n]) => `${r}: ${n}`).join(", ");
      return [m.id, m.names.join(", "), m.kind, m.backend, workers, m.running, queue, rej || "0"];
    }), "no models");
    $("n-running").textContent = `${running} / ${queued}`;

    const d = o.devices;
    fill("devices", d.readings.map((r) => [
      r.kind, r.device,
      `${fmtBytes(r.used_bytes)} of ${fmtBytes(r.total_bytes)}`,
      bar(r.total_bytes ? r.used_bytes / r.total_bytes : 0, r.total_bytes ? Math.round(100 * r.used_bytes / r.total_bytes) + "%" : ""),
      r.utilization === null ? "-" : r.utilization.toFixed(0) + "%",
      r.health || "-",
    ]), "no device readings");
    $("devices-note").textContent = d.ok ? "" : "device probe: " + (d.error || "no reading yet");

    const aliases = Object.entries(o.routes.aliases);
    fill("aliases", aliases.map(([name, a]) => [
      name,
      a.targets.map((t) => `${t.model} (${t.weight}, ${t.effective_weight}${t.rolled_back ? ", rolled back" : ""})`).join("; "),
      a.fallbacks.length ? a.fallbacks.join(" → ") : "-",
    ]), "no aliases");
    const ups = [];
    for (const u of o.routes.upstreams) {
      for (const x of u.urls) {
        ups.push([u.upstream, x.url, (x.serves || []).join(", ") || x.model || "-",
          chip(x.healthy ? "healthy" : "unhealthy", x.healthy ? "ready" : "restarting"),
          x.breaker, x.outstanding, x.last_error || "-"]);
      }
    }
    fill("upstreams", ups, "no upstream nodes");
  }

  function drawRecent(r) {
    fill("recent", r.data.map((x) => [
      (x.time || "").replace("T", " ").replace("Z", "").slice(11),
      x.key || "-", x.endpoint, x.model, x.target, chip(x.status, x.status < 400 ? "ready" : "restarting"),
      fmtInt(x.prompt_tokens), fmtInt(x.completion_tokens), fmtInt(x.cached_tokens),
      fmtSeconds(x.queue_wait), fmtSeconds(x.ttft), fmtSeconds(x.duration), (x.request_id || "").slice(0, 12),
    ]), "no requests yet");
  }

  // ---------------------------------------------------------------- usage

  async function drawUsage() {
    const to = new Date();
    const from = new Date(to.getTime() - 24 * 3600 * 1000);
    const q = new URLSearchParams({ from: from.toISOString(), to: to.toISOString() });
    const r = await (await getJSON("/console/api/usage?" + q.toString())).json();
    const note = $("usage-note");
    if (r.ledger !== "on") {
      const why = r.ledger === "off" ? "usage ledger off" : `usage ledger: HTTP ${r.status}`;
      note.textContent = why;
      fill("usage", [], why);
      return;
    }
    note.textContent = "";
    const usage = r.usage;
    const budgets = r.budgets;
    const byKey = new Map();
    for (const u of usage) byKey.set(u.group, { usage: u, budget: null });
    for (const b of budgets) {
      const row = byKey.get(b.key) || { usage: null, budget: null };
      row.budget = b;
      byKey.set(b.key, row);
    }
    const rows = [];
    for (const [key, { usage: u, budget: b }] of [...byKey.entries()].sort()) {
      const cell = el("span", null, "budgets");
      for (const x of (b && b.budgets) || []) {
        const line = el("span", null, "budget");
        line.appendChild(el("span", x.name, "budget-name"));
        line.appendChild(bar(x.limit ? x.used / x.limit : 0, `${fmtInt(x.used)} / ${fmtInt(x.limit)}`));
        line.title = "resets " + x.resets_at;
        cell.appendChild(line);
      }
      if (!cell.childNodes.length) cell.textContent = "none";
      rows.push([key, fmtInt(u && u.requests), fmtInt(u && u.prompt_tokens), fmtInt(u && u.completion_tokens),
        fmtInt(u && u.cached_tokens), fmtInt(u && u.errors), cell, (b && b.expires_at) || "-"]);
    }
    fill("usage", rows, "no usage in the last 24 h");
  }

  // ----------------------------------------------------------------- loop

  let tick = 0;
  async function refresh() {
    try {
      const [o, h, r] = await Promise.all([
        getJSON("/console/api/overview"), getJSON("/console/api/history"), getJSON("/console/api/recent?limit=30"),
      ]);
      drawOverview(await o.json());
      drawHistory(await h.json());
      drawRecent(await r.json());
      if (tick % USAGE_EVERY === 0) await drawUsage();
      tick++;
      $("refreshed").textContent = "updated " + new Date().toLocaleTimeString("en-GB");
      document.body.dataset.refreshes = String(tick);
    } catch (e) {
      if (e instanceof Unauthorized) {
        location.assign("/console"); // the session ended: back to the sign-in form
        return;
      }
      $("refreshed").textContent = "refresh failed: " + e.message;
    }
    setTimeout(refresh, REFRESH_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    setupPlots();
    refresh();
  });
})();
