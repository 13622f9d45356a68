"""kvgate's KV cache layer: chunked KV store (CPU pool, disk), KV events, controller, codecs."""

from cachelayer.engine import CacheEngine

__all__ = ["CacheEngine"]
