"""The daemon's L1 pool in shared memory, mapped by clients on the same host (zero-copy data plane).

The daemon creates an anonymous memory file (memfd) the size of its L1 budget and builds its CPU
tier over it. The file descriptor is handed only to clients the daemon let attach: `attach` (on
the authenticated data plane) answers a one-time ticket and the name of a Unix socket in the
abstract namespace (`PoolHandout`); a client that connects there and sends the ticket gets the
descriptor (SCM_RIGHTS) and maps it. Only processes in the daemon's network namespace reach that
socket: that is what "same host" means here. `cachelayer server` also makes itself non-dumpable,
so that other processes of its user cannot open /proc/<daemon pid>/fd/<fd> to map the pool
without asking. The segment's header holds a random token that the client checks against the
one `attach` answered. The memfd has no name in any filesystem, so a daemon that dies leaves
nothing behind in /dev/shm.

A client that maps the pool can read and write every chunk in it: the shared-memory path is for
engines the operator trusts as much as the daemon, and only a credential that reaches every key
space may attach. Anything else uses the TCP path (`cachelayer server --no-shared-memory` turns
the shared path off).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import threading
import time

import torch

from cachelayer.errors import CacheLayerError

log = logging.getLogger(__name__)

# The segment starts with a header page (the token); the pool follows, page-aligned.
HEADER_BYTES = 4096
TOKEN_BYTES = 16
TICKET_BYTES = 16
# How long an `attach` ticket may wait to be used, and how many may wait at once.
TICKET_TTL_S = 10.0
MAX_OPEN_TICKETS = 1024
# How long the handout waits for a connected client's ticket (a silent client must not stall it).
HANDOUT_READ_TIMEOUT_S = 2.0


class SharedPoolUnavailable(CacheLayerError, OSError):
    """The daemon's segment cannot be mapped from this process (another host, user or namespace)."""


class SharedPool:
    """One shared segment: a header with the daemon's token, then `pool_bytes` of L1 pool."""

    def __init__(self, fd: int, pool_bytes: int, mapping: mmap.mmap, token: bytes) -> None:
        self.fd = fd
        self.pool_bytes = pool_bytes
        self.token = token
        self._mapping = mapping
        self.cuda_registered = False
        # Writable bytes of the pool (after the header), viewing the shared mapping: no copy.
        self.pool = (
            torch.frombuffer(mapping, dtype=torch.uint8, offset=HEADER_BYTES, count=pool_bytes)
            if pool_bytes
            else torch.empty(0, dtype=torch.uint8)
        )

    @classmethod
    def create(cls, pool_bytes: int) -> SharedPool:
        """A fresh segment (the daemon's). Pages are allocated as chunks are written."""
        fd = os.memfd_create("cachelayer-l1", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + pool_bytes)
            mapping = mmap.mmap(fd, HEADER_BYTES + pool_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        mapping[:TOKEN_BYTES] = token
        return cls(fd, pool_bytes, mapping, token)

    @classmethod
    def attach(cls, handout: bytes, ticket: bytes, pool_bytes: int, token: bytes) -> SharedPool:
        """Map the daemon's segment, asked of its handout socket with `ticket`;
        SharedPoolUnavailable when it is not reachable (another host or namespace) or not the
        daemon's."""
        path = f"the daemon's pool handout {handout!r}"
        try:
            local_fd = _receive_pool_fd(handout, ticket)
        except OSError as exc:
            raise SharedPoolUnavailable(f"cannot get the daemon's pool from {path}: {exc}") from exc
        try:
            size = os.fstat(local_fd).st_size
            if size != HEADER_BYTES + pool_bytes:
                raise SharedPoolUnavailable(
                    f"{path} is {size} bytes, the daemon announced {HEADER_BYTES + pool_bytes}"
                )
            mapping = mmap.mmap(local_fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(local_fd)
            raise
        if mapping[:TOKEN_BYTES] != token:
            mapping.close()
            os.close(local_fd)
            raise SharedPoolUnavailable(f"{path} is not the daemon's pool (its token differs)")
        return cls(local_fd, pool_bytes, mapping, token)

    def register_with_cuda(self) -> bool:
        """Page-lock the pool for CUDA (cudaHostRegister) in this process, so copies between its
        chunks and GPU memory run as DMA at pinned-memory speed and GPU kernels read it directly:
        a chunk leased from the daemon then goes to the GPU in one copy, with no staging through a
        pinned bounce buffer. Every page of the pool becomes resident (pages are shared with the
        daemon and the other clients, so the host pays for them once). False (logged) when CUDA is
        unavailable or refuses: the copies still work, through pageable memory."""
        if self.cuda_registered or not self.pool_bytes:
            return self.cuda_registered
        if not torch.cuda.is_available():
            return False
        error = torch.cuda.cudart().cudaHostRegister(self.pool.data_ptr(), self.pool_bytes, 0)
        if int(error) != 0:
            log.warning(
                "cachelayer: cudaHostRegister of the daemon's %d-byte pool failed (%s): "
                "copies to the GPU go through pageable memory",
                self.pool_bytes,
                error,
            )
            return False
        self.cuda_registered = True
        return True

    def close(self) -> None:
        """Unmap and close. Tensors still viewing the pool keep the mapping alive until they go."""
        if self.cuda_registered:
            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
            self.cuda_registered = False
        self.pool = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):
            self._mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _receive_pool_fd(handout: bytes, ticket: bytes) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(HANDOUT_READ_TIMEOUT_S * 2)
        conn.connect(handout)
        conn.sendall(ticket)
        _, fds, _, _ = socket.recv_fds(conn, 16, 1)
    if not fds:
        raise OSError("the daemon refused the ticket (expired or already used): attach again")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


class PoolHandout:
    """Hands the pool's file descriptor, over a Unix socket in the abstract namespace, to whoever
    brings a ticket `issue()` made: once each, within TICKET_TTL_S. One thread, one client at a
    time, each given HANDOUT_READ_TIMEOUT_S to send its ticket."""

    def __init__(self, pool_fd: int) -> None:
        self._pool_fd = pool_fd
        self.address = b"\0cachelayer-pool-" + secrets.token_hex(8).encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self._tickets: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.handed_out = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._serve, name="cachelayer-pool-handout", daemon=True)
        self._thread.start()

    def issue(self) -> bytes:
        """A one-time ticket for the pool's descriptor."""
        now = time.monotonic()
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            for old in [old for old, deadline in self._tickets.items() if deadline < now]:
                del self._tickets[old]
            while len(self._tickets) >= MAX_OPEN_TICKETS:  # the oldest unused goes
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket] = now + TICKET_TTL_S
        return ticket

    def _redeem(self, ticket: bytes) -> bool:
        with self._lock:
            deadline = self._tickets.pop(ticket, None)
        return deadline is not None and deadline >= time.monotonic()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(HANDOUT_READ_TIMEOUT_S)
                    ticket = b""
                    while len(ticket) < TICKET_BYTES:
                        piece = conn.recv(TICKET_BYTES - len(ticket))
                        if not piece:
                            break
                        ticket += piece
                    if len(ticket) == TICKET_BYTES and self._redeem(ticket):
                        socket.send_fds(conn, [b"pool"], [self._pool_fd])
                        self.handed_out += 1
                    else:
                        self.refused += 1
                except OSError as exc:  # a client that vanished or stalled: its problem only
                    log.debug("cachelayer server: pool handout: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
