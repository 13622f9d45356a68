# The compiled entry (`CompiledEntry`: where `IndexWriter.apply` and `apply_wire` go when the
# compiled writer is built) and the writer lock it takes in C (`WriterLock`). Included into
# router/index/_ingest.pyx, not a module of its own: the entry calls the writer's inline C methods
# (`BackendWriter._apply_one`, `_store_wire`), which a second module could reach only through a
# vtable call per event.

cdef class WriterLock:
    """The index's writer lock: `with lock:` in Python (as a `threading.Lock`), taken in C by
    `CompiledEntry` without a Python call. Waiting for it releases the GIL, as `threading.Lock`
    does, so the thread that holds it can finish."""

    cdef PyThread_type_lock handle
    cdef bint held

    def __cinit__(self):
        self.handle = PyThread_allocate_lock()
        if self.handle is NULL:
            raise MemoryError("cannot allocate a lock")

    def __dealloc__(self):
        if self.handle is not NULL:
            PyThread_free_lock(self.handle)

    cdef inline void take(self) noexcept:
        if not PyThread_acquire_lock(self.handle, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self.handle, WAIT_LOCK)
        self.held = True

    cdef inline void give(self) noexcept:
        self.held = False
        PyThread_release_lock(self.handle)

    def acquire(self, bint blocking=True):
        """Take the lock (True), or False at once when `blocking` is false and it is held."""
        if not blocking:
            if not PyThread_acquire_lock(self.handle, NOWAIT_LOCK):
                return False
            self.held = True
            return True
        self.take()
        return True

    def release(self):
        if not self.held:
            raise RuntimeError("release of an unheld index lock")
        self.give()

    def locked(self):
        return self.held

    def __enter__(self):
        self.take()
        return True

    def __exit__(self, exc_type, exc_value, traceback):
        self.give()
        return False


cdef class CompiledEntry:
    """The index's ingest entry when the compiled writer is built (`IndexWriter.apply` and
    `apply_wire` go here): a batch of one event of a shape the writer takes (an engine step that
    filled one block, a prefill, an eviction) is applied here, in C, under the index's
    `WriterLock`, through the backend's `BackendWriter`; every other call goes to
    `general(backend_name, events, first_refused)` (`IndexWriter._apply_refused`), told whether this
    entry offered the event already, so that no event is offered to the compiled writer twice.
    The backend is looked up under the lock: a replaced or cleared backend is never written
    through a stale writer. When what it applied took the backend past its `max_blocks`,
    `over_capacity(backend_name)` (the index's eviction) runs once the lock is given back."""

    cdef dict backends, shared_masks
    cdef WriterLock lock
    cdef object general, general_wire, over_capacity
    cdef Py_ssize_t shared_masks_limit
    # Events this entry applied itself (the rest went to `general` or `general_wire`).
    cdef readonly Py_ssize_t applied

    def __init__(self, dict backends, dict shared_masks, WriterLock lock, general, Py_ssize_t shared_masks_limit,
                 general_wire=None, *, over_capacity):
        self.backends = backends
        self.shared_masks = shared_masks
        self.lock = lock
        self.general = general
        self.general_wire = general_wire
        self.over_capacity = over_capacity
        self.shared_masks_limit = shared_masks_limit

    cdef object _writer_of(self, backend_name):
        """The backend's compiled writer, or None (no backend yet, no writer yet, or the shared
        masks due to be dropped): the Python entry takes the call. The caller holds the lock."""
        cdef PyObject* found = PyDict_GetItemWithError(self.backends, backend_name)
        if found is NULL or PyDict_GET_SIZE(self.shared_masks) > self.shared_masks_limit:
            return None
        writer = (<object>found).compiled_writer
        return writer if isinstance(writer, BackendWriter) else None

    def apply_wire(self, backend_name, list batches):
        """Apply scanned batches (`scan_batch`) in order (`IndexWriter.apply_wire`): while the
        backend's writer takes every event, here, under the lock; from the first event it
        refuses, `general_wire(backend_name, batches_left, refused_at)` (`IndexWriter._apply_wire_refused`),
        `refused_at` the refused event's position in the first batch left (None when no writer
        was there to offer it to)."""
        cdef Py_ssize_t position = 0, count = PyList_GET_SIZE(batches), stopped = 0
        cdef WireBatch batch
        cdef bint over = False, offered = False
        if count == 0:
            return
        self.lock.take()
        try:
            writer = self._writer_of(backend_name)
            if writer is not None:
                offered = True
                while position < count:
                    batch = <WireBatch?>PyList_GET_ITEM(batches, position)
                    stopped = (<BackendWriter>writer)._store_wire(batch, 0)
                    if stopped < batch.count:
                        break
                    self.applied += batch.count
                    position += 1
                over = PyDict_GET_SIZE((<BackendWriter>writer).nodes) > (<BackendWriter>writer).max_nodes
        finally:
            self.lock.give()
        if position < count:
            # (it evicts itself)
            self.general_wire(backend_name, batches[position:], stopped if offered else None)
        elif over:
            self.over_capacity(backend_name)

    def apply(self, backend_name, events):
        """Apply the events of one batch, in order (`IndexWriter.apply`)."""
        cdef bint stored = False, over = False, offered = False
        if type(events) is list and PyList_GET_SIZE(events) == 1:
            self.lock.take()
            try:
                writer = self._writer_of(backend_name)
                if writer is not None:
                    offered = True
                    # The event's stats stay pending in the writer (`flush_stats`), added once
                    # before they are read: cheaper than updating the backend's dicts per event.
                    stored = (<BackendWriter>writer)._apply_one(<object>PyList_GET_ITEM(events, 0))
                    over = PyDict_GET_SIZE((<BackendWriter>writer).nodes) > (<BackendWriter>writer).max_nodes
            finally:
                self.lock.give()
            if stored:
                self.applied += 1
                if over:
                    self.over_capacity(backend_name)
                return
        self.general(backend_name, events, offered)
