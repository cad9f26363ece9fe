// mmkv chat: one page over the server's own API (/v1/models, /v1/files, /v1/skills,
// /v1/chat/completions). Every text from the server or the user enters the DOM through
// textContent or an attribute, never as markup. Conversations live in this browser's localStorage.
"use strict";

const STORE = {conversations: "mmkv.conversations", apiKey: "mmkv.apiKey", settings: "mmkv.settings"};
const MAX_CONVERSATIONS = 50;  // the oldest beyond this are dropped: localStorage holds a few MB per origin

const $ = (id) => document.getElementById(id);

const state = {
  apiKey: localStorage.getItem(STORE.apiKey) || "",
  model: null,
  conversations: loadConversations(),
  currentId: null,
  attachments: [],  // {kind: "image"|"skill", id, name, status: "uploading"|"ready"|"error", error, preview}
  streaming: null,  // the AbortController of the answer being streamed
};

// ------------------------------------------------------------------ the API

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.param = error.param || null;
    this.code = error.code || null;
  }

  static async from(response) {
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON: the status says it */ }
    return new ApiError(response.status, body);
  }

  toJSON() {
    return {message: this.message, status: this.status, param: this.param, code: this.code};
  }
}

// An error the page itself found (no HTTP status, no param).
const clientError = (message) => new ApiError(null, {error: {message}});

async function api(path, {method = "GET", json, form, signal} = {}) {
  const headers = {};
  if (state.apiKey) headers.Authorization = `Bearer ${state.apiKey}`;
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form) {
    body = form;
  }
  const response = await fetch(path, {method, headers, body, signal});
  if (!response.ok) throw await ApiError.from(response);
  return response;
}

async function apiJSON(path, options) {
  return (await api(path, options)).json();
}

// One streamed completion: calls onText with each delta; returns the finish reason, the usage chunk
// and the mmkv report (the finishing chunk carries it). An error event mid-stream throws.
async function streamCompletion(body, onText, signal) {
  const response = await api("/v1/chat/completions", {method: "POST", json: body, signal});
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const out = {finish: null, usage: null, report: null};
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return out;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return out;
        readChunk(JSON.parse(data), out, onText);
      }
    }
  }
}

function readChunk(chunk, out, onText) {
  if (chunk.error) throw new ApiError(null, chunk);
  if (chunk.usage) out.usage = chunk.usage;
  if (chunk.mmkv) out.report = chunk.mmkv;
  for (const choice of chunk.choices || []) {
    if (choice.delta && choice.delta.content) onText(choice.delta.content);
    if (choice.finish_reason) out.finish = choice.finish_reason;
  }
}

// ------------------------------------------------------------------ conversations (localStorage)

// A stored value, or `fallback` where there is none or it does not parse (another page's, an old one).
function readJSON(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch (_) {
    return fallback;
  }
}

function loadConversations() {
  const stored = readJSON(STORE.conversations, []);
  const conversations = Array.isArray(stored) ? stored.filter((c) => c && Array.isArray(c.messages)) : [];
  for (const m of conversations.flatMap((c) => c.messages)) {
    if (m.pending) {  // the page was closed while this answer streamed
      delete m.pending;
      m.error = {message: "interrupted: the page was closed"};
    }
  }
  return conversations;
}

function saveConversations() {
  state.conversations.sort((a, b) => b.updated - a.updated);
  state.conversations.length = Math.min(state.conversations.length, MAX_CONVERSATIONS);
  for (;;) {
    try {
      localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
      return;
    } catch (e) {  // the origin's storage is full: the oldest conversations go first
      if (state.conversations.length <= 1) throw e;
      state.conversations.pop();
    }
  }
}

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function startConversation(title) {
  const conversation = {id: crypto.randomUUID(), title, updated: Date.now(), messages: []};
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  return conversation;
}

function titleOf(text, images) {
  const line = text.split("\n")[0].trim();
  if (line) return line.length > 48 ? `${line.slice(0, 47)}…` : line;
  return images.length ? images.map((i) => i.name).join(", ") : "New chat";
}

// The API's messages for stored ones: a user turn's images and skills as parts before its text;
// an answer that failed is left out (it said nothing).
function apiMessages(messages) {
  const out = [];
  for (const m of messages) {
    if (m.role === "assistant") {
      if (m.text) out.push({role: "assistant", content: m.text});
      continue;
    }
    const parts = [
      ...(m.images || []).map((i) => ({type: "image_file", image_file: {file_id: i.id}})),
      ...(m.skills || []).map((s) => ({type: "skill", skill_id: s.id})),
    ];
    if (!parts.length) out.push({role: "user", content: m.text});
    else out.push({role: "user", content: m.text ? [...parts, {type: "text", text: m.text}] : parts});
  }
  return out;
}

// ------------------------------------------------------------------ DOM helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

const number = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));

function errorBox(error) {
  const where = [error.status ? `HTTP ${error.status}` : null,
    error.param ? `param ${error.param}` : null, error.code].filter(Boolean).join(" · ");
  return el("div", {class: "error", role: "alert"},
    el("span", {class: "error-message", text: error.message}),
    where ? el("span", {class: "error-where", text: where}) : null);
}

// An upload's picture: its bytes fetched with the API key and shown through a blob: URL (an <img>
// cannot send the key). One fetch per id while the page is open.
const pictures = new Map();

function picture(fileId) {
  if (!pictures.has(fileId)) {
    pictures.set(fileId, api(`/v1/files/${encodeURIComponent(fileId)}/content`)
      .then((r) => r.blob()).then((b) => URL.createObjectURL(b))
      .catch((e) => { pictures.delete(fileId); throw e; }));
  }
  return pictures.get(fileId);
}

function forgetPicture(fileId) {
  const pending = pictures.get(fileId);
  pictures.delete(fileId);
  if (pending) pending.then(URL.revokeObjectURL, () => {});
}

function forgetPictures() {
  for (const fileId of [...pictures.keys()]) forgetPicture(fileId);
}

function thumbnail(fileId, name, className = "thumb") {
  const img = el("img", {class: className, alt: name, title: name});
  picture(fileId).then((url) => { img.src = url; },
    () => { img.replaceWith(el("span", {class: `${className} missing`, title: name, text: "deleted"})); });
  return img;
}

// ------------------------------------------------------------------ rendering

function renderConversationList() {
  const nav = $("conversations");
  nav.replaceChildren(...state.conversations.map((c) => el("div",
    {class: c.id === state.currentId ? "conversation active" : "conversation"},
    el("button", {class: "conversation-open", type: "button", title: c.title, text: c.title,
      onclick: () => openConversation(c.id)}),
    el("button", {class: "conversation-delete", type: "button", title: "Delete this conversation",
      "aria-label": `Delete ${c.title}`, text: "×", onclick: () => deleteConversation(c.id)}))));
}

function renderMessages() {
  const conversation = currentConversation();
  const messages = conversation ? conversation.messages : [];
  $("chat-title").textContent = conversation ? conversation.title : "New chat";
  $("empty").hidden = messages.length > 0;
  $("messages").replaceChildren(...messages.map((m, i) => renderMessage(m, i)));
  scrollToEnd();
}

function renderMessage(m, index) {
  return m.role === "user" ? renderUserMessage(m) : renderAnswer(m, index);
}

function renderUserMessage(m) {
  const images = (m.images || []).map((i) => thumbnail(i.id, i.name, "message-image"));
  const skills = (m.skills || []).map((s) => el("span", {class: "chip skill", text: `skill: ${s.name}`}));
  return el("div", {class: "message user"},
    images.length || skills.length ? el("div", {class: "message-media"}, ...images, ...skills) : null,
    m.text ? el("div", {class: "message-text", text: m.text}) : null);
}

function renderAnswer(m, index) {
  const node = el("div", {class: "message assistant", dataset: {index: String(index)}},
    el("div", {class: m.pending && !m.text ? "message-text typing" : "message-text", text: m.text}));
  if (m.error) node.append(errorBox(m.error));
  if (!m.pending && !m.error) node.append(reuseFigures(m, index));
  if (m.fidelity) node.append(fidelityResult(m.fidelity));
  return node;
}

function stat(name, value, label, hint) {
  return el("span", {class: "stat", title: hint, dataset: {stat: name, value: String(value ?? "")}},
    el("b", {text: number(value)}), ` ${label}`);
}

// What mmkv reused for this answer: the usage chunk's cached / prompt tokens and the mmkv report.
function reuseFigures(m, index) {
  const usage = m.usage || {};
  const report = m.report || {};
  const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  const prompt = usage.prompt_tokens;
  const share = prompt ? Math.round((100 * cached) / prompt) : 0;
  const fill = el("span", {class: "reuse-fill"});
  fill.style.width = `${share}%`;  // CSSOM, which the page's CSP allows (a style attribute it would not)
  const bar = el("span", {class: "reuse-bar", title: `${share}% of the prompt reused`}, fill);
  const figures = el("div", {class: "reuse"},
    el("span", {class: "stat cached", dataset: {stat: "cached_tokens", value: String(cached ?? "")},
      title: "usage.prompt_tokens_details.cached_tokens: prompt tokens whose KV existed before the request"},
    el("b", {text: number(cached)}), ` / ${number(prompt)} prompt tokens cached`, bar),
    stat("image_tokens_reused", report.image_tokens_reused, "image tokens reused", "image KV spliced from the cache"),
    stat("vision_tower_runs", report.vision_tower_runs, "vision runs", "vision-tower runs this request caused"),
    stat("lm_tokens_computed", report.lm_tokens_computed, "tokens computed",
      "prompt tokens the language model prefilled"),
    report.ttft_ms !== undefined ? el("span", {class: "stat", title: "arrival to first token, queue included",
      dataset: {stat: "ttft_ms", value: String(report.ttft_ms)}},
    el("b", {text: report.ttft_ms.toFixed(1)}), " ms TTFT") : null,
    report.skill_tokens_reused ? stat("skill_tokens_reused", report.skill_tokens_reused, "skill tokens reused") : null,
    el("button", {class: "button ghost small fidelity-button", type: "button",
      title: "Re-ask this turn with mmkv.fidelity: compare the fast path's first-token logits with a full recompute",
      text: "Fidelity check", onclick: (e) => fidelityCheck(index, e.currentTarget)}));
  if (!m.report) figures.append(el("span", {class: "note", text: "the stream carried no mmkv report"}));
  if (!m.usage) figures.append(el("span", {class: "note", text: "the stream carried no usage chunk"}));
  if (m.finish === "length") figures.append(el("span", {class: "note", text: "cut at max tokens"}));
  return figures;
}

function fidelityResult(fidelity) {
  if (fidelity.error) {
    return el("div", {class: "fidelity"}, el("span", {class: "fidelity-title", text: "Fidelity check"}),
      errorBox(fidelity.error));
  }
  const r = fidelity.result;
  return el("div", {class: "fidelity ok"},
    el("span", {class: "fidelity-title", text: "Fidelity vs full recompute"}),
    el("span", {class: "stat", dataset: {stat: "logit_cosine", value: String(r.logit_cosine)}},
      el("b", {text: r.logit_cosine.toFixed(6)}), " logit cosine"),
    el("span", {class: "stat", dataset: {stat: "max_abs_diff", value: String(r.max_abs_diff)}},
      el("b", {text: r.max_abs_diff.toExponential(2)}), " max |Δ logit|"),
    el("span", {class: r.same_argmax ? "stat good" : "stat bad",
      dataset: {stat: "same_argmax", value: String(r.same_argmax)}},
      el("b", {text: r.same_argmax ? "same" : "different"}), " first token"));
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((a) => {
    const media = a.kind === "skill" ? el("span", {class: "chip-icon", text: "S"})
      : a.status === "error" || !(a.preview || a.id) ? el("span", {class: "chip-icon", text: "!"})
        : a.preview ? el("img", {class: "chip-thumb", src: a.preview, alt: ""}) : thumbnail(a.id, a.name, "chip-thumb");
    const detail = a.status === "uploading" ? "uploading…" : a.status === "error" ? a.error.message
      : a.kind === "skill" ? `${number(a.tokens)} tokens` : `${number(a.tokens)} image tokens`;
    return el("div", {class: `chip attachment is-${a.status}`, dataset: {status: a.status}}, media,
      el("span", {class: "chip-name", text: a.name}), el("span", {class: "chip-detail", text: detail}),
      el("button", {class: "chip-remove", type: "button", title: "Remove", "aria-label": `Remove ${a.name}`,
        text: "×", onclick: () => removeAttachment(a)}));
  }));
  updateSendButton();
}

function updateSendButton() {
  const send = $("send");
  send.textContent = state.streaming ? "Stop" : "Send";
  send.disabled = !state.streaming && (!state.model || state.attachments.some((a) => a.status === "uploading"));
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setStatus(text, kind) {
  const status = $("server-status");
  status.className = `server-status ${kind}`;
  status.textContent = text;
}

// ------------------------------------------------------------------ actions

function openConversation(id) {
  if (state.streaming) return;
  state.currentId = id;
  renderConversationList();
  renderMessages();
}

function deleteConversation(id) {
  if (state.streaming && id === state.currentId) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveConversations();
  renderConversationList();
  renderMessages();
}

async function connect() {
  try {
    const models = await apiJSON("/v1/models");
    state.model = models.data.length ? models.data[0].id : null;
    $("model-name").textContent = state.model || "";
    setStatus(state.model ? `Connected · ${state.model}` : "The server lists no model", state.model ? "ok" : "bad");
    await refreshPanel();
  } catch (e) {
    state.model = null;
    $("model-name").textContent = "";
    setStatus(e.status === 401 ? "This server needs an API key" : `Not connected: ${e.message}`, "bad");
    if (e.status === 401) $("api-key").focus();
  }
  updateSendButton();
}

async function refreshPanel() {
  const [uploads, skills] = await Promise.allSettled([apiJSON("/v1/files"), apiJSON("/v1/skills")]);
  renderItems($("uploads"), uploads, "No uploads yet", uploadItem);
  renderItems($("skills"), skills, "No skills (POST /v1/skills)", skillItem);
}

function renderItems(list, settled, emptyText, itemOf) {
  if (settled.status === "rejected") list.replaceChildren(el("li", {class: "items-note"}, errorBox(settled.reason)));
  else if (!settled.value.data.length) list.replaceChildren(el("li", {class: "items-note", text: emptyText}));
  else list.replaceChildren(...settled.value.data.map(itemOf));
}

function uploadItem(f) {
  return el("li", {class: "item", dataset: {fileId: f.id}},
    thumbnail(f.id, f.filename, "item-thumb"),
    el("div", {class: "item-body"},
      el("span", {class: "item-name", title: f.id, text: f.filename}),
      el("span", {class: "item-meta", title: kilobytes(f.bytes),
        text: `${f.width}×${f.height} · ${number(f.image_tokens)} image tokens`})),
    el("div", {class: "item-actions"},
      el("button", {class: "button ghost small", type: "button", text: "Attach", title: "Add to the next message",
        onclick: () => attach({kind: "image", id: f.id, name: f.filename, tokens: f.image_tokens})}),
      el("button", {class: "button danger small item-delete", type: "button", text: "Delete",
        title: "Delete the upload and its cached KV",
        onclick: (e) => deleteItem(`/v1/files/${encodeURIComponent(f.id)}`, e.currentTarget, f.id)})));
}

function skillItem(s) {
  return el("li", {class: "item", dataset: {skillId: s.id}},
    el("span", {class: "item-thumb skill-mark", text: "S"}),
    el("div", {class: "item-body"},
      el("span", {class: "item-name", title: s.id, text: s.name}),
      el("span", {class: "item-meta", text: `${number(s.tokens)} tokens · ${s.id}`})),
    el("div", {class: "item-actions"},
      el("button", {class: "button ghost small", type: "button", text: "Attach", title: "Splice into the next message",
        onclick: () => attach({kind: "skill", id: s.id, name: s.name, tokens: s.tokens})}),
      el("button", {class: "button danger small item-delete", type: "button", text: "Delete",
        title: "Delete the skill and its cached KV",
        onclick: (e) => deleteItem(`/v1/skills/${encodeURIComponent(s.id)}`, e.currentTarget)})));
}

const kilobytes = (n) => (n < 1024 ? `${n} B` : `${(n / 1024).toFixed(1)} KB`);

async function deleteItem(path, button, fileId) {
  button.disabled = true;
  try {
    await api(path, {method: "DELETE"});
    if (fileId) forgetPicture(fileId);
  } catch (e) {
    button.closest("li").append(errorBox(e));
    button.disabled = false;
    return;
  }
  await refreshPanel();
}

function attach(attachment) {
  if (state.attachments.some((a) => a.kind === attachment.kind && a.id === attachment.id)) return;
  state.attachments.push({...attachment, status: "ready"});
  renderAttachments();
}

function removeAttachment(attachment) {
  state.attachments = state.attachments.filter((a) => a !== attachment);
  if (attachment.preview) URL.revokeObjectURL(attachment.preview);
  renderAttachments();
}

// Uploads each image once (POST /v1/files); the message then names it by id.
async function addFiles(fileList) {
  const uploads = [...fileList].map((file) => uploadOne(file));
  await Promise.all(uploads);
  await refreshPanel().catch(() => {});
}

async function uploadOne(file) {
  const attachment = {kind: "image", id: null, name: file.name || "pasted image", status: "uploading",
    preview: file.type.startsWith("image/") ? URL.createObjectURL(file) : null};
  state.attachments.push(attachment);
  renderAttachments();
  try {
    if (!file.type.startsWith("image/")) {
      throw clientError(`${file.type || "this file"} is not an image; only images are supported`);
    }
    const form = new FormData();
    form.append("purpose", "vision");
    form.append("file", file, attachment.name);
    const uploaded = await apiJSON("/v1/files", {method: "POST", form});
    Object.assign(attachment, {id: uploaded.id, tokens: uploaded.image_tokens, status: "ready"});
    if (state.attachments.some((a) => a !== attachment && a.kind === "image" && a.id === uploaded.id)) {
      removeAttachment(attachment);  // the same bytes are already attached (same content, same id)
    }
  } catch (e) {
    Object.assign(attachment, {status: "error", error: e instanceof ApiError ? e : clientError(String(e))});
  }
  renderAttachments();
}

function settings() {
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  return {max_tokens: maxTokens > 0 ? maxTokens : 256,
    temperature: temperature >= 0 && temperature <= 2 ? temperature : 0};
}

async function send() {
  if (state.streaming) {
    state.streaming.abort();
    return;
  }
  const text = $("prompt").value.trim();
  const ready = state.attachments.filter((a) => a.status === "ready");
  if (!state.model || (!text && !ready.length) || state.attachments.some((a) => a.status === "uploading")) return;
  const images = ready.filter((a) => a.kind === "image").map((a) => ({id: a.id, name: a.name}));
  const skills = ready.filter((a) => a.kind === "skill").map((a) => ({id: a.id, name: a.name}));
  const conversation = currentConversation() || startConversation(titleOf(text, images));
  conversation.messages.push({role: "user", text, images, skills});
  const answer = {role: "assistant", text: "", pending: true};
  conversation.messages.push(answer);
  conversation.updated = Date.now();
  $("prompt").value = "";
  resizePrompt();
  state.attachments.filter((a) => a.status !== "uploading").forEach((a) => a.preview && URL.revokeObjectURL(a.preview));
  state.attachments = [];
  saveConversations();
  renderAttachments();
  renderConversationList();
  renderMessages();
  await streamAnswer(conversation, answer);
}

async function streamAnswer(conversation, answer) {
  const index = conversation.messages.indexOf(answer);
  const textNode = () => $("messages").querySelector(`[data-index="${index}"] .message-text`);
  state.streaming = new AbortController();
  updateSendButton();
  try {
    const body = {model: state.model, messages: apiMessages(conversation.messages.slice(0, index)), stream: true,
      stream_options: {include_usage: true}, ...settings()};
    const result = await streamCompletion(body, (delta) => {
      answer.text += delta;
      const node = textNode();
      if (node) { node.textContent = answer.text; node.classList.remove("typing"); scrollToEnd(); }
    }, state.streaming.signal);
    Object.assign(answer, result);
  } catch (e) {
    answer.error = e.name === "AbortError" ? {message: "stopped"} : errorJSON(e);
  } finally {
    delete answer.pending;
    state.streaming = null;
    conversation.updated = Date.now();
    saveConversations();
    if (state.currentId === conversation.id) renderMessages();
    updateSendButton();
  }
}

const errorJSON = (e) => (e instanceof ApiError ? e.toJSON() : {message: String(e.message || e)});

// Re-asks the turn this answer replied to, with mmkv.fidelity and one token: the server reports how
// far the reused KV's first next-token logits are from a full recompute's (or refuses, and says why).
async function fidelityCheck(index, button) {
  const conversation = currentConversation();
  const answer = conversation.messages[index];
  button.disabled = true;
  button.textContent = "Checking…";
  try {
    const reply = await apiJSON("/v1/chat/completions", {method: "POST", json: {
      model: state.model, messages: apiMessages(conversation.messages.slice(0, index)), max_tokens: 1,
      temperature: 0, mmkv: {fidelity: true}}});
    answer.fidelity = reply.mmkv && reply.mmkv.fidelity ? {result: reply.mmkv.fidelity}
      : {error: {message: "the server answered without a fidelity report"}};
  } catch (e) {
    answer.fidelity = {error: errorJSON(e)};
  }
  saveConversations();
  if (state.currentId === conversation.id) renderMessages();
}

function resizePrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 200)}px`;
}

// ------------------------------------------------------------------ wiring

function wireDragAndDrop() {
  const overlay = $("drop-overlay");
  let depth = 0;  // dragenter / dragleave fire for every child crossed
  const hasFiles = (e) => e.dataTransfer && [...e.dataTransfer.types].includes("Files");
  window.addEventListener("dragenter", (e) => { if (hasFiles(e)) { depth += 1; overlay.hidden = false; } });
  window.addEventListener("dragleave", () => { depth = Math.max(0, depth - 1); if (!depth) overlay.hidden = true; });
  window.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
  window.addEventListener("drop", (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    depth = 0;
    overlay.hidden = true;
    addFiles(e.dataTransfer.files);
  });
}

function wire() {
  $("api-key").value = state.apiKey;
  $("api-key").addEventListener("change", (e) => {
    state.apiKey = e.target.value.trim();
    localStorage.setItem(STORE.apiKey, state.apiKey);
    forgetPictures();
    connect();
  });
  const saved = readJSON(STORE.settings, {});
  for (const id of ["max-tokens", "temperature"]) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", () => {
      localStorage.setItem(STORE.settings, JSON.stringify({"max-tokens": $("max-tokens").value,
        temperature: $("temperature").value}));
    });
  }
  $("new-chat").addEventListener("click", () => openConversation(null));
  $("refresh").addEventListener("click", () => refreshPanel());
  $("file-input").addEventListener("change", (e) => { addFiles(e.target.files); e.target.value = ""; });
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("input", resizePrompt);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      if (!state.streaming) send();  // only the button stops an answer
    }
  });
  $("prompt").addEventListener("paste", (e) => {
    const files = [...e.clipboardData.files].filter((f) => f.type.startsWith("image/"));
    if (files.length) { e.preventDefault(); addFiles(files); }
  });
  wireDragAndDrop();
}

wire();
renderConversationList();
renderMessages();
renderAttachments();
connect();
