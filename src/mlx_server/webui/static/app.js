// The chat page: conversations, the composer, streaming answers, settings and panels.

import { ApiError, apiKey, cancel, getJSON, setApiKey, streamChat } from "./api.js";
import { el, jsonBlock, markdownFragment, statsLine } from "./render.js";
import { StatusPanel } from "./status.js";
import { Conversations, loadSettings, loadTheme, saveSettings, saveTheme } from "./store.js";

const $ = (id) => document.getElementById(id);

const state = {
  models: [],
  model: null,
  convs: new Conversations(),
  conv: null,
  settings: loadSettings(),
  attachments: [], // data: URLs of images waiting to be sent
  run: null, // the generation in flight: {id, controller, stopped}
};
const status = new StatusPanel($("status"), $("status-list"));

// ---- theme -------------------------------------------------------------------------------

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("hl-light").disabled = theme === "dark";
  $("hl-dark").disabled = theme !== "dark";
}

$("toggle-theme").addEventListener("click", () => {
  const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
  saveTheme(next);
  applyTheme(next);
});

// ---- models and the API key --------------------------------------------------------------

async function loadModels() {
  try {
    const list = await getJSON("/v1/models");
    state.models = list.data || [];
    $("key-panel").hidden = true;
    $("forget-key").hidden = !apiKey();
    showModels();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) askForKey(apiKey() ? "That key was refused." : "");
    else showBanner(e.plain || String(e));
  }
}

function askForKey(problem) {
  $("key-panel").hidden = false;
  $("key-error").hidden = !problem;
  $("key-error").textContent = problem;
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  loadModels();
});

$("forget-key").addEventListener("click", () => {
  setApiKey("");
  $("forget-key").hidden = true;
  loadModels();
});

function showModels() {
  const picker = $("model-picker");
  const wanted = state.models.find((m) => m.id === state.settings.model);
  state.model = wanted || state.models[0] || null;
  picker.hidden = state.models.length < 2;
  $("model-name").hidden = !picker.hidden;
  $("model-name").textContent = state.model ? state.model.id : "";
  picker.replaceChildren(
    ...state.models.map((m) => el("option", { value: m.id, text: m.id, selected: m === state.model })),
  );
  const vision = !!state.model && (state.model.capabilities || []).includes("vision");
  $("attach-label").hidden = !vision;
  status.setModel(state.model);
}

$("model-picker").addEventListener("change", (ev) => {
  state.settings.model = ev.target.value;
  saveSettings(state.settings);
  showModels();
});

function showBanner(text) {
  const note = el("div", { className: "banner error-text", role: "alert", text });
  $("messages").prepend(note);
}

// ---- conversations -----------------------------------------------------------------------

function persist() {
  const problem = state.convs.save();
  if (problem) showBanner(problem);
}

function openConversation(conv) {
  state.conv = conv;
  $("title").textContent = conv.title;
  renderMessages();
  renderList();
  $("sidebar").classList.remove("open");
}

function newConversation() {
  if (state.conv && state.conv.messages.length === 0) return openConversation(state.conv);
  openConversation(state.convs.create());
}

function renderList() {
  const items = state.convs.list
    .filter((c) => c.messages.length > 0 || c === state.conv)
    .map((c) => conversationItem(c));
  $("conversations").replaceChildren(...items);
}

function conversationItem(c) {
  const open = el("button", { type: "button", className: "conv-title", text: c.title, title: c.title });
  open.addEventListener("click", () => openConversation(c));
  const rename = el("button", { type: "button", className: "icon small", text: "✎", "aria-label": "Rename" });
  rename.addEventListener("click", () => startRename(item, c));
  const del = el("button", { type: "button", className: "icon small", text: "×", "aria-label": "Delete" });
  del.addEventListener("click", () => deleteConversation(c));
  const item = el("li", { className: c === state.conv ? "current" : "", "data-id": c.id }, open, rename, del);
  return item;
}

function startRename(item, c) {
  const input = el("input", { type: "text", className: "rename", value: c.title, "aria-label": "New name" });
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep) {
      const problem = state.convs.rename(c.id, input.value);
      if (problem) showBanner(problem);
    }
    if (c === state.conv) $("title").textContent = c.title;
    renderList();
  };
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") finish(true);
    if (ev.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function deleteConversation(c) {
  const problem = state.convs.remove(c.id);
  if (problem) showBanner(problem);
  if (c === state.conv) openConversation(state.convs.list[0] || state.convs.create());
  else renderList();
}

$("new-chat").addEventListener("click", newConversation);
$("open-sidebar").addEventListener("click", () => $("sidebar").classList.add("open"));
$("close-sidebar").addEventListener("click", () => $("sidebar").classList.remove("open"));

$("export").addEventListener("click", () => {
  const url = URL.createObjectURL(state.convs.exportBlob());
  const a = el("a", { href: url, download: "mlx-server-conversations.json" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
});

// ---- messages ----------------------------------------------------------------------------

function renderMessages() {
  const nodes = state.conv.messages.map((m) => (m.role === "user" ? userNode(m) : assistantNode(m)));
  if (nodes.length === 0) nodes.push(el("p", { className: "empty muted", text: "Ask the model something." }));
  $("messages").replaceChildren(...nodes);
  scrollDown();
}

function userNode(m) {
  const images = (m.images || []).map((src) => el("img", { src, alt: "attached image", className: "thumb" }));
  return el(
    "article",
    { className: "msg user" },
    images.length ? el("div", { className: "thumbs" }, ...images) : null,
    el("div", { className: "text", text: m.content }),
  );
}

function assistantNode(m) {
  const node = el("article", { className: "msg assistant" });
  fillAssistant(node, m);
  return node;
}

function fillAssistant(node, m) {
  const parts = [];
  if (m.reasoning && state.settings.showReasoning) {
    const body = el("div", { className: "reasoning-body", text: m.reasoning });
    parts.push(el("details", { className: "reasoning" }, el("summary", { text: "Reasoning" }), body));
  }
  if (m.content) {
    const content = el("div", { className: "content markdown" });
    content.append(m.json ? jsonBlock(m.content) : markdownFragment(m.content));
    parts.push(content);
  }
  for (const call of m.toolCalls || []) parts.push(toolCallNode(call));
  if (m.pending && !m.content && !(m.toolCalls || []).length)
    parts.push(el("div", { className: "typing muted", text: m.reasoning ? "thinking…" : "…" }));
  if (m.error) parts.push(el("div", { className: "error-text", role: "alert", text: m.error }));
  const line = statsLine(m.stats);
  if (line) parts.push(el("div", { className: "meta muted small", text: line }));
  // Keep the reasoning open if the user opened it while the answer streams.
  const wasOpen = node.querySelector("details.reasoning[open]");
  node.replaceChildren(...parts);
  if (wasOpen) node.querySelector("details.reasoning")?.setAttribute("open", "");
}

function toolCallNode(call) {
  let args = call.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch (_) {
    // still streaming or not JSON: as it came
  }
  return el(
    "div",
    { className: "tool-call" },
    el("div", { className: "tool-head" }, el("span", { className: "badge", text: "tool call" }), el("code", { text: call.name || "?" })),
    el("pre", { className: "tool-args" }, el("code", { text: args })),
  );
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// ---- sending -----------------------------------------------------------------------------

function requestMessages() {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
  for (const m of state.conv.messages) {
    if (m.role === "user") {
      const images = m.images || [];
      out.push({
        role: "user",
        content: images.length
          ? [{ type: "text", text: m.content }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
          : m.content,
      });
    } else if (m.content) {
      out.push({ role: "assistant", content: m.content });
    }
  }
  return out;
}

// The JSON settings (schema, tools, extra fields), parsed; a mistake is shown in the panel.
function jsonSetting(key, what, check) {
  const text = state.settings[key].trim();
  if (!text) return null;
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
  if (!check(value)) throw new Error(`${what} has the wrong shape`);
  return value;
}

function requestBody() {
  const s = state.settings;
  const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  const schema = jsonSetting("schema", "The JSON schema", isObject);
  const tools = jsonSetting("tools", "Tools", Array.isArray);
  const extra = jsonSetting("extra", "Extra request fields", isObject);
  const body = { ...(extra || {}), messages: requestMessages() };
  if (state.model) body.model = state.model.id;
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
  if (tools) body.tools = tools;
  return body;
}

async function sendMessage() {
  const text = $("prompt").value;
  if (state.run || (!text.trim() && state.attachments.length === 0)) return;
  const conv = state.conv;
  let body;
  $("settings-error").hidden = true;
  try {
    conv.messages.push({ role: "user", content: text, images: state.attachments });
    body = requestBody();
  } catch (e) {
    conv.messages.pop();
    $("settings-error").textContent = e.message;
    $("settings-error").hidden = false;
    $("settings").hidden = false;
    return;
  }
  if (conv.messages.length === 1) {
    conv.title = (text.trim() || "Image").slice(0, 60);
    $("title").textContent = conv.title;
  }
  const answer = { role: "assistant", content: "", reasoning: "", toolCalls: [], json: !!body.response_format, pending: true };
  conv.messages.push(answer);
  $("prompt").value = "";
  setAttachments([]);
  persist();
  renderMessages();
  renderList();
  await generate(conv, answer, body);
}

async function generate(conv, answer, body) {
  const node = $("messages").lastElementChild;
  const run = { id: null, controller: new AbortController(), stopped: false };
  state.run = run;
  setBusy(true);
  let queued = false;
  const repaint = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      if (state.conv === conv) {
        fillAssistant(node, answer);
        scrollDown();
      }
    });
  };
  try {
    await streamChat(body, (chunk) => {
      run.id = chunk.id || run.id;
      applyChunk(answer, chunk);
      repaint();
    }, run.controller.signal);
  } catch (e) {
    if (e.name !== "AbortError") {
      answer.error = e instanceof ApiError ? e.plain : String(e.message || e);
      if (e instanceof ApiError && e.status === 401) askForKey(apiKey() ? "That key was refused." : "");
    }
  } finally {
    answer.pending = false;
    if (run.stopped) answer.stats = { ...(answer.stats || {}), finish: "cancelled" };
    state.run = null;
    setBusy(false);
    persist();
    if (state.conv === conv) {
      fillAssistant(node, answer);
      scrollDown();
    }
  }
}

function applyChunk(answer, chunk) {
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    if (d.content) answer.content += d.content;
    if (d.reasoning_content) answer.reasoning += d.reasoning_content;
    for (const t of d.tool_calls || []) {
      const call = (answer.toolCalls[t.index] ||= { id: "", name: "", arguments: "" });
      if (t.id) call.id = t.id;
      if (t.function?.name) call.name += t.function.name;
      if (t.function?.arguments) call.arguments += t.function.arguments;
    }
    if (choice.finish_reason) answer.stats = { ...(answer.stats || {}), finish: choice.finish_reason };
  }
  if (chunk.usage) answer.stats = { ...(answer.stats || {}), usage: chunk.usage };
  if (chunk.timings) answer.stats = { ...(answer.stats || {}), timings: chunk.timings };
}

async function stop() {
  const run = state.run;
  if (!run || run.stopped) return;
  run.stopped = true;
  $("stop").disabled = true;
  if (!run.id) {
    run.controller.abort(); // nothing streamed yet: hanging up cancels it on the server
    return;
  }
  try {
    await cancel(run.id); // the stream then ends on its own with what was generated
  } catch (_) {
    run.controller.abort();
    return;
  }
  setTimeout(() => state.run === run && run.controller.abort(), 5000);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("stop").disabled = false;
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sendMessage();
});
$("stop").addEventListener("click", stop);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    sendMessage();
  }
});
$("prompt").addEventListener("input", () => {
  const box = $("prompt");
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight, 240)}px`;
});

// ---- images ------------------------------------------------------------------------------

function visionOn() {
  return !$("attach-label").hidden;
}

function setAttachments(list) {
  state.attachments = list;
  const box = $("attachments");
  box.hidden = list.length === 0;
  box.replaceChildren(
    ...list.map((src, i) => {
      const remove = el("button", { type: "button", className: "icon small", text: "×", "aria-label": "Remove image" });
      remove.addEventListener("click", () => setAttachments(state.attachments.filter((_, j) => j !== i)));
      return el("span", { className: "attachment" }, el("img", { src, alt: "image to send", className: "thumb" }), remove);
    }),
  );
}

function readImages(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  return Promise.all(
    images.map(
      (f) =>
        new Promise((resolve, reject) => {
          const reader = new FileReader();
          reader.onload = () => resolve(reader.result);
          reader.onerror = () => reject(reader.error);
          reader.readAsDataURL(f);
        }),
    ),
  );
}

async function addImages(files) {
  if (!visionOn()) return;
  setAttachments([...state.attachments, ...(await readImages(files))]);
}

$("attach").addEventListener("change", async (ev) => {
  await addImages(ev.target.files);
  ev.target.value = "";
});
// A file dropped anywhere must not make the browser leave the page.
window.addEventListener("dragover", (ev) => {
  ev.preventDefault();
  $("drop-hint").hidden = !visionOn();
});
window.addEventListener("dragleave", () => ($("drop-hint").hidden = true));
window.addEventListener("drop", (ev) => {
  ev.preventDefault();
  $("drop-hint").hidden = true;
  if (ev.dataTransfer) addImages(ev.dataTransfer.files);
});

// ---- settings and panels -----------------------------------------------------------------

function bindSetting(id, key, kind = "value") {
  const input = $(id);
  input[kind] = state.settings[key];
  input.addEventListener(kind === "checked" ? "change" : "input", () => {
    state.settings[key] = input[kind];
    saveSettings(state.settings);
    if (key === "showReasoning") renderMessages();
  });
}

bindSetting("set-system", "system");
bindSetting("set-temperature", "temperature");
bindSetting("set-max-tokens", "maxTokens");
bindSetting("set-schema", "schema");
bindSetting("set-tools", "tools");
bindSetting("set-extra", "extra");
bindSetting("set-reasoning", "showReasoning", "checked");

$("toggle-settings").addEventListener("click", () => {
  $("settings").hidden = !$("settings").hidden;
  if (!$("settings").hidden) $("status").hidden = true;
});
$("toggle-status").addEventListener("click", () => {
  if (!$("settings").hidden) $("settings").hidden = true;
  status.toggle();
});

// ---- start -------------------------------------------------------------------------------

applyTheme(loadTheme());
openConversation(state.convs.list.find((c) => c.messages.length > 0) || state.convs.create());
loadModels();
