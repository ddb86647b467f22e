// slimkv dashboard: polls /dashboard/state (the /v1/cache/state JSON) once a second and
// redraws. No framework; each block of the pool is one .cell element, built once and then
// only re-classed when its state changes. A cluster answers {"replicas": [state, ...]}: one
// block map per replica, and the cards show the replica picked in the bar above them.
"use strict";

const POLL_MS = 1000;
const STALE_MS = 3000;
const STATES = [
  ["in_use", "in use", "held by a running or queued sequence"],
  ["cached", "cached", "free, prefix-cached content (evictable, ref 0)"],
  ["pinned", "pinned head", "free, head of a live session (evicted last)"],
  ["staging", "staging", "full-precision staging block (reported when the KV scheme uses staging)"],
  ["free", "free", "empty"],
];
const LABEL = Object.fromEntries(STATES.map(([key, label]) => [key, label]));
const $ = (id) => document.getElementById(id);
const view = { maps: {}, selected: null, lastOk: 0 };

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n < 10 && i ? 2 : n < 100 && i ? 1 : 0)} ${units[i]}`;
}
const fmtPct = (x) => (x == null ? "–" : `${(100 * x).toFixed(1)}%`);
const fmtSec = (s) => (s == null ? "–" : s < 1 ? `${(1000 * s).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`);
const sum = (xs) => xs.reduce((a, b) => a + b, 0);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function setText(id, text) { $(id).textContent = text; }

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = `status ${kind}`;
}

function renderOccupancy(s) {
  const pool = s.pool;
  const alert = pool.watermark_alert;
  setText("usage", fmtPct(pool.usage));
  $("usage").classList.toggle("alert", alert);
  setText("usage-sub", `${pool.num_blocks - pool.num_free_blocks} of ${pool.num_blocks} blocks held`
    + ` · ${pool.block_size} tokens/block`);
  const bar = $("usage-bar");
  bar.classList.toggle("alert", alert);
  bar.querySelector(".fill").style.width = fmtPct(pool.usage);
  bar.querySelector(".mark").style.left = fmtPct(pool.watermark);
  const mark = `watermark ${fmtPct(pool.watermark)}`;
  setText("watermark", alert ? `ALERT: over the ${mark}; new work queues` : `${mark} · admission open`);
  $("watermark").classList.toggle("alert", alert);
}

function renderRequests(s) {
  const r = s.requests;
  for (const lane of ["fast", "slow"]) {
    setText(`${lane}-running`, r.lanes[lane].running);
    setText(`${lane}-waiting`, r.lanes[lane].waiting);
  }
  setText("running", r.running);
  setText("waiting", r.waiting);
  const share = Math.min(1, r.running / r.max_concurrency_soft);
  $("soft-bar").querySelector(".fill").style.width = fmtPct(share);
  const over = r.running >= r.max_concurrency_soft;
  setText("soft", `${r.running} running of soft limit ${r.max_concurrency_soft}`
    + (over ? "; new requests queue" : ""));
}

function renderMemory(s) {
  const m = s.memory;
  const parts = [["weights", m.weights, "--weights"], ["KV cache", m.kv_cache, "--kv"],
    ["activations", m.activations, "--act"]];
  const total = sum(parts.map((p) => p[1])) || 1;
  $("mem-bar").replaceChildren(...parts.map(([name, bytes, color]) => {
    const seg = document.createElement("div");
    seg.style.width = `${(100 * bytes) / total}%`;
    seg.style.background = `var(${color})`;
    seg.title = `${name}: ${fmtBytes(bytes)}`;
    return seg;
  }));
  $("mem-keys").replaceChildren(...parts.map(([name, bytes, color]) => {
    const li = document.createElement("li");
    li.innerHTML = `<span class="swatch" style="background: var(${color})"></span>${name}`
      + `<b>${fmtBytes(bytes)}</b><span class="muted">${fmtPct(bytes / total)}</span>`;
    return li;
  }));
  const kind = m.k_dtype === m.v_dtype ? m.k_dtype : `K ${m.k_dtype} / V ${m.v_dtype}`;
  setText("bpt", `KV ${kind}: ${fmtBytes(m.kv_bytes_per_token)} per token`);
  renderOffload(s.offload || {});
}

function renderOffload(tiers) {
  const parts = Object.entries(tiers).map(([tier, t]) => `${tier} ${fmtBytes(t.bytes)} of `
    + `${fmtBytes(t.capacity_bytes)} (${t.loaded_blocks} blocks loaded)`);
  setText("offload", parts.length ? `Offload: ${parts.join(" · ")}` : "");
}

function renderRates(s) {
  setText("ttft-p50", fmtSec(s.ttft.p50_s));
  setText("ttft-p99", fmtSec(s.ttft.p99_s));
  setText("hit-recent", fmtPct(s.prefix_cache.hit_rate_recent));
  setText("hit-sub", `${s.ttft.count} first tokens in the window · prefix hit rate since start `
    + `${fmtPct(s.prefix_cache.hit_rate)} (${s.prefix_cache.hits_total} of `
    + `${s.prefix_cache.queries_total} prompt tokens)`);
  for (const name of ["evictions", "preemptions"]) {
    drawSpark($(`spark-${name}`), s.events[name]);
    $(name).innerHTML = `<b>${sum(s.events[name])}</b> / min · ${s.events[`${name}_total`]} total`;
  }
}

function drawSpark(svg, counts) {
  const top = Math.max(1, ...counts);
  svg.innerHTML = counts.map((c, i) => (c ? `<rect x="${i + 0.1}" width="0.8" `
    + `y="${20 - (20 * c) / top}" height="${(20 * c) / top}"/>` : "")).join("");
}

function renderLegend(counts) {
  $("legend").replaceChildren(...STATES.map(([key, label, why]) => {
    const li = document.createElement("li");
    li.title = why;
    li.innerHTML = `<span class="swatch s-${key}"></span>${label} <b>${counts[key]}</b>`;
    return li;
  }));
}

function mapFor(key, title) {
  if (!view.maps[key]) {
    // The page's own #map serves the first engine; more replicas get a map each.
    const first = Object.keys(view.maps).length === 0 && $("map");
    const box = first ? first.parentElement : document.createElement("div");
    if (!first) {
      box.className = "replica-map";
      box.innerHTML = `<h3 class="map-title"></h3><div class="map" aria-label="KV blocks"></div>`;
    }
    const map = box.querySelector(".map");
    map.dataset.key = key;
    map.addEventListener("mousemove", onHover);
    map.addEventListener("mouseleave", () => { $("tip").hidden = true; });
    $("maps").append(box);
    view.maps[key] = { box, map, blocks: [], clock: 0 };
  }
  const entry = view.maps[key];
  entry.box.querySelector(".map-title").textContent = title;
  entry.box.querySelector(".map-title").hidden = !title;
  return entry;
}

function renderMap(s, key, title) {
  const entry = mapFor(key, title);
  const map = entry.map;
  const blocks = s.blocks;
  if (map.childElementCount !== blocks.length) {
    const side = Math.floor(Math.sqrt((map.clientWidth * 520) / blocks.length)) - 2;
    map.style.setProperty("--cell", `${Math.max(4, Math.min(26, side))}px`);
    map.replaceChildren(...blocks.map((b) => {
      const cell = document.createElement("div");
      cell.dataset.i = b.id;
      return cell;
    }));
  }
  blocks.forEach((b, i) => {
    const cls = `cell s-${b.state}`;
    const cell = map.children[i];
    if (cell.className !== cls) cell.className = cls;
  });
  entry.blocks = blocks;
  entry.clock = s.pool.clock;
}

function renderMaps(states) {
  const keys = states.map((s) => s.replica || "engine");
  for (const key of Object.keys(view.maps)) {
    if (!keys.includes(key)) { view.maps[key].box.remove(); delete view.maps[key]; }
  }
  states.forEach((s, i) => {
    const title = s.replica ? `replica ${s.replica} · ${fmtPct(s.pool.usage)} in use · `
      + `${s.requests.running} running, ${s.requests.waiting} waiting` : "";
    renderMap(s, keys[i], title);
  });
  const s = states[0];
  setText("map-sub", `${s.blocks.length} blocks × ${s.pool.block_size} tokens`
    + (states.length > 1 ? ` · ${states.length} replicas` : ` · step ${s.step}`));
}

function renderReplicaBar(states) {
  const bar = $("replicas");
  bar.hidden = !states[0].replica;
  if (bar.hidden) return;
  bar.replaceChildren(...states.map((s) => {
    const button = document.createElement("button");
    button.textContent = `replica ${s.replica}`;
    button.className = s.replica === view.selected ? "on" : "";
    button.addEventListener("click", () => { view.selected = s.replica; renderReplicaBar(states); });
    return button;
  }));
}

function tipHtml(b, clock) {
  const ago = clock - b.last_used;
  const reqs = b.requests.length ? esc(b.requests.join(", ")) : "–";
  const tokens = b.tokens ? `${b.tokens[0]}–${b.tokens[1] - 1} (block ${b.tokens[0] / (b.tokens[1] - b.tokens[0])} of the sequence)` : "–";
  return `<b>block #${b.id} · ${LABEL[b.state]}</b>`
    + `<div class="row">ref count <span>${b.ref}</span></div>`
    + `<div class="row">sequence <span>${reqs}</span></div>`
    + `<div class="row">tokens <span>${tokens}</span></div>`
    + `<div class="row">session <span>${b.session === null ? "–" : esc(b.session)}</span></div>`
    + `<div class="row">last use <span>${b.last_used ? `${ago} pool events ago (clock ${b.last_used})` : "never"}</span></div>`;
}

function onHover(event) {
  const tip = $("tip");
  const entry = view.maps[event.currentTarget.dataset.key];
  const i = event.target.dataset ? event.target.dataset.i : undefined;
  const block = i === undefined || !entry ? undefined : entry.blocks[Number(i)];
  if (!block) { tip.hidden = true; return; }
  tip.innerHTML = tipHtml(block, entry.clock);
  tip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

function render(data) {
  const states = data.replicas || [data];
  if (!states.length) throw new Error("no replica answered");
  if (!states.some((s) => s.replica === view.selected)) view.selected = states[0].replica || null;
  const s = states.find((x) => x.replica === view.selected) || states[0];
  const where = s.replica ? ` · replica ${s.replica} of ${states.length}` : "";
  setText("model", `${s.model} · KV ${s.memory.k_dtype}/${s.memory.v_dtype} · ${s.pool.evict_policy}${where}`);
  renderReplicaBar(states);
  renderOccupancy(s);
  renderRequests(s);
  renderMemory(s);
  renderRates(s);
  renderLegend(s.counts);
  renderMaps(states);
}

async function poll() {
  try {
    // location.origin, not a relative URL: a page opened as http://user:key@host/ must not
    // put the credentials into fetch() (the browser resends them itself).
    const response = await fetch(`${location.origin}/dashboard/state`, { cache: "no-store" });
    if (!response.ok) {
      throw new Error(response.status === 401 ? "API key needed (reload to log in)" : `HTTP ${response.status}`);
    }
    render(await response.json());
    view.lastOk = Date.now();
    setStatus(`live · updated ${new Date().toLocaleTimeString()}`, "ok");
  } catch (err) {
    const age = view.lastOk ? ` · last data ${Math.round((Date.now() - view.lastOk) / 1000)} s ago` : "";
    setStatus(`no data: ${err.message}${age}`, Date.now() - view.lastOk > STALE_MS ? "bad" : "ok");
  }
  setTimeout(poll, POLL_MS);
}

poll();
