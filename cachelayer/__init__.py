"""kvgate's KV cache layer: chunked KV store (CPU pool, disk), KV events, controller, codecs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachelayer.engine import CacheEngine

__all__ = ["CacheEngine"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the controller and key helpers must not pay for importing torch.
    if name == "CacheEngine":
        from cachelayer.engine import CacheEngine

        return CacheEngine
    raise AttributeError(f"module 'cachelayer' has no attribute {name!r}")
