// The page at `/`: a chat playground over /v1/chat/completions (streamed) and a live view of
// the server from /status. Plain JS with no dependencies: served as-is, nothing to build.
"use strict";

const $ = (id) => document.getElementById(id);
const history = []; // the conversation so far, as chat messages
let running = null; // AbortController of the request in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// Settings survive a reload (the API key only for this tab).
function restoreSettings() {
  for (const id of ["system", "temperature", "max-tokens"]) {
    const saved = localStorage.getItem("ferrox." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("ferrox." + id, $(id).value));
  }
  $("api-key").value = sessionStorage.getItem("ferrox.api-key") || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("ferrox.api-key", $("api-key").value);
    loadModels();
  });
}

async function loadModels() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    const body = await resp.json();
    if (!resp.ok) throw new Error(body.error ? body.error.message : resp.statusText);
    const select = $("model");
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    showError(null);
  } catch (err) {
    showError("models: " + err.message);
  }
}

function showError(text) {
  $("chat-error").hidden = !text;
  $("chat-error").textContent = text || "";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const thinking = document.createElement("div"); // a reasoning model's thinking (--reasoning-parser)
  thinking.className = "thinking";
  thinking.hidden = true;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  div.append(who, thinking, body, meta);
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

// Yields the JSON payload of each `data:` line of a server-sent event stream.
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  const body = {
    model: $("model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  running = new AbortController();
  setBusy(true);
  const started = performance.now();
  let answer = "";
  let thought = "";
  let finish = "";
  let tokens = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : resp.status + " " + resp.statusText);
    }
    for await (const chunk of sseData(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        if (choice.delta.content) reply.dataset.chunks = Number(reply.dataset.chunks || 0) + 1; // text deltas seen
        answer += choice.delta.content || "";
        thought += choice.delta.reasoning || "";
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      reply.querySelector(".text").textContent = answer;
      const thinking = reply.querySelector(".thinking");
      thinking.textContent = thought;
      thinking.hidden = !thought;
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else showError(err.message);
  } finally {
    reply.classList.remove("streaming");
    const seconds = (performance.now() - started) / 1000;
    const parts = [finish || "unfinished", seconds.toFixed(1) + " s"];
    if (tokens !== null) parts.push(tokens + " tokens", (tokens / seconds).toFixed(1) + " tokens/s");
    reply.querySelector(".meta").textContent = parts.join(" · ");
    reply.dataset.done = finish || "error";
    if (answer) history.push({ role: "assistant", content: answer });
    running = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function formatDuration(s) {
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

async function pollStatus() {
  try {
    const resp = await fetch("/status");
    if (!resp.ok) throw new Error(resp.status + " " + resp.statusText);
    const s = await resp.json();
    $("server-model").textContent = s.model;
    $("server-version").textContent = "v" + s.version;
    $("stat-running").textContent = s.requests_running;
    $("stat-waiting").textContent = s.requests_waiting;
    $("stat-prompt-tps").textContent = s.prompt_tokens_per_s.toFixed(1);
    $("stat-gen-tps").textContent = s.generation_tokens_per_s.toFixed(1);
    $("stat-prefix-hit").textContent =
      s.prefix_cache_hit_rate === null ? "–" : (100 * s.prefix_cache_hit_rate).toFixed(1) + " %";
    $("stat-kv").value = s.kv_cache_usage;
    $("stat-kv-text").textContent = (100 * s.kv_cache_usage).toFixed(1) + " %";
    $("stat-max-len").textContent = s.max_model_len + " tokens";
    $("stat-uptime").textContent = formatDuration(s.uptime_s);
    $("server-state").textContent = s.healthy ? "healthy" : "engine not running";
  } catch (err) {
    $("server-state").textContent = "unreachable (" + err.message + ")";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  restoreSettings();
  loadModels();
  pollStatus();
  setInterval(pollStatus, 1000);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    showError(null);
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
  });
});
