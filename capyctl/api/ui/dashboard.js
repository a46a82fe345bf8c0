// The CapyCTL dashboard: one Server-Sent Events stream (GET /v1/events) read with fetch, so the
// credential travels as an Authorization header (EventSource cannot send one); the actions are
// POSTs with the same header. No cookie is ever used, so another site cannot act through this
// page's credential. Everything from the daemon is put on the page as text, never as HTML.
"use strict";

const TOKEN_KEY = "capyctl.token";
const JOURNAL_MAX_LINES = 500;
const RETRY_MS = 3000;

const state = { deployments: [], usage: null, requests: {}, journal: null, stream: null };
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "width") node.style.width = v;  // CSSOM: the CSP refuses style attributes
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

// -- the credential ----------------------------------------------------------------------------

function takeTokenFromFragment() {
  // capyctl ui opens /ui/#session=SECRET: a fragment never reaches a server or a Referer.
  const params = new URLSearchParams(location.hash.slice(1));
  const session = params.get("session");
  if (session) {
    sessionStorage.setItem(TOKEN_KEY, session);
    history.replaceState(null, "", location.pathname + location.search);
  }
}

const token = () => sessionStorage.getItem(TOKEN_KEY);

function showLogin(message) {
  if (state.stream) state.stream.abort();
  $("dashboard").hidden = true;
  $("forget-token").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setConnection("connecting", "no credential");
}

function showDashboard() {
  $("login").hidden = true;
  $("dashboard").hidden = false;
  $("forget-token").hidden = false;
}

function setConnection(kind, text) {
  const badge = $("connection");
  badge.dataset.state = kind;
  badge.textContent = text;
}

async function api(method, path, init = {}) {
  const response = await fetch(path, {
    method, cache: "no-store", credentials: "omit", ...init,
    headers: { "Authorization": `Bearer ${token()}`, "Accept": "application/json", ...(init.headers || {}) },
  });
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    const body = await response.json().catch(() => ({}));
    showLogin((body.error && body.error.message) || "The credential was refused.");
    throw new Error("unauthenticated");
  }
  return response;
}

async function errorText(response) {
  const body = await response.json().catch(() => null);
  const err = body && body.error;
  return err ? `${err.message} (${err.code})` : `the daemon answered ${response.status}`;
}

// -- the event stream ----------------------------------------------------------------------------

async function follow() {
  while (token()) {
    const controller = new AbortController();
    state.stream = controller;
    try {
      const response = await api("GET", "/v1/events", { signal: controller.signal,
                                                         headers: { "Accept": "text/event-stream" } });
      if (!response.ok) throw new Error(await errorText(response));
      showDashboard();
      setConnection("live", "live");
      await readEvents(response.body, onEvent);
    } catch (exc) {
      if (exc.message === "unauthenticated" || controller.signal.aborted) return;
      setConnection("lost", `reconnecting: ${exc.message}`);
    }
    setConnection("lost", "reconnecting");
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

async function readEvents(body, handle) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) handle(event, JSON.parse(data.join("\n")));
    }
  }
}

function onEvent(event, data) {
  if (event === "deployments") { state.deployments = data; renderDeployments(); renderMemory(); }
  else if (event === "usage") { state.usage = data; renderMemory(); renderDeployments(); }
  else if (event === "usage_error") { $("measured-at").textContent = data.message; }
  else if (event === "requests") { state.requests = data.deployments || {}; renderDeployments(); }
}

// -- deployments -----------------------------------------------------------------------------------

const ACTIONS = ["park", "wake", "stop"];
const ALLOWED = {  // which buttons make sense in which state
  park: new Set(["ready", "starting", "waking"]),
  wake: new Set(["parked", "stopped", "failed"]),
  stop: new Set(["ready", "starting", "waking", "parked", "parking", "failed"]),
};
const pending = new Set();

function fmtRate(row) {
  if (!row || row.rate_per_s === null || row.rate_per_s === undefined) return "–";
  return row.rate_per_s.toFixed(row.rate_per_s < 10 ? 2 : 0);
}

function fmtLatency(row) {
  if (!row || row.mean_latency_s === null || row.mean_latency_s === undefined) return "–";
  const s = row.mean_latency_s;
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

function fmtWake(d) {
  const record = d.park_record || {};
  if (record.wake_seconds === null || record.wake_seconds === undefined) return "–";
  const cache = record.prompt_cache || {};
  let text = `${record.wake_seconds.toFixed(2)} s`;
  if (cache.state === "restored") {
    text += `; ${cache.tokens} cached tokens restored`;
    if (cache.seconds_saved !== null && cache.seconds_saved !== undefined) text += `, ${cache.seconds_saved.toFixed(1)} s saved`;
  } else if (cache.state === "refused" || cache.state === "failed") {
    text += `; prompt cache ${cache.state}`;
  }
  return text;
}

function renderDeployments() {
  const body = $("deployments").tBodies[0];
  body.replaceChildren();
  $("no-deployments").hidden = state.deployments.length > 0;
  for (const d of state.deployments) {
    const rates = state.requests[d.name];
    const buttons = ACTIONS.map((verb) => {
      const b = el("button", { type: "button", dataset: { action: verb, deployment: d.name } },
                   verb[0].toUpperCase() + verb.slice(1));
      b.disabled = pending.has(d.name) || !ALLOWED[verb].has(d.state);
      b.addEventListener("click", () => act(verb, d.name));
      return b;
    });
    const logs = el("button", { type: "button", dataset: { action: "logs", deployment: d.name } }, "Logs");
    logs.addEventListener("click", () => followJournal(d.name));
    // Each cell names its column (data-label): on a narrow screen the rows stack, without the head.
    const cell = (cls, label, ...content) => el("td", { class: cls, dataset: { label } }, ...content);
    const stateCell = cell("state", "State", d.state);
    stateCell.dataset.state = d.state;
    if (d.reason) stateCell.title = d.reason;
    body.append(el("tr", { dataset: { deployment: d.name } },
      cell("name", "Name", d.name), stateCell,
      cell("revision", "Revision", d.revision),
      cell("engine", "Engine", d.engine),
      cell("host", "Host", (d.hosts || []).join(", ") || "local"),
      cell("unit", "Unit", d.unit),
      cell("rate", "Requests/s", fmtRate(rates)),
      cell("latency", "Latency", fmtLatency(rates)),
      cell("wake", "Last wake", fmtWake(d)),
      cell("in-flight", "In flight", `${d.in_flight}${d.waiting ? ` (+${d.waiting} waiting)` : ""}`),
      cell("actions", "", el("div", { class: "buttons" }, ...buttons, logs))));
  }
}

async function act(verb, name) {
  $("action-error").textContent = "";
  pending.add(name);
  renderDeployments();
  try {
    const response = await api("POST", `/v1/deployments/${encodeURIComponent(name)}/${verb}`);
    if (!response.ok) $("action-error").textContent = `${verb} ${name}: ${await errorText(response)}`;
  } catch (exc) {
    if (exc.message !== "unauthenticated") $("action-error").textContent = `${verb} ${name}: ${exc.message}`;
  } finally {
    pending.delete(name);
    renderDeployments();  // the state itself arrives through the event stream
  }
}

// -- memory ----------------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "unknown";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function renderMemory() {
  const root = $("memory");
  root.replaceChildren();
  const usage = state.usage;
  if (!usage) return;
  $("measured-at").textContent = `Measured ${new Date(usage.measured_at * 1000).toLocaleTimeString()}.`;
  const stateOf = Object.fromEntries(state.deployments.map((d) => [d.name, d.state]));
  for (const host of usage.hosts || []) {
    for (const dom of host.domains || []) {
      const holders = [];
      for (const dep of usage.deployments || []) {
        const mine = (dep.domains || []).find((x) => x.id === dom.id);
        const amount = mine ? (mine.held ?? mine.reserved) : 0;
        if (amount > 0) holders.push({ name: dep.name, amount, parked: (stateOf[dep.name] || dep.state) === "parked" });
      }
      // Cores (a cpu:<host> domain) are counted in cores, every other domain in bytes.
      const fmt = dom.kind === "cpu" ? (n) => `${n} core${n === 1 ? "" : "s"}` : bytes;
      const capacity = dom.capacity || 1;
      const held = holders.reduce((sum, h) => sum + h.amount, 0);
      const used = dom.available === null || dom.available === undefined ? null : Math.max(0, capacity - dom.available);
      const other = used === null ? 0 : Math.max(0, used - held);
      const free = Math.max(0, capacity - held - other);
      const bar = el("div", { class: "bar", role: "img" });
      const legend = el("div", { class: "legend" });
      for (const h of holders) {
        const kind = h.parked ? "parked" : "resident";
        const parked = dom.kind === "cpu" ? "parked in place" : "parked in host RAM";
        const title = `${h.name}: ${fmt(h.amount)} ${h.parked ? parked : "resident"}`;
        bar.append(el("div", { class: `segment ${kind}`, title, dataset: { deployment: h.name },
                               width: `${(100 * h.amount / capacity).toFixed(2)}%` }));
        legend.append(el("span", {}, el("span", { class: `swatch segment ${kind}` }), title));
      }
      if (other > 0) {
        bar.append(el("div", { class: "segment other", title: `other use: ${fmt(other)}`,
                               width: `${(100 * other / capacity).toFixed(2)}%` }));
        legend.append(el("span", {}, el("span", { class: "swatch segment other" }), `other use: ${fmt(other)}`));
      }
      legend.append(el("span", {}, `free: ${used === null ? "unknown" : fmt(free)}`));
      bar.setAttribute("aria-label", `${dom.id}: ${fmt(held)} held by deployments of ${fmt(dom.capacity)}`);
      const label = dom.kind === "gpu" ? `GPU ${dom.index}${dom.model ? ` (${dom.model})` : ""} on ${host.host}`
                  : dom.kind === "cpu" ? `Cores of ${host.host}` : `RAM of ${host.host}`;
      root.append(el("div", { class: "domain", dataset: { domain: dom.id } },
        el("div", { class: "domain-title" }, el("span", {}, label), el("span", { class: "muted" }, `${fmt(dom.capacity)}`)),
        bar, legend));
    }
  }
  if (!root.childElementCount) root.append(el("p", { class: "muted" }, "No memory domain is known yet."));
}

// -- the journal -------------------------------------------------------------------------------------

async function followJournal(name) {
  if (state.journal) state.journal.abort();
  const controller = new AbortController();
  state.journal = controller;
  const pre = $("journal");
  pre.textContent = "";
  $("journal-name").textContent = name;
  $("journal-hint").hidden = true;
  try {
    const response = await api("GET", `/v1/deployments/${encodeURIComponent(name)}/logs?lines=100&follow=1`,
                               { signal: controller.signal });
    if (!response.ok) { pre.textContent = await errorText(response); return; }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.trim()) continue;
        const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(JSON.parse(line).line + "\n");
        while (pre.childNodes.length > JOURNAL_MAX_LINES) pre.firstChild.remove();
        if (stick) pre.scrollTop = pre.scrollHeight;
      }
    }
  } catch (exc) {
    if (!controller.signal.aborted && exc.message !== "unauthenticated") pre.append(`[journal ended: ${exc.message}]\n`);
  }
}

// -- start ---------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  takeTokenFromFragment();
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token").value = "";
    follow();
  });
  $("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    if (state.journal) state.journal.abort();
    showLogin("");
  });
  if (token()) follow(); else showLogin("");
});
