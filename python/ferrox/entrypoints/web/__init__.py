"""The page at `/` for people: a chat playground and a live view of the server.

Plain HTML/CSS/JS under static/, served as files by the same aiohttp app: no build step and
nothing fetched from the internet, so it works on an air-gapped machine. The live view reads
the small JSON route `/status` (status.py).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parent / "static"


async def index(request: web.Request) -> web.FileResponse:
    """GET /: the playground page."""
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/", index)
    router.add_static("/static/", STATIC_DIR, append_version=False)
