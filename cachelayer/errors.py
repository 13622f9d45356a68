"""The root of the cache layer's own errors."""

from __future__ import annotations


class CacheLayerError(Exception):
    """The root of every error the cache layer (`cachelayer`) raises on purpose: `except
    CacheLayerError` catches them all and nothing else."""
