"""Strict request headers: what RFC 9110 and RFC 9112 refuse, refused with a 400.

The standard library reads headers leniently, the way a mail reader reads mail: a line
without a colon, a space before the colon, a continuation line folded under the one
before it, a NUL byte in a value all pass, and a repeated header is simply there twice.
Leniency is dangerous in a server: when two programs read one request differently — a
proxy in front and this server behind it — a request can be smuggled past the proxy's
checks. `Transfer-Encoding : chunked` is a header named "Transfer-Encoding " to one and
the body's framing to the other; of two `Host` headers a proxy may check one while the
server answers the other. So, as h11 and the RFCs do, only one reading is accepted:

* every header line is `name: value`, the name a token (no space before the colon), the
  value visible characters, spaces and tabs only (no NUL, CR, LF or other controls), and
  no line starts with whitespace (obsolete line folding, RFC 9112 section 5.2);
* `Host` comes once and is a valid `host[:port]` (no `user@`), and an HTTP/1.1 request
  has one (RFC 9112 section 3.2); `Content-Type`, `Authorization` and `Origin` come once;
* a body is framed by one `Content-Length`: repeats of the same value are harmless (RFC
  9110 section 8.6), different values or `Transfer-Encoding` beside it are refused
  (RFC 9112 section 6.3), and `Transfer-Encoding` alone is a 501 (not implemented here).
"""

from __future__ import annotations

import re
from email.message import Message

from nanoqwen.server.protocol import APIError, bad_request

# RFC 9110 section 5.1: a field name is a token; section 5.5: a value is visible characters
# (and obs-text) with spaces and tabs inside, optional whitespace around it.
HEADER_LINE = re.compile(
    rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[ \t]*(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*"
    rb"[\x21-\x7e\x80-\xff])?)?[ \t]*\r?\n"
)
# RFC 9110 section 7.2 with RFC 3986's authority: an IP literal, or a name of unreserved,
# percent-encoded and sub-delimiter characters, and an optional port. No "user@".
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(:[0-9]*)?")
SINGLE_HEADERS = ("Host", "Content-Type", "Authorization", "Origin")


def check_header_lines(lines: list[bytes]) -> None:
    """A 400 unless every header line (the blank line that ends them excluded) is a
    well-formed `name: value` line."""
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise bad_request("the request folds a header over several lines (obsolete line "
                              "folding), which is not allowed")
        if not HEADER_LINE.fullmatch(line):
            name = line.partition(b":")[0][:64].decode("latin-1")
            raise bad_request(f"the request has a malformed header line starting {name!r}: a "
                              "header is 'Name: value', with no space before the colon and "
                              "no control characters in the value")


def check_headers(headers: Message, request_version: str) -> None:
    """A 400 for a missing, repeated or invalid Host, and for other headers repeated."""
    for name in SINGLE_HEADERS:
        if len(headers.get_all(name, [])) > 1:
            raise bad_request(f"the request has more than one {name} header")
    host = headers.get("Host")
    if host is None:
        if request_version >= "HTTP/1.1":
            raise bad_request("an HTTP/1.1 request needs a Host header")
    elif not HOST.fullmatch(host):
        raise bad_request(f"the Host header is not a valid host[:port]: {host!r}")


def declared_body_length(headers: Message) -> int:
    """The body's length, from its one Content-Length (0 without one)."""
    lengths = headers.get_all("Content-Length", [])
    if "Transfer-Encoding" in headers:  # a proxy may frame the body by it, not by length
        if lengths:
            raise bad_request("the request has both Transfer-Encoding and Content-Length; "
                              "send only a Content-Length")
        raise APIError(501, "Transfer-Encoding is not supported; send a Content-Length",
                       code="transfer_encoding_not_supported")
    values = {value.strip() for value in lengths or ["0"]}
    if len(values) > 1:  # repeats of one value are harmless (RFC 9110, section 8.6)
        raise bad_request(f"the request has conflicting Content-Length headers: "
                          f"{', '.join(sorted(values))}")
    (value,) = values
    if not (value.isascii() and value.isdigit()):
        raise bad_request(f"Content-Length must be a non-negative integer, got {value!r}")
    return int(value)
