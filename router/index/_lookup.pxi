# The lookup side of the compiled index module (included by router/index/_ingest.pyx, whose C
# declarations it uses): what a prompt's lookup runs in C instead of numpy.

def held_runs(dict holders, list keys):
    """`(runs, masks)` of a prompt's router `keys` in the index's `holders` (key -> holder mask):
    `masks` the masks of the leading keys held, up to the first that is not (the same int objects),
    and `runs`, per slot bit of the first mask, how many leading masks hold it: what
    `store._held_masks` and `PrefixIndex._runs_of_masks` give together, in one pass that probes
    each key once and stops at the first hole, without numpy's per-call cost (a lookup's probes
    and runs were a tenth of kv_aware's request path through numpy, run cold). OverflowError where
    a mask does not fit 64 bits (more than 64 slots: the caller's wide path)."""
    cdef Py_ssize_t size = PyList_GET_SIZE(keys), position
    cdef PyObject* mask
    cdef uint64_t running = 0, current, lost, bit
    cdef list masks = []
    cdef dict runs = {}
    for position in range(size):
        mask = PyDict_GetItemWithError(holders, <object>PyList_GET_ITEM(keys, position))
        if mask is NULL:
            break
        current = PyLong_AsUnsignedLongLong(<object>mask)
        masks.append(<object>mask)
        if position == 0:
            running = current
            continue
        # The running AND only loses bits: each slot's run ends where its bit is lost.
        lost = running & ~current
        running &= current
        while lost:
            bit = lost & (~lost + 1)
            lost ^= bit
            runs[PyLong_FromUnsignedLongLong(bit)] = position
    while running:
        bit = running & (~running + 1)
        running ^= bit
        runs[PyLong_FromUnsignedLongLong(bit)] = len(masks)
    return runs, masks
