"""The chat page: the static files behind `GET /`, and the headers that lock them down.

The page is a whole chat client in the browser (`static/index.html`, `chat.js`,
`chat.css`, and two vendored libraries that render the model's markdown safely). The
conversations live in the browser's localStorage; the server stays stateless and only
serves these files and the API the page calls.

Every file is read once, at import, into `PAGE_FILES`: URL path -> `StaticFile`. Serving
is a lookup of the exact path in that table, so no URL can reach another file on disk
(`/static/../app.py` is simply not a key). Each answer carries:

* an ETag (a hash of the bytes) and `Cache-Control: no-cache`: browsers keep the files
  and ask each time whether they changed, so a reload after an upgrade gets the new page
  while an unchanged file costs a `304 Not Modified` and no bytes;
* a Content-Security-Policy that lets the page run only scripts and styles this server
  serves (no inline script, no other origin) and talk only to this server, so markdown
  from the model that slipped a `<script>` or a remote `<img>` past the sanitizer still
  cannot run or phone home; and `X-Frame-Options: DENY` (with CSP's `frame-ancestors`)
  so no other site can frame the page and trick clicks out of its user.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CONTENT_TYPES = {  # by file suffix; files of other kinds (an editor's backups) are not served
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".md": "text/plain; charset=utf-8",  # the vendored libraries' notes and licenses
    ".txt": "text/plain; charset=utf-8",
}
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",  # fetch() to this server's API, nowhere else
    "img-src 'self' data:",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",  # a .js file is never taken for anything else
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # keep, but revalidate: see the module docstring
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str  # a strong validator: quoted, and changes whenever the bytes do


def load_files(folder: Traversable, prefix: str) -> dict[str, StaticFile]:
    """Every file under `folder`, keyed by its URL path (`prefix` + relative path)."""
    files = {}
    for entry in folder.iterdir():
        url = prefix + entry.name
        if entry.is_dir():
            files.update(load_files(entry, url + "/"))
            continue
        content_type = CONTENT_TYPES.get("." + entry.name.rpartition(".")[2])
        if content_type is None:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        files[url] = StaticFile(body, content_type, etag)
    return files


def page_files() -> dict[str, StaticFile]:
    """The table the server answers from: `/` is the page, `/static/...` what it loads."""
    files = load_files(resources.files("nanoqwen.server") / "static", "/static/")
    return {"/": files["/static/index.html"], **files}


PAGE_FILES = page_files()


def answer(path: str, if_none_match: str | None) -> tuple[int, bytes, str, dict[str, str]]:
    """(status, body, content type, headers) for a GET of `path`, a key of `PAGE_FILES`:
    the file, or `304 Not Modified` when the browser's copy (its If-None-Match) is current."""
    file = PAGE_FILES[path]
    headers = {**SECURITY_HEADERS, "ETag": file.etag}
    if not is_fresh(file, if_none_match):
        return 200, file.body, file.content_type, headers
    # No body; a 304's Content-Length, if sent, must be the file's own.
    return 304, b"", file.content_type, {**headers, "Content-Length": str(len(file.body))}


def is_fresh(file: StaticFile, if_none_match: str | None) -> bool:
    """Whether the browser's copy (named by its If-None-Match header) is this file."""
    if if_none_match is None:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return file.etag in tags or "*" in tags
