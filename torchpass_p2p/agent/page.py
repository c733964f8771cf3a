"""The status page: ``GET /`` with its script and style sheet, static files shipped as package
data (``torchpass_p2p/agent/page/``, read with :mod:`importlib.resources`; no build step, nothing
fetched from elsewhere). The script opens ``/events`` (:mod:`.sse`) and draws every status
document it receives: members, configurations, recoveries, the state transfer, stragglers.

The page never interprets data as markup: the script builds every node with ``textContent``
(member ids, event details and error strings may hold anything a peer or a GPU driver sent), and
the Content-Security-Policy below allows only this server's own script and style, no inline
code, no frames, no form targets: a string that got through as markup still could not run.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

__all__ = ["FILES", "SECURITY_HEADERS", "serve_file"]

FILES = {
    "/": ("status.html", "text/html"),
    "/page.js": ("status.js", "text/javascript"),
    "/page.css": ("status.css", "text/css"),
}
"""Route -> (file under ``page/``, media type)."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return (resources.files(__package__) / "page" / name).read_bytes()


def serve_file(path: str) -> web.Response:
    """The response for ``path``, one of :data:`FILES`.

    Raises:
        KeyError: ``path`` is not one of them.
        OSError: the package was installed without its data files.
    """
    name, media_type = FILES[path]
    return web.Response(body=_read(name), content_type=media_type, charset="utf-8",
                        headers=SECURITY_HEADERS)
