"""Store (paged GPU cache -> pinned host chunk) and retrieve (back), pipelined layer by layer on side streams.

Store: the gather of layers [a, b) runs on the caller's (compute) stream right after those layers
wrote their KV, into a device staging chunk, so it reads the cache in compute order; an event
recorded there gates the device-to-host copy on a per-device side stream. Retrieve: host-to-device
copies run on a second side stream (so a store and a retrieve use both copy engines at once); each
layer group's scatter runs on the compute stream after waiting on that group's copy event.
On CPU caches both run synchronously through the torch movers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cachelayer.gpu import torch_ops
from cachelayer.gpu.layouts import PagedGeometry, check_chunk, check_slot_mapping, paged_geometry

_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """One long-lived stream per device and direction ("d2h" or "h2d"): one copy engine each."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), direction)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=key[0])
    return _side_streams[key]


class TransferHandle:
    """Completion of an asynchronous store or retrieve; on CPU caches it is complete on creation."""

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    def wait(self) -> None:
        """Block the host until the transfer has finished (host chunk filled, or cache written)."""
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        return self._event is None or self._event.query()


def layer_groups(num_layers: int, pieces: int | str | None, *, growing: bool = True) -> list[tuple[int, int]]:
    """Split layers into contiguous ranges: `pieces` equal ones; "doubling" (1, 1, 2, 4, ...); or None:
    one layer, then the rest.

    None is the default because it measured best on the H200: a store's copy starts after a
    one-layer gather, and each direction issues only two copies, which matters when a store and a
    retrieve run at once (more, smaller copies cost bandwidth there). `growing=False` reverses the
    order (a retrieve ends on a one-layer scatter).
    """
    if pieces is None:
        sizes = [1, num_layers - 1] if num_layers > 1 else [1]
        if not growing:
            sizes.reverse()
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    if pieces == "doubling":
        sizes = []
        while sum(sizes) < num_layers:
            sizes.append(min(max(1, sum(sizes)), num_layers - sum(sizes)))
        if not growing:
            sizes.reverse()
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    if isinstance(pieces, str) or pieces < 1:
        raise ValueError(f"pieces must be None, 'doubling' or a count >= 1, got {pieces!r}")
    pieces = min(pieces, num_layers)
    bounds = [round(i * num_layers / pieces) for i in range(pieces + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(pieces)]


def _checked_host_transfer(
    kv_caches: Sequence[Tensor], layout: str, slot_mapping: Tensor, host: Tensor, name: str, check_range: bool
) -> PagedGeometry:
    """The layers' geometry, once `slot_mapping` and the host chunk `host` (called `name`) are checked
    against it for a transfer between the cache's device and host memory."""
    geometry = paged_geometry(kv_caches, layout)
    check_slot_mapping(slot_mapping, geometry, check_range=check_range)
    check_chunk(host, geometry, slot_mapping.numel(), name)
    if host.device.type != "cpu":
        raise ValueError(f"{name} must be a host (CPU) tensor, got one on {host.device}")
    if not host.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if geometry.device.type == "cuda" and not host.is_pinned():
        raise ValueError(
            f"{name} must be pinned host memory for asynchronous copies: allocate it with "
            "torch.empty(..., pin_memory=True) or call .pin_memory()"
        )
    return geometry


class LayerwiseStorer:
    """Store a request's KV while later layers still compute: call after_layer(i) as layer i finishes.

    On CUDA, after_layer(i) gathers layer i on the current stream (microseconds) and queues its
    device-to-host copy on the side stream behind an event, so the copy of layer i overlaps the
    compute of layer i+1. Rows of skipped tokens (negative slots) are written with zeros.
    """

    def __init__(
        self,
        kv_caches: Sequence[Tensor],
        layout: str,
        slot_mapping: Tensor,
        host_out: Tensor,
        *,
        check_range: bool = True,
    ):
        self._kv_caches = list(kv_caches)
        self._geometry = _checked_host_transfer(
            self._kv_caches, layout, slot_mapping, host_out, "host_out", check_range
        )
        self._slot_mapping = slot_mapping
        self._host_out = host_out
        self._cuda = self._geometry.device.type == "cuda"
        if self._cuda:
            self._stream = _side_stream(self._geometry.device, "d2h")
            self._staging = torch.empty_like(host_out, device=self._geometry.device)
            self._staging.record_stream(self._stream)

    def after_layer(self, layer: int) -> None:
        self.after_layers(layer, layer + 1)

    def after_layers(self, start: int, stop: int) -> None:
        """Queue the store of layers [start, stop), whose KV the current stream has just written."""
        if not 0 <= start < stop <= self._geometry.num_layers:
            raise ValueError(f"layers [{start}, {stop}) out of range for {self._geometry.num_layers} layers")
        if not self._cuda:
            torch_ops.gather(
                self._kv_caches[start:stop],
                self._geometry,
                self._slot_mapping,
                self._host_out[start:stop],
                fill_skipped=True,
            )
            return
        from cachelayer.gpu import triton_ops

        triton_ops.paged_copy(
            self._kv_caches,
            self._geometry,
            self._slot_mapping,
            self._staging,
            to_chunk=True,
            layers=(start, stop),
            fill_skipped=True,
        )
        gathered = torch.cuda.Event()
        gathered.record(torch.cuda.current_stream(self._geometry.device))
        self._stream.wait_event(gathered)
        with torch.cuda.stream(self._stream):
            self._host_out[start:stop].copy_(self._staging[start:stop], non_blocking=True)

    def finish(self) -> TransferHandle:
        """A handle that completes when every queued layer is in host memory."""
        if not self._cuda:
            return TransferHandle()
        stored = torch.cuda.Event()
        stored.record(self._stream)
        return TransferHandle(stored)


class LayerwiseLoader:
    """Load a host chunk into the cache layer by layer: start() queues every copy, wait_for_layer(i)
    makes the current stream wait for layer i (and scatters its group) before layer i's attention."""

    def __init__(
        self,
        host_chunk: Tensor,
        kv_caches: Sequence[Tensor],
        layout: str,
        slot_mapping: Tensor,
        *,
        groups: list[tuple[int, int]] | None = None,
        check_range: bool = True,
    ):
        """`groups`: contiguous layer ranges copied and scattered as units (None: one per layer)."""
        self._kv_caches = list(kv_caches)
        self._geometry = _checked_host_transfer(
            self._kv_caches, layout, slot_mapping, host_chunk, "host_chunk", check_range
        )
        self._slot_mapping = slot_mapping
        self._host_chunk = host_chunk
        num_layers = self._geometry.num_layers
        self._groups = groups or [(layer, layer + 1) for layer in range(num_layers)]
        if [layer for start, stop in self._groups for layer in range(start, stop)] != list(range(num_layers)):
            raise ValueError(
                f"groups {self._groups} must cover layers 0..{num_layers - 1} in order, once each"
            )
        self._group_of_layer = [g for g, (a, b) in enumerate(self._groups) for _ in range(a, b)]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._groups)
        self._scattered = [False] * len(self._groups)
        self._cuda = self._geometry.device.type == "cuda"
        self._started = False

    def start(self) -> None:
        """Queue every host-to-device copy on the side stream (on CPU caches there is nothing to queue)."""
        if self._started:
            return
        self._started = True
        if not self._cuda:
            return
        stream = _side_stream(self._geometry.device, "h2d")
        compute_stream = torch.cuda.current_stream(self._geometry.device)
        with torch.cuda.stream(stream):
            # Allocated on the copy stream, so the copies need not wait for the compute stream (a store
            # queued there just before would otherwise delay this load); the scatters on the compute
            # stream keep it alive through record_stream.
            self._staging = torch.empty_like(self._host_chunk, device=self._geometry.device)
            self._staging.record_stream(compute_stream)
            for group, (start, stop) in enumerate(self._groups):
                self._staging[start:stop].copy_(self._host_chunk[start:stop], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
                self._copied[group] = copied

    def wait_for_layer(self, layer: int) -> None:
        if not 0 <= layer < self._geometry.num_layers:
            raise ValueError(f"layer {layer} out of range for {self._geometry.num_layers} layers")
        self.start()
        group = self._group_of_layer[layer]
        if self._scattered[group]:
            return
        self._scattered[group] = True
        start, stop = self._groups[group]
        if not self._cuda:
            torch_ops.scatter(
                self._host_chunk[start:stop], self._kv_caches[start:stop], self._geometry, self._slot_mapping
            )
            return
        from cachelayer.gpu import triton_ops

        torch.cuda.current_stream(self._geometry.device).wait_event(self._copied[group])
        triton_ops.paged_copy(
            self._kv_caches,
            self._geometry,
            self._slot_mapping,
            self._staging,
            to_chunk=False,
            layers=(start, stop),
        )

    def finish(self) -> TransferHandle:
        """Scatter every layer not yet waited for; the handle completes when the cache holds the chunk."""
        for start, _ in self._groups:
            self.wait_for_layer(start)
        if not self._cuda:
            return TransferHandle()
        loaded = torch.cuda.Event()
        loaded.record(torch.cuda.current_stream(self._geometry.device))
        return TransferHandle(loaded)


def store(
    kv_caches: Sequence[Tensor],
    layout: str,
    slot_mapping: Tensor,
    host_out: Tensor,
    *,
    pieces: int | str | None = None,
    check_range: bool = True,
) -> TransferHandle:
    """Gather every layer into pinned `host_out`, the device-to-host copy split into layer groups that
    chase the gathers (`pieces`: see layer_groups); returns at once on CUDA (wait on the handle).

    Unlike gather, the rows of skipped tokens (negative slots) are written with zeros.
    """
    storer = LayerwiseStorer(kv_caches, layout, slot_mapping, host_out, check_range=check_range)
    for start, stop in layer_groups(len(storer._kv_caches), pieces):
        storer.after_layers(start, stop)
    return storer.finish()


def retrieve(
    host_chunk: Tensor,
    kv_caches: Sequence[Tensor],
    layout: str,
    slot_mapping: Tensor,
    *,
    pieces: int | str | None = None,
    check_range: bool = True,
) -> TransferHandle:
    """Copy pinned `host_chunk` to the device in layer groups and scatter each as it lands.

    Work queued on the current stream afterwards sees the cache filled; the handle is for the host.
    """
    loader = LayerwiseLoader(
        host_chunk,
        kv_caches,
        layout,
        slot_mapping,
        groups=layer_groups(len(kv_caches), pieces, growing=False),
        check_range=check_range,
    )
    loader.start()
    return loader.finish()
