"""The chat page at ``/``: static files shipped inside the package, no build step.

The page is a client of the public API like any other (``/v1/models``,
``/v1/chat/completions``, ``/v1/cancel``, ``/health``, ``/metrics``). Its files need no API
key (the page learns that one is needed from a 401 and asks the user for it); the API keeps
its own rules. Every answer carries a strict Content-Security-Policy: scripts and styles come
only from this server, nothing inline runs, and the page connects only to its own origin.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from mlx_server.errors import NotFound

STATIC = Path(__file__).parent / "static"

# img-src allows data: and blob: for the user's own attached images; model output never gets
# an <img> (the sanitizer drops it), so nothing leaves the machine through an image URL.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".md": "text/plain; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE files
}


def asset_path(name: str) -> Path | None:
    """The file under ``static/`` that ``name`` names, or None: nothing outside it, no
    hidden files, only the kinds of file the page is made of."""
    if not name or any(part.startswith(".") or not part for part in name.split("/")):
        return None
    path = (STATIC / name).resolve()
    if not path.is_relative_to(STATIC.resolve()) or not path.is_file():
        return None
    return path if path.suffix in MEDIA_TYPES else None


def _file(path: Path) -> Response:
    return Response(
        path.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS
    )


def make_router() -> APIRouter:
    router = APIRouter()

    @router.get("/")
    async def page() -> Response:
        return _file(STATIC / "index.html")

    @router.get("/webui/{name:path}")
    async def asset(name: str) -> Response:
        path = asset_path(name)
        if path is None:
            raise NotFound(f"no file {name!r} in the web UI")
        return _file(path)

    return router
