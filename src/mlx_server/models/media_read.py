"""Reading a media reference's bytes, within the caps of ``MediaLimits``.

A media reference is a string: a ``data:`` URL (base64), a ``file://`` URL or an absolute
path on the server's machine, or an ``http(s)://`` URL. Remote URLs are refused unless the
server runs with ``--allow-remote-images``: a local server that fetches any URL it is given
lets every web page or client that can reach it make requests from the user's machine (to
the LAN, to cloud metadata endpoints, to localhost services) — server-side request forgery.
Local paths are the user's own files on the user's own machine, as in Jan.

Every failure is an ``InvalidRequest`` (HTTP 400) naming the message part it came from.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mlx_server.errors import InvalidRequest

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
        raise too_large(where, size, max_bytes)
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
        raise too_large(where, len(payload) * 3 // 4, max_bytes)
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
                raise too_large(where, int(declared), max_bytes)
            while chunk := resp.read(64 * 1024):
                got += len(chunk)
                if got > max_bytes:
                    raise too_large(where, got, max_bytes)
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


def too_large(where: str, size: int, limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: the media is {size / MB:.1f} MB, more than this server's limit of "
        f"{limit / MB:.1f} MB",
        param=where,
    )


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
