// The mtplx dashboard: one live stream (fetch + a stream reader, so the API key travels in the
// Authorization header, never in a URL), drawn on plain canvases and tables. No dependencies.
"use strict";

const KEY_STORAGE = "mtplx.apiKey";  // sessionStorage: this tab only
const STREAM = "/v1/mtplx/metrics/stream";
const HISTORY_S = 120;
const COLORS = ["#ffb74d", "#ab47bc", "#66bb6a", "#ef5350", "#26a69a", "#d4e157", "#8d6e63", "#ec407a"];
const PHASES = [["draft", "var(--draft)"], ["verify", "var(--verify)"], ["accept", "var(--accept)"],
                ["commit", "var(--commit)"]];

const $ = (id) => document.getElementById(id);
const state = {controller: null, retryTimer: null, history: [], colors: new Map(), settingsDirty: false,
               cancelling: new Set(), latest: null};

// -- formatting --------------------------------------------------------------------------------
function num(x, digits = 1) { return x === null || x === undefined ? "—" : Number(x).toFixed(digits); }
function pct(x) { return x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%"; }
function shortId(id) { return id.length > 18 ? id.slice(0, 9) + "…" + id.slice(-6) : id; }
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}
function duration(s) {
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// -- the API key ---------------------------------------------------------------------------------
function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}
function askKey(reason) {
  setStatus("needs key", "down");
  $("key-reason").textContent = reason;
  $("key-overlay").hidden = false;
  $("key-input").focus();
}
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("key-input").value = "";
  $("key-overlay").hidden = true;
  connect();
});
$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  if (state.controller) state.controller.abort();
  askKey("Key forgotten. Enter it again to reconnect.");
});

// -- the stream ------------------------------------------------------------------------------------
function setStatus(text, cls) {
  $("status-text").textContent = text;
  $("status").className = "status " + (cls || "");
  $("forget-key").hidden = !sessionStorage.getItem(KEY_STORAGE);
}

function retryLater() {
  clearTimeout(state.retryTimer);
  state.retryTimer = setTimeout(connect, 2000);
}

async function connect() {
  clearTimeout(state.retryTimer);
  if (state.controller) state.controller.abort();  // at most one stream per tab
  const controller = new AbortController();
  state.controller = controller;
  setStatus("connecting");
  let response;
  try {
    response = await fetch(STREAM, {headers: authHeaders({Accept: "text/event-stream"}), cache: "no-store",
                                    signal: controller.signal});
  } catch (err) {
    if (!controller.signal.aborted) { setStatus("server unreachable", "down"); retryLater(); }
    return;
  }
  if (response.status === 401) {
    askKey(sessionStorage.getItem(KEY_STORAGE) ? "The server refused that key." : "This server needs its API key.");
    return;
  }
  if (!response.ok) { setStatus("error " + response.status, "down"); retryLater(); return; }
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (err) {
    if (controller.signal.aborted) return;
  }
  if (state.controller === controller) { setStatus("disconnected, retrying", "down"); retryLater(); }
}

// -- rendering ---------------------------------------------------------------------------------------
function render(s) {
  state.latest = s;
  $("model").textContent = s.model.id + (s.model.mtp_head ? " · MTP head" : " · no MTP head") +
    " · up " + duration(s.uptime_s);
  $("mode").textContent = s.scheduler_mode;
  $("policy").textContent = s.scheduler_policy;
  $("lane").textContent = "lane: " + s.active_lane;
  $("tok-s").textContent = num(s.tok_s === null ? null : s.tok_s);
  const running = s.running.filter((r) => r.state === "running");
  $("active").textContent = running.length + " running";
  $("queue").textContent = s.queue_depth + " queued";
  renderSpec(s.spec);
  renderSpeedup(s.speedup_vs_ar, s.defaults);
  renderKV(s.kv_cache, s.prefix_cache_hit_rate);
  renderScheduler(s);
  renderRequests(s.running, s.recent);
  renderSettings(s);
  pushHistory(s, running);
  drawTokChart();
}

function renderSpec(spec) {
  $("mean-acceptance-length").textContent = num(spec.mean_acceptance_length, 2);
  $("acceptance-rate").textContent = spec.cycles ?
    `acceptance ${pct(spec.acceptance_rate)} · ${spec.cycles} cycles` : "no MTP cycles yet";
  const list = $("acceptance-by-position");
  list.replaceChildren();
  spec.acceptance_by_position.forEach((rate, i) => {
    const item = el("span");
    item.append(`d${i + 1} `, el("b", pct(rate)), ` (${spec.accepted_by_position[i]}/${spec.drafted_by_position[i]})`);
    list.append(item);
  });
  drawBars($("chart-accept"), spec.acceptance_by_position.map((r, i) => ["d" + (i + 1), r || 0]));
  const cycle = spec.cycle_ms;
  const total = PHASES.reduce((sum, [p]) => sum + (cycle[p] || 0), 0);
  $("cycle-total").textContent = total ? num(total, 2) + " ms" : "";
  stackBar($("cycle-bar"), $("cycle-split"), PHASES.map(([p, color]) => [p, cycle[p] || 0, color, num(cycle[p], 2) + " ms"]),
           total);
}

function renderSpeedup(speedup, defaults) {
  // the regime of the default temperature first; else the other one, if it has both modes
  const preferred = defaults.temperature > 0 ? "sampled" : "greedy";
  const order = [preferred, preferred === "greedy" ? "sampled" : "greedy"];
  const shown = order.find((r) => speedup[r].speedup);
  if (!shown) {
    $("speedup").textContent = "—";
    $("speedup-sub").textContent = "needs MTP and AR requests at the same temperature regime";
    return;
  }
  const m = speedup[shown];
  $("speedup").textContent = num(m.speedup, 2) + "×";
  const other = order.find((r) => r !== shown && speedup[r].speedup);
  $("speedup-sub").textContent = `${shown}: MTP ${num(m.mtp_tok_s)} vs AR ${num(m.ar_tok_s)} tok/s` +
    (other ? ` · ${other}: ${num(speedup[other].speedup, 2)}×` : "");
}

function renderKV(kv, hitRate) {
  const used = kv.used_blocks, cached = kv.cached_blocks, total = kv.total_blocks;
  const idle = Math.max(0, total - used - cached);
  $("kv-used").textContent = `${used} / ${total}`;
  $("kv-sub").textContent = `prefix-cache hit rate ${pct(hitRate)}`;
  $("kv-total").textContent = `${total} blocks of ${kv.block_size} tokens`;
  stackBar($("kv-bar"), $("kv-split"), [["used", used, "var(--accent)", String(used)],
                                         ["cached", cached, "var(--good)", String(cached)],
                                         ["free", idle, "#2a3442", String(idle)]], total);
}

function stackBar(bar, legend, parts, total) {
  bar.replaceChildren();
  legend.replaceChildren();
  for (const [name, value, color, label] of parts) {
    const seg = el("div");
    seg.style.width = total ? (100 * value / total) + "%" : "0";
    seg.style.background = color;
    seg.title = `${name}: ${label}`;
    bar.append(seg);
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    item.append(swatch, `${name} `, el("b", label));
    legend.append(item);
  }
}

function renderScheduler(s) {
  const t = s.telemetry, dl = $("scheduler");
  dl.replaceChildren();
  const fact = (k, v) => { dl.append(el("dt", k), el("dd", v === undefined || v === null ? "—" : String(v))); };
  const section = (name) => dl.append(el("div", name, "section"));
  fact("mode", s.scheduler_mode);
  fact("policy", s.scheduler_policy);
  fact("active lane", s.active_lane);
  fact("queue depth", s.queue_depth);
  fact("active requests", s.active_requests);
  const totals = t.totals || t.job_totals || {};
  fact("completed / cancelled / failed", `${totals.completed ?? "—"} / ${totals.cancelled ?? "—"} / ${totals.failed ?? 0}`);
  if (t.queue_wait_s) fact("queue wait p50 / p90", `${num(t.queue_wait_s.p50, 3)} / ${num(t.queue_wait_s.p90, 3)} s`);
  if (t.batch_histogram) fact("rows per step", Object.entries(t.batch_histogram).map(([k, v]) => `${k}:${v}`).join(" ") || "—");
  if (s.scheduler_mode === "hyper") {
    section("hyper");
    fact("stage", t.stage);
    fact("admission cap / width", `${t.admission_cap} / ${t.width}`);
    fact("passthrough", t.passthrough);
    fact("width executor", t.width_executor_installed ? "installed" : "none");
    const rows = t.self_spec_rows || {}, forks = t.forks || {};
    fact("self-spec rows launched / committed", `${rows.launched ?? 0} / ${rows.committed ?? 0}`);
    fact("forks attempted / won", `${forks.attempts ?? 0} / ${forks.wins ?? 0}`);
    const byWidth = (t.width_stats || {}).requests_by_width || {};
    fact("requests by width", Object.entries(byWidth).map(([k, v]) => `${k}:${v}`).join(" ") || "—");
  }
  section("defaults");
  const d = s.defaults;
  fact("generation mode", d.generation_mode || "auto");
  fact("depth", d.depth || `auto (${d.engine_depth})`);
  fact("temperature", d.temperature);
}

function decodeLabel(r) {
  return r.generation_mode === "mtp" ? `mtp d${r.depth}` : r.generation_mode;
}

function renderRequests(live, ended) {
  const tbody = document.querySelector("#requests tbody");
  const rows = live.map((r) => ({...r, kind: r.state})).concat(ended.map((r) => ({...r, kind: "ended"})));
  const old = new Map([...tbody.children].map((tr) => [tr.dataset.key, tr]));
  const ordered = [];
  for (const r of rows) {
    const key = r.kind === "ended" ? "ended:" + r.n : "live:" + r.id;
    let tr = old.get(key);
    if (!tr) {
      tr = el("tr");
      tr.dataset.key = key;
      tr.dataset.requestId = r.id;
      for (let i = 0; i < 9; i++) tr.append(el("td"));
      [3, 4, 5, 6, 7].forEach((i) => tr.children[i].classList.add("num"));
      tr.children[1].classList.add("state");
      if (r.kind !== "ended") {
        const button = el("button", "Cancel", "cancel");
        button.type = "button";
        button.dataset.requestId = r.id;
        button.addEventListener("click", () => cancelRequest(r.id, button));
        tr.children[8].append(button);
      }
    }
    old.delete(key);
    tr.className = r.kind;
    const c = tr.children;
    c[0].textContent = shortId(r.id);
    c[0].title = r.id;
    if (r.kind === "ended") {
      c[1].textContent = r.finish_reason;
      c[1].className = "state reason-" + r.finish_reason;
    } else {
      c[1].textContent = r.cancelling ? "cancelling" : r.state;
    }
    c[2].textContent = decodeLabel(r) + (r.temperature > 0 ? ` · T ${r.temperature}` : " · greedy");
    c[3].textContent = r.prompt_tokens;
    c[4].textContent = r.completion_tokens;
    c[5].textContent = num(r.ttft_s, 3);
    c[6].textContent = num(r.tok_s);
    c[6].classList.add("tok-s");
    c[7].textContent = num(r.mean_acceptance_length, 2);
    ordered.push(tr);
  }
  const current = [...tbody.children];
  if (current.length !== ordered.length || current.some((tr, i) => tr !== ordered[i])) {
    tbody.replaceChildren(...ordered);  // rows are reused by key: a Cancel button survives updates
  }
  $("requests-empty").hidden = ordered.length > 0;
}

async function cancelRequest(id, button) {
  button.disabled = true;
  button.textContent = "Cancelling…";
  try {
    const response = await fetch("/v1/mtplx/cancel/" + encodeURIComponent(id), {method: "POST", headers: authHeaders()});
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      button.textContent = (body.error && body.error.code === "not_found") ? "Ended" : "Failed";
    }
  } catch (err) {
    button.disabled = false;
    button.textContent = "Cancel";
  }
}

// -- settings ------------------------------------------------------------------------------------
const form = $("settings");
// once edited, the form stops following the stream until it is applied
for (const type of ["input", "change", "focusin"]) form.addEventListener(type, () => { state.settingsDirty = true; });
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const s = state.latest;
  const body = {
    generation_mode: form.generation_mode.value,
    depth: form.depth.value === "auto" ? "auto" : Number(form.depth.value),
    temperature: form.temperature.value === "" ? "auto" : Number(form.temperature.value),
  };
  if (s && form.scheduler_mode.value !== s.scheduler_mode) body.scheduler_mode = form.scheduler_mode.value;
  const message = $("settings-message");
  try {
    const response = await fetch("/v1/mtplx/settings", {method: "POST", body: JSON.stringify(body),
      headers: authHeaders({"Content-Type": "application/json"})});
    const reply = await response.json();
    if (response.ok) {
      message.textContent = "Applied to new requests.";
      message.className = "ok";
      state.settingsDirty = false;
    } else {
      message.textContent = reply.error ? reply.error.message : "HTTP " + response.status;
      message.className = "error";
    }
  } catch (err) {
    message.textContent = "The server did not answer.";
    message.className = "error";
  }
});

function renderSettings(s) {
  if (state.settingsDirty) return;
  const d = s.defaults;
  form.generation_mode.value = d.generation_mode || "auto";
  form.depth.value = d.depth ? String(d.depth) : "auto";
  form.temperature.value = d.temperature;
  form.scheduler_mode.value = s.scheduler_mode;
}

// -- charts ------------------------------------------------------------------------------------------
function pushHistory(s, running) {
  const per = {};
  for (const r of running) if (r.tok_s !== null) per[r.id] = r.tok_s;
  state.history.push({t: s.t, total: s.tok_s, per});
  while (state.history.length && s.t - state.history[0].t > HISTORY_S) state.history.shift();
}

function colorFor(id) {
  if (!state.colors.has(id)) state.colors.set(id, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(id);
}

function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = Number(canvas.getAttribute("height"));
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.height = height + "px";
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width, height];
}

function niceMax(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

function drawTokChart() {
  const canvas = $("chart-tok");
  const [ctx, w, h] = sizeCanvas(canvas);
  const pad = {l: 44, r: 10, t: 8, b: 20};
  const hist = state.history;
  const now = hist.length ? hist[hist.length - 1].t : 0;
  let top = 0;
  for (const p of hist) {
    top = Math.max(top, p.total || 0);
    for (const v of Object.values(p.per)) top = Math.max(top, v);
  }
  top = niceMax(top * 1.1);
  const x = (t) => pad.l + (w - pad.l - pad.r) * (1 - (now - t) / HISTORY_S);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / top);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8593a3";
  ctx.strokeStyle = "#253040";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4, yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(v >= 100 ? v.toFixed(0) : v.toFixed(1), pad.l - 6, yy + 4);
  }
  ctx.textAlign = "center";
  for (let s = 0; s <= HISTORY_S; s += 30) ctx.fillText(s ? `-${s}s` : "now", x(now - s), h - 5);
  const line = (points, color, width) => {
    ctx.strokeStyle = color; ctx.lineWidth = width; ctx.beginPath();
    let started = false;
    for (const [t, v] of points) {
      if (v === null || v === undefined) { started = false; continue; }
      if (started) ctx.lineTo(x(t), y(v)); else { ctx.moveTo(x(t), y(v)); started = true; }
    }
    ctx.stroke();
  };
  const ids = new Set();
  for (const p of hist) for (const id of Object.keys(p.per)) ids.add(id);
  for (const id of ids) line(hist.map((p) => [p.t, p.per[id]]), colorFor(id), 1.5);
  line(hist.map((p) => [p.t, p.total]), "#4fc3f7", 2.5);
  const legend = $("legend-tok");
  legend.replaceChildren();
  const entry = (color, text) => {
    const item = el("span"); const swatch = el("i"); swatch.style.background = color;
    item.append(swatch, text); legend.append(item);
  };
  entry("#4fc3f7", "all requests");
  const live = hist.length ? hist[hist.length - 1].per : {};
  for (const id of Object.keys(live)) entry(colorFor(id), `${shortId(id)} ${num(live[id])}`);
}

function drawBars(canvas, bars) {
  const [ctx, w, h] = sizeCanvas(canvas);
  const pad = {l: 36, r: 8, t: 8, b: 18};
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8593a3";
  ctx.strokeStyle = "#253040";
  for (let i = 0; i <= 4; i++) {
    const yy = Math.round(h - pad.b - (h - pad.t - pad.b) * i / 4) + 0.5;
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(25 * i + "%", pad.l - 5, yy + 4);
  }
  if (!bars.length) {
    ctx.textAlign = "center"; ctx.fillText("no drafts yet", (w + pad.l) / 2, h / 2);
    return;
  }
  const slot = (w - pad.l - pad.r) / bars.length;
  bars.forEach(([label, value], i) => {
    const bh = (h - pad.t - pad.b) * Math.min(1, value);
    const bx = pad.l + slot * i + slot * 0.2;
    ctx.fillStyle = "#66bb6a";
    ctx.fillRect(bx, h - pad.b - bh, slot * 0.6, bh);
    ctx.fillStyle = "#8593a3"; ctx.textAlign = "center";
    ctx.fillText(label, bx + slot * 0.3, h - 5);
  });
}

window.addEventListener("resize", () => { if (state.latest) render(state.latest); });
connect();
