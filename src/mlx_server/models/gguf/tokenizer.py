"""A Hugging Face fast tokenizer (`tokenizer.json` and friends) from GGUF metadata.

A GGUF stores the vocabulary, merges, token types and special token ids under llama.cpp's
`tokenizer.ggml.*` keys, plus the name of the pre-tokenizer (`tokenizer.ggml.pre`) the merges
were learned with. Two vocabulary kinds are rebuilt with the `tokenizers` library:

- `gpt2`: byte-level BPE, split by the regular expressions the named pre-tokenizer uses
  (`pretokenizers`);
- `llama`: SentencePiece BPE with byte fallback, merges ordered by the token scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from .pretokenizers import PreTokenizerSpec, pre_tokenizer_spec
from .reader import GGUFImportError

# llama.cpp token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp also treats as end of generation, found by their text.
_END_OF_TURN = frozenset(
    ["<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"]
    + ["<|end_of_text|>", "<EOT>"]
)
_SPECIAL_IDS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


@dataclass(frozen=True)
class ImportedTokenizer:
    """Everything mlx-lm's `load_tokenizer` reads from a model directory."""

    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, str]
    eos_token_ids: list[int]

    def save(self, dest: Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`."""
        self.tokenizer.save(str(dest / "tokenizer.json"))
        for name, content in (
            ("tokenizer_config.json", self.tokenizer_config),
            ("special_tokens_map.json", self.special_tokens_map),
        ):
            (dest / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def build_tokenizer(
    metadata: dict[str, Any], *, pre_tokenizer: str | None = None
) -> ImportedTokenizer:
    """Rebuild the file's tokenizer; `pre_tokenizer` overrides `tokenizer.ggml.pre`."""
    tokens, types = _vocabulary(metadata)
    specials = _special_tokens(metadata, tokens)
    tokenizer, default_add_bos = _base_tokenizer(metadata, tokens, types, specials, pre_tokenizer)
    _add_special_tokens(tokenizer, tokens, types)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_bos = add_bos and "bos" in specials
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and "eos" in specials
    tokenizer.post_processor = _post_processor(
        _special_pair(metadata, tokens, "bos") if add_bos else None,
        _special_pair(metadata, tokens, "eos") if add_eos else None,
        byte_level=metadata.get("tokenizer.ggml.model") == "gpt2",
    )
    return ImportedTokenizer(
        tokenizer=tokenizer,
        tokenizer_config=_tokenizer_config(metadata, specials, add_bos=add_bos, add_eos=add_eos),
        special_tokens_map={f"{k}_token": v for k, v in specials.items()},
        eos_token_ids=_eos_token_ids(metadata, tokens, types),
    )


def _vocabulary(metadata: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The tokens and their llama.cpp types, checked for consistency."""
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFImportError(
            "GGUF metadata has no tokenizer.ggml.tokens; cannot build a tokenizer"
        )
    if len(set(tokens)) != len(tokens):
        raise GGUFImportError("GGUF vocabulary has duplicate tokens")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFImportError("GGUF tokenizer.ggml.token_type does not match the vocabulary size")
    return tokens, types


def _base_tokenizer(
    metadata: dict[str, Any],
    tokens: list[str],
    types: list[int],
    specials: dict[str, str],
    pre_tokenizer: str | None,
) -> tuple[Tokenizer, bool]:
    """The model, normalizer, pre-tokenizer and decoder; and whether BOS is added by default."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        spec = pre_tokenizer_spec(pre_tokenizer or metadata.get("tokenizer.ggml.pre") or "default")
        return _byte_level(tokens, metadata, spec), spec.add_bos
    if kind == "llama":
        return _sentencepiece(tokens, types, metadata, specials.get("unk")), True
    raise GGUFImportError(
        f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
        "llama (SentencePiece)"
    )


def _byte_level(tokens: list[str], metadata: dict[str, Any], spec: PreTokenizerSpec) -> Tokenizer:
    """Byte-level BPE: the vocabulary is already spelled in GPT-2's byte alphabet."""
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges))
    if spec.nfc:
        tokenizer.normalizer = normalizers.NFC()
    steps: list[Any] = []
    if spec.digits:
        steps.append(pre.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre.Split(Regex(spec.split), behavior="isolated"))
    steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    tokenizer.pre_tokenizer = pre.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    """`"Ġ t"` -> `("Ġ", "t")`. The separator is the first space after the first character."""
    at = merge.find(" ", 1)
    if at < 0:
        raise GGUFImportError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return merge[:at], merge[at + 1 :]


def _sentencepiece(
    tokens: list[str], types: list[int], metadata: dict[str, Any], unk: str | None
) -> Tokenizer:
    """SentencePiece BPE: spaces spelled `▁`, unknown bytes as `<0xNN>` tokens."""
    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if len(scores) != len(tokens):
        raise GGUFImportError("GGUF tokenizer.ggml.scores does not match the vocabulary size")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _merges_from_scores(tokens, scores, types, vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    # llama.cpp puts a space before the text and after every special token, as this does.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, best-scoring token first.

    SentencePiece merges the adjacent pair whose joined piece scores highest, which BPE
    reproduces when the merges are ranked by that score.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens.

    Both are matched whole in text, as llama.cpp does; each keeps its vocabulary id.
    """
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in (CONTROL, UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _special_tokens(metadata: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """{"bos": "<s>", ...} for the special ids the file names and that exist."""
    found = {}
    for short, key in _SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            found[short] = tokens[int(token_id)]
    return found


def _special_pair(metadata: dict[str, Any], tokens: list[str], key: str) -> tuple[str, int]:
    token_id = int(metadata[f"tokenizer.ggml.{key}_token_id"])
    return tokens[token_id], token_id


def _post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None, *, byte_level: bool
) -> Any:
    """Add BOS and/or EOS around encoded text, as the file's flags say."""
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos or eos:

        def sequence(piece: str, type_id: int) -> list[str]:
            around = [f"{bos[0]}:{type_id}"] if bos else []
            return [*around, f"{piece}:{type_id}"] + ([f"{eos[0]}:{type_id}"] if eos else [])

        steps.append(
            processors.TemplateProcessing(
                single=sequence("$A", 0),
                pair=sequence("$A", 0) + sequence("$B", 1),
                special_tokens=[t for t in (bos, eos) if t],
            )
        )
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def _tokenizer_config(
    metadata: dict[str, Any], specials: dict[str, str], *, add_bos: bool, add_eos: bool
) -> dict[str, Any]:
    """`tokenizer_config.json`: a plain fast tokenizer over `tokenizer.json`, plus the template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        **{f"{k}_token": v for k, v in specials.items()},
    }
    arch = metadata.get("general.architecture")
    if (context := metadata.get(f"{arch}.context_length")) is not None:
        config["model_max_length"] = int(context)
    if (template := metadata.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def _eos_token_ids(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    """EOS plus the end-of-turn tokens llama.cpp stops on (by id key, or by their text)."""
    ids = [
        int(metadata[f"tokenizer.ggml.{key}_token_id"])
        for key in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{key}_token_id" in metadata
    ]
    ids += [i for i, t in enumerate(tokens) if t in _END_OF_TURN and types[i] == CONTROL]
    return sorted(set(ids), key=ids.index)
