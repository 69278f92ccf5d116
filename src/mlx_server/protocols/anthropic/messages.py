"""Anthropic Messages content → Hugging Face chat-template messages.

``tool_result`` blocks become ``tool`` messages in their original order, ``tool_use`` blocks
the assistant's ``tool_calls``, ``thinking`` blocks its ``reasoning_content``; consecutive
turns of one role are one turn. Claude Code's per-request billing line is removed from the
system prompt so the prompt prefix (and the KV cache) is reused.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from mlx_server.errors import InvalidRequest
from mlx_server.models.system_turns import join_messages
from mlx_server.protocols.anthropic.schemas import (
    BLOCK_MODELS,
    Block,
    ImageBlock,
    InputMessage,
    RedactedThinkingBlock,
    SystemBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)

# Claude Code starts its system prompt with a line such as
# "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"
# (usually as the whole first system block). The cch= value changes on every request, so
# left in place it would make every prompt differ from the previous one at its very start.
BILLING_HEADER = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.I | re.M)

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def strip_billing_header(text: str) -> str:
    """Remove Claude Code's ``x-anthropic-billing-header:`` line(s) from system text."""
    return BILLING_HEADER.sub("", text)


def system_text(system: str | list[SystemBlock] | None) -> str:
    """The system prompt as one string: text blocks joined by newlines, billing line removed."""
    if system is None:
        return ""
    if isinstance(system, str):
        return strip_billing_header(system)
    texts = []
    for block in system:
        text = strip_billing_header(block.text)
        if text or not BILLING_HEADER.search(block.text):
            texts.append(text)
    return "\n".join(texts)


def parse_block(raw: object, where: str) -> Block:
    """Validate one content block; errors name it (``messages[1].content[2].id: ...``)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = raw.get("type")
    model = BLOCK_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequest(
            f"{where}: unsupported content block type {kind!r} "
            f"(supported: {', '.join(BLOCK_MODELS)})",
            param=f"{where}.type",
        )
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as e:
        err = e.errors()[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        msg = "field required" if err["type"] == "missing" else err["msg"]
        raise InvalidRequest(f"{where}{loc}: {msg}", param=f"{where}{loc}") from e


class MessageConverter:
    """Converts one request's messages, remembering tool names by tool_use id."""

    def __init__(self, vision: bool):
        self.vision = vision
        self.tool_names: dict[str, str] = {}

    def convert(
        self, system: str | list[SystemBlock] | None, messages: list[InputMessage]
    ) -> list[dict[str, Any]]:
        if all(m.role == "system" for m in messages):
            raise InvalidRequest(
                "messages: at least one message must be a user or assistant turn",
                param="messages",
            )
        out: list[dict[str, Any]] = []
        text = system_text(system)
        if text:
            out.append({"role": "system", "content": text})
        for i, m in enumerate(messages):
            for msg in self._message(i, m):
                if out and out[-1]["role"] == msg["role"] and msg["role"] != "tool":
                    # Like Anthropic's API, consecutive turns of one role are one turn (and
                    # templates that insist on alternating roles accept the result); a
                    # leading system message joins the top-level system prompt.
                    out[-1] = join_messages(out[-1], msg, {"role": msg["role"]})
                else:
                    out.append(msg)
        return out

    def _message(self, i: int, m: InputMessage) -> list[dict[str, Any]]:
        if isinstance(m.content, str):
            return [{"role": m.role, "content": m.content}]
        if m.role == "system":
            return [{"role": "system", "content": self._system_text(i, m.content)}]
        out: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for j, raw in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            block = parse_block(raw, where)
            self._check_role(block, m.role, where)
            if isinstance(block, ToolResultBlock):
                if parts:  # keep the order: text before a result is its own user message
                    out.append(_compose("user", parts))
                    parts = []
                out.append(self._tool_result(block, where))
            elif isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(self._image(block, where))
            elif isinstance(block, ToolUseBlock):
                self.tool_names[block.id] = block.name
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            # redacted_thinking: opaque to us, nothing to render
        if parts or calls or thinking or not out:
            msg = _compose(m.role, parts)
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
        return out

    @staticmethod
    def _system_text(i: int, content: list[dict[str, Any]]) -> str:
        texts = []
        for j, raw in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            block = parse_block(raw, where)
            if not isinstance(block, TextBlock):
                raise InvalidRequest(
                    f"{where}: a system message may hold text blocks only", param=where
                )
            texts.append(block.text)
        return "\n".join(texts)

    @staticmethod
    def _check_role(block: Block, role: str, where: str) -> None:
        only = {ToolResultBlock: "user", ToolUseBlock: "assistant", ThinkingBlock: "assistant"}
        only[RedactedThinkingBlock] = "assistant"
        want = only.get(type(block))
        if want is not None and role != want:
            raise InvalidRequest(
                f"{where}: a {block.type} block may only appear in a {want} message",
                param=where,
            )

    def _tool_result(self, block: ToolResultBlock, where: str) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        if isinstance(block.content, str):
            parts.append({"type": "text", "text": block.content})
        for k, raw in enumerate(block.content if isinstance(block.content, list) else []):
            inner = parse_block(raw, f"{where}.content[{k}]")
            if isinstance(inner, TextBlock):
                parts.append({"type": "text", "text": inner.text})
            elif isinstance(inner, ImageBlock):
                parts.append(self._image(inner, f"{where}.content[{k}]"))
            else:
                raise InvalidRequest(
                    f"{where}.content[{k}]: a tool_result may hold text and image blocks only",
                    param=f"{where}.content[{k}]",
                )
        if block.is_error:
            # Templates have no error flag for tool results; say it in the text.
            if parts and parts[0]["type"] == "text":
                parts[0] = {"type": "text", "text": "Error: " + parts[0]["text"]}
            else:
                parts.insert(0, {"type": "text", "text": "Error:"})
        msg = _compose("tool", parts)
        msg["tool_call_id"] = block.tool_use_id
        name = self.tool_names.get(block.tool_use_id)
        if name:
            msg["name"] = name
        return msg

    def _image(self, block: ImageBlock, where: str) -> dict[str, Any]:
        if not self.vision:
            raise InvalidRequest(
                f"{where} is an image block, but this model accepts text only", param=where
            )
        src = block.source
        if src.type == "url":
            if not src.url:
                raise InvalidRequest(f"{where}.source.url: field required", param=where)
            return {"type": "image", "image": src.url, "param": where}
        if not src.data:
            raise InvalidRequest(f"{where}.source.data: field required", param=where)
        if src.media_type not in IMAGE_MEDIA_TYPES:
            raise InvalidRequest(
                f"{where}.source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}",
                param=f"{where}.source.media_type",
            )
        url = f"data:{src.media_type};base64,{src.data}"
        return {"type": "image", "image": url, "param": where}


def _compose(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat message from text/image parts: plain text unless it carries images.

    With images (vision models only) the content is a list of Hugging Face style parts,
    ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <url or data URL>,
    "param": <the block's place in the request>}``, in block order; that is what the vision
    prompt builder consumes (``param`` names the block in its error messages).
    """
    if any(p["type"] == "image" for p in parts):
        return {"role": role, "content": parts}
    return {"role": role, "content": "\n".join(p["text"] for p in parts)}
