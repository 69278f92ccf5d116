"""llama.cpp's named pre-tokenizers (``tokenizer.ggml.pre``): how each splits text before
the byte-level merges, as the regular expressions and options of its reference tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from .reader import GGUFImportError

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How a named llama.cpp pre-tokenizer splits text before the byte-level merges."""

    split: str | None = None  # one regex, isolated; None means GPT-2's built-in one
    digits: bool = False  # every digit its own piece first (StarCoder family)
    ignore_merges: bool = False  # whole-word vocabulary hits skip the merges (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file does not say
    nfc: bool = False  # the reference tokenizer normalizes to NFC


_GPT2 = PreTokenizerSpec()
_STARCODER = PreTokenizerSpec(digits=True)
_LLAMA3_SPEC = PreTokenizerSpec(split=_LLAMA3, ignore_merges=True, add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec(split=_QWEN2, nfc=True)

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    **dict.fromkeys(["default", "gpt-2", "phi-2", "mpt", "olmo", "mellum"], _GPT2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        _STARCODER,
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_SPEC,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], PreTokenizerSpec(split=_LLAMA3)),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"], _QWEN2_SPEC
    ),
    "qwen35": PreTokenizerSpec(split=_QWEN35, nfc=True),
    "tekken": PreTokenizerSpec(split=_TEKKEN, ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4"], PreTokenizerSpec(split=_GPT4O)),
}


def pre_tokenizer_spec(name: str) -> PreTokenizerSpec:
    """The spec of the pre-tokenizer ``name``; GGUFImportError names the ones supported."""
    if name not in PRE_TOKENIZERS:
        raise GGUFImportError(
            f"GGUF pre-tokenizer {name!r} is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]
