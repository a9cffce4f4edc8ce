/* The chat page: a chat client that keeps its conversations in the browser.

   The server is stateless: every turn sends the whole conversation to
   /v1/chat/completions and streams the reply back as Server-Sent Events. Sending the
   same messages again (regenerate, edit, retry) lets the server's prefix cache reuse the
   KV of the unchanged beginning, so only the new part is computed. Stop aborts the
   fetch: the server sees its client leave, and aborts the request.

   State: `store` = {conversations: [{id, system, messages, updated}], currentId}, written
   to localStorage after every change. A message is {role, content}; a reply may add
   `stopped` (the user stopped it), `truncated` (max tokens ended it) and `stats` (its
   speed and cache figures).
   Invariant: the history holds only what the server answered. A failed turn stores
   nothing, so the conversation then ends with the user's message, which Retry answers. */
"use strict";

const STORE_KEY = "nanoqwen.conversations";
const SETTINGS_KEY = "nanoqwen.settings";
const API_KEY_KEY = "nanoqwen.api-key"; // in sessionStorage: the key is forgotten with the tab
const $ = (id) => document.getElementById(id);

let store = loadStore();
let model = null; // the served model's card from /v1/models, once it has loaded
let controller = null; // aborts the reply in flight; null while idle

// ---------------------------------------------------------------- small helpers
function element(tag, properties = {}, ...children) {
  const node = Object.assign(document.createElement(tag), properties);
  node.append(...children);
  return node;
}

function note(className, text) {
  return element("span", { className, textContent: text });
}

function button(label, onClick, className = "") {
  return element("button", { type: "button", textContent: label, className, onclick: onClick });
}

function newId() {
  // crypto.randomUUID exists only on secure origins; a LAN address over http is not one.
  return Date.now().toString(36) + Math.random().toString(36).slice(2);
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = false;
}

function clearNotice() {
  $("notice").hidden = true;
}

// An error to show in a reply's bubble. `overflow` marks a conversation longer than the
// model's context, which the server answers with OpenAI's code `context_length_exceeded`.
class ChatError extends Error {
  constructor(message, status = null, code = null) {
    super(message);
    this.status = status;
    this.overflow = code === "context_length_exceeded";
  }
}

// ---------------------------------------------------------------- storage
function loadStore() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE_KEY));
    if (saved && Array.isArray(saved.conversations)) return saved;
  } catch {
    // Unreadable (written by hand, or by an older page): start with no conversations.
  }
  return { conversations: [], currentId: null };
}

function save() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(store));
  } catch (error) {
    showNotice(`The browser did not store this conversation (${error.message}): `
      + "delete old conversations to make room.");
  }
}

function touch(conversation) {
  conversation.updated = Date.now();
  save();
}

// Temperature and max tokens hold for all conversations and are kept across reloads; a
// field left empty is left out of the request, so the server uses its default.
function restoreSettings() {
  const settings = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
  $("temperature").value = settings.temperature ?? "";
  $("max-tokens").value = settings.maxTokens ?? "";
  $("key").value = sessionStorage.getItem(API_KEY_KEY) || "";
}

function saveSettings() {
  const settings = { temperature: $("temperature").value, maxTokens: $("max-tokens").value };
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

function samplingSettings() {
  const settings = {};
  if ($("temperature").value !== "") settings.temperature = Number($("temperature").value);
  if ($("max-tokens").value !== "") settings.max_tokens = Number($("max-tokens").value);
  return settings;
}

// ---------------------------------------------------------------- conversations
function currentConversation() {
  return store.conversations.find((c) => c.id === store.currentId) ?? createConversation("");
}

function createConversation(system) {
  const conversation = { id: newId(), system, messages: [], updated: Date.now() };
  store.conversations.push(conversation);
  store.currentId = conversation.id;
  return conversation;
}

function titleOf(conversation) {
  const first = conversation.messages.find((message) => message.role === "user");
  return first ? first.content.slice(0, 80) : "New chat";
}

function startNewChat() {
  stopReply();
  const conversation = currentConversation();
  // An empty conversation is reused: "New chat" twice makes one, not two.
  if (conversation.messages.length > 0) createConversation(conversation.system);
  save();
  render();
  $("input").focus();
}

function switchTo(id) {
  stopReply();
  store.currentId = id;
  save();
  render();
}

function deleteConversation(conversation) {
  if (!confirm(`Delete the conversation "${titleOf(conversation)}"?`)) return;
  if (conversation.id === store.currentId) stopReply();
  store.conversations = store.conversations.filter((c) => c !== conversation);
  if (conversation.id === store.currentId) store.currentId = byRecency()[0]?.id ?? null;
  save();
  render();
}

function byRecency() {
  return [...store.conversations].sort((a, b) => b.updated - a.updated);
}

// ---------------------------------------------------------------- rendering
function render() {
  const conversation = currentConversation();
  $("system").value = conversation.system;
  renderSidebar(conversation);
  const views = conversation.messages.map((message, index) =>
    messageView(conversation, message, index));
  $("log").replaceChildren(...views);
  $("log").scrollTop = $("log").scrollHeight;
}

function renderSidebar(current) {
  const items = byRecency().map((conversation) => {
    const open = button(titleOf(conversation), () => switchTo(conversation.id), "open");
    const remove = button("×", () => deleteConversation(conversation), "delete");
    remove.title = "Delete conversation";
    const item = element("li", {}, open, remove);
    item.classList.toggle("current", conversation === current);
    return item;
  });
  $("conversations").replaceChildren(...items);
}

// A bubble: the text, then a line of notes (stopped, speed) and actions (edit, regenerate).
function bubble(role) {
  const content = element("div", { className: "content" });
  const meta = element("div", { className: "meta" });
  const root = element("div", { className: `turn ${role}` }, content, meta);
  return { root, content, meta };
}

function messageView(conversation, message, index) {
  const view = bubble(message.role);
  if (message.role === "assistant") showReply(view.content, message.content);
  else view.content.textContent = message.content;
  if (message.stopped) view.meta.append(note("stopped", "stopped"));
  if (message.truncated) view.meta.append(note("stopped", "max tokens reached"));
  if (message.stats) view.meta.append(note("stats", describe(message.stats)));
  const actions = element("span", { className: "actions" });
  if (message.role === "user") {
    actions.append(button("Edit", () => startEditing(conversation, index, view)));
  }
  if (index === conversation.messages.length - 1) {
    actions.append(button(message.role === "user" ? "Answer" : "Regenerate",
      () => regenerate(conversation)));
  }
  view.meta.append(actions);
  return view.root;
}

// A reply as HTML: its reasoning, if any, folded away, then the answer.
function showReply(container, text) {
  const { thinking, answer } = splitThinking(text);
  // A re-render mid-stream keeps the reasoning open if the user opened it.
  const wasOpen = container.querySelector("details.reasoning")?.open ?? false;
  container.replaceChildren();
  if (thinking !== null) {
    const summary = element("summary", { textContent: "Reasoning" });
    const reasoning = element("details", { className: "reasoning", open: wasOpen }, summary);
    reasoning.append(markdown(thinking));
    container.append(reasoning);
  }
  container.append(markdown(answer));
  addCopyButtons(container);
}

// Qwen3 reasons first, inside <think>…</think> (still open while it streams).
function splitThinking(text) {
  const match = /^\s*<think>([\s\S]*?)(?:<\/think>|$)([\s\S]*)$/.exec(text);
  return match ? { thinking: match[1].trim(), answer: match[2] } : { thinking: null, answer: text };
}

// Markdown as sanitized HTML: marked writes whatever HTML the text holds (a <script>, an
// onerror= attribute), and DOMPurify removes everything that could run.
function markdown(text) {
  return DOMPurify.sanitize(marked.parse(text), { RETURN_DOM_FRAGMENT: true });
}

function addCopyButtons(container) {
  for (const pre of container.querySelectorAll("pre")) {
    const copy = button("Copy", () => copyText(pre.textContent, copy), "copy");
    const frame = element("div", { className: "code" });
    pre.replaceWith(frame);
    frame.append(copy, pre);
  }
}

// Links in a reply open in a new tab, and tell the site nothing about this page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

async function copyText(text, copyButton) {
  // navigator.clipboard exists only on secure origins (https, localhost); over plain http
  // from another machine, the older copy command still works.
  if (navigator.clipboard) {
    await navigator.clipboard.writeText(text);
  } else {
    const scratch = element("textarea", { value: text });
    document.body.append(scratch);
    scratch.select();
    document.execCommand("copy");
    scratch.remove();
  }
  copyButton.textContent = "Copied";
  setTimeout(() => { copyButton.textContent = "Copy"; }, 1500);
}

function describe(stats) {
  const parts = [];
  if (stats.completionTokens !== undefined) parts.push(`${stats.completionTokens} tokens`);
  if (stats.tokensPerSecond !== undefined) {
    parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  }
  if (stats.ttft !== undefined) parts.push(`first token after ${stats.ttft.toFixed(2)} s`);
  if (stats.cachedTokens !== undefined) {
    parts.push(`${stats.cachedTokens}/${stats.promptTokens} prompt tokens from cache`);
  }
  return parts.join(" · ");
}

function startEditing(conversation, index, view) {
  if (controller) return;
  const original = conversation.messages[index].content;
  const editor = element("textarea", { className: "editor", value: original });
  const saveButton = button("Save and regenerate", () => {
    const text = editor.value.trim();
    if (!text) return;
    // What came after the edited message no longer follows from it: it goes. What came
    // before is sent unchanged, so the server's prefix cache still holds it.
    const before = conversation.messages.slice(0, index);
    conversation.messages = [...before, { role: "user", content: text }];
    touch(conversation);
    render();
    generate(conversation);
  });
  view.content.replaceChildren(editor);
  const actions = element("span", { className: "actions" }, saveButton, button("Cancel", render));
  view.meta.replaceChildren(actions);
  editor.focus();
}

// ---------------------------------------------------------------- a turn
function send(text) {
  const conversation = currentConversation();
  conversation.messages.push({ role: "user", content: text });
  touch(conversation);
  render();
  generate(conversation);
}

// Answer the conversation's last user message again: the replies after it are replaced.
function regenerate(conversation) {
  if (controller) return;
  while (conversation.messages.at(-1)?.role === "assistant") conversation.messages.pop();
  if (conversation.messages.length === 0) return;
  touch(conversation);
  render();
  generate(conversation);
}

function stopReply() {
  if (controller) controller.abort();
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  if ($("key").value) headers.Authorization = "Bearer " + $("key").value;
  return headers;
}

function chatMessages(system, messages) {
  const sent = messages.map(({ role, content }) => ({ role, content }));
  return system.trim() ? [{ role: "system", content: system }, ...sent] : sent;
}

async function generate(conversation) {
  clearNotice();
  const view = bubble("assistant");
  $("log").append(view.root);
  view.root.scrollIntoView();
  const turn = {
    text: "", sentAt: performance.now(), firstTokenAt: null, lastTokenAt: null,
    finishReason: null, usage: null, renderPending: false,
  };
  const ticking = showThinking(view, turn);
  controller = new AbortController();
  setBusy(true);
  let failure = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(), signal: controller.signal,
      body: JSON.stringify({
        model: model?.id, messages: chatMessages(conversation.system, conversation.messages),
        stream: true, stream_options: { include_usage: true }, ...samplingSettings(),
      }),
    });
    if (!response.ok) throw await responseError(response);
    const finished = await readEvents(response, (chunk) => onChunk(view, turn, chunk));
    // Only [DONE] says the reply is complete: a stream that just ends was cut off (the
    // server stopped, or something between dropped the connection).
    if (!finished) {
      throw new ChatError("The connection closed before the reply finished: did the server stop?");
    }
  } catch (error) {
    failure = error;
  }
  clearInterval(ticking);
  controller = null;
  setBusy(false);
  if (failure === null || failure.name === "AbortError") {
    keepReply(conversation, turn, failure !== null);
  } else {
    showFailure(conversation, view, turn, failure);
  }
}

// Until the first token: "thinking… 3 s", so a long prompt doesn't look like a hang.
function showThinking(view, turn) {
  const started = Date.now();
  const update = () => {
    if (turn.firstTokenAt !== null) return;
    const seconds = Math.floor((Date.now() - started) / 1000);
    view.content.replaceChildren(note("thinking", `thinking… ${seconds} s`));
  };
  update();
  return setInterval(update, 1000);
}

function onChunk(view, turn, chunk) {
  if (chunk.usage) turn.usage = chunk.usage;
  for (const choice of chunk.choices) {
    const text = choice.delta?.content;
    if (!text) continue;
    turn.firstTokenAt ??= performance.now();
    turn.lastTokenAt = performance.now();
    turn.text += text;
  }
  turn.finishReason = chunk.choices[0]?.finish_reason ?? turn.finishReason;
  if (turn.text) scheduleReply(view, turn);
}

// A reply is re-rendered at most once a frame: chunks can come faster than that.
function scheduleReply(view, turn) {
  if (turn.renderPending) return;
  turn.renderPending = true;
  requestAnimationFrame(() => {
    turn.renderPending = false;
    const log = $("log");
    const following = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    showReply(view.content, turn.text);
    if (following) log.scrollTop = log.scrollHeight; // else the user scrolled up to read
  });
}

// Server-Sent Events: events are separated by a blank line; a line "data: <json>" carries
// a chunk, and a line starting with ":" is a comment (the server's keep-alive probes).
// Returns whether the stream ended with "data: [DONE]".
async function readEvents(response, onChunk) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return true;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ChatError(chunk.error.message); // e.g. the server is stopping
        onChunk(chunk);
      }
    }
  }
}

// An error answer as a ChatError. The API answers JSON ({"error": {"message": ...}});
// anything else (a proxy's HTML error page) is shown as its status and its text.
async function responseError(response) {
  const body = await response.text();
  try {
    const { message, code } = JSON.parse(body).error;
    if (typeof message === "string") return new ChatError(message, response.status, code);
  } catch {
    // Not the API's JSON: described below.
  }
  const page = new DOMParser().parseFromString(body, "text/html");
  page.querySelectorAll("script, style").forEach((node) => node.remove());
  // "<h1>502</h1>nginx" is two words, not "502nginx".
  page.querySelectorAll("body *").forEach((node) => node.append(" "));
  const text = page.body.textContent.replace(/\s+/g, " ").trim().slice(0, 300);
  const status = `${response.status} ${response.statusText}`.trim();
  return new ChatError(`The server answered ${status}${text ? ": " + text : ""}`, response.status);
}

function keepReply(conversation, turn, stopped) {
  // A reply stopped before its first token leaves nothing to keep.
  if (turn.text) {
    const reply = { role: "assistant", content: turn.text, stats: replyStats(turn) };
    if (stopped) reply.stopped = true;
    if (turn.finishReason === "length") reply.truncated = true; // it would have gone on
    conversation.messages.push(reply);
  }
  touch(conversation);
  if (conversation.id === store.currentId) render();
}

function replyStats(turn) {
  const stats = {};
  if (turn.firstTokenAt !== null) stats.ttft = (turn.firstTokenAt - turn.sentAt) / 1000;
  const usage = turn.usage; // only a reply that ran to its end has one
  if (usage) {
    stats.completionTokens = usage.completion_tokens;
    stats.promptTokens = usage.prompt_tokens;
    stats.cachedTokens = usage.prompt_tokens_details?.cached_tokens;
    // Decode speed: the tokens after the first, over the time they took. The first
    // token's wait (prefill and queueing) is the separate time-to-first-token figure.
    const seconds = (turn.lastTokenAt - turn.firstTokenAt) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) {
      stats.tokensPerSecond = (usage.completion_tokens - 1) / seconds;
    }
  }
  return stats;
}

// The failed turn's bubble shows the error, what text had come, and what to do next;
// the history is left as it was (see the invariant at the top).
function showFailure(conversation, view, turn, error) {
  view.root.classList.add("failed");
  if (turn.text) showReply(view.content, turn.text); // as far as it got, for reading
  else view.content.replaceChildren();
  const retry = button("Retry", () => regenerate(conversation));
  const actions = element("span", { className: "actions" }, retry);
  if (error.overflow) {
    actions.prepend(button("Drop the oldest turns and retry", (event) => {
      event.target.disabled = true; // counting the tokens takes a moment: one click is enough
      dropOldestAndRetry(conversation, view);
    }));
  }
  const message = error.overflow
    ? `This conversation is too long for the model's context. ${error.message}`
    : error.message;
  view.meta.replaceChildren(element("p", { className: "error", textContent: message }), actions);
  if (error.status === 401) $("settings").open = true;
}

async function dropOldestAndRetry(conversation, view) {
  let dropped;
  try {
    dropped = await fitToContext(conversation);
  } catch (error) {
    showFailure(conversation, view, { text: "" }, error);
    return;
  }
  touch(conversation);
  render();
  generate(conversation);
  showNotice(`The ${dropped} oldest messages were dropped to fit the model's context.`);
}

// Drop the oldest exchanges (a user message and the replies to it) until the prompt leaves
// room for the reply: max tokens if set, else a quarter of the context. The server's
// /tokenize counts the prompt exactly as the chat route will. Returns how many went.
async function fitToContext(conversation) {
  let messages = conversation.messages;
  for (;;) {
    const { count, max_model_len: context } = await countTokens(conversation.system, messages);
    const reserve = samplingSettings().max_tokens ?? Math.floor(context / 4);
    if (count + reserve <= context) break;
    const nextExchange = messages.findIndex((message, i) => i > 0 && message.role === "user");
    if (nextExchange === -1) {
      throw new ChatError(`The last message (${count} tokens) and the reply's ${reserve} `
        + `tokens do not fit the model's ${context}-token context: shorten the message, or `
        + "lower Max tokens in Settings.");
    }
    messages = messages.slice(nextExchange);
  }
  const dropped = conversation.messages.length - messages.length;
  conversation.messages = messages;
  return dropped;
}

async function countTokens(system, messages) {
  const response = await fetch("/tokenize", {
    method: "POST", headers: requestHeaders(),
    body: JSON.stringify({ model: model?.id, messages: chatMessages(system, messages) }),
  });
  if (!response.ok) throw await responseError(response);
  return response.json();
}

// ---------------------------------------------------------------- the model
// Its id, context length and default temperature, shown (and changeable) in Settings.
async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: requestHeaders() });
    if (!response.ok) throw await responseError(response);
    model = (await response.json()).data[0];
  } catch (error) {
    const keyMissing = error.status === 401;
    showNotice(keyMissing ? "The server asks for an API key: enter it in Settings."
      : `Could not load the model's details: ${error.message}`);
    $("settings").open = keyMissing;
    return;
  }
  clearNotice();
  $("model").textContent = model.id;
  if ($("temperature").value === "") {
    $("temperature").value = model.sampling_defaults.temperature ?? 1;
  }
  $("max-tokens").placeholder = `up to ${model.max_model_len}`;
}

// ---------------------------------------------------------------- wiring
$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  // isComposing: Enter that confirms an input method's candidate (Chinese, Japanese) isn't a send.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", stopReply);
$("new-chat").addEventListener("click", () => {
  startNewChat();
  document.body.classList.remove("sidebar-open");
});
$("conversations").addEventListener("click", (event) => {
  if (event.target.closest(".open")) document.body.classList.remove("sidebar-open");
});
$("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
document.querySelector("main").addEventListener("click", (event) => {
  // On a narrow screen the conversations cover the page: a click beside them closes them.
  if (!event.target.closest("#toggle-sidebar")) document.body.classList.remove("sidebar-open");
});
$("system").addEventListener("input", () => {
  currentConversation().system = $("system").value;
  save();
});
$("temperature").addEventListener("change", saveSettings);
$("max-tokens").addEventListener("change", saveSettings);
$("key").addEventListener("change", () => {
  sessionStorage.setItem(API_KEY_KEY, $("key").value);
  loadModel();
});

// Another tab of this page changed the conversations: take its version, staying on this
// tab's conversation if it still exists. (Not while a reply streams here: its conversation
// would be lost. The next save here then wins.)
window.addEventListener("storage", (event) => {
  if (event.key !== STORE_KEY || controller) return;
  const shown = store.currentId;
  store = loadStore();
  if (store.conversations.some((c) => c.id === shown)) store.currentId = shown;
  render();
});

restoreSettings();
render();
loadModel();
