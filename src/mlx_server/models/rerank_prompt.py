"""A causal reranker's prompt: the (query, document) pair laid out by the model's chat template.

sentence-transformers (v5.x on) hands a causal cross-encoder each pair as chat messages with
the roles ``query`` and ``document`` (and an instruction, when one is given, as a ``system``
message before them), renders the tokenizer's chat template and tokenizes the text without
adding special tokens. Qwen3-Reranker's template turns that into its model card's prompt
(a fixed system turn asking for "yes" or "no", then ``<Instruct>: ...``, ``<Query>: ...``,
``<Document>: ...`` in the user turn, then an empty thinking block in the assistant turn).
Over-long prompts are cut as sentence-transformers cuts them: at the maximum length, then
the template's tail after the document is written back over the last tokens, so the prompt
still ends where the model answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_server.models.base import ModelLoadError
from mlx_server.models.chat_template import compile_template

_DOCUMENT_MARK = "\u2063mlx-server-document\u2063"
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token")
# apply_chat_template's tokenizing arguments, and sentence-transformers' own flag: not
# template variables.
_NOT_TEMPLATE_KWARGS = {"truncation", "max_length", "padding", "return_tensors", "restore_suffix"}


class ChatPairPrompt:
    """Renders and tokenizes (query, document) prompts for one causal reranker."""

    def __init__(self, source: str, tokenizer: Any, variables: dict[str, Any]):
        try:
            self.template = compile_template(source)
        except Exception as e:
            raise ModelLoadError(f"the reranker's chat template does not compile: {e}") from e
        self.tokenizer = tokenizer
        self.variables = variables
        probe = self.render("\u2063query\u2063", _DOCUMENT_MARK, None)
        if "\u2063query\u2063" not in probe or _DOCUMENT_MARK not in probe:
            raise ModelLoadError(
                "the reranker's chat template does not render the 'query' and 'document' "
                "messages a pair is given as"
            )

    @classmethod
    def from_model_dir(cls, model_dir: Path, tokenizer: Any) -> ChatPairPrompt:
        """The template (``chat_template.jinja``, else tokenizer_config.json's), the special
        tokens and sentence-transformers' template arguments, as the model ships them."""
        tok_config = _json(model_dir / "tokenizer_config.json")
        jinja = model_dir / "chat_template.jinja"
        source = jinja.read_text() if jinja.is_file() else tok_config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ModelLoadError(f"the reranker in {model_dir} has no chat template")
        variables = {k: _token_text(tok_config.get(k)) for k in _SPECIAL_KEYS}
        st_config = _json(model_dir / "sentence_bert_config.json")
        kwargs = (st_config.get("processing_kwargs") or {}).get("chat_template") or {}
        variables.update({k: v for k, v in kwargs.items() if k not in _NOT_TEMPLATE_KWARGS})
        return cls(source, tokenizer, variables)

    def render(self, query: str, document: str, instruction: str | None) -> str:
        messages = [] if instruction is None else [{"role": "system", "content": instruction}]
        messages += [{"role": "query", "content": query}, {"role": "document", "content": document}]
        context = {"add_generation_prompt": False, **self.variables}
        return self.template.render(messages=messages, **context)

    def encode(
        self,
        query: str,
        documents: list[str],
        instruction: str | None,
        max_length: int | None = None,
    ) -> list[list[int]]:
        """Token ids of each document's prompt; cut to ``max_length`` (keeping the template's
        tail) when one is given. Runs the template and the tokenizer: call off the event loop."""
        texts = [self.render(query, d, instruction) for d in documents]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        seqs = [list(e.ids) for e in encodings]
        if max_length is None or all(len(s) <= max_length for s in seqs):
            return seqs
        tail = self._tail_ids(query, instruction)
        keep = max(max_length - len(tail), 0)
        return [s if len(s) <= max_length else s[:keep] + tail[-max_length:] for s in seqs]

    def _tail_ids(self, query: str, instruction: str | None) -> list[int]:
        """The tokens of what the template renders after the document."""
        tail = self.render(query, _DOCUMENT_MARK, instruction).split(_DOCUMENT_MARK)[-1]
        return list(self.tokenizer.encode(tail, add_special_tokens=False).ids)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
