"""One fancy index over items that lie in several memory maps, as if they were one np.memmap.

A batch of sampled frames lies in many maps (one per cached episode or hot shard). Copying them
one at a time costs a Python step per frame (~1-2 us, as much as the copy); a numpy gather of
all of them is one call. ``take_at`` builds a strided view based at the lowest item's address
whose rows start every ``unit`` bytes (``unit``: the gcd of the items' offsets from it), so
every item is one row of it, and indexes it once. The view spans the address range between the
maps too; only the rows of the items asked for are read, so a caller must pass only offsets of
items it checked lie inside maps it keeps referenced until the index returns.

Where the compiled extension is built (``replaybuf/_native.c``), contiguous items are copied by
its ``gather`` from their addresses instead, with the GIL released: building the view and its
index cost ~0.1 ms of Python per batch of 256 frames of 84x84x3, a fifth of the copy.
"""

from __future__ import annotations

import numpy as np

from ._compiled import compiled

_gather = compiled("gather")  # None: built without a compiler, the strided view serves


def take_at(anchor: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """The items at byte ``offsets`` (int64, >= 0) from ``anchor``'s first item, each laid out
    as one of ``anchor``'s items (its shape and strides after the first axis), gathered into a
    new array with one fancy index; None when the span is too wide for one view (numpy's
    ValueError: the caller copies item by item)."""
    out = gather_addresses(offsets + anchor.__array_interface__["data"][0], anchor[0])
    if out is not None:
        return out
    unit = int(np.gcd.reduce(offsets)) or 1
    try:
        view = np.lib.stride_tricks.as_strided(
            anchor, (int(offsets.max()) // unit + 1, *anchor.shape[1:]), (unit, *anchor.strides[1:]), writeable=False
        )
    except ValueError:
        return None
    return view[offsets // unit]


def gather_addresses(addresses: np.ndarray, item: np.ndarray) -> np.ndarray | None:
    """The items at memory ``addresses`` (int64), each laid out as the contiguous ``item``,
    copied into a new array by the compiled ``gather``; None where it is not built (the caller
    indexes a strided view, ``take_at``). The caller keeps the maps holding them referenced."""
    if _gather is None or not item.flags.c_contiguous:
        return None
    out = np.empty((len(addresses), *item.shape), item.dtype)
    _gather(out, np.ascontiguousarray(addresses, np.int64), item.nbytes)
    return out
