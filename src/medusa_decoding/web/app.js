// The chat page of `medusa serve`: the server's OpenAI API, streamed, with each forward pass's accepted tokens drawn
// as one span (the `medusa` extension of every stream chunk: {step, accepted}). No framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "medusa-api-key";
let model = null;
let history = [];  // the chat so far, as OpenAI messages
let running = null;  // the AbortController of the request in flight

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers() {
  const key = localStorage.getItem(KEY);
  return Object.assign({"Content-Type": "application/json"}, key ? {"Authorization": `Bearer ${key}`} : {});
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function failure(response) {
  let message = `HTTP ${response.status}`;
  try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
  if (response.status === 401) $("key-form").hidden = false;
  return new HttpError(response.status, message);
}

// POST a streamed completion; onPiece(text, step, accepted) for every chunk with text -> the final chunk's usage.
async function stream(body, onPiece, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), signal, body: JSON.stringify(Object.assign({model, stream: true}, body)),
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", usage = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return usage;
    buffer += decoder.decode(value, {stream: true});
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return usage;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new HttpError(500, chunk.error.message);
      const text = chunk.choices[0].delta.content;
      if (text) onPiece(text, chunk.medusa.step, chunk.medusa.accepted);
      if (chunk.usage) usage = chunk.usage;
    }
  }
}

// A pane of text drawn pass by pass, with its counters.
class Passes {
  constructor(element) {
    this.element = element;
    this.tokens = 0;
    this.passes = 0;
  }
  add(text, step, accepted) {
    const span = document.createElement("span");
    span.className = `pass ${step % 2 ? "odd" : "even"}${accepted > 1 ? " multi" : ""}`;
    span.title = `forward pass ${step}: ${accepted} token${accepted > 1 ? "s" : ""}`;
    span.dataset.step = step;
    span.dataset.accepted = accepted;
    span.textContent = text;
    this.element.appendChild(span);
    if (step !== this.passes) this.tokens += accepted;
    this.passes = step;
  }
  get text() { return this.element.textContent; }
}

function stats(passes, seconds) {
  $("tps").textContent = seconds > 0 ? (passes.tokens / seconds).toFixed(1) : "–";
  $("tpp").textContent = passes.passes ? (passes.tokens / passes.passes).toFixed(2) : "–";
  $("passes").textContent = passes.passes || "–";
}

function bubble(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  element.textContent = text || "";
  $("messages").appendChild(element);
  return element;
}

// plain decoding in the same engine: no tree, no lookup drafts (the server's defaults are MEDUSA's)
function decoding(mode) {
  return mode === "plain" ? {medusa: {tree: [], lookup: 0}} : {};
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || running) return;
  showError("");
  history.push({role: "user", content: prompt});
  bubble("user", prompt);
  $("prompt").value = "";
  const passes = new Passes(bubble("assistant"));
  passes.element.dataset.state = "running";
  const body = Object.assign({messages: history, temperature: Number($("temperature").value),
                              max_tokens: Number($("max-tokens").value)}, decoding($("mode").value));
  if ($("stop").value) body.stop = [$("stop").value];
  running = new AbortController();
  setBusy(true);
  const start = performance.now();
  try {
    await stream(body, (text, step, accepted) => {
      passes.add(text, step, accepted);
      stats(passes, (performance.now() - start) / 1000);
    }, running.signal);
    history.push({role: "assistant", content: passes.text});
    passes.element.dataset.state = "done";
  } catch (error) {
    passes.element.dataset.state = "stopped";
    history.pop();  // the question goes unanswered
    if (error.name !== "AbortError") showError(error.message);
  } finally {
    running = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
  $("race-start").disabled = busy;
}

// ---- the race: each decoder alone, live, then both replayed from one start ----

let recordings = null;

async function runPane(name, body) {
  const pane = $(`pane-${name}`);
  const text = pane.querySelector(".text");
  text.textContent = "";
  pane.classList.remove("done");
  const passes = new Passes(text);
  const record = [];
  const start = performance.now();
  const clock = setInterval(() => tick(pane, passes, (performance.now() - start) / 1000), 50);
  try {
    await stream(body, (piece, step, accepted) => {
      passes.add(piece, step, accepted);
      record.push([performance.now() - start, piece, step, accepted]);
    }, running.signal);
  } finally {
    clearInterval(clock);
  }
  const seconds = (performance.now() - start) / 1000;
  tick(pane, passes, seconds);
  pane.classList.add("done");
  pane.dataset.state = "done";
  return {record, seconds, passes};
}

function tick(pane, passes, seconds) {
  pane.querySelector(".clock").textContent = `${seconds.toFixed(2)} s`;
  pane.querySelector(".pane-stats").textContent =
    `${passes.tokens} tokens in ${passes.passes} forward passes (${passes.passes ?
      (passes.tokens / passes.passes).toFixed(2) : "–"} a pass)`;
}

async function race(event) {
  event.preventDefault();
  if (running) return;
  showError("");
  $("verdict").textContent = "";
  for (const name of ["medusa", "plain"]) $(`pane-${name}`).dataset.state = "waiting";
  const base = {messages: [{role: "user", content: $("race-prompt").value}], temperature: 0,
                max_tokens: Number($("race-max-tokens").value)};
  running = new AbortController();
  setBusy(true);
  try {
    const medusa = await runPane("medusa", base);
    const plain = await runPane("plain", Object.assign({}, base, decoding("plain")));
    recordings = {medusa, plain};
    $("verdict").textContent = `MEDUSA ${medusa.seconds.toFixed(2)} s, plain decoding ${plain.seconds.toFixed(2)} s: ` +
      `${(plain.seconds / medusa.seconds).toFixed(2)}x` +
      (medusa.passes.text === plain.passes.text ? ", the same text" : ", different text (sampling?)");
    $("replay").disabled = false;
  } catch (error) {
    if (error.name !== "AbortError") showError(error.message);
  } finally {
    running = null;
    setBusy(false);
  }
}

function replay() {
  for (const [name, run] of Object.entries(recordings)) {
    const pane = $(`pane-${name}`);
    const text = pane.querySelector(".text");
    text.textContent = "";
    pane.classList.remove("done");
    const passes = new Passes(text);
    tick(pane, passes, 0);
    for (const [at, piece, step, accepted] of run.record) {
      setTimeout(() => { passes.add(piece, step, accepted); tick(pane, passes, at / 1000); }, at);
    }
    setTimeout(() => { tick(pane, passes, run.seconds); pane.classList.add("done"); }, run.seconds * 1000);
  }
}

// ---- start ----

async function connect() {
  const response = await fetch("v1/models", {headers: headers()});
  if (!response.ok) {
    showError((await failure(response)).message);
    return;
  }
  model = (await response.json()).data[0].id;
  $("model").textContent = model;
  $("key-form").hidden = true;
  showError("");
}

function show(view) {
  for (const name of ["chat", "race"]) {
    $(name).hidden = name !== view;
    $(`tab-${name}`).classList.toggle("active", name === view);
  }
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
$("stop-button").addEventListener("click", () => running && running.abort());
$("reset").addEventListener("click", () => { history = []; $("messages").textContent = ""; stats(new Passes(null), 0); });
$("race-form").addEventListener("submit", race);
$("replay").addEventListener("click", replay);
for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY, $("key").value);
  connect();
});
connect();
