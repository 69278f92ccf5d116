"""Raw-text prompts (no chat template): plain text, token ids, and fill-in-the-middle.

Fill-in-the-middle (FIM) prompts are built from the model's own FIM special tokens, found in
its vocabulary under one of the common spellings, in prefix-suffix-middle order (as
llama.cpp's ``/infill`` does): ``PRE prefix SUF suffix MID``, after which the model writes
the middle part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.errors import InvalidRequest


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    spelling: tuple[str, str, str]


# (prefix, suffix, middle) spellings, most common first.
FIM_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek-Coder
    ("<PRE>", "<SUF>", "<MID>"),  # CodeLlama
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama, as its Hugging Face tokenizer spells them
)


# Tokens after which a FIM model has left the hole it was filling (llama.cpp ends generation
# on them too): padding, and the start of another file or repository.
FIM_END_SPELLINGS = (
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|repo_name|>",
    "<fim_pad>",
    "<file_sep>",
    "<EOT>",
    "▁<EOT>",
)


def fim_stop_strings(tokenizer: Any) -> tuple[str, ...]:
    """The FIM end tokens this vocabulary has, as stop strings."""
    vocab = token_vocab(tokenizer)
    return tuple(s for s in FIM_END_SPELLINGS if s in vocab)


def token_vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's vocabulary, added tokens included (string → id)."""
    cached = getattr(tokenizer, "_mlx_server_vocab", None)
    if cached is None:
        cached = dict(tokenizer.get_vocab())
        try:
            tokenizer._mlx_server_vocab = cached
        except AttributeError:  # a tokenizer that takes no new attributes: no caching
            pass
    return cached


def vocab_size(tokenizer: Any) -> int:
    """One past the largest token id the tokenizer knows."""
    vocab = token_vocab(tokenizer)
    return max(vocab.values()) + 1 if vocab else 0


def find_fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The model's FIM tokens, or None when its vocabulary has no complete set."""
    vocab = token_vocab(tokenizer)
    for spelling in FIM_SPELLINGS:
        if all(s in vocab for s in spelling):
            pre, suf, mid = (vocab[s] for s in spelling)
            return FimTokens(pre, suf, mid, spelling)
    return None


def missing_fim_message() -> str:
    names = "; ".join("/".join(s) for s in FIM_SPELLINGS[:4])
    return (
        "this model has no fill-in-the-middle tokens, so 'suffix' cannot be used: its "
        f"vocabulary has none of {names}"
    )


def check_token_ids(tokenizer: Any, ids: list[int], param: str) -> list[int]:
    """Token ids as given, or InvalidRequest naming the first one outside the vocabulary."""
    n = vocab_size(tokenizer)
    for i, t in enumerate(ids):
        if not 0 <= t < n:
            raise InvalidRequest(
                f"{param}[{i}] = {t} is not a token id of this model (0 to {n - 1})", param=param
            )
    return list(ids)


def encode_text(tokenizer: Any, text: str, *, add_special: bool = True) -> list[int]:
    """Token ids for raw text; ``add_special`` adds what the tokenizer adds itself (a BOS
    token for most Llama-style models, nothing for many others)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def _leading_specials(tokenizer: Any) -> list[int]:
    """The tokens ``encode`` puts before any text (e.g. BOS), found by encoding a probe."""
    probe = "a"
    with_specials = encode_text(tokenizer, probe)
    plain = encode_text(tokenizer, probe, add_special=False)
    cut = len(with_specials) - len(plain)
    return with_specials[:cut] if cut > 0 and with_specials[cut:] == plain else []


def fim_prompt(tokenizer: Any, fim: FimTokens, prefix: str | list[int], suffix: str) -> list[int]:
    """``[BOS] PRE prefix SUF suffix MID``. A prefix given as token ids is used as is (and
    gets no BOS: token-id prompts say exactly what the model sees)."""
    if isinstance(prefix, list):
        head, pre = [], list(prefix)
    else:
        head = _leading_specials(tokenizer)
        pre = encode_text(tokenizer, prefix, add_special=False)
    suf = encode_text(tokenizer, suffix, add_special=False)
    return [*head, fim.prefix, *pre, fim.suffix, *suf, fim.middle]
