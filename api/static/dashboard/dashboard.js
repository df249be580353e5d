// kvgate dashboard: polls /dashboard/history for the samples it lacks and draws them.
// Hand-written, no dependencies, no build step. Every value from the server reaches the page
// through textContent or an SVG attribute, never as HTML: worker ids come from heartbeats.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const QUEUE_FIELDS = [
    ["pending", "pending", fmtInt],
    ["ack_pending", "ack-pending", fmtInt],
    ["redelivered", "redelivered", fmtInt],
    ["oldest_pending_age_s", "oldest pending", fmtSeconds],
  ];
  const RATE_WINDOW_S = 30;
  const PRESSURE_LEVEL = { normal: 0, elevated: 1, saturated: 2 };

  const state = { epoch: null, lastSeq: -1, samples: [], meta: null, queueCards: {} };
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs = {}, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fmtInt(v) { return v === null || v === undefined ? "–" : String(Math.round(v)); }
  function fmtSeconds(v) {
    if (v === null || v === undefined) return "–";
    if (v < 1) return `${Math.round(v * 1000)} ms`;
    if (v < 60) return `${v.toFixed(1)} s`;
    return `${Math.floor(v / 60)}m ${Math.round(v % 60)}s`;
  }
  function fmtMs(v) {
    if (v === null || v === undefined) return "–";
    return v < 0.01 ? `${(v * 1000).toFixed(1)} ms` : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
  }
  function fmtPct(v) { return v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`; }
  function fmtRate(v) { return v < 10 ? v.toFixed(2) : v.toFixed(1); }

  // One small line chart: each series is [[t, value or null], ...]; a null is a gap (unknown,
  // never drawn as zero). `ref` draws a dashed line (an objective).
  function spark(svg, series, opts = {}) {
    const box = svg.viewBox.baseVal;
    const W = box.width, H = box.height;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const t1 = state.samples.length ? state.samples[state.samples.length - 1].t : 0;
    const t0 = state.samples.length ? state.samples[0].t : 0;
    let max = opts.max || 0;
    for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
    if (opts.ref) max = Math.max(max, opts.ref * 1.15);
    if (max <= 0) max = 1;
    const x = (t) => (t1 > t0 ? ((t - t0) / (t1 - t0)) * W : W);
    const y = (v) => H - 2 - (v / max) * (H - 4);
    for (const s of series) {
      let d = "", pen = "M";
      for (const [t, v] of s.points) {
        if (v === null || v === undefined) { pen = "M"; continue; }
        d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
        pen = "L";
      }
      if (!d) continue;
      const path = document.createElementNS(SVG, "path");
      path.setAttribute("d", d);
      if (s.cls) path.setAttribute("class", s.cls);
      svg.appendChild(path);
    }
    if (opts.ref) {
      const line = document.createElementNS(SVG, "path");
      line.setAttribute("d", `M0,${y(opts.ref).toFixed(1)}L${W},${y(opts.ref).toFixed(1)}`);
      line.setAttribute("class", "objective");
      svg.appendChild(line);
    }
  }

  function sparkSvg(w = 300, h = 40) {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("preserveAspectRatio", "none");
    return svg;
  }

  function series(pick) { return state.samples.map((s) => [s.t, pick(s)]); }

  // -- queues ------------------------------------------------------------------------------------

  function queueCard(tier) {
    if (state.queueCards[tier]) return state.queueCards[tier];
    const card = el("div", { class: "card", "data-tier": tier });
    card.appendChild(el("h3", {}, tier));
    const fields = {};
    for (const [key, label] of QUEUE_FIELDS) {
      const row = el("div", { class: "metric", "data-tier": tier, "data-field": key });
      row.appendChild(el("span", { class: "label" }, label));
      const value = el("span", { class: "value" }, "–");
      row.appendChild(value);
      const svg = sparkSvg();
      row.appendChild(svg);
      card.appendChild(row);
      fields[key] = { value, svg };
    }
    const pulls = el("div", { class: "small", "data-tier": tier, "data-field": "waiting_pulls" });
    card.appendChild(pulls);
    $("queue-tiers").appendChild(card);
    state.queueCards[tier] = { fields, pulls };
    return state.queueCards[tier];
  }

  function lagRow(sample, tier) {
    return sample.lag ? sample.lag.find((r) => r.tier === tier) || null : null;
  }

  function renderQueues(latest) {
    const tiers = latest.latency.map((r) => r.tier);
    for (const tier of tiers) {
      const card = queueCard(tier);
      const row = lagRow(latest, tier);
      for (const [key, , fmt] of QUEUE_FIELDS) {
        const f = card.fields[key];
        f.value.textContent = row ? fmt(row[key]) : "unknown";
        f.value.dataset.value = row ? String(row[key] ?? "") : "unknown";  // raw, for tests
        spark(f.svg, [{ points: series((s) => { const r = lagRow(s, tier); return r ? r[key] ?? 0 : null; }) }]);
      }
      card.pulls.textContent = row ? `open pull requests: ${row.waiting_pulls}` : "";
    }
    $("lag-note").textContent = latest.lag
      ? `read ${fmtSeconds(latest.lag_age_s)} ago`
      : latest.lag_age_s === null ? "no reading yet" : `unknown: the last reading is ${fmtSeconds(latest.lag_age_s)} old`;
  }

  // -- admission ---------------------------------------------------------------------------------

  function renderAdmission(latest) {
    const p = $("pressure");
    p.textContent = latest.pressure;
    p.className = `pressure ${latest.pressure}`;
    spark($("pressure-spark"), [{ points: series((s) => PRESSURE_LEVEL[s.pressure]) }], { max: 2 });
    $("overcommit").textContent = `${latest.overcommit.toFixed(2)}×`;
    spark($("overcommit-spark"), [{ points: series((s) => s.overcommit) }]);
    $("windows").textContent = "windows: " + Object.entries(latest.windows)
      .map(([tier, w]) => `${tier} ${w.toFixed(2)}×`).join(" · ");

    const total = (s, tier) => Object.values(s.sessions[tier] || {}).reduce((a, n) => a + n, 0);
    const sessionRows = Object.keys(latest.sessions).map((tier) => {
      const tenants = Object.entries(latest.sessions[tier]).sort((a, b) => b[1] - a[1])
        .map(([tenant, n]) => `${tenant} ${n}`).join(" · ");
      const tr = el("tr", { "data-tier": tier });
      tr.appendChild(el("td", {}, tier));
      tr.appendChild(el("td", { class: "num" }, String(total(latest, tier))));
      tr.appendChild(el("td", { class: "small" }, tenants));
      return tr;
    });
    $("session-rows").replaceChildren(...sessionRows);
    spark($("sessions-spark"), Object.keys(latest.sessions).map((tier) => (
      { points: series((s) => total(s, tier)), cls: tier })));

    const keys = new Map();
    for (const s of state.samples) for (const d of s.decisions) keys.set(`${d.decision}/${d.reason}`, d.decision);
    const since = latest.t - RATE_WINDOW_S;
    const lines = [], rows = [];
    for (const [key, decision] of [...keys.entries()].sort()) {
      const rate = (s) => { const d = s.decisions.find((x) => `${x.decision}/${x.reason}` === key); return d ? d.per_s : 0; };
      lines.push({ points: series(rate), cls: decision });
      const recent = state.samples.filter((s) => s.t > since);
      const mean = recent.length ? recent.reduce((a, s) => a + rate(s), 0) / recent.length : 0;
      const tr = el("tr", { "data-decision": key });
      const name = el("td");
      name.appendChild(el("span", { class: `dot ${decision}` }));
      name.appendChild(document.createTextNode(key));
      tr.appendChild(name);
      tr.appendChild(el("td", {}, `${fmtRate(mean)} /s`));
      rows.push(tr);
    }
    spark($("decisions-spark"), lines);
    const note = el("tr");
    note.appendChild(el("td", { class: rows.length ? "small" : "empty" },
      rows.length ? `mean over the last ${RATE_WINDOW_S} s` : "no decisions yet"));
    $("decision-rows").replaceChildren(...rows, note);
  }

  // -- workers -----------------------------------------------------------------------------------

  function renderWorkers() {
    const rows = state.meta.workers.map((w) => {
      const tr = el("tr", { class: w.state, "data-worker": w.worker_id });
      const cell = (text, attrs = {}) => { const td = el("td", attrs, text); tr.appendChild(td); return td; };
      cell(w.worker_id);
      cell(w.model);
      cell("").appendChild(el("span", { class: `badge ${w.state}` }, w.state));
      cell(fmtPct(w.kv_cache_usage), { "data-field": "kv" });
      const svg = sparkSvg(200, 30);
      cell("").appendChild(svg);
      spark(svg, [{ points: series((s) => (w.worker_id in s.worker_kv ? s.worker_kv[w.worker_id] : null)) }], { max: 1 });
      cell(`${w.num_running} / ${w.max_num_seqs}`);
      cell(fmtInt(w.num_waiting));
      cell(fmtInt(w.staged));
      cell(fmtInt(w.num_preemptions));
      cell(fmtSeconds(w.heartbeat_age_s), { "data-field": "age" });
      return tr;
    });
    if (!rows.length) {
      const tr = el("tr");
      tr.appendChild(el("td", { colspan: "10", class: "empty" }, "no worker has sent a heartbeat"));
      rows.push(tr);
    }
    $("worker-rows").replaceChildren(...rows);
  }

  // -- calls -------------------------------------------------------------------------------------

  function renderCalls(latest) {
    const rows = latest.latency.map((r) => {
      const goal = state.meta.objectives[r.tier] || {};
      const tr = el("tr", { "data-tier": r.tier });
      const judged = (v, objective) => (v === null ? "none" : v > objective ? "miss" : "met");
      tr.appendChild(el("td", {}, r.tier));
      tr.appendChild(el("td", { "data-field": "calls" }, fmtInt(r.ttft_calls)));
      for (const [kind, objective] of [["ttft", goal.ttft_s], ["tpot", goal.tpot_s]]) {
        const p50 = r[`${kind}_p50_s`], p99 = r[`${kind}_p99_s`], key = `${kind}_p99_s`;
        tr.appendChild(el("td", { class: judged(p50, objective), "data-field": `${kind}_p50_s` }, fmtMs(p50)));
        tr.appendChild(el("td", { class: judged(p99, objective), "data-field": key }, fmtMs(p99)));
        tr.appendChild(el("td", {}, fmtMs(objective)));
        const td = el("td");
        const svg = sparkSvg(200, 30);
        td.appendChild(svg);
        tr.appendChild(td);
        spark(svg, [{ points: series((s) => { const x = s.latency.find((l) => l.tier === r.tier); return x ? x[key] : null; }) }], { ref: objective });
      }
      return tr;
    });
    $("latency-rows").replaceChildren(...rows);
  }

  // -- polling -----------------------------------------------------------------------------------

  function render() {
    const latest = state.samples[state.samples.length - 1];
    if (!latest) return;
    $("max-age").textContent = String(state.meta.heartbeat_max_age_s);
    $("latency-window").textContent = String(state.meta.latency_window_s);
    renderQueues(latest);
    renderAdmission(latest);
    renderWorkers();
    renderCalls(latest);
    const span = latest.t - state.samples[0].t;
    const status = $("status");
    status.className = "status";
    status.textContent = `updated ${new Date(latest.t * 1000).toLocaleTimeString()} · a sample every ${state.meta.interval_s} s · ${fmtSeconds(span)} of history`;
    document.body.dataset.seq = String(latest.seq);
  }

  async function poll() {
    let wait = 2000;
    try {
      const resp = await fetch(`/dashboard/history?after=${state.lastSeq}`, { cache: "no-store", credentials: "same-origin" });
      if (resp.status === 401) { window.location.reload(); return; }  // signed out: the form
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const body = await resp.json();
      if (body.epoch !== state.epoch) {
        const restarted = state.epoch !== null;
        state.epoch = body.epoch;
        state.samples = [];
        if (restarted) {  // a new front door: its history, from the start, at once
          state.lastSeq = -1;
          return poll();
        }
      }
      state.meta = body;
      state.samples.push(...body.samples);
      if (body.samples.length) state.lastSeq = body.samples[body.samples.length - 1].seq;
      const latest = state.samples[state.samples.length - 1];
      if (latest) state.samples = state.samples.filter((s) => s.t >= latest.t - body.history_s);
      render();
      wait = body.interval_s * 1000;
    } catch (err) {
      const status = $("status");
      status.className = "status error";
      status.textContent = `front door unreachable (${err.message}); retrying`;
      wait = 5000;
    }
    setTimeout(poll, wait);
  }

  poll();
})();
