// localllm's web page: chat and model manager over the server's public API only (Ollama's /api/*, plus
// /api/chats and /api/catalog). No framework, no build step.
import { render } from "./md.js";

const $ = (sel) => document.querySelector(sel);
const el = (tag, props = {}, ...kids) => {
  const e = Object.assign(document.createElement(tag), props);
  for (const k of kids) e.append(k);
  return e;
};
const TOKEN_KEY = "localllm-token";
const PAINT_EVERY_MS = 100;  // while an answer streams

// ------------------------------------------------------------------------------------------------ API

let tokenAsked = null;
function askToken() {
  if (!tokenAsked) {
    tokenAsked = new Promise((resolve) => {
      const d = $("#token-dialog");
      const done = () => {
        const t = $("#token").value.trim();
        if (!t) return;
        sessionStorage.setItem(TOKEN_KEY, t);
        d.close();
        tokenAsked = null;
        resolve();
      };
      $("#token-ok").onclick = done;
      $("#token").onkeydown = (e) => { if (e.key === "Enter") done(); };
      d.oncancel = (e) => e.preventDefault();
      d.showModal();
      $("#token").focus();
    });
  }
  return tokenAsked;
}

async function api(path, { method = "GET", body, signal, raw = false } = {}) {
  for (;;) {
    const headers = {};
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const r = await fetch(path, { method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body) });
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      await askToken();
      continue;
    }
    if (!r.ok) {
      let msg = `${r.status} ${r.statusText}`;
      try { msg = (await r.json()).error || msg; } catch { /* not JSON */ }
      throw new Error(msg);
    }
    if (raw) return r;
    const text = await r.text();
    return text ? JSON.parse(text) : null;
  }
}

// NDJSON lines of a streamed response, as objects
async function* lines(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) yield JSON.parse(line);
    }
  }
  if (buf.trim()) yield JSON.parse(buf);
}

function notice(text, kind = "error") {
  const n = $("#notice");
  n.textContent = text;
  n.className = `notice ${kind}`;
  n.hidden = !text;
}

const human = (n) => {
  if (!n) return "";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${u[i]}`;
};

// ------------------------------------------------------------------------------------------------ state

const state = {
  models: [],          // /api/tags
  caps: new Map(),     // model -> capabilities (/api/show)
  chat: null,          // the open conversation: {id, title, model, system, params, head, messages: Map}
  generating: null,    // AbortController of the answer being generated
  attachments: [],     // {name, kind: "image"|"audio", data (base64), url}
};

function pathTo(head) {
  const out = [];
  let id = head;
  while (id != null && state.chat.messages.has(id)) {
    const m = state.chat.messages.get(id);
    out.unshift(m);
    id = m.parent;
  }
  return out;
}
const children = (parent) => [...state.chat.messages.values()].filter((m) => m.parent === parent);
function leafOf(id) {  // the newest branch under a message
  for (;;) {
    const kids = children(id);
    if (!kids.length) return id;
    id = kids[kids.length - 1].id;
  }
}

// ------------------------------------------------------------------------------------------------ models

async function capabilities(model) {
  if (!state.caps.has(model)) {
    try {
      state.caps.set(model, (await api("/api/show", { method: "POST", body: { model } })).capabilities || []);
    } catch { state.caps.set(model, []); }
  }
  return state.caps.get(model);
}

async function loadModels() {
  const tags = await api("/api/tags");
  state.models = tags.models;
  const sel = $("#model");
  const current = sel.value || localStorage.getItem("localllm-model") || "";
  sel.replaceChildren(...state.models.map((m) => el("option", { value: m.name, textContent: m.name })));
  if (!state.models.length) sel.append(el("option", { value: "", textContent: "(no model: pull one)" }));
  if (state.models.some((m) => m.name === current)) sel.value = current;
  await modelChanged();
}

async function modelChanged() {
  const model = $("#model").value;
  if (model) localStorage.setItem("localllm-model", model);
  const caps = model ? await capabilities(model) : [];
  const accept = ["text/*", ".md", ".json", ".py", ".js", ".ts", ".csv", ".yaml", ".toml", ".c", ".rs", ".go"];
  if (caps.includes("vision")) accept.push("image/*");
  if (caps.includes("audio")) accept.push("audio/*");
  $("#file").accept = accept.join(",");
  $("#think-label").hidden = !caps.includes("thinking");
}

// ------------------------------------------------------------------------------------------------ conversations

async function loadChats() {
  const q = $("#search").value;
  const { chats } = await api(`/api/chats?q=${encodeURIComponent(q)}`);
  $("#chats").replaceChildren(...chats.map((c) => {
    const li = el("li", { textContent: c.title, title: c.title });
    li.dataset.id = c.id;
    if (state.chat && state.chat.id === c.id) li.classList.add("active");
    li.onclick = () => { openChat(c.id); $("#sidebar").classList.remove("open"); };
    return li;
  }));
}

async function openChat(id) {
  const c = await api(`/api/chats/${id}`);
  state.chat = { ...c, messages: new Map(c.messages.map((m) => [m.id, m])) };
  if (c.model && state.models.some((m) => m.name === c.model)) { $("#model").value = c.model; await modelChanged(); }
  showSettings();
  renderChat();
  loadChats();
}

function newChat() {
  if (state.generating) return;
  state.chat = null;
  showSettings();
  renderChat();
  loadChats();
  $("#prompt").focus();
}

async function ensureChat(firstPrompt) {
  if (state.chat) return state.chat;
  const title = firstPrompt.split("\n")[0].slice(0, 60) || "New chat";
  const c = await api("/api/chats", { method: "POST", body: { title, model: $("#model").value, system: $("#system").value, params: readParams() } });
  state.chat = { ...c, messages: new Map() };
  showSettings();
  loadChats();
  return state.chat;
}

function readParams() {
  const p = {};
  for (const k of ["temperature", "num_ctx", "seed"]) {
    const v = $(`#${k}`).value;
    if (v !== "") p[k] = Number(v);
  }
  if ($("#think").value) p.think = $("#think").value;
  return p;
}

function showSettings() {
  const c = state.chat;
  $("#system").value = c ? c.system || "" : "";
  for (const k of ["temperature", "num_ctx", "seed"]) $(`#${k}`).value = c && c.params[k] != null ? c.params[k] : "";
  $("#think").value = c && c.params.think != null ? String(c.params.think) : "";
  $("#chat-title").textContent = c ? c.title : "New chat";
  for (const b of ["#rename", "#export-json", "#export-md", "#delete-chat"]) $(b).disabled = !c;
}

async function saveSettings() {
  if (!state.chat) return;
  const c = await api(`/api/chats/${state.chat.id}`, { method: "POST", body: { system: $("#system").value, params: readParams() } });
  Object.assign(state.chat, { system: c.system, params: c.params });
}

// ------------------------------------------------------------------------------------------------ rendering

function figures(s) {
  if (!s) return "";
  const parts = [];
  if (s.eval_count != null) parts.push(`${s.eval_count} tokens`);
  if (s.tokens_per_second) parts.push(`${s.tokens_per_second.toFixed(1)} tok/s`);
  if (s.ttft_ms != null) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.prompt_eval_count != null) parts.push(`prompt ${s.prompt_eval_count} (${s.prompt_cached_count || 0} cached)`);
  if (s.model) parts.push(s.model);
  if (s.cancelled) parts.push("stopped");
  return parts.join(" · ");
}

function messageView(m) {
  const box = el("div", { className: `msg ${m.role}` });
  box.dataset.id = m.id ?? "";
  const role = el("div", { className: "role", textContent: m.role === "user" ? "You" : "Assistant" });
  box.append(role);
  if (m.thinking) box.append(el("details", { className: "thinking" }, el("summary", { textContent: "Thinking" }), m.thinking));
  const content = el("div", { className: "content" });
  if (m.role === "user") content.textContent = m.content;
  else content.innerHTML = render(m.content);
  box.append(content);
  for (const img of m.images || []) {
    if (img.format && ["WAV", "MP3", "FLAC"].includes(img.format)) box.append(el("span", { className: "chip", textContent: `audio: ${img.name}` }));
    else box.append(el("span", { className: "chip", textContent: `image: ${img.name}` }));
  }
  if (m.role === "assistant") box.append(el("div", { className: "figures", textContent: figures(m.stats) }));
  if (m.id != null) {
    const actions = el("div", { className: "actions" });
    const sibs = children(m.parent).filter((s) => s.role === m.role);
    if (sibs.length > 1) {
      const i = sibs.findIndex((s) => s.id === m.id);
      const prev = el("button", { className: "branch-prev", textContent: "‹", title: "Previous branch", disabled: i === 0 });
      const next = el("button", { className: "branch-next", textContent: "›", title: "Next branch", disabled: i === sibs.length - 1 });
      prev.onclick = () => switchBranch(sibs[i - 1].id);
      next.onclick = () => switchBranch(sibs[i + 1].id);
      actions.append(prev, el("span", { className: "branch", textContent: `${i + 1}/${sibs.length}` }), next);
    }
    const copy = el("button", { textContent: "Copy", title: "Copy this message" });
    copy.onclick = () => copyText(m.content, copy);
    actions.append(copy);
    if (m.role === "user") {
      const edit = el("button", { className: "edit-btn", textContent: "Edit", title: "Edit and send again (a new branch)" });
      edit.onclick = () => startEdit(box, m);
      actions.append(edit);
    } else {
      const regen = el("button", { className: "regen", textContent: "Regenerate", title: "Answer again (a new branch)" });
      regen.onclick = () => regenerate(m);
      actions.append(regen);
    }
    box.append(actions);
  }
  return box;
}

function renderChat() {
  const box = $("#messages");
  if (!state.chat || state.chat.head == null) {
    box.replaceChildren(el("p", { className: "empty", textContent: "Ask anything. Enter sends, Shift+Enter starts a new line." }));
    return;
  }
  box.replaceChildren(...pathTo(state.chat.head).map(messageView));
  box.scrollTop = box.scrollHeight;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

async function switchBranch(id) {
  const head = leafOf(id);
  const c = await api(`/api/chats/${state.chat.id}`, { method: "POST", body: { head } });
  state.chat.head = c.head;
  renderChat();
}

function startEdit(box, m) {
  if (state.generating) return;
  const area = el("textarea", { className: "edit", value: m.content, rows: 3 });
  const save = el("button", { className: "primary save-edit", textContent: "Send" });
  const cancel = el("button", { textContent: "Cancel" });
  const content = box.querySelector(".content");
  content.replaceChildren(area, el("div", { className: "row" }, save, cancel));
  area.focus();
  cancel.onclick = renderChat;
  const go = async () => {
    const text = area.value.trim();
    if (!text) return;
    const user = await addMessage({ role: "user", content: text, parent: m.parent, images: await reattach(m) });
    renderChat();
    await answer(user.id);
  };
  save.onclick = go;
  area.onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); go(); } };
}

async function reattach(m) {  // the images of an edited message go with its new version
  const out = [];
  for (const img of m.images || []) out.push({ name: img.name, data: await imageData(img.sha256) });
  return out;
}

async function addMessage(body) {
  const msg = await api(`/api/chats/${state.chat.id}/messages`, { method: "POST", body });
  state.chat.messages.set(msg.id, msg);
  state.chat.head = msg.id;
  return msg;
}

async function regenerate(m) {
  if (state.generating) return;
  await answer(m.parent);
}

const imageCache = new Map();
async function imageData(sha) {
  if (!imageCache.has(sha)) {
    const r = await api(`/api/chats/images/${sha}`, { raw: true });
    const bytes = new Uint8Array(await r.arrayBuffer());
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    imageCache.set(sha, btoa(s));
  }
  return imageCache.get(sha);
}

// ------------------------------------------------------------------------------------------------ generation

async function send() {
  const prompt = $("#prompt").value;
  if (state.generating || (!prompt.trim() && !state.attachments.length)) return;
  const model = $("#model").value;
  if (!model) { notice("Pull a model first (Models)."); return; }
  const caps = await capabilities(model);
  for (const a of state.attachments) {
    const need = a.kind === "image" ? "vision" : "audio";
    if (!caps.includes(need)) {
      notice(`${model} cannot take ${a.kind === "image" ? "images" : "audio"}: remove ${a.name} or pick a model with ${need}.`);
      return;
    }
  }
  notice("");
  await ensureChat(prompt);
  let content = prompt;
  for (const a of state.attachments.filter((x) => x.kind === "text")) content += `\n\n${a.name}:\n\`\`\`\n${a.text}\n\`\`\``;
  const images = state.attachments.filter((x) => x.kind !== "text").map((a) => ({ name: a.name, data: a.data }));
  for (const a of state.attachments.filter((x) => x.kind !== "text")) imageCache.set(a.sha, a.data);
  const user = await addMessage({ role: "user", content, images });
  $("#prompt").value = "";
  state.attachments = [];
  renderAttachments();
  renderChat();
  await answer(user.id);
}

async function answer(parentId) {
  const chat = state.chat;
  const model = $("#model").value;
  const history = pathTo(parentId);
  const messages = [];
  if ($("#system").value.trim()) messages.push({ role: "system", content: $("#system").value });
  for (const m of history) {
    const out = { role: m.role, content: m.content };
    if (m.images && m.images.length) out.images = await Promise.all(m.images.map((i) => imageData(i.sha256)));
    messages.push(out);
  }
  const params = readParams();
  const options = {};
  for (const k of ["temperature", "num_ctx", "seed"]) if (params[k] != null) options[k] = params[k];
  const body = { model, messages, stream: true, options };
  if (params.think != null && $("#think-label").hidden === false) {
    body.think = params.think === "true" ? true : params.think === "false" ? false : params.think;
  }
  if (chat.model !== model) { chat.model = model; api(`/api/chats/${chat.id}`, { method: "POST", body: { model } }); }

  // the answer's view, before its message exists
  state.chat.head = parentId;
  renderChat();
  const live = { role: "assistant", content: "", thinking: "", images: [] };
  const view = messageView(live);
  view.classList.add("live");
  const contentEl = view.querySelector(".content");
  const thinkBox = el("details", { className: "thinking" }, el("summary", { textContent: "Thinking…" }));
  const thinkText = document.createTextNode("");
  thinkBox.append(thinkText);
  $("#messages").append(view);

  const ctrl = new AbortController();
  state.generating = ctrl;
  $("#send").hidden = true;
  $("#stop").hidden = false;
  const t0 = performance.now();
  let ttft = null, done = null, cancelled = false, pending = false, lastPaint = 0;
  const paint = () => {
    pending = false;
    lastPaint = performance.now();
    contentEl.innerHTML = render(live.content);
    thinkText.data = live.thinking;
    const box = $("#messages");
    if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  };
  try {
    const r = await api("/api/chat", { method: "POST", body, signal: ctrl.signal, raw: true });
    for await (const line of lines(r)) {
      if (line.error) throw new Error(line.error);
      if (line.message) {
        if (line.message.content || line.message.thinking) ttft ??= performance.now() - t0;
        if (line.message.thinking) {
          if (!thinkBox.isConnected) view.insertBefore(thinkBox, contentEl);
          live.thinking += line.message.thinking;
        }
        live.content += line.message.content || "";
      }
      if (line.done) done = line;
      if (!pending) {  // the first token at once, then at most ~10 repaints a second (decoding keeps the CPU)
        pending = true;
        const wait = lastPaint ? Math.max(0, PAINT_EVERY_MS - (performance.now() - lastPaint)) : 0;
        setTimeout(() => requestAnimationFrame(paint), wait);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") cancelled = true;
    else notice(`The answer failed: ${e.message}`);
  } finally {
    state.generating = null;
    $("#send").hidden = false;
    $("#stop").hidden = true;
  }
  paint();
  if (!live.content && !live.thinking && !done) { view.remove(); state.chat.head = parentId; renderChat(); return; }
  const stats = { model };
  if (ttft != null) stats.ttft_ms = ttft;
  if (done) {
    for (const k of ["eval_count", "eval_duration", "prompt_eval_count", "prompt_eval_duration", "prompt_cached_count", "total_duration", "load_duration"]) {
      if (done[k] != null) stats[k] = done[k];
    }
    if (done.eval_duration) stats.tokens_per_second = done.eval_count / done.eval_duration * 1e9;
    stats.done_reason = done.done_reason;
  }
  if (cancelled) stats.cancelled = true;
  // saved in its conversation even when the user has moved to another one meanwhile
  const msg = await api(`/api/chats/${chat.id}/messages`, { method: "POST", body: { role: "assistant", content: live.content, thinking: live.thinking || null, stats, parent: parentId } });
  chat.messages.set(msg.id, msg);
  chat.head = msg.id;
  if (state.chat === chat) renderChat();
  loadChats();
}

function stop() {
  if (state.generating) state.generating.abort();
}

// ------------------------------------------------------------------------------------------------ attachments

function renderAttachments() {
  $("#attachments").replaceChildren(...state.attachments.map((a, i) => {
    const x = el("button", { textContent: "×", title: `Remove ${a.name}` });
    x.onclick = () => { state.attachments.splice(i, 1); renderAttachments(); };
    return el("span", { className: "chip" }, `${a.kind}: ${a.name}`, x);
  }));
}

async function sha256(buf) {
  const d = await crypto.subtle.digest("SHA-256", buf);
  return [...new Uint8Array(d)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

async function attach(files) {
  const model = $("#model").value;
  const caps = model ? await capabilities(model) : [];
  for (const f of files) {
    const kind = f.type.startsWith("image/") ? "image" : f.type.startsWith("audio/") ? "audio" : "text";
    if (kind !== "text") {
      const need = kind === "image" ? "vision" : "audio";
      if (!caps.includes(need)) {
        notice(`${model || "This model"} cannot take ${kind === "image" ? "images" : "audio"} (no ${need} capability): ${f.name} was not attached.`);
        continue;
      }
      const buf = await f.arrayBuffer();
      const bytes = new Uint8Array(buf);
      let s = "";
      for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
      state.attachments.push({ name: f.name, kind, data: btoa(s), sha: await sha256(buf) });
    } else {
      if (f.size > 1_000_000) { notice(`${f.name} is over 1 MB: too long to paste as context.`); continue; }
      state.attachments.push({ name: f.name, kind, text: await f.text() });
    }
  }
  renderAttachments();
}

// ------------------------------------------------------------------------------------------------ model manager

function row(cells, tag = "td") {
  return el("tr", {}, ...cells.map((c) => {
    const td = el(tag);
    if (c instanceof Node) td.append(c);
    else td.textContent = c ?? "";
    return td;
  }));
}
function button(text, onclick, cls = "small") {
  const b = el("button", { textContent: text, className: cls });
  b.onclick = onclick;
  return b;
}

async function loadManager() {
  const [tags, ps] = await Promise.all([api("/api/tags"), api("/api/ps")]);
  $("#loaded").replaceChildren(row(["Name", "Memory", "Context", "Slots", "Drafting", "Until", ""], "th"),
    ...ps.models.map((m) => row([m.name, human(m.size), m.context_length,
      m.slots != null ? `${m.slots_busy}/${m.slots} busy` : "", m.drafting || "-", new Date(m.expires_at).toLocaleTimeString(),
      button("Unload", async () => { await api("/api/generate", { method: "POST", body: { model: m.name, keep_alive: 0 } }); loadManager(); })])));
  if (!ps.models.length) { const r = row(["Nothing loaded."]); r.firstChild.colSpan = 7; $("#loaded").append(r); }
  const infos = await Promise.all(tags.models.map((m) => capabilities(m.name)));
  $("#installed").replaceChildren(row(["Name", "Size", "Format", "Quant", "Capabilities", "Kind", ""], "th"),
    ...tags.models.map((m, i) => {
      const caps = infos[i];
      const kind = caps.includes("embedding") && !caps.includes("completion") ? "embedding" : caps.includes("rerank") ? "rerank" : "chat";
      const tr = row([m.name, human(m.size), m.details?.format || "", m.details?.quantization_level || "", caps.join(", "), kind,
        button("Delete", () => deleteModel(m.name), "small danger")]);
      tr.dataset.model = m.name;
      return tr;
    }));
  try {
    const cat = await api("/api/catalog");
    $("#catalog").replaceChildren(row(["Name", "Family", "Size", "Capabilities", "MoE", "Fit", ""], "th"),
      ...cat.models.map((c) => {
        const fit = el("span", { textContent: c.fit.text, className: c.fit.verdict === "too_big" ? "fit-no" : c.fit.verdict === "gpu" || c.fit.verdict === "cpu" ? "fit-fits" : "fit-tight" });
        return row([c.name, c.family, human(c.size), (c.capabilities || []).join(", "), c.moe || "", fit,
          c.installed ? "installed" : button("Pull", () => { $("#pull-name").value = c.name; pull(); })]);
      }));
  } catch (e) {
    $("#catalog").replaceChildren(row([`No catalog from this server (${e.message}).`]));
  }
}

async function deleteModel(name) {
  if (!confirm(`Delete ${name}? Its files are removed.`)) return;
  await api("/api/delete", { method: "DELETE", body: { model: name } });
  state.caps.delete(name);
  await Promise.all([loadManager(), loadModels()]);
}

let pulling = null;
async function pull() {
  const name = $("#pull-name").value.trim();
  if (!name || pulling) return;
  pulling = new AbortController();
  $("#pull").disabled = true;
  $("#pull-cancel").hidden = false;
  $("#pull-status").hidden = false;
  const bar = $("#pull-progress"), text = $("#pull-text");
  bar.removeAttribute("value");
  text.textContent = "starting";
  try {
    const r = await api("/api/pull", { method: "POST", body: { model: name, stream: true }, signal: pulling.signal, raw: true });
    for await (const line of lines(r)) {
      if (line.error) throw new Error(line.error);
      if (line.total) {
        bar.max = line.total;
        bar.value = line.completed || 0;
        text.textContent = `${line.status}: ${human(line.completed || 0)} of ${human(line.total)} (${Math.floor(100 * (line.completed || 0) / line.total)}%)`;
      } else text.textContent = line.status;
      if (line.status === "success") { bar.max = 1; bar.value = 1; }
    }
    notice(`${name} is installed.`, "info");
    await Promise.all([loadManager(), loadModels()]);
  } catch (e) {
    text.textContent = e.name === "AbortError" ? "cancelled (pull again to resume)" : `failed: ${e.message}`;
  } finally {
    pulling = null;
    $("#pull").disabled = false;
    $("#pull-cancel").hidden = true;
  }
}

// ------------------------------------------------------------------------------------------------ export

async function exportChat(format) {
  const r = await api(`/api/chats/${state.chat.id}/export?format=${format}`, { raw: true });
  const blob = await r.blob();
  const name = (r.headers.get("Content-Disposition") || "").match(/filename="([^"]+)"/)?.[1] || `chat.${format}`;
  const a = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ------------------------------------------------------------------------------------------------ wiring

function showView(name) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === name);
  $("#view-chat").hidden = name !== "chat";
  $("#view-models").hidden = name !== "models";
  if (name === "models") loadManager().catch((e) => notice(e.message));
}

function applyTheme(t) {
  if (t) document.documentElement.dataset.theme = t;
  else delete document.documentElement.dataset.theme;
}

function wire() {
  applyTheme(localStorage.getItem("localllm-theme"));
  $("#theme").onclick = () => {
    const dark = document.documentElement.dataset.theme ? document.documentElement.dataset.theme === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
    const t = dark ? "light" : "dark";
    localStorage.setItem("localllm-theme", t);
    applyTheme(t);
  };
  for (const t of document.querySelectorAll(".tab")) t.onclick = () => showView(t.dataset.view);
  $("#menu").onclick = () => $("#sidebar").classList.toggle("open");
  $("#model").onchange = modelChanged;
  $("#new-chat").onclick = newChat;
  let searchTimer;
  $("#search").oninput = () => { clearTimeout(searchTimer); searchTimer = setTimeout(loadChats, 150); };
  $("#send").onclick = () => send().catch((e) => notice(e.message));
  $("#stop").onclick = stop;
  $("#prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send().catch((err) => notice(err.message)); }
  };
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.generating) { e.preventDefault(); stop(); } });
  $("#file").onchange = (e) => { attach([...e.target.files]); e.target.value = ""; };
  $("#prompt").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])];
    if (files.length) { e.preventDefault(); attach(files); }
  });
  for (const id of ["#system", "#temperature", "#num_ctx", "#seed", "#think"]) $(id).onchange = () => saveSettings().catch((e) => notice(e.message));
  $("#rename").onclick = async () => {
    const title = prompt("New title", state.chat.title);
    if (!title) return;
    const c = await api(`/api/chats/${state.chat.id}`, { method: "POST", body: { title } });
    state.chat.title = c.title;
    showSettings();
    loadChats();
  };
  $("#delete-chat").onclick = async () => {
    if (!confirm(`Delete “${state.chat.title}”?`)) return;
    await api(`/api/chats/${state.chat.id}`, { method: "DELETE" });
    newChat();
  };
  $("#export-json").onclick = () => exportChat("json");
  $("#export-md").onclick = () => exportChat("markdown");
  $("#messages").addEventListener("click", (e) => {  // a code block's copy button
    const b = e.target.closest("button.copy");
    if (b) copyText(b.closest(".code").querySelector("code").textContent, b);
  });
  $("#pull").onclick = pull;
  $("#pull-name").onkeydown = (e) => { if (e.key === "Enter") pull(); };
  $("#pull-cancel").onclick = () => pulling && pulling.abort();
  $("#refresh").onclick = () => loadManager();
}

async function main() {
  wire();
  showSettings();
  renderChat();
  try {
    await loadModels();
    await loadChats();
  } catch (e) {
    notice(`The server did not answer: ${e.message}`);
  }
  document.body.dataset.ready = "1";
}

main();
