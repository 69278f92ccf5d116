"""Image and video inputs: read, check and decode what a request's media parts refer to.

A media reference is a string: a ``data:`` URL (base64), a ``file://`` URL or an absolute
path on the server's machine, or an ``http(s)://`` URL. Remote URLs are refused unless the
server runs with ``--allow-remote-images``: a local server that fetches any URL it is given
lets every web page or client that can reach it make requests from the user's machine (to
the LAN, to cloud metadata endpoints, to localhost services) — server-side request forgery.
Local paths are the user's own files on the user's own machine, as in Jan.

Every failure is an ``InvalidRequest`` (HTTP 400) naming the message part it came from,
e.g. ``messages[1].content[2]``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_server.errors import InvalidRequest

# Pillow plugins we let parse untrusted bytes; other formats are refused, not guessed at.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
LOW_DETAIL_SIZE = 512  # OpenAI's "detail": "low" works on a 512x512 image
MB = 1 << 20


@dataclass(frozen=True)
class MediaLimits:
    """Caps on the media of one request (the server's ``--max-image*`` flags)."""

    max_images: int = 16
    max_image_bytes: int = 20 * MB
    max_image_pixels: int = 50_000_000
    max_video_bytes: int = 100 * MB
    allow_remote: bool = False
    fetch_timeout: float = 10.0


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


# ---- reading ------------------------------------------------------------------------------


def read_bytes(ref: str, where: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """The bytes a media reference points to, at most ``max_bytes`` of them."""
    low = ref[:16].lower()
    if low.startswith("data:"):
        return _data_url(ref, where, max_bytes)
    if low.startswith(("http://", "https://")):
        return _fetch(ref, where, limits, max_bytes)
    path = local_path(ref, where)
    size = path.stat().st_size
    if size > max_bytes:
        raise _too_large(where, size, max_bytes)
    return path.read_bytes()


def local_path(ref: str, where: str) -> Path:
    """A ``file://`` URL or an absolute path → an existing regular file, else InvalidRequest."""
    if ref.lower().startswith("file://"):
        raw = ref[len("file://") :]
        if raw.lower().startswith("localhost/"):
            raw = raw[len("localhost") :]
        # Percent-decoded, as a URL should be; fall back to the raw text, as Jan does for
        # paths pasted with unencoded spaces.
        candidates = [urllib.parse.unquote(raw), raw]
    elif os.path.isabs(ref):
        candidates = [ref]
    else:
        raise InvalidRequest(
            f"{where}: unsupported media URL (use a data: URL, a file:// URL or an absolute "
            f"path, or an http(s) URL where the server allows them): {_short(ref)}",
            param=where,
        )
    for c in candidates:
        p = Path(c)
        if p.is_file():
            return p
    p = Path(candidates[0])
    what = "is not a file" if p.exists() else "does not exist"
    raise InvalidRequest(f"{where}: the path {_short(str(p))} {what}", param=where)


def _data_url(ref: str, where: str, max_bytes: int) -> bytes:
    head, sep, payload = ref.partition(",")
    mime = head[5:].split(";")[0].strip().lower()
    if not sep or ";base64" not in head.lower():
        raise InvalidRequest(
            f"{where}: a data URL must be base64 encoded (data:image/png;base64,...)", param=where
        )
    if mime and not mime.startswith(("image/", "video/", "application/octet-stream")):
        raise InvalidRequest(f"{where}: unsupported media type '{mime}'", param=where)
    payload = "".join(payload.split())  # base64 wrapped over lines
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise _too_large(where, len(payload) * 3 // 4, max_bytes)
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"{where}: the data URL is not valid base64 ({e})", param=where) from e
    if not data:
        raise InvalidRequest(f"{where}: the data URL is empty", param=where)
    return data


def _fetch(url: str, where: str, limits: MediaLimits, max_bytes: int) -> bytes:
    if not limits.allow_remote:
        raise InvalidRequest(
            f"{where}: this server does not fetch remote URLs ({_short(url)}); send the image "
            "as a data: URL, or start the server with --allow-remote-images",
            param=where,
        )
    req = urllib.request.Request(url, headers={"User-Agent": "mlx-server"})
    deadline = time.monotonic() + limits.fetch_timeout
    chunks: list[bytes] = []
    got = 0
    try:
        with urllib.request.urlopen(req, timeout=limits.fetch_timeout) as resp:
            declared = resp.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(where, int(declared), max_bytes)
            while chunk := resp.read(64 * 1024):
                got += len(chunk)
                if got > max_bytes:
                    raise _too_large(where, got, max_bytes)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"took longer than {limits.fetch_timeout:g}s")
                chunks.append(chunk)
    except InvalidRequest:
        raise
    except Exception as e:  # URLError, HTTPError, timeouts, bad URLs, connection resets
        raise InvalidRequest(
            f"{where}: could not fetch {_short(url)}: {type(e).__name__}: {e}", param=where
        ) from e
    return b"".join(chunks)


def _too_large(where: str, size: int, limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: the media is {size / MB:.1f} MB, more than this server's limit of "
        f"{limit / MB:.1f} MB",
        param=where,
    )


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


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
            raise _too_large(where, p.stat().st_size, limits.max_video_bytes)
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
