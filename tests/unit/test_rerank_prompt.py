"""A causal reranker's prompt: the chat template renders the query, the document and an
instruction; an over-long prompt is cut with the template's tail kept; a template that cannot
carry the pair is refused at load."""

from __future__ import annotations

import pytest
from embedding_support import QWEN3_RERANKER_TEMPLATE
from tiny_model import build_tokenizer
from tokenizers import Tokenizer

from mlx_server.models.base import ModelLoadError
from mlx_server.models.rerank_prompt import ChatPairPrompt

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_the_template_lays_out_the_pair_and_the_instruction(tokenizer):
    prompt = ChatPairPrompt(QWEN3_RERANKER_TEMPLATE, tokenizer, {})
    text = prompt.render("what is mlx", "MLX is an array framework.", None)
    assert "<Query>: what is mlx\n<Document>: MLX is an array framework.<|im_end|>" in text
    assert "<Instruct>: Given a web search query" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    task = prompt.render("q", "d", "Find code")
    assert "<Instruct>: Find code\n" in task


def test_a_long_prompt_is_cut_before_the_tail(tokenizer):
    prompt = ChatPairPrompt(QWEN3_RERANKER_TEMPLATE, tokenizer, {})
    short, long = prompt.encode("q", ["a short one", "word " * 400], None, max_length=300)
    full_short = prompt.encode("q", ["a short one"], None)[0]
    assert short == full_short  # under the limit: as rendered
    tail = tokenizer.encode(
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False
    ).ids
    assert len(long) == 300 and long[-len(tail) :] == tail
    assert long[:20] == full_short[:20]  # the head is the prompt's own start


def test_a_template_without_the_pair_roles_is_refused(tokenizer):
    chat_only = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'user' %}!{% endif %}{% endfor %}"
    ChatPairPrompt(chat_only, tokenizer, {})  # renders every role: accepted
    users_only = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    with pytest.raises(ModelLoadError, match="'query' and 'document'"):
        ChatPairPrompt(users_only, tokenizer, {})
