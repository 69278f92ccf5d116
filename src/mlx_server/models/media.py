"""Image and video inputs: check and decode what a request's media parts refer to (read by
``media_read``).

Every failure is an ``InvalidRequest`` (HTTP 400) naming the message part it came from,
e.g. ``messages[1].content[2]``.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

from mlx_server.errors import InvalidRequest

# MediaLimits: the caps the start-up and the vision models hand in, with the media.
from mlx_server.models.media_read import MediaLimits, local_path, read_bytes, too_large

# Pillow plugins we let parse untrusted bytes; other formats are refused, not guessed at.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
LOW_DETAIL_SIZE = 512  # OpenAI's "detail": "low" works on a 512x512 image


@dataclass
class Media:
    """Decoded media of one request, in prompt order."""

    images: list[Any] = field(default_factory=list)  # PIL images, RGB
    videos: list[str] = field(default_factory=list)  # local file paths
    _temp: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.images or self.videos)

    def cleanup(self) -> None:
        """Delete the temporary files written for videos that arrived as bytes."""
        for p in self._temp:
            try:
                os.unlink(p)
            except OSError:
                pass
        self._temp.clear()


def media_parts(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """``(kind, part, where)`` for every image/video part of neutral messages, in order."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "video"):
                found.append((kind, part, part_where(i, j, part)))
    return found


def part_where(i: int, j: int, part: dict[str, Any]) -> str:
    """Where a part was in the request: its ``param`` hint, else ``messages[i].content[j]``."""
    hint = part.get("param")
    return hint if isinstance(hint, str) and hint else f"messages[{i}].content[{j}]"


def collect_media(messages: list[dict[str, Any]], limits: MediaLimits) -> Media:
    """Read, check and decode every image and video of the messages (InvalidRequest on error)."""
    parts = media_parts(messages)
    if len(parts) > limits.max_images:
        where = parts[limits.max_images][2]
        raise InvalidRequest(
            f"{where}: too many images/videos in this request (at most {limits.max_images})",
            param=where,
        )
    media = Media()
    try:
        for kind, part, where in parts:
            ref = part.get(kind)
            if not isinstance(ref, str) or not ref.strip():
                raise InvalidRequest(f"{where}: the {kind} URL is missing or empty", param=where)
            if kind == "image":
                data = read_bytes(ref.strip(), where, limits, limits.max_image_bytes)
                media.images.append(decode_image(data, where, limits, part.get("detail")))
            else:
                media.videos.append(_video_file(ref.strip(), where, limits, media))
    except BaseException:
        media.cleanup()
        raise
    return media


# ---- decoding -----------------------------------------------------------------------------


def decode_image(data: bytes, where: str, limits: MediaLimits, detail: Any = None) -> Any:
    """Bytes → an RGB PIL image (EXIF orientation applied), within the pixel limit."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Our own pixel limit applies below; Pillow's bomb warning would pre-empt it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            src = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        w, h = src.size
        if w * h > limits.max_image_pixels:
            raise InvalidRequest(
                f"{where}: the image is {w}x{h} ({w * h:,} pixels), more than this server's "
                f"limit of {limits.max_image_pixels:,} pixels",
                param=where,
            )
        img = ImageOps.exif_transpose(src).convert("RGB")
    except InvalidRequest:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequest(f"{where}: the image has too many pixels ({e})", param=where) from e
    except UnidentifiedImageError as e:
        raise InvalidRequest(
            f"{where}: not an image in a supported format ({', '.join(IMAGE_FORMATS)})",
            param=where,
        ) from e
    except Exception as e:  # truncated or corrupt data: OSError, SyntaxError, ValueError...
        raise InvalidRequest(
            f"{where}: the image could not be decoded ({type(e).__name__}: {e})", param=where
        ) from e
    if detail == "low":
        img.thumbnail((LOW_DETAIL_SIZE, LOW_DETAIL_SIZE))
    return img


# Container signatures we hand to the video decoder. Anything else (playlists, images,
# text) is refused: FFmpeg would otherwise follow references inside files such as HLS
# playlists, which is the same request forgery remote URLs are refused for.
_VIDEO_MAGIC = (
    (4, b"ftyp"),  # MP4, MOV, M4V, 3GP
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska, WebM
    (8, b"AVI "),  # AVI (RIFF)
)


def is_video_container(head: bytes) -> bool:
    """Whether the first bytes look like an MP4/MOV, Matroska/WebM or AVI file."""
    return any(head[off : off + len(sig)] == sig for off, sig in _VIDEO_MAGIC)


def _video_file(ref: str, where: str, limits: MediaLimits, media: Media) -> str:
    low = ref[:16].lower()
    if low.startswith(("data:", "http://", "https://")):
        data = read_bytes(ref, where, limits, limits.max_video_bytes)
        head = data[:16]
        path = None
    else:
        p = local_path(ref, where)
        if p.stat().st_size > limits.max_video_bytes:
            raise too_large(where, p.stat().st_size, limits.max_video_bytes)
        with p.open("rb") as f:
            head = f.read(16)
        path = str(p)
    if not is_video_container(head):
        raise InvalidRequest(
            f"{where}: not a video in a supported container (MP4/MOV, WebM/MKV, AVI)",
            param=where,
        )
    if path is None:
        fd, path = tempfile.mkstemp(prefix="mlx-server-video-")
        media._temp.append(path)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return path
