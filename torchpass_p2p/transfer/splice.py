"""Sending snapshot memory without copying it: ``vmsplice(2)`` then ``splice(2)`` (Linux).

``send()`` copies every byte from tensor memory into the kernel. In the loopback benchmark, where
the sender, the receiver and the receiver's MAC thread share 2 cores, that copy was the largest
item on the core the MAC thread also needs (source 0.24 s of CPU per GB, MAC thread ~0.17).
``vmsplice`` puts references to the snapshot's pages into a pipe and ``splice`` moves them into
the socket; the receiver's read is then the only copy. On a real link the saving is CPU left to
the training process that serves the state.

Safety: the pages travel by reference until the receiver reads them, so a byte written in that
time would arrive changed. A served snapshot is not written (the trainer serves its state only
while it waits for the fetching members to join its group), and every chunk's MAC
(:mod:`.chunkmac`) was computed from the snapshot when it was first served: a changed byte fails
the receiver's check and the chunk is fetched again, never accepted.

:func:`available` is False where the calls do not exist or are refused (not Linux, a seccomp
filter); the server then sends with the event loop as before.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import sys
import time
from collections.abc import Callable, Sequence

from . import outq

__all__ = ["PIPE_BYTES", "available", "send_pages"]

PIPE_BYTES = 1 << 20
"""Pipe capacity asked for (``F_SETPIPE_SZ``): 1 MiB, Linux's default ``pipe-max-size``, so one
``vmsplice`` + ``splice`` pair moves up to 256 pages. A smaller grant only costs more calls."""
_F_SETPIPE_SZ = 1031  # <linux/fcntl.h>
_SPLICE_F_MORE = 4  # more data follows: let TCP fill segments


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vmsplice() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux") or not hasattr(os, "splice"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn  # type: ignore[no-any-return]


_vmsplice = _load_vmsplice()
_probed: bool | None = None


def available() -> bool:
    """Whether zero-copy sending works in this process (probed once with a one-page pipe)."""
    global _probed
    if _probed is None:
        _probed = _vmsplice is not None and _probe()
    return _probed


def _probe() -> bool:
    r, w = os.pipe()
    try:
        page = ctypes.create_string_buffer(16)
        iov = _Iovec(ctypes.addressof(page), 16)
        assert _vmsplice is not None
        return bool(_vmsplice(w, ctypes.byref(iov), 1, 0) == 16)
    finally:
        os.close(r)
        os.close(w)


def send_pages(fd: int, buffers: Sequence[memoryview], progress_timeout_s: float,
               stop: Callable[[], bool] = lambda: False,
               on_progress: Callable[[int], None] | None = None) -> int:
    """Send ``buffers`` (writable, C-contiguous memoryviews) to the stream socket ``fd``, which may
    be non-blocking, by reference. Blocks this thread; returns the bytes sent (all of them).
    ``on_progress(n)``, if given, is called (from this thread) whenever ``n`` more bytes went
    into the socket, so a watchdog elsewhere sees a slow send move.

    Raises:
        TimeoutError: no byte moved for ``progress_timeout_s`` seconds: none went into the
            socket, and its peer acknowledged none of those sent (:mod:`.outq`: a full socket
            buffer takes bytes only once a third of it is free, which behind a slow shared
            link takes seconds while the peer takes every byte).
        ConnectionError: ``stop()`` became true (checked whenever the socket is full).
        OSError: the socket failed (``EPIPE`` after a shutdown, ``ECONNRESET``...).
        TypeError: a buffer is read-only or not contiguous.
    """
    assert _vmsplice is not None, "check available() first"
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB pipe works, with more calls
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        iov = _Iovec()
        sent = 0
        for buf in buffers:
            if not len(buf):
                continue
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            pos = 0
            while pos < len(buf):
                iov.base, iov.len = base + pos, min(PIPE_BYTES, len(buf) - pos)
                n = _vmsplice(w, ctypes.byref(iov), 1, 0)
                if n < 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"vmsplice: {os.strerror(e)}")
                _drain(r, fd, n, poller, progress_timeout_s, stop, on_progress)
                pos += n
            sent += len(buf)
        return sent
    finally:
        os.close(r)
        os.close(w)


def _drain(r: int, fd: int, n: int, poller: select.poll, progress_timeout_s: float,
           stop: Callable[[], bool], on_progress: Callable[[int], None] | None) -> None:
    """Move ``n`` bytes from the pipe ``r`` into the socket ``fd``."""
    last = time.monotonic()
    unacked = outq.queued(fd)  # bytes sent that the peer has yet to acknowledge
    while n:
        try:
            k = os.splice(r, fd, n, flags=_SPLICE_F_MORE)
        except BlockingIOError:
            k = 0
        except InterruptedError:
            continue
        if k:
            n -= k
            last = time.monotonic()
            if on_progress is not None:
                on_progress(k)
            continue
        if stop():
            raise ConnectionError("stopped")
        queued = outq.queued(fd)
        if queued is not None and unacked is not None and queued < unacked:  # peer took some
            last = time.monotonic()
            if on_progress is not None:
                on_progress(0)
        unacked = queued
        left = last + progress_timeout_s - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, f"no progress for {progress_timeout_s} s")
        poller.poll(min(left, 0.5) * 1000)
