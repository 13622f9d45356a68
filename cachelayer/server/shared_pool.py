"""The daemon's L1 pool in shared memory, mapped by clients on the same host (zero-copy data plane).

The daemon creates an anonymous memory file (memfd) the size of its L1 budget and builds its CPU
tier over it. A client on the same host maps the same memory through `/proc/<daemon pid>/fd/<fd>`,
which only a process of the same user in the same PID namespace may open: that is what "same
host" means here. The daemon writes a random token into the segment's header and sends it over
the control socket; a client that maps a segment whose header differs (a stale pid, another
daemon) refuses it and uses TCP. The memfd has no name in any filesystem, so a daemon that dies
leaves nothing behind in /dev/shm.

A client that maps the pool can read and write every chunk in it: the shared-memory path is for
engines the operator trusts as much as the daemon (the same user on the same host). Anything else
uses the TCP path (`cachelayer server --no-shared-memory` turns the shared path off).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets

import torch

from cachelayer.errors import CacheLayerError

log = logging.getLogger(__name__)

# The segment starts with a header page (the token); the pool follows, page-aligned.
HEADER_BYTES = 4096
TOKEN_BYTES = 16


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
    def attach(cls, daemon_pid: int, fd: int, pool_bytes: int, token: bytes) -> SharedPool:
        """Map the daemon's segment; SharedPoolUnavailable when it is not this host's same daemon."""
        path = f"/proc/{daemon_pid}/fd/{fd}"
        try:
            local_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedPoolUnavailable(f"cannot open the daemon's pool at {path}: {exc}") from exc
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
