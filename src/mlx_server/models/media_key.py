"""The prefix cache's key for a prompt with images or videos.

Two prompts with the same tokens but different pictures have the same placeholder tokens
and different KV states, so the prefix cache cannot key them by tokens alone. The key here
is the prompt's tokens with every media placeholder replaced by a negative id (no token is
negative) drawn from a digest of the media: the same image in the next turn gives the same
key, a different image at the same place a different one, from that place on.

Which image a placeholder belongs to is the model's layout (one run of placeholders per
image for Qwen-VL, Gemma 3 or LLaVA; one per tile for Idefics3, one per row for Pixtral).
The key does not need it: the r-th run of placeholders carries the digest of the first
``r + 1`` media (all of them from the last one on). Each media item has at least one run,
and runs come in the media's order, so run ``r`` belongs to one of the first ``r + 1``: its
key covers every picture the KV state there has seen. With one run per image the key is
exact (a second image in a later turn leaves the first one's prefix a hit); with more, a
hit reaches at least the first image's first run. A prompt with videos keys every run by
all its media (videos come after the images in the processor's inputs, wherever they sit
in the prompt). The ids are spread over a run's positions, eight 31-bit slices of a
SHA-256 in turn, and fit the disk tier's 32-bit tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any

_SLICES = 8  # 31-bit ids a 256-bit digest gives
# Where the prompt builder leaves the key among a prompt's model inputs, for the request.
CACHE_TOKENS = "cache_tokens"


def media_digest(item: Any) -> bytes:
    """A digest of one image (a PIL image: its mode, size and pixels) or video (a file)."""
    h = hashlib.sha256()
    if isinstance(item, str):  # a video file
        with open(item, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(f"{item.mode}:{item.size}".encode())
        h.update(item.tobytes())
    return h.digest()


def placeholder_ids(config: dict[str, Any], processor: Any) -> set[int]:
    """The token ids that stand for media in this model's prompts."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    found: set[int] = set()  # (a model without any: cache_key's fallback)
    for src in (config, text or {}):
        for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
            v = src.get(name)
            if isinstance(v, int) and v >= 0:
                found.add(v)
    tokenizer = getattr(processor, "tokenizer", processor)
    for attr in ("image_token", "video_token"):
        token = getattr(processor, attr, None)
        if isinstance(token, str) and token:
            try:
                tid = tokenizer.convert_tokens_to_ids(token)
            except Exception:
                continue
            unk = getattr(tokenizer, "unk_token_id", None)
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                found.add(tid)
    return found


def cache_key(
    tokens: list[int], digests: list[bytes], placeholders: set[int], videos: bool = False
) -> list[int] | None:
    """``tokens`` with each placeholder run keyed by the media (see the module docstring);
    None without media. Where no placeholder is found, every token is keyed with the digest
    of all the media: only the same media and the same tokens hit."""
    if not digests:
        return None
    chained = []  # chained[i]: the digest of the first i + 1 media
    h = hashlib.sha256()
    for d in digests:
        h.update(d)
        chained.append(h.copy().digest())
    key = list(tokens)
    run, k, seen = -1, 0, False
    for i, t in enumerate(tokens):
        if t not in placeholders:
            seen = False
            continue
        if not seen:
            run, k, seen = run + 1, 0, True
        digest = chained[-1] if videos else chained[min(run, len(chained) - 1)]
        key[i] = _id(digest, k)
        k += 1
    if run >= 0:
        return key
    everything = chained[-1]
    return [_id(everything, i, t) for i, t in enumerate(tokens)]


def _id(digest: bytes, k: int, token: int = 0) -> int:
    """A negative 31-bit id from the ``k``-th slice of ``digest`` (offset by ``token``)."""
    j = (k % _SLICES) * 4
    return -1 - ((int.from_bytes(digest[j : j + 4], "little") + token) & 0x7FFFFFFF)
