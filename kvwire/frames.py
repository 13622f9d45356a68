"""The byte reader of KV event frames, compiled where it is built: `scan_batch`.

`scan_batch(payload)` maps an `EventBatch` payload in place (a `WireBatch`: its events' kinds and
where each field lies) without decoding it, for a consumer that reads its events from the bytes
(the router's compiled index writer cimports the readers from `kvwire/_frames.pxd`). It returns
None for any payload it does not read exactly as `decode_batch` would: the decoder takes those.
The scan is compiled (`kvwire/_frames.pyx`, an optional extension of pyproject's ext-modules);
where it is not built `scan_batch` is None and every payload is decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

FRAMES_SOURCE = "kvwire/_frames.pyx"

try:
    from kvwire import _frames
except ImportError as missing:  # not built: every payload is decoded
    logger.debug("%s not built (%s): every payload is decoded", FRAMES_SOURCE, missing)
    _frames = None  # type: ignore[assignment]

# The compiled scan, or None where the extension is not built.
scan_batch: Callable[[bytes], Any] | None = _frames.scan_batch if _frames is not None else None
# The class of what `scan_batch` returns (None where it is not built).
WireBatch: type | None = _frames.WireBatch if _frames is not None else None
