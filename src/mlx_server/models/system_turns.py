"""System messages after the start of a conversation, for templates that cannot render them.

Clients may send a system message anywhere in a conversation (Anthropic's mid-conversation
system messages, OpenAI's system/developer messages). Many chat templates take a system
message only as the first message: they raise on a later one ("roles must alternate"), drop
it, or move it. Whether a template renders system messages where they stand is found out
once per template by rendering a probe conversation; where it does not, the later system
messages are folded into the leading one, so their text still reaches the model.
"""

from __future__ import annotations

from typing import Any

from mlx_server.models.chat_template import ChatTemplate

# A conversation with a system message first, after a user turn, and last: the places
# Anthropic's and OpenAI's APIs allow one. Each text is a marker found in the rendered prompt.
_PROBE = (
    ("system", "probe-sys-first"),
    ("user", "probe-user-one"),
    ("system", "probe-sys-middle"),
    ("assistant", "probe-assistant-one"),
    ("user", "probe-user-two"),
    ("system", "probe-sys-last"),
)


def renders_system_in_place(tokenizer: Any, template: ChatTemplate | None = None) -> bool:
    """True if the chat template renders every system message of the probe conversation,
    in order, where it stands (no error, none dropped or moved). ``template``: the model's
    probed template, which renders its requests (else the tokenizer renders them)."""
    messages = [{"role": role, "content": text} for role, text in _PROBE]
    try:
        if template is not None:
            text = template.render(messages, add_generation_prompt=True)
        else:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
    except Exception:  # raise_exception() in the template, or any other refusal
        return False
    if not isinstance(text, str):
        return False
    positions = [text.find(marker) for _, marker in _PROBE]
    return min(positions) >= 0 and positions == sorted(positions)


def has_late_system(messages: list[dict[str, Any]]) -> bool:
    """Whether a system message follows a message of another role."""
    seen_other = False
    for m in messages:
        if m.get("role") != "system":
            seen_other = True
        elif seen_other:
            return True
    return False


def fold_late_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One leading system message holding the text of every system message, in order.

    The leading system messages and each later one are joined with a blank line (a system
    message is created at the start when the conversation has none there). Turns that
    become adjacent once a system message is taken out of their way, two user turns say,
    are merged, so templates that insist on alternating roles still accept the result.
    """
    if not has_late_system(messages):
        return messages
    texts = [_text(m.get("content")) for m in messages if m.get("role") == "system"]
    out: list[dict[str, Any]] = [{"role": "system", "content": "\n\n".join(t for t in texts if t)}]
    for m in messages:
        if m.get("role") == "system":
            continue
        prev = out[-1]
        if prev["role"] == m.get("role") and prev["role"] in ("user", "assistant"):
            out[-1] = _merge(prev, m)
        else:
            out.append(m)
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return join_messages(a, b, {**a, **b})


def join_messages(a: dict[str, Any], b: dict[str, Any], into: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive messages of one role as one: ``into`` (the joined message's other
    fields) with their contents, tool calls and reasoning joined."""
    ca, cb = a.get("content"), b.get("content")
    if isinstance(ca, list) or isinstance(cb, list):
        into["content"] = _parts(ca) + _parts(cb)
    else:
        into["content"] = "\n".join(c for c in (ca, cb) if c)
    calls = (a.get("tool_calls") or []) + (b.get("tool_calls") or [])
    if calls:
        into["tool_calls"] = calls
    reasoning = [r for r in (a.get("reasoning_content"), b.get("reasoning_content")) if r]
    if reasoning:
        into["reasoning_content"] = "\n".join(reasoning)
    return into


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []
