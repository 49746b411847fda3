// flashdraft chat page: streams /v1/chat/completions (server-sent events) and shows, per
// answer, the server's own `timings` (decode tokens/s, draft_n / draft_n_accepted, τ), so
// what you read is what the engine measured, not a browser-side guess.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "top_k", "max_tokens", "system", "api_key"];
const STORE = "flashdraft.settings";

const chat = {
  history: [],        // [{role, content}] sent with every request (multi-turn)
  controller: null,   // AbortController of the answer being streamed, or null
};

// -- settings: kept in localStorage so a reload keeps them -------------------------------
function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch (_) { /* corrupt: start over */ }
  for (const k of SETTINGS) if (typeof saved[k] === "string") $(k).value = saved[k];
  for (const k of SETTINGS) $(k).addEventListener("change", saveSettings);
}

function saveSettings() {
  const out = {};
  for (const k of SETTINGS) out[k] = $(k).value;
  localStorage.setItem(STORE, JSON.stringify(out));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// Sampling fields: an empty input is left out, so the server's default (--temp ...) applies.
function samplingFields() {
  const body = {};
  for (const [k, parse] of [["temperature", parseFloat], ["top_p", parseFloat],
                            ["top_k", (v) => parseInt(v, 10)], ["max_tokens", (v) => parseInt(v, 10)]]) {
    const raw = $(k).value.trim();
    if (raw !== "") {
      const v = parse(raw);
      if (!Number.isNaN(v)) body[k] = v;
    }
  }
  return body;
}

// -- server facts for the header and the settings placeholders ---------------------------
async function loadProps() {
  try {
    const r = await fetch("/props", { headers: headers() });
    const body = await r.json();
    if (!r.ok) {
      $("model").textContent = (body.error && body.error.message) || ("HTTP " + r.status);
      if (r.status === 503) setTimeout(loadProps, 1000);  // still loading the model
      if (r.status === 401) $("settings").open = true;
      return;
    }
    const spec = body.speculative || {};
    $("model").textContent = `${body.model_alias} · ${spec.type || "?"}` +
      (spec.drafting ? ` (${spec.drafter}, n_max ${spec.n_max})` : " (no drafting)");
    const p = (body.default_generation_settings || {}).params || {};
    for (const k of ["temperature", "top_p", "top_k"]) if (p[k] !== undefined) $(k).placeholder = String(p[k]);
  } catch (e) {
    $("model").textContent = "server unreachable: " + e.message;
  }
}

// -- messages ------------------------------------------------------------------------------
function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;  // textContent, never innerHTML: model output is not markup
  const stats = document.createElement("div");
  stats.className = "stats";
  const note = document.createElement("div");
  note.className = "note";
  el.append(content, stats, note);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function showStats(el, t, clientMs) {
  const stats = el.querySelector(".stats");
  const item = (name, label, value) => {
    const span = document.createElement("span");
    span.dataset.stat = name;
    span.append(label + " ");
    const b = document.createElement("b");
    b.textContent = value;
    span.append(b);
    stats.append(span);
  };
  item("tps", "decode", `${Number(t.predicted_per_second || 0).toFixed(1)} tok/s`);
  item("tokens", "tokens", String(t.predicted_n));
  if (t.draft_n !== undefined) {
    const rate = t.draft_n ? ` (${(100 * t.draft_n_accepted / t.draft_n).toFixed(0)}%)` : "";
    item("draft", "draft accepted", `${t.draft_n_accepted} / ${t.draft_n}${rate}`);
    item("tau", "τ", Number(t.acceptance_length || 0).toFixed(2));
  } else {
    item("draft", "drafting", "off");
  }
  item("prompt", "prompt", `${t.prompt_n} tok in ${Math.round(t.prompt_ms)} ms`);
  if (clientMs !== null) item("ttft", "first text after", `${Math.round(clientMs)} ms`);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// -- one answer ------------------------------------------------------------------------------
// Parses server-sent events from the fetch body; calls onEvent(json) for each `data:` line.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return true;
        onEvent(JSON.parse(data));
      }
    }
  }
  return false;
}

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const turn = { role: "user", content: text };
  messages.push(...chat.history, turn);

  addMessage("user", text);
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  const content = el.querySelector(".content");
  const note = el.querySelector(".note");
  let answer = "", timings = null, failed = null, firstTextMs = null;
  const t0 = performance.now();

  chat.controller = new AbortController();
  setBusy(true);
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: chat.controller.signal,
      body: JSON.stringify({ messages, stream: true, ...samplingFields() }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const complete = await readEvents(r, (ev) => {
      if (ev.error) { failed = ev.error.message || "error"; return; }
      const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
      if (delta && delta.content) {
        if (firstTextMs === null) firstTextMs = performance.now() - t0;
        answer += delta.content;
        content.textContent = answer;
        el.scrollIntoView({ block: "end" });
      }
      if (ev.timings) timings = ev.timings;
    });
    if (failed) throw new Error(failed);
    if (!complete) throw new Error("the stream ended early (server stopped?)");
    chat.history.push(turn, { role: "assistant", content: answer });
    if (timings) showStats(el, timings, firstTextMs);  // another server may send none
    el.classList.add("done");
  } catch (e) {
    if (e.name === "AbortError") {
      // keep the partial answer as the assistant's turn: it is what the user saw
      chat.history.push(turn, { role: "assistant", content: answer });
      note.textContent = "stopped";
      el.classList.add("stopped");
    } else {
      note.textContent = "error: " + e.message;
      el.classList.add("error");
    }
  } finally {
    el.classList.remove("streaming");
    chat.controller = null;
    setBusy(false);
  }
}

// -- wiring ------------------------------------------------------------------------------------
function submit(event) {
  if (event) event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  $("prompt").value = "";
  send(text);
}

$("composer").addEventListener("submit", submit);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) submit(e);
});
// aborting the fetch closes the connection; the server sees the disconnect and stops decoding
$("stop").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (chat.controller) chat.controller.abort();
  chat.history = [];
  $("messages").replaceChildren();
  $("prompt").focus();
});
$("api_key").addEventListener("change", loadProps);
$("settings-form").addEventListener("submit", (e) => e.preventDefault());  // Enter in a field: no reload

loadSettings();
loadProps();
