// The status panel: the model (from /v1/models), then the live figures /health and
// /metrics give, refreshed while the panel is open.

import { getJSON, getText } from "./api.js";
import { el } from "./render.js";

const METRICS = [
  ["mlx_server_requests_total", "Requests"],
  ["mlx_server_running_sequences", "Running"],
  ["mlx_server_queue_depth", "Queued"],
  ["mlx_server_generation_tokens_total", "Tokens generated"],
  ["mlx_server_prompt_tokens_total", "Prompt tokens"],
  ["mlx_server_prompt_tokens_cached_total", "Prompt tokens from cache"],
  ["mlx_server_cancellations_total", "Cancellations"],
];

// Prometheus text format: every sample's value, summed over its labels.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) out[m[1]] = (out[m[1]] || 0) + Number(m[3]);
  }
  return out;
}

function bytes(n) {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  return `${n} B`;
}

function label(key) {
  return key.replace(/_/g, " ");
}

function fmt(key, value) {
  if (typeof value === "number" && key.endsWith("bytes")) return bytes(value);
  if (typeof value === "number" && !Number.isInteger(value)) return value.toFixed(3);
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

export class StatusPanel {
  constructor(root, list) {
    this.root = root;
    this.list = list;
    this.model = null;
    this.timer = null;
  }

  setModel(model) {
    this.model = model;
    if (!this.root.hidden) this.refresh();
  }

  toggle() {
    this.root.hidden = !this.root.hidden;
    clearInterval(this.timer);
    if (!this.root.hidden) {
      this.refresh();
      this.timer = setInterval(() => this.refresh(), 3000);
    }
  }

  async refresh() {
    const rows = [];
    const m = this.model;
    if (m) {
      rows.push(["Model", m.id]);
      rows.push(["Context size", m.context_length ? `${m.context_length} tokens` : "not reported"]);
      rows.push(["Capabilities", (m.capabilities || []).join(", ") || "text"]);
    }
    try {
      const health = await getJSON("/health");
      for (const [k, v] of Object.entries(health)) rows.push([label(k), fmt(k, v)]);
    } catch (e) {
      rows.push(["/health", e.plain || String(e)]);
    }
    try {
      const metrics = parseMetrics(await getText("/metrics"));
      for (const [name, title] of METRICS) if (name in metrics) rows.push([title, fmt(name, metrics[name])]);
    } catch (e) {
      rows.push(["/metrics", e.status === 401 ? "needs the API key" : e.plain || String(e)]);
    }
    this.list.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
  }
}
