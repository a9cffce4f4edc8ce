"""Socket reads and writes with time limits: what keeps one slow or vanished client from
holding a server thread (and, through its request, KV pages) for long.

* `DeadlineReader` — every read of one request ends by a single deadline, so a client
  sending a byte a second cannot stretch its request out;
* `ProgressWriter` — a write fails once the client takes nothing from a full send buffer
  for `timeout` seconds; any progress starts the wait again, so a slow reader is served
  and a stalled one is not;
* `client_writes` — turns a failed or stalled write into `ClientDisconnected`, the one
  signal the routes act on: abort the request, free its pages.
"""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ClientDisconnected(Exception):
    """The client closed its connection: there is nobody left to answer."""


class DeadlineReader(io.RawIOBase):
    """Socket reads that all end by one deadline, however slowly the bytes trickle in."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        self.connection, self.deadline = connection, deadline
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request was not received in time")
        self.connection.settimeout(remaining)
        count = self.connection.recv_into(buffer)
        self.received += count
        return count


class ProgressWriter(io.RawIOBase):
    """Socket writes that fail (`TimeoutError`) once the client takes nothing for `timeout`
    seconds: each send waits that long at most for room in the send buffer, and whatever
    the client reads starts the wait again, so a slow reader is served, a stalled one not."""

    def __init__(self, connection: socket.socket, timeout: float) -> None:
        self.connection, self.timeout = connection, timeout

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        # Reads set their own timeout; setting one is a system call, saved on every token.
        if self.connection.gettimeout() != self.timeout:
            self.connection.settimeout(self.timeout)
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            sent += self.connection.send(view[sent:])
        return sent


@contextmanager
def client_writes() -> Iterator[None]:
    """A failed write means the client went away (or stopped reading: as good as gone)."""
    try:
        yield
    except TimeoutError as error:
        raise ClientDisconnected("client stopped reading") from error
    except OSError as error:
        raise ClientDisconnected("client disconnected") from error
