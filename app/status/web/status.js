// slotgate's status page: reads GET /admission/events (server-sent events) with fetch(), so
// that a key travels in a header and never in a URL, and draws each snapshot as it comes.
// Every path is relative to the page's, so that it works behind a proxy's path prefix too.
"use strict";

const KEY = "slotgate-key"; // sessionStorage: this tab only, gone when it closes
const SERIES = [
  ["admitted", "admitted"],
  ["refused_429", "429s"],
  ["timeouts", "timeouts"],
  ["gone", "clients gone"],
];
const $ = (id) => document.getElementById(id);
let lastFrame = 0;
let current = null;

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 1) return Math.round(value * 1000) + " ms";
  if (value < 10) return value.toFixed(1) + " s";
  if (value < 120) return Math.round(value) + " s";
  return Math.round(value / 60) + " min";
}

// -- the stream ------------------------------------------------------------------------------

async function watch() {
  for (;;) {
    let answer;
    try {
      answer = await fetch("admission/events", { headers: headers(), cache: "no-store" });
    } catch (error) {
      say("cannot reach slotgate; trying again", "bad");
      await sleep(2000);
      continue;
    }
    if (answer.status === 401) {
      askForKey(sessionStorage.getItem(KEY) ? "That key was not accepted." : "");
      return;
    }
    if (answer.status === 429) {
      // Every watcher place is taken: read the snapshot once a second instead, for a while.
      say("many watchers: polling once a second", "warn");
      await poll(30);
      continue;
    }
    if (!answer.ok || !answer.body) {
      say("slotgate answered " + answer.status + "; trying again", "bad");
      await sleep(2000);
      continue;
    }
    await read(answer.body.getReader());
    say("stream ended (slotgate draining or restarting); reconnecting", "warn");
    await sleep(2000);
  }
}

async function read(reader) {
  const decoder = new TextDecoder();
  let buffered = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffered += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) show(JSON.parse(data));
      }
    }
  } catch (error) {
    return; // the connection broke: watch() reconnects
  }
}

async function poll(times) {
  for (let i = 0; i < times; i++) {
    try {
      const answer = await fetch("admission", { headers: headers(), cache: "no-store" });
      if (answer.ok) show(await answer.json());
    } catch (error) {
      /* shown as stale below */
    }
    await sleep(1000);
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function askForKey(message) {
  $("board").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  say("key needed", "warn");
  $("key").focus();
}

function say(text, kind) {
  const state = $("state");
  state.textContent = text;
  state.className = "state " + (kind || "");
}

// -- one snapshot ----------------------------------------------------------------------------

function show(snap) {
  current = snap;
  lastFrame = Date.now();
  $("key-form").hidden = true;
  $("board").hidden = false;
  const ready = snap.upstreams.filter((u) => u.ready).length;
  const words = [];
  let kind = "ok";
  if (snap.paused) { words.push("PAUSED: new requests wait"); kind = "warn"; }
  if (!snap.admission_control) words.push("admission control off");
  words.push(ready + " of " + snap.upstreams.length + " upstreams ready");
  if (!ready) kind = "bad";
  const drained = snap.upstreams.filter((u) => u.draining).length;
  if (drained) {
    words.push(drained + " drained");
    if (kind === "ok") kind = "warn";
  }
  const models = snap.models || [];
  if (models.length) {
    // Behind routers the slots are the models': each model's line has its own.
    const loaded = models.filter((m) => LOADED.has(m.state)).length;
    words.push(loaded + " of " + models.length + " models loaded");
    words.push(busy(sum(models, "active"), sum(models, "capacity")));
  } else {
    words.push(snap.capacity === null && !snap.active ? "slot count not known yet" : busy(snap.active, snap.capacity || 0));
  }
  words.push(queued(snap) + " waiting");
  const mode = snap.replication?.mode;
  if (mode && mode !== "local" && mode !== "shared") {
    words.push("shared line " + mode.toUpperCase());
    if (kind === "ok") kind = "warn";
  }
  say(words.join(" · "), kind);
  gateActions(snap);
  upstreams(snap);
  modelLines(snap.models);
  line(snap);
  recent(snap.recent);
  tenants(snap.tenants);
  replicas(snap.replication);
  for (const [key, button] of buttons) if (!button.isConnected) buttons.delete(key);
}

function gateActions(snap) {
  const box = $("gate-actions");
  box.replaceChildren();
  if (snap.paused === undefined) return; // this gate has no operator controls
  box.append(
    snap.paused
      ? action("Resume admission", "admin/resume")
      : action("Pause admission", "admin/pause")
  );
}

// Each button is made once and moved into every new picture, so that a click that spans a
// tick still lands on the button it began on.
const buttons = new Map();

function action(label, path) {
  const known = buttons.get(label + " " + path);
  if (known) return known;
  const button = el("button", { type: "button" }, label);
  buttons.set(label + " " + path, button);
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      const answer = await fetch(path, { method: "POST", headers: headers() });
      const body = await answer.json().catch(() => ({}));
      notice(answer.ok ? label + ": done" : label + ": " + (body.error?.message || answer.status));
    } catch (error) {
      notice(label + ": slotgate did not answer");
    } finally {
      button.disabled = false;
    }
  });
  return button;
}

function notice(text) {
  $("notice").textContent = text;
}

function upstreams(snap) {
  const box = $("upstreams");
  box.replaceChildren();
  for (const u of snap.upstreams) {
    const name = u.name ?? u.url;
    const state = !u.ready ? "NOT READY: " + (u.reason || "unknown") : u.draining ? "DRAINING" : "ready";
    const head = el("div", {},
      el("span", { class: "name" }, name), " ",
      el("span", { class: u.ready && !u.draining ? "ok" : u.ready ? "warn" : "bad" }, state));
    const row = el("div", { class: "upstream" }, head);
    if (u.router) {
      // A router has no slots of its own: its models' are under Models.
      row.append(el("div", { class: "muted" }, "router: its models' slots are under Models"));
    } else {
      row.append(...slots(u, u.ready), el("div", { class: "muted" }, (u.model ? u.model + ": " : "") + usage(u)));
    }
    if (u.draining !== undefined) {
      const path = "admin/upstreams/" + encodeURIComponent(name) + (u.draining ? "/restore" : "/drain");
      row.append(action(u.draining ? "Restore " + name : "Drain " + name, path));
    }
    box.append(row);
  }
}

// A drained upstream's slots leave the capacity while its requests finish.
const busy = (active, capacity) =>
  active > capacity ? active + " slots busy (" + capacity + " in rotation)" : active + " of " + capacity + " slots busy";

// The states in which a router runs a model with known slots.
const LOADED = new Set(["loaded", "sleeping"]);
const sum = (list, field) => list.reduce((total, item) => total + (item[field] || 0), 0);
const queued = (snap) => snap.queued + sum(snap.models || [], "queued");

function slots(pool, live) {
  const box = el("div", { class: "slots", role: "img",
    "aria-label": pool.active + " of " + pool.capacity + " slots busy" });
  for (let i = 0; i < (pool.capacity || 0); i++) {
    const busy = i < pool.active;
    box.append(el("span", { class: "slot" + (busy ? " busy" : "") + (live ? "" : " off"),
      title: busy ? "busy" : "free" }));
  }
  return [box];
}

function usage(pool) {
  const tokens = pool.budget_tokens ? " · KV " + pool.committed_tokens + " / " + pool.budget_tokens + " tokens" : "";
  return (pool.active || 0) + " busy, " + Math.max((pool.capacity || 0) - (pool.active || 0), 0) + " free" + tokens;
}

// Each model behind routers (`/admission`'s `models`): its state, its line, and its pools, one
// per upstream that serves it, with their slots.
function modelLines(models) {
  $("models-section").hidden = !models || !models.length;
  const box = $("models");
  box.replaceChildren();
  for (const m of models || []) {
    const failed = m.state === "failed";
    const codes = Object.values(m.exit_codes || {});
    let state = failed ? "FAILED to load" + (codes.length ? " (exit code " + codes.join(", ") + ")" : "") : m.state;
    if (m.held) state += " · HELD for a swap: no new work until it is unloaded";
    const kind = failed ? "bad" : LOADED.has(m.state) ? (m.held ? "warn" : "ok") : m.state === "unloaded" ? "muted" : "warn";
    const name = m.model + (m.aliases && m.aliases.length ? " (" + m.aliases.join(", ") + ")" : "");
    const limit = m.queue_limit === null || m.queue_limit === undefined ? "no limit" : "limit " + m.queue_limit;
    const row = el("div", { class: "model" },
      el("div", {}, el("span", { class: "name" }, name), " ", el("span", { class: kind }, state),
        " · " + m.queued + " waiting (" + limit + ")"));
    for (const pool of m.pools || []) {
      // A router's pool is keyed "<router URL>#<model>"; a server of one model's by its URL.
      const where = pool.key.endsWith("#" + m.model) ? pool.key.slice(0, -m.model.length - 1) : pool.key;
      let said;
      if (pool.draining) said = "DRAINING: " + (pool.active ? pool.active + " running finish, " : "") + "nothing new goes there";
      else if (pool.capacity !== null) said = usage(pool);
      else if (m.state === "unloaded" || failed) said = "no slots while " + (failed ? "it fails to load" : "unloaded");
      else said = "slots not known yet (" + m.state + ")";
      row.append(el("div", { class: "pool" }, ...slots(pool, pool.capacity !== null),
        el("div", { class: pool.draining ? "warn" : "muted" }, where + ": " + said)));
    }
    box.append(row);
  }
}

function line(snap) {
  const waiting = snap.waiting || [];
  const oldest = waiting.reduce((most, w) => Math.max(most, w.waited_s), 0);
  const limit = snap.queue_limit === null || snap.queue_limit === undefined ? "no limit" : "limit " + snap.queue_limit;
  const total = queued(snap);
  $("line-summary").textContent =
    total + " waiting (" + limit + (snap.models && snap.models.length ? " each line" : "") + ")" +
    (waiting.length ? " · oldest waited " + seconds(oldest) : "") +
    (waiting.length < total ? " · the " + waiting.length + " longest waits shown" : "");
  const body = $("waiting").tBodies[0];
  body.replaceChildren();
  if (!waiting.length) {
    body.append(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "nobody waits")));
    return;
  }
  const controls = snap.paused !== undefined;
  for (const w of waiting) {
    const cancel = controls
      ? action("Cancel", "admin/requests/" + encodeURIComponent(w.request_id) + "/cancel")
      : "";
    body.append(el("tr", {},
      el("td", {}, w.position), el("td", {}, w.tenant), el("td", {}, w.band),
      el("td", {}, w.model ?? "–"), el("td", {}, seconds(w.waited_s)), el("td", {}, seconds(w.eta_s)),
      el("td", { class: "id" }, w.request_id), el("td", {}, cancel)));
  }
}

function recent(r) {
  if (!r) return;
  const width = 600, height = 140, left = 34, bottom = 18;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 " + width + " " + height);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "requests per second over the last " + Math.round(r.window_s / 60) + " minutes");
  let top = 1;
  for (const [name] of SERIES) for (const v of r.per_s[name]) top = Math.max(top, v);
  // The span shown: what there is of the window, a minute at least.
  const span = Math.min(r.window_s, Math.max(60, ...r.ago_s.map((ago) => ago + 1)));
  const x = (ago) => left + (width - left) * (1 - ago / span);
  const y = (v) => (height - bottom) * (1 - v / top) + 2;
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
  };
  add("line", { class: "axis", x1: left, y1: height - bottom + 2, x2: width, y2: height - bottom + 2 });
  add("line", { class: "axis", x1: left, y1: 2, x2: left, y2: height - bottom + 2 });
  add("text", { x: 2, y: 12 }, fmt(top) + "/s");
  add("text", { x: 2, y: height - bottom }, "0");
  add("text", { x: left + 2, y: height - 4 }, "-" + (span < 120 ? Math.round(span) + " s" : Math.round(span / 60) + " min"));
  add("text", { x: width - 30, y: height - 4 }, "now");
  for (const [name] of SERIES) {
    const points = r.ago_s.map((ago, i) => x(ago).toFixed(1) + "," + y(r.per_s[name][i]).toFixed(1));
    if (points.length) add("polyline", { class: "s-" + name, points: points.join(" ") });
  }
  $("chart").replaceChildren(svg);
  const last = r.ago_s.length - 1;
  const rates = $("rates");
  rates.replaceChildren();
  for (const [name, label] of SERIES) {
    const now = last >= 0 ? r.per_s[name][last] : 0;
    rates.append(el("span", {}, el("span", { class: "key k-" + name }), label + " " + fmt(now) + "/s"));
  }
  const q = (h) => "p50 " + seconds(h.p50) + ", p95 " + seconds(h.p95);
  $("percentiles").textContent = "queue wait " + q(r.queue_wait_s) + " · slot hold " + q(r.slot_hold_s);
}

function fmt(v) {
  return v >= 10 ? String(Math.round(v)) : v.toFixed(1);
}

const QUOTAS = {requests_per_minute: "requests/min", tokens_per_minute: "tokens/min", tokens_per_day: "tokens/day"};

// A tenant's quota standing under its name: what is left of each limit it has (null with a
// shared line, whose windows are in Redis).
function quota(q) {
  return Object.entries(q).map(([name, w]) =>
    (w.remaining ?? "?") + " of " + w.limit + " " + (QUOTAS[name] || name) + " left").join(" · ");
}

function tenants(list) {
  const body = $("tenants").tBodies[0];
  body.replaceChildren();
  for (const t of list || []) {
    const standing = t.quota ? [el("br"), el("small", {}, quota(t.quota))] : [];
    body.append(el("tr", {},
      el("td", {}, t.name, ...standing), el("td", {}, t.band), el("td", {}, t.weight),
      el("td", {}, t.active), el("td", {}, t.queued),
      el("td", {}, Math.round(t.slot_seconds_share_1m * 100) + " %")));
  }
}

function replicas(view) {
  const shared = view && view.mode !== "local";
  $("replicas-section").hidden = !shared;
  if (!shared) return;
  const fleet = view.fleet || {};
  const mine = view.this_replica || {};
  const parts = [
    "mode " + view.mode + (view.mode === "shared" ? "" : " (Redis away: " + (view.last_error || "no answer") + ")"),
    (fleet.replicas ?? "?") + " replicas",
    "fleet " + (fleet.active ?? "?") + " of " + (fleet.capacity ?? "?") + " slots busy, " + (fleet.queued ?? "?") + " waiting",
    "this replica (" + view.replica + ") " + (mine.active ?? 0) + " busy, " + (mine.queued ?? 0) + " waiting",
  ];
  $("replicas").textContent = parts.join(" · ");
}

// -- start -----------------------------------------------------------------------------------

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  $("key").value = "";
  $("key-form").hidden = true;
  say("connecting…");
  watch();
});

setInterval(() => {
  if (current && Date.now() - lastFrame > 3000) {
    say("no update for " + Math.round((Date.now() - lastFrame) / 1000) + " s: the data below is stale", "bad");
  }
}, 1000);

watch();
