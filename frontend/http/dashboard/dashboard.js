// headwater dashboard: polls /dashboard/data and draws it. Read-only.
//
// Every string from the server goes into the page as text (textContent, text nodes),
// never as markup: stack frames contain "<" and task names are arbitrary. Charts are
// plain SVG drawn here; the x axes use the server's clock (data.now), not the browser's.
"use strict";

(() => {
  const POLL_MS = 500;
  const HIDDEN_POLL_MS = 5000;
  const HISTORY_S = 60;
  const RATE_WINDOW_S = 5;
  const MAX_STALL_ROWS = 50;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    stallsAfter: null, // started_at of the newest stall record shown
    history: [], // the server's load history as objects: {t, inflight, queued, busy, ...}
    last: null, // the latest snapshot, redrawn on resize
    key: null, // the API key typed in (also in sessionStorage, for a reload)
    polling: false, // a poll is scheduled or running
  };

  const $ = (id) => document.getElementById(id);

  // -- DOM helpers: text only ----------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, String(v));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function setText(id, text, hot) {
    const node = $(id);
    node.textContent = text;
    if (hot !== undefined) node.classList.toggle("hot", Boolean(hot));
  }

  // -- formatting ------------------------------------------------------------------------

  function fmtSeconds(s) {
    if (s === null || s === undefined || Number.isNaN(s)) return "–";
    if (s < 0.001) return (s * 1000).toFixed(2) + " ms";
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(2) + " s";
  }

  function fmtClock(unix) {
    const d = new Date(unix * 1000);
    const pad = (n, w) => String(n).padStart(w, "0");
    return `${pad(d.getHours(), 2)}:${pad(d.getMinutes(), 2)}:${pad(d.getSeconds(), 2)}.` +
      pad(d.getMilliseconds(), 3);
  }

  function niceCeil(v) {
    // A round upper bound for a count axis: 1, 2, 4, 5, 10, 20, 40, 50, 100, ...
    if (v <= 1) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 4, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // -- charts ----------------------------------------------------------------------------

  // opts: {x: [x0, x1], y: [y0, y1], log, yTicks: [{v, label}], xTicks: [{v, label}],
  //        lines: [{points: [[x, y]], cls, area}], hlines: [{v, cls, label}],
  //        marks: [{x, w, from, to}]}
  function drawChart(svg, opts) {
    const box = svg.getBoundingClientRect();
    const w = Math.max(120, Math.round(box.width));
    const h = Math.max(60, Math.round(box.height));
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.replaceChildren();
    const m = { l: 46, r: 8, t: 8, b: 18 };
    const pw = w - m.l - m.r;
    const ph = h - m.t - m.b;
    const [x0, x1] = opts.x;
    const [y0, y1] = opts.y;
    const f = opts.log ? (v) => Math.log10(v) : (v) => v;
    const clampY = (v) => Math.min(Math.max(v, y0), y1);
    const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
    const sy = (v) => m.t + ph - ((f(clampY(v)) - f(y0)) / (f(y1) - f(y0))) * ph;

    for (const tick of opts.yTicks || []) {
      const y = sy(tick.v).toFixed(1);
      svg.append(svgEl("line", { class: "gridline", x1: m.l, x2: w - m.r, y1: y, y2: y }));
      const label = svgEl("text", { class: "axis", x: m.l - 4, y: Number(y) + 3, "text-anchor": "end" });
      label.textContent = tick.label;
      svg.append(label);
    }
    const xTicks = opts.xTicks || [];
    xTicks.forEach((tick, i) => {
      const anchor = i === 0 ? "start" : i === xTicks.length - 1 ? "end" : "middle";
      const label = svgEl("text", { class: "axis", x: sx(tick.v).toFixed(1), y: h - 4, "text-anchor": anchor });
      label.textContent = tick.label;
      svg.append(label);
    });
    for (const mark of opts.marks || []) {
      const xa = sx(mark.x);
      const width = Math.max(2, sx(mark.x + mark.w) - xa);
      const top = sy(mark.to);
      svg.append(svgEl("rect", {
        class: "stall-mark", x: xa.toFixed(1), y: top.toFixed(1), width: width.toFixed(1),
        height: Math.max(1, sy(mark.from) - top).toFixed(1),
      }));
    }
    for (const line of opts.lines || []) {
      const pts = line.points.filter((p) => p[0] >= x0 && p[0] <= x1);
      if (!pts.length) continue;
      const coords = pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`);
      if (line.area) {
        const base = sy(y0).toFixed(1);
        const first = sx(pts[0][0]).toFixed(1);
        const last = sx(pts[pts.length - 1][0]).toFixed(1);
        svg.append(svgEl("path", { class: line.area, d: `M${first},${base}L${coords.join("L")}L${last},${base}Z` }));
      }
      svg.append(svgEl("path", { class: line.cls, d: "M" + coords.join("L") }));
    }
    for (const hline of opts.hlines || []) {
      const y = sy(hline.v).toFixed(1);
      svg.append(svgEl("line", { class: hline.cls, x1: m.l, x2: w - m.r, y1: y, y2: y }));
      if (hline.label) {
        const label = svgEl("text", { class: hline.cls + "-label", x: m.l + 4, y: Number(y) - 4, "text-anchor": "start" });
        label.textContent = hline.label;
        svg.append(label);
      }
    }
  }

  function timeTicks(now) {
    return [60, 45, 30, 15, 0].map((ago) => ({ v: now - ago, label: ago ? `-${ago}s` : "now" }));
  }

  function linearTicks(top) {
    const values = Number.isInteger(top / 2) ? [0, top / 2, top] : [0, top];
    return values.map((v) => ({ v, label: String(v) }));
  }

  // -- sections --------------------------------------------------------------------------

  function renderLoop(data) {
    const loop = data.loop;
    const now = data.now;
    const delays = loop.delays;
    const peak = delays.reduce((acc, p) => Math.max(acc, p[1]), 0);
    const floor = 1e-4;
    const top = Math.max(1, Math.pow(10, Math.ceil(Math.log10(Math.max(peak, floor) * 1.5))));
    const ticks = [];
    for (let v = floor; v <= top * 1.001; v *= 10) ticks.push({ v, label: fmtSeconds(v).replace(".00", "").replace(".0 ", " ") });
    const half = loop.bucket_s / 2;
    const marks = delays
      .filter((p) => p[1] > loop.threshold_s)
      .map((p) => ({ x: p[0], w: loop.bucket_s, from: loop.threshold_s, to: p[1] }));
    // A group's page: the worst loop as the filled line, then one line per process.
    const lines = [{ points: delays.map((p) => [p[0] + half, Math.max(p[1], floor)]), cls: "s-delay", area: "a-delay" }];
    const perProcess = loop.processes || [];
    if (perProcess.length > 1) {
      perProcess.forEach((proc, i) => lines.push({
        points: proc.delays.map((p) => [p[0] + half, Math.max(p[1], floor)]),
        cls: "s-delay-" + (1 + (i % 3)),
      }));
    }
    drawChart($("loop-chart"), {
      x: [now - loop.window_s, now],
      y: [floor, top],
      log: true,
      yTicks: ticks,
      xTicks: timeTicks(now),
      lines,
      hlines: [{ v: loop.threshold_s, cls: "threshold", label: "threshold " + fmtSeconds(loop.threshold_s) }],
      marks,
    });
    setText("threshold", fmtSeconds(loop.threshold_s));
    setText("t-delay", fmtSeconds(peak), peak > loop.threshold_s);
    const hint = `max per ${loop.bucket_s * 1000} ms, last ${loop.window_s} s, log scale` +
      (perProcess.length > 1 ? ` · worst of ${perProcess.length} processes (filled) and each` : "") +
      (loop.instrumented ? "" : " · stall detector off");
    setText("loop-hint", hint);
  }

  function renderRequests(data) {
    const now = data.now;
    const hist = state.history;
    const top = niceCeil(Math.max(1, ...hist.map((h) => Math.max(h.inflight, h.queued))) * 1.1);
    drawChart($("requests-chart"), {
      x: [now - HISTORY_S, now],
      y: [0, top],
      yTicks: linearTicks(top),
      xTicks: timeTicks(now),
      lines: [
        { points: hist.map((h) => [h.t, h.queued]), cls: "s-queued" },
        { points: hist.map((h) => [h.t, h.inflight]), cls: "s-inflight" },
      ],
    });
    const tbody = $("by-status").tBodies[0];
    const rows = Object.entries(data.requests.by_status).sort((a, b) => b[1] - a[1]);
    rows.push(["disconnected clients", data.requests.disconnected_clients]);
    tbody.replaceChildren(...rows.map(([status, n]) => el("tr", {}, el("td", {}, status), el("td", { class: "num" }, n))));
    $("by-code").tBodies[0].replaceChildren(...codeRows(data.requests.by_code || {}));
    setText("t-inflight", String(data.requests.inflight));
    setText("t-queued", String(data.requests.queued), data.requests.queued > 0);
    const cur = hist[hist.length - 1];
    const old = hist.find((h) => h.t >= now - RATE_WINDOW_S);
    const rate = old && cur && cur.t > old.t ? (cur.finished - old.finished) / (cur.t - old.t) : 0;
    setText("t-rate", rate.toFixed(rate < 10 ? 1 : 0));
  }

  // One row per status class (2xx, 4xx, ...) with its total, then one per code in it.
  function codeRows(byCode) {
    const classes = {};
    for (const [code, n] of Object.entries(byCode)) {
      const cls = code[0] + "xx";
      (classes[cls] = classes[cls] || []).push([code, n]);
    }
    const rows = [];
    for (const cls of Object.keys(classes).sort()) {
      const codes = classes[cls].sort((a, b) => a[0].localeCompare(b[0]));
      const total = codes.reduce((sum, [, n]) => sum + n, 0);
      rows.push(el("tr", { class: "class-" + cls }, el("th", {}, cls), el("td", { class: "num" }, total)));
      for (const [code, n] of codes) {
        rows.push(el("tr", { "data-code": code }, el("td", { class: "indent" }, code), el("td", { class: "num" }, n)));
      }
    }
    return rows;
  }

  function renderPool(data) {
    const pool = data.pool;
    const now = data.now;
    const share = pool.threads ? pool.busy / pool.threads : 0;
    const fill = $("pool-fill");
    fill.style.width = (share * 100).toFixed(1) + "%";
    fill.classList.toggle("full", share >= 1 && pool.waiting > 0);
    setText("pool-text", `${pool.busy} of ${pool.threads} threads busy · ${pool.waiting} waiting · ` +
      `${pool.encoded_total - pool.inline_total} encoded in threads, ${pool.inline_total} inline · mode ${pool.mode}`);
    setText("t-pool", `${pool.busy} / ${pool.threads}`, share >= 1);
    const hist = state.history;
    const top = niceCeil(Math.max(pool.threads, ...hist.map((h) => Math.max(h.busy, h.queued))) * 1.15);
    drawChart($("pool-chart"), {
      x: [now - HISTORY_S, now],
      y: [0, top],
      yTicks: linearTicks(top),
      xTicks: timeTicks(now),
      lines: [
        { points: hist.map((h) => [h.t, h.queued]), cls: "s-waiting" },
        { points: hist.map((h) => [h.t, h.busy]), cls: "s-busy" },
      ],
      hlines: [{ v: pool.threads, cls: "capacity", label: `pool size ${pool.threads}` }],
    });
  }

  function renderLatency(data) {
    const rows = [["TTFT", data.latency.ttft], ["ITL", data.latency.itl]];
    $("latency").tBodies[0].replaceChildren(...rows.map(([name, s]) => el("tr", {},
      el("th", {}, name),
      el("td", { class: "num" }, s.count),
      el("td", { class: "num" }, fmtSeconds(s.p50)),
      el("td", { class: "num" }, fmtSeconds(s.p90)),
      el("td", { class: "num" }, fmtSeconds(s.p99)),
      el("td", { class: "num" }, fmtSeconds(s.max)),
    )));
    setText("latency-hint", `last ${data.latency.ttft.window_s} s`);
    setText("t-ttft", fmtSeconds(data.latency.ttft.p99));
  }

  function mb(value) {
    return value === null || value === undefined ? "–" : value.toFixed(0);
  }

  function renderProcesses(data) {
    // A group's page has one row per frontend process, plus the supervisor and the zygote;
    // a single process's page has its own row.
    const memory = data.memory || [];
    const rows = [];
    if (data.processes) {
      for (const p of data.processes) {
        const m = p.memory || {};
        const state = el("span", { class: "badge " + (p.up ? "state-healthy" : "state-inhibited") },
          p.up ? "up" : "not answering");
        const name = el("td", { "data-label": "process" }, el("a", { href: p.url + "/dashboard" }, "process " + p.process));
        rows.push(el("tr", {}, name,
          el("td", { class: "num", "data-label": "pid" }, p.pid),
          el("td", { "data-label": "state" }, state, p.restarts ? ` (${p.restarts} restarts)` : ""),
          el("td", { class: "num", "data-label": "in flight" }, p.inflight === undefined ? "–" : p.inflight),
          el("td", { class: "num", "data-label": "finished" }, p.finished === undefined ? "–" : p.finished),
          el("td", { class: "num", "data-label": "loop max" }, fmtSeconds(p.loop_max_s)),
          el("td", { class: "num", "data-label": "stalls" }, p.stalls === undefined || p.stalls === null ? "–" : p.stalls),
          el("td", { class: "num", "data-label": "RSS MB" }, mb(m.rss_mb)),
          el("td", { class: "num", "data-label": "PSS MB" }, mb(m.pss_mb)),
          el("td", { class: "num", "data-label": "USS MB" }, mb(m.uss_mb)),
        ));
      }
    }
    for (const m of memory) {
      if (data.processes && m.role.startsWith("process ")) continue; // in its row above
      rows.push(el("tr", {}, el("td", { "data-label": "process" }, m.role),
        el("td", { class: "num", "data-label": "pid" }, m.pid),
        el("td", {}, ""), el("td", {}, ""), el("td", {}, ""), el("td", {}, ""), el("td", {}, ""),
        el("td", { class: "num", "data-label": "RSS MB" }, mb(m.rss_mb)),
        el("td", { class: "num", "data-label": "PSS MB" }, mb(m.pss_mb)),
        el("td", { class: "num", "data-label": "USS MB" }, mb(m.uss_mb)),
      ));
    }
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10 }, "No process data.")));
    $("processes").tBodies[0].replaceChildren(...rows);
    const sum = (key) => memory.reduce((acc, m) => acc + (m[key] || 0), 0);
    setText("memory-total", memory.length
      ? `memory of ${memory.length} process${memory.length > 1 ? "es" : ""}: PSS ${mb(sum("pss_mb"))} MB ` +
        `(what they hold together), USS ${mb(sum("uss_mb"))} MB (their own pages), ` +
        `RSS ${mb(sum("rss_mb"))} MB (shared pages counted once per process)`
      : "memory: not readable here");
    setText("processes-hint", data.group
      ? `${data.group.up} of ${data.group.processes} frontend processes answering; each row links to its own page`
      : "this process");
  }

  function renderWorkers(data) {
    const rows = data.workers.map((w) => {
      const state = el("span", { class: "badge state-" + w.state }, w.state);
      const stateCell = el("td", { "data-label": "state" }, state);
      if (w.state === "inhibited" || w.state === "probing") stateCell.append(" ", fmtSeconds(w.probe_in_s));
      if (w.reason && w.state !== "healthy") {
        stateCell.append(el("div", { class: "reason" }, w.reason));
      }
      const id = w.process === undefined ? w.worker_id : `p${w.process} · ${w.worker_id}`;
      return el("tr", {},
        el("td", { class: "mono", title: w.address, "data-label": "worker" }, id),
        el("td", { "data-label": "role" }, w.role),
        stateCell,
        el("td", { class: "num", "data-label": "in flight" }, w.inflight),
        el("td", { class: "num", "data-label": "served" }, w.served),
        el("td", { class: "num", "data-label": "cached blocks" }, w.cached_blocks ?? 0),
        el("td", { class: "num", "data-label": "failures" }, w.failures),
        el("td", { class: "err", "data-label": "last error" }, w.last_error || ""),
      );
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 8 }, "No worker known yet.")));
    $("workers").tBodies[0].replaceChildren(...rows);
    const r = data.routing;
    if (!r) setText("routing", "–");
    else if (r.policy !== "kv") setText("routing", `router: ${r.policy}`);
    else {
      const mean = r.routed ? (r.overlap_blocks / r.routed).toFixed(1) : "–";
      setText("routing", `router: kv · ${r.routed} routed by cache · ${mean} cached blocks a request · ` +
        `hit rate ${recentHitRate(data.now, r)} over the last minute · ` +
        `${r.prefill_tokens_saved} prompt tokens found cached · ${r.events} KV events, ${r.dumps} dumps, ${r.gaps} gaps`);
    }
  }

  // The router's counters as polled, for the hit rate of the last minute: prompt blocks
  // found cached ÷ prompt blocks routed, between the oldest sample of the minute and now.
  const hitSamples = [];
  function recentHitRate(now, r) {
    hitSamples.push({ t: now, overlap: r.overlap_blocks, prompt: r.prompt_blocks });
    while (hitSamples.length > 1 && hitSamples[0].t < now - 60) hitSamples.shift();
    if (hitSamples[0].prompt > r.prompt_blocks) hitSamples.splice(0, hitSamples.length - 1);
    // With one sample (the page just opened) the rate so far stands in for the minute's.
    const first = hitSamples.length > 1 ? hitSamples[0] : { overlap: 0, prompt: 0 };
    const prompt = r.prompt_blocks - first.prompt;
    if (prompt <= 0) return "–";
    return `${(100 * (r.overlap_blocks - first.overlap) / prompt).toFixed(0)}%`;
  }

  function renderErrors(data) {
    const rows = (data.errors || []).map((e) => el("tr", {},
      el("td", { "data-label": "time" }, fmtClock(e.at)),
      el("td", { class: "num", "data-label": "status" }, e.status),
      el("td", { class: "mono", "data-label": "route" },
        (e.process === undefined ? "" : `p${e.process} · `) + `${e.method} ${e.path}`),
      el("td", { class: "mono", "data-label": "request id" }, e.request_id || ""),
      el("td", { "data-label": "type" }, e.type || ""),
      el("td", { class: "err", "data-label": "message" }, e.message || ""),
    ));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 6 }, "No error answered.")));
    $("errors").tBodies[0].replaceChildren(...rows);
  }

  // What each cause means, under an opened stall (docs/observability.md, "Reading a stall record").
  const CAUSES = {
    loop: "this process's code ran or blocked on the loop",
    gil: "another thread of this process held the GIL",
    contention: "the host had no CPU for the loop: other work, not this code",
  };

  function pct(share) {
    return share === null || share === undefined ? "unknown" : Math.round(share * 100) + "%";
  }

  function stallRow(rec) {
    const stack = rec.stack || [];
    const innermost = stack.length ? stack[stack.length - 1] : "(no stack sampled)";
    const pre = el("pre", {});
    stack.forEach((frame, i) => {
      if (i === stack.length - 1) pre.append(el("span", { class: "inner" }, frame));
      else pre.append(frame + "\n");
    });
    const detail = (rec.sampled ? "stack sampled during the stall" : "stack: where the task next awaited (not sampled)") +
      ` · loop thread busy ${pct(rec.loop_busy_fraction)} of the stall, waiting for a CPU ${pct(rec.cpu_wait_fraction)}` +
      ` · host CPU pressure ${pct(rec.cpu_pressure)}` + (CAUSES[rec.cause] ? ` · ${CAUSES[rec.cause]}` : "");
    return el("li", { class: "stall", "data-started-at": rec.started_at, "data-cause": rec.cause },
      el("details", {},
        el("summary", {},
          el("span", { class: "when" }, fmtClock(rec.started_at)),
          el("span", { class: "dur" }, fmtSeconds(rec.duration_s)),
          el("span", { class: "badge cause-" + rec.cause }, rec.cause),
          el("span", { class: "task" }, rec.process === undefined ? rec.task : `p${rec.process} · ${rec.task}`),
          el("span", { class: "where" }, innermost),
        ),
        el("p", { class: "detail" }, detail),
        stack.length ? pre : null,
      ),
    );
  }

  function renderStalls(data) {
    const stats = data.stalls.statistics;
    if (stats === null) {
      setText("stall-stats", "Stall detector off (--no-instrument): only the loop-delay canary runs.");
      setText("t-stalls", "off");
    } else {
      setText("stall-stats", `${stats.stalls_total} stalls (${stats.loop_stalls_total} loop, ` +
        `${stats.gil_stalls_total} gil, ${stats.contention_stalls_total || 0} host CPU contention) · ` +
        `longest ${fmtSeconds(stats.max_duration_s)} · ` +
        `last ${fmtSeconds(stats.last_duration_s)} · ` +
        (stats.tracking ? "detector tracking" : "detector NOT tracking"));
    }
    const list = $("stalls");
    const fresh = data.stalls.records; // newest first
    for (let i = fresh.length - 1; i >= 0; i--) {
      list.prepend(stallRow(fresh[i]));
      if (state.stallsAfter === null || fresh[i].started_at > state.stallsAfter) state.stallsAfter = fresh[i].started_at;
    }
    while (list.children.length > MAX_STALL_ROWS) list.lastElementChild.remove();
    $("stalls-empty").hidden = list.children.length > 0;
    if (stats !== null) {
      const recent = state.stallsAfter !== null && state.stallsAfter > data.now - HISTORY_S;
      setText("t-stalls", String(stats.stalls_total), recent);
    }
  }

  // -- loop ------------------------------------------------------------------------------

  function remember(data) {
    // Columns named by data.history.fields: t, inflight, queued, busy, threads, finished.
    const fields = data.history.fields;
    state.history = data.history.points.map((point) =>
      Object.fromEntries(fields.map((name, i) => [name, point[i]])));
  }

  function drawAll(data) {
    setText("model", data.model);
    renderLoop(data);
    renderRequests(data);
    renderPool(data);
    renderLatency(data);
    renderProcesses(data);
    renderWorkers(data);
    renderErrors(data);
  }

  function setStatus(kind, text) {
    const node = $("status");
    node.className = "status status-" + kind;
    node.textContent = text;
  }

  // -- the API key (a server started with --api-key) ---------------------------------------
  // The page itself is open; its data is not. The key the user types is kept in this tab's
  // sessionStorage and sent in the Authorization header: never in a URL, where logs,
  // history and the Referer would keep it.

  const KEY_ITEM = "headwater.dashboard.apiKey";

  function storedKey() {
    try { return sessionStorage.getItem(KEY_ITEM); } catch (err) { return null; }
  }

  function askForKey(message) {
    $("key-error").textContent = message;
    $("key-form").hidden = false;
    setStatus("wait", "API key needed");
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    try { sessionStorage.setItem(KEY_ITEM, key); } catch (err) { /* storage off: this page only */ }
    state.key = key;
    $("key-input").value = "";
    $("key-form").hidden = true;
    setStatus("wait", "connecting…");
    if (!state.polling) poll();
  });

  async function poll() {
    let url = "/dashboard/data";
    if (state.stallsAfter !== null) url += "?stalls_after=" + encodeURIComponent(String(state.stallsAfter));
    const headers = { Accept: "application/json" };
    const key = state.key || storedKey();
    if (key) headers.Authorization = "Bearer " + key;
    state.polling = true;
    try {
      const response = await fetch(url, { cache: "no-store", headers });
      if (response.status === 401) {
        try { sessionStorage.removeItem(KEY_ITEM); } catch (err) { /* storage off */ }
        state.key = null;
        state.polling = false;
        askForKey(key ? "That key was refused." : "");
        return; // polling resumes when a key is given
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const data = await response.json();
      state.last = data;
      remember(data);
      drawAll(data);
      renderStalls(data);
      setStatus("live", "live");
      setText("updated", "updated " + fmtClock(data.now));
    } catch (err) {
      setStatus("down", "disconnected (" + (err && err.message ? err.message : "error") + ")");
    }
    setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  window.addEventListener("resize", () => {
    if (state.last) drawAll(state.last);
  });
  poll();
})();
