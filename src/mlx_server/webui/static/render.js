// Model output is untrusted: Markdown becomes HTML through marked, then DOMPurify turns it
// into a DOM fragment with only harmless tags; plain text always goes in through textContent.

const FORBID_TAGS = [
  "img", "style", "form", "input", "button", "textarea", "select", "option", "svg", "math",
  "video", "audio", "picture", "source", "iframe", "object", "embed", "link", "meta", "base",
];
const LANG_CLASS = /^language-[\w#+.-]{1,32}$/;
let hooked = false;

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function installHooks() {
  if (hooked) return;
  hooked = true;
  // HTML a model writes is shown as the text it is: it is never parsed as markup, so the
  // sanitizer below only ever sees what marked itself made (links, code, tables...).
  window.marked.use({ renderer: { html: (token) => escapeHtml(token.text ?? token.raw ?? "") } });
  // Links from a model open in a new tab and never tell the target where they came from.
  window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  // The one class kept is marked's mark of a code block's language: a model cannot style
  // the page with the page's own classes.
  window.DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
    if (data.attrName === "class" && !(node.tagName === "CODE" && LANG_CLASS.test(data.attrValue)))
      data.keepAttr = false;
  });
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "className") node.className = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c) node.append(c);
  return node;
}

export function markdownFragment(text) {
  installHooks();
  const html = window.marked.parse(text, { gfm: true, breaks: false, async: false });
  const fragment = window.DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    USE_PROFILES: { html: true },
    FORBID_TAGS,
    FORBID_ATTR: ["style", "id"],
  });
  decorateCode(fragment);
  return fragment;
}

function decorateCode(root) {
  root.querySelectorAll("pre > code").forEach((code) => {
    const match = /language-([\w#+.-]+)/.exec(code.className);
    const lang = match ? match[1].toLowerCase() : "";
    highlight(code, lang);
    code.parentElement.replaceWith(codeBlock(code, lang));
  });
}

function highlight(code, lang) {
  if (lang && window.hljs.getLanguage(lang)) {
    code.className = `language-${lang}`;
    window.hljs.highlightElement(code);
  } else {
    code.className = "hljs";
  }
}

export function codeBlock(code, lang) {
  const copy = el("button", { type: "button", className: "copy", text: "Copy" });
  copy.addEventListener("click", () => copyText(code.textContent, copy));
  const head = el("div", { className: "code-head" }, el("span", { text: lang || "text" }), copy);
  return el("div", { className: "code-block" }, head, el("pre", {}, code));
}

export function jsonBlock(text) {
  let shown = text;
  try {
    shown = JSON.stringify(JSON.parse(text), null, 2);
  } catch (_) {
    // not (yet) complete JSON: show it as it is
  }
  const code = el("code", { text: shown });
  highlight(code, "json");
  return codeBlock(code, "json");
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (_) {
    button.textContent = "Copy failed";
  }
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

// "12.3 tok/s · 40 prompt (32 cached) · 17 generated" from a finished answer's usage/timings.
export function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  const t = stats.timings;
  const u = stats.usage;
  if (t && t.predicted_per_second) parts.push(`${t.predicted_per_second.toFixed(1)} tok/s`);
  if (u) {
    const cached = u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : (t ? t.cache_n : 0);
    parts.push(`${u.prompt_tokens} prompt (${cached || 0} cached)`);
    parts.push(`${u.completion_tokens} generated`);
  }
  if (stats.finish === "cancelled") parts.push("stopped");
  else if (stats.finish && stats.finish !== "stop") parts.push(`finish: ${stats.finish}`);
  return parts.join(" · ");
}
