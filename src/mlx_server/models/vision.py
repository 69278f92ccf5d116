"""Vision-language models: detection, loading through mlx-vlm, and prompt building with media.

mlx-vlm is an optional dependency (``pip install 'mlx-server[vision]'``); it is imported
only when a model that needs it is loaded, so the text-only server runs without it.

Neutral messages carry media as Hugging Face style content parts,
``{"type": "image", "image": <url>}`` and ``{"type": "video", "video": <url>}``, optionally
with ``"param"`` (where the part was in the protocol request, for error messages) and
``"detail"``. The prompt builder turns them into the model's own placeholders (through
mlx-vlm's per-model message formats), renders the chat template as the text path does,
and lets the model's processor expand the placeholders into image tokens and pixels.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.models.base import (
    LoadedModel,
    ModelLoadError,
    read_chat_template,
    settle_arrays,
)
from mlx_server.models.cuda_paths import install_cuda_paths
from mlx_server.models.media import Media, MediaLimits, collect_media, part_where
from mlx_server.models.media_key import CACHE_TOKENS, cache_key, media_digest, placeholder_ids
from mlx_server.models.template_override import install_chat_template
from mlx_server.models.vlm_repairs import repair_loaded

INSTALL_HINT = "pip install 'mlx-server[vision]'  (or: pip install mlx-vlm)"

# Config keys that declare a vision tower. mlx-vlm itself tells VLMs apart by
# "vision_config"; LLaVA-style checkpoints (FastVLM) name their tower "mm_vision_tower".
_VISION_KEYS = ("vision_config", "mm_vision_tower")


Encoded = tuple[list[int], Any]  # token ids, and the model's other inputs (or None)


def is_vision_config(config: dict[str, Any]) -> bool:
    """Whether a model config declares a vision tower."""
    return any(config.get(k) for k in _VISION_KEYS)


def is_vision_model(model_dir: Path) -> bool:
    """Whether the model directory holds a vision-language model (by its config.json)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and is_vision_config(config)


def load_vision_model(
    model_dir: Path, *, model_id: str, dtype: str | None = None, chat_template: str = ""
) -> LoadedModel:
    """Load a vision-language model and its processor with mlx-vlm. Raises ModelLoadError."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(
            f"the model in {model_dir} is a vision-language model, which needs mlx-vlm: "
            f"{INSTALL_HINT}"
        ) from e
    try:
        import mlx.core as mx
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_vlm.utils import load as vlm_load

        net, processor = vlm_load(str(model_dir))
        if dtype is not None and not getattr(net.config, "quantization", None):
            net.set_dtype(getattr(mx, dtype))
        settle_arrays(net)
        for repair in repair_loaded():
            log(f"Vision: mlx-vlm repaired ({repair})")
        for line in install_cuda_paths(net):
            log(line)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        tokenizer = load_tokenizer(model_dir, eos_token_ids=_eos_ids(model_dir, config, processor))
    except Exception as e:
        raise ModelLoadError(f"{type(e).__name__}: {e}") from e
    template = read_chat_template(model_dir) or getattr(processor, "chat_template", None)
    if not (isinstance(template, str | dict) and template):
        template = None
    install_chat_template(tokenizer, template, chat_template)
    if getattr(tokenizer._tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"the model in {model_dir} has no chat template")
    log(f"Vision-language model ({config.get('model_type')}) loaded with mlx-vlm")
    return LoadedModel(
        model_id=model_id,
        path=model_dir,
        model=net,
        tokenizer=tokenizer,
        config=config,
        capabilities=["vision"],
        processor=processor,
    )


def _eos_ids(model_dir: Path, config: dict[str, Any], processor: Any) -> list[int] | None:
    """End-of-turn ids from every place VLM checkpoints declare them: config.json (top level
    or text_config), generation_config.json, and the processor (Idefics3's end of utterance)."""
    found: list[int] = []
    sources: list[Any] = [config, config.get("text_config") or {}]
    try:
        sources.append(json.loads((model_dir / "generation_config.json").read_text()))
    except (OSError, ValueError):
        pass
    for src in sources:
        eos = src.get("eos_token_id") if isinstance(src, dict) else None
        found += [eos] if isinstance(eos, int) else [e for e in eos or [] if isinstance(e, int)]
    extra = getattr(processor, "additional_eos_token_ids", None)
    found += [e for e in extra or [] if isinstance(e, int)]
    return sorted(set(found)) or None


class VisionPromptBuilder:
    """Media-aware prompt building for one vision-language model."""

    def __init__(self, processor: Any, config: dict[str, Any], limits: MediaLimits):
        from mlx_vlm.utils import get_model_type

        self.processor = processor
        self.config = config
        self.model_type = get_model_type(config) or str(config.get("model_type", ""))
        self.limits = limits
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.placeholders = placeholder_ids(config, processor)  # media tokens in the prompt

    # ---- rendering -----------------------------------------------------------------------

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages for the chat template: media parts become the model's placeholders."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):
                m = {**m, "content": self._content(i, m.get("role", "user"), content)}
            out.append(m)
        return out

    def _content(self, i: int, role: str, parts: list[dict[str, Any]]) -> Any:
        kinds = [p.get("type") if isinstance(p, dict) else None for p in parts]
        media = [(j, p) for j, p in enumerate(parts) if kinds[j] in ("image", "video")]
        if not media:
            return "\n".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))
        first = part_where(i, *media[0])
        keep = [
            {"type": "image"} if k == "image" else p
            for p, k in zip(parts, kinds, strict=True)
            if k in ("image", "text")
        ]
        if role == "tool" and "video" not in kinds:
            # Tool results (screenshots) stay Hugging Face parts, as mlx-vlm passes them on;
            # whether the template shows them is checked once the prompt is rendered.
            return keep
        if role != "user":
            raise InvalidRequest(
                f"{first}: images and videos are accepted in user messages and tool results only",
                param=first,
            )
        content = self._format(keep, kinds.count("image"))
        videos = [(j, p) for j, p in media if kinds[j] == "video"]
        if videos:
            where = part_where(i, *videos[0])
            if not isinstance(content, list) or not getattr(
                self.processor, "video_processor", None
            ):
                raise InvalidRequest(f"{where}: this model does not accept video", param=where)
            content = [{"type": "video"}] * len(videos) + content
        return content

    def _format(self, parts: list[dict[str, Any]], n_images: int) -> Any:
        """The user content in the model's image convention (mlx-vlm's message formats)."""
        from mlx_vlm.prompt_utils import MODEL_CONFIG, get_message_json

        if self.model_type not in MODEL_CONFIG:
            return parts  # Hugging Face parts, which multimodal chat templates understand
        try:
            msg = get_message_json(self.model_type, parts, "user", num_images=n_images)
        except ValueError as e:  # e.g. a model that takes one image per request
            raise InvalidRequest(str(e), param="messages") from e
        return msg["content"] if isinstance(msg, dict) else msg

    # ---- encoding ------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        messages: list[dict[str, Any]],
        on_mlx_thread: Callable[[Callable[[], Encoded]], Encoded] | None = None,
    ) -> Encoded:
        """Token ids (image placeholders expanded) and the processor's model inputs, or None.

        Fetching and decoding the media happens in the calling thread (a worker: fetches can
        take seconds); the processor, which makes MLX arrays, runs through
        ``on_mlx_thread`` (the engine thread's ``call``), or right here when None."""
        media = collect_media(messages, self.limits)
        if not media:
            ids = self.tokenizer.encode(text, add_special_tokens=self._add_bos(text))
            if not ids:
                raise InvalidRequest("the rendered prompt is empty", param="messages")
            return list(ids), None
        try:
            self._check_tool_images(text, messages, len(media.images))
            digests = [media_digest(m) for m in [*media.images, *media.videos]]
            run = on_mlx_thread or (lambda fn: fn())
            tokens, inputs = run(lambda: self._model_inputs(text, media))
        finally:
            media.cleanup()
        key = cache_key(tokens, digests, self.placeholders, videos=bool(media.videos))
        if key is not None:
            inputs[CACHE_TOKENS] = key
        return tokens, inputs

    def _model_inputs(self, text: str, media: Media) -> Encoded:
        inputs = self._process(text, media)
        ids = inputs.pop("input_ids")
        tokens = [int(t) for t in (ids[0] if getattr(ids, "ndim", 1) > 1 else ids).tolist()]
        return tokens, inputs

    def _add_bos(self, text: str) -> bool:
        """Whether tokenizing should add BOS: the template usually writes it itself (as the
        text path assumes); some VLM templates leave it to the processor (as mlx-vlm does)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        return isinstance(bos, str) and bool(bos) and not text.startswith(bos)

    def _check_tool_images(self, text: str, messages: list[dict[str, Any]], n: int) -> None:
        """Images in tool results reach the prompt only if the template renders them there:
        then the rendered text holds one image placeholder per image."""
        where = next(iter(_tool_images(messages)), None)
        token = getattr(self.processor, "image_token", None)
        if where is not None and (not isinstance(token, str) or text.count(token) != n):
            raise InvalidRequest(
                f"{where}: this model's chat template does not show images in tool results",
                param=where,
            )

    def _process(self, text: str, media: Media) -> dict[str, Any]:
        from mlx_vlm.utils import prepare_inputs

        video_token = getattr(self.processor, "video_token", None)
        if media.videos and isinstance(video_token, str) and video_token not in text:
            raise InvalidRequest(
                "this model's chat template does not place videos in the prompt",
                param="messages",
            )
        try:
            return dict(
                prepare_inputs(
                    self.processor,
                    images=media.images or None,
                    videos=media.videos or None,
                    prompts=text,
                    image_token_index=self.config.get("image_token_index"),
                    add_special_tokens=self._add_bos(text),
                )
            )
        except InvalidRequest:
            raise
        except Exception as e:  # the processor rejects the media or the placeholders
            raise InvalidRequest(
                f"the model's processor could not prepare this request's media: "
                f"{type(e).__name__}: {e}",
                param="messages",
            ) from e


def _tool_images(messages: list[dict[str, Any]]) -> list[str]:
    """Where each image part of a tool-result message is."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") == "tool" and isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") == "image":
                    out.append(part_where(i, j, p))
    return out
