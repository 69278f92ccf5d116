"""Drafter kinds named by ``--draft-kind`` (the Jan fork's flag): which are built, which not."""

from __future__ import annotations

BUILT = {"model": "a draft model (--draft-model)", "ngram": "prompt lookup (--prompt-lookup)"}
# Named by other servers (mlx-vlm, vllm-mlx, llama.cpp), not built here yet.
NOT_BUILT = ("dflash", "eagle3", "mtp")


def draft_kind_problem(
    kind: str | None, prompt_lookup: bool, draft_model: str | None
) -> str | None:
    """Why the speculative-decoding flags do not go together, or None."""
    if kind is None:
        return None
    if kind in NOT_BUILT:
        return f"--draft-kind {kind!r} is not built in this server; built kinds: " + ", ".join(
            f"{k} ({v})" for k, v in BUILT.items()
        )
    if kind not in BUILT:
        return f"--draft-kind: unknown kind {kind!r}; valid: {', '.join([*BUILT, *NOT_BUILT])}"
    if kind == "model" and not draft_model:
        return "--draft-kind model needs --draft-model PATH"
    if kind == "ngram" and draft_model:
        return "--draft-kind ngram does not use --draft-model; drop one of them"
    return None
