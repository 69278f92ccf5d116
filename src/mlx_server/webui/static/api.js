// The public API as the page uses it: the key, JSON requests, errors in plain words, and
// the chat stream read as server-sent events.

const KEY_STORE = "mlx-server.api-key";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code || "";
  }

  // What the user reads: the kind of failure first, then the server's own words.
  get plain() {
    if (this.status === 401) return `Authentication failed (401): the server needs a valid API key.`;
    if (this.status === 503) return `Server busy (503): ${this.message} Try again in a moment.`;
    if (this.code === "context_length_exceeded")
      return `Conversation too long for the model's context (400): ${this.message}`;
    if (this.code === "stream_error") return `The generation failed: ${this.message}`;
    if (this.status === 0) return `Cannot reach the server: ${this.message}`;
    return `Error ${this.status}: ${this.message}`;
  }
}

async function errorFrom(resp) {
  let message = resp.statusText || "request failed";
  let code = "";
  try {
    const body = await resp.json();
    const err = body.error || body;
    if (typeof err.message === "string") message = err.message;
    if (typeof err.code === "string") code = err.code;
  } catch (_) {
    // not JSON: keep the status text
  }
  return new ApiError(resp.status, message, code);
}

async function send(method, path, body, signal) {
  let resp;
  try {
    resp = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, String(e.message || e));
  }
  if (!resp.ok) throw await errorFrom(resp);
  return resp;
}

export async function getJSON(path) {
  return (await send("GET", path)).json();
}

export async function getText(path) {
  return (await send("GET", path)).text();
}

export async function cancel(id) {
  return (await send("POST", "/v1/cancel", { id })).json();
}

// Streams one chat completion: calls onChunk(chunk) for every SSE data frame and returns
// when the stream ends. An error frame mid-stream is thrown as an ApiError.
export async function streamChat(body, onChunk, signal) {
  const resp = await send("POST", "/v1/chat/completions", { ...body, stream: true }, signal);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (handleFrame(frame, onChunk)) return;
    }
  }
}

function handleFrame(frame, onChunk) {
  for (const line of frame.split("\n")) {
    if (!line.startsWith("data:")) continue; // "error:" lines repeat the data frame below
    const data = line.slice(5).trim();
    if (data === "[DONE]") return true;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(0, chunk.error.message || "generation failed", "stream_error");
    onChunk(chunk);
  }
  return false;
}
