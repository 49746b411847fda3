// flashdraft chat page: streams /v1/chat/completions (server-sent events) and shows, per
// answer, the server's own `timings` (decode tokens/s, draft_n / draft_n_accepted, τ), so
// what you read is what the engine measured, not a browser-side guess. Answers render as
// Markdown with highlighted code when the vendored libraries loaded, as plain text if not.
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

// -- Markdown answers ----------------------------------------------------------------------
// marked turns the answer into HTML, DOMPurify sanitises that before it reaches the DOM (on
// every render, whatever marked produced), highlight.js colours the code blocks. Raw HTML in
// the answer is escaped rather than parsed: model output is text, never markup.
const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "form", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],  // the CSP refuses inline styles anyway; nothing here needs them
};
const HLJS_LANGUAGE = /\blang(?:uage)?-([\w-]+)\b/i;  // how highlight.js reads a class name

const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

// null when a vendor script failed to load: answers are then shown as plain text
const markdown = (() => {
  if (!window.marked || !window.DOMPurify || !DOMPurify.isSupported) return null;
  // links in an answer leave the chat in a new tab, without a handle back to this page
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  return new marked.Marked({
    gfm: true,
    renderer: {
      html: ({ text, block }) => (block ? `<p>${escapeHtml(text)}</p>` : escapeHtml(text)),
      // an image would be fetched from wherever the model points: offer a link to it instead
      image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
    },
  });
})();

function renderAnswer(content, text) {
  if (markdown) {
    try {
      content.innerHTML = DOMPurify.sanitize(markdown.parse(text), PURIFY);
      content.classList.add("markdown");
      for (const pre of content.querySelectorAll("pre")) decorateCode(pre);
      return;
    } catch (e) {
      console.warn("Markdown rendering failed, showing plain text:", e);
    }
  }
  content.classList.remove("markdown");
  content.textContent = text;
}

function decorateCode(pre) {
  const code = pre.querySelector("code");
  if (!code) return;
  if (window.hljs) {
    const lang = (HLJS_LANGUAGE.exec(code.className) || [])[1];
    // highlight.js throws on a language it lacks: drop the name so it guesses instead
    if (lang && !/^no-?highlight$/i.test(lang) && !hljs.getLanguage(lang)) {
      code.className = code.className.replace(HLJS_LANGUAGE, "");
    }
    hljs.highlightElement(code);
  }
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.title = "Copy the code";
  pre.prepend(copy);
}

// Re-renders an answer at most once per animation frame however fast tokens arrive: parsing
// and highlighting the whole answer per token would fall behind a fast model.
function answerView(el) {
  const content = el.querySelector(".content");
  let text = "", frame = 0;
  const draw = () => {
    frame = 0;
    renderAnswer(content, text);
    el.scrollIntoView({ block: "end" });
  };
  return {
    show(t) { text = t; if (!frame) frame = requestAnimationFrame(draw); },
    flush() { if (frame) { cancelAnimationFrame(frame); draw(); } },
  };
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try { await navigator.clipboard.writeText(text); return true; } catch (_) { /* refused: the old way */ }
  }
  // no clipboard API (plain http from another host): copy the selection of a hidden textarea
  const area = document.createElement("textarea");
  area.value = text;
  area.readOnly = true;
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (_) { ok = false; }
  area.remove();
  return ok;
}

async function copyCode(button) {
  const code = button.parentElement.querySelector("code");
  // marked ends every code block with a newline the fence did not have
  const ok = await copyText(code.textContent.replace(/\n$/, ""));
  button.textContent = ok ? "Copied" : "Copy failed";
  clearTimeout(button.reset);
  button.reset = setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// -- messages ------------------------------------------------------------------------------
function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;  // as typed; an answer is rendered later, by renderAnswer
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
  const view = answerView(el);
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
        view.show(answer);
      }
      if (ev.timings) timings = ev.timings;
    });
    view.flush();  // the whole answer is on screen before it is marked done
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
    view.flush();
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
// one listener for every code block's Copy button, including those not rendered yet
$("messages").addEventListener("click", (e) => {
  const button = e.target.closest("button.copy");
  if (button) copyCode(button);
});
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
