// Conversations and settings, kept in the browser's localStorage (nothing on the server).

const CONVERSATIONS = "mlx-server.conversations";
const SETTINGS = "mlx-server.settings";
const THEME = "mlx-server.theme";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch (_) {
    return fallback;
  }
}

function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export class Conversations {
  constructor() {
    this.list = read(CONVERSATIONS, []).filter((c) => c && Array.isArray(c.messages));
    // An answer that was streaming when the page went away ends where it was saved.
    for (const c of this.list) for (const m of c.messages) delete m.pending;
  }

  save() {
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.list));
      return "";
    } catch (e) {
      return `Could not save the conversation in the browser's storage: ${e.message}`;
    }
  }

  create() {
    const c = { id: newId(), title: "New chat", created: Date.now(), messages: [] };
    this.list.unshift(c);
    return c;
  }

  get(id) {
    return this.list.find((c) => c.id === id) || null;
  }

  rename(id, title) {
    const c = this.get(id);
    if (c && title.trim()) c.title = title.trim().slice(0, 200);
    return this.save();
  }

  remove(id) {
    this.list = this.list.filter((c) => c.id !== id);
    return this.save();
  }

  exportBlob() {
    const doc = { exported: new Date().toISOString(), conversations: this.list };
    return new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" });
  }
}

export const DEFAULT_SETTINGS = {
  system: "",
  temperature: "",
  maxTokens: "",
  schema: "",
  tools: "",
  extra: "",
  showReasoning: true,
  model: "",
};

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export function loadTheme() {
  const saved = localStorage.getItem(THEME);
  if (saved === "light" || saved === "dark") return saved;
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

export function saveTheme(theme) {
  localStorage.setItem(THEME, theme);
}
