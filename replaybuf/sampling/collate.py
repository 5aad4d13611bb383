"""Turning fetched batches into what a DataLoader yields: padding, masks, named tuples, device.

The datasets assemble whole batches in ``__getitems__`` and hand them over as
``CollatedSamples``: a sequence of per-sample dicts (so any collate function still works) that
carries the ready batch, which ``Collator`` passes through without restacking.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info


class CollatedSamples(Sequence):
    """A batch assembled by a dataset: ``batch`` maps names to stacked tensors.

    Indexing gives sample ``i`` as the dict ``__getitem__`` would return; keys in ``time_keys``
    are cut back to that sample's length ``lens[i]`` (trajectories are padded only in batches).
    """

    def __init__(self, batch: dict[str, torch.Tensor], lens: np.ndarray | None = None, time_keys: Iterable[str] = ()):
        self.batch = batch
        self.lens = lens
        self.time_keys = frozenset(time_keys)

    def __len__(self) -> int:
        return len(next(iter(self.batch.values()))) if self.batch else 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]  # no slices: collate indexes
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a batch of {len(self)}")
        sample = {}
        for key, value in self.batch.items():
            value = value[i]
            if self.lens is not None and key in self.time_keys:
                value = value[: int(self.lens[i])]
            sample[key] = value.clone()
        return sample


def pad_collate(samples: Sequence[dict[str, torch.Tensor]], time_keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts, right-padding the time axis of ``time_keys`` with zeros (the seed's
    ``collate_var_time``)."""
    time_keys = set(time_keys)
    batch = {}
    for key in samples[0]:
        tensors = [s[key] for s in samples]
        if key in time_keys and tensors[0].ndim > 0:
            longest = max(t.shape[0] for t in tensors)
            tensors = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 1) + (0, longest - t.shape[0])) for t in tensors]
        batch[key] = torch.stack(tensors)
    return batch


def _rebuild_named_batch(fields: tuple[str, ...], values: tuple) -> tuple:
    return named_batch_class(fields)(*values)


@functools.cache
def named_batch_class(fields: tuple[str, ...]) -> type:
    """The namedtuple class ``Batch`` with ``fields``; its instances pickle by field names, so
    DataLoader workers can send them back whatever the start method."""
    base = namedtuple("Batch", fields)  # type: ignore[misc]  # field names known only at run time

    def __reduce__(self):
        return _rebuild_named_batch, (fields, tuple(self))

    return type("Batch", (base,), {"__slots__": (), "__reduce__": __reduce__})


def named_tuple_fields(names: Sequence[str]) -> tuple[str, ...]:
    """Field names of the named tuple: leading underscores stripped (``_mask`` -> ``mask``)."""
    return tuple(name.lstrip("_") for name in names)


def to_device(batch: Any, device: torch.device | str | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, dict):
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return type(batch)(*(v.to(device) if torch.is_tensor(v) else v for v in batch))


def in_shared_memory(batch: Any) -> Any:
    """``batch`` with its CPU tensors moved into shared memory when this is a DataLoader worker
    (as torch's ``default_collate`` stacks them there); unchanged elsewhere.

    A worker hands its batches to a queue whose feeder thread pickles them, and pickling a CPU
    tensor not yet in shared memory copies it there with the GIL released. A spawned worker told
    to stop (a loader dropped midway) runs interpreter finalization while that daemon thread may
    still be copying a prefetched batch; taking the GIL back then ends the thread by unwinding
    through torch's C++ GIL guard, which aborts the worker ("terminate called without an active
    exception") and keeps its pipes open in the parent. Copied here, in the worker's own thread,
    the feeder only hands out the shared memory's handle. The feeder still drops the last
    reference to the batch once pickled, and torch lets go of the GIL while it destroys a
    tensor: that can abort a finalizing worker the same way, less often (not ours to fix here)."""
    if get_worker_info() is None:
        return batch
    for value in batch.values() if isinstance(batch, dict) else batch:
        if torch.is_tensor(value) and value.device.type == "cpu":
            value.share_memory_()
    return batch


class Collator:
    """The ``collate_fn`` of replaybuf loaders (a plain object, so spawn workers can pickle it).

    Parameters
    ----------
    time_keys
        Keys padded along time when per-sample dicts are collated (trajectories); None for
        timestep and n-step batches (torch's ``default_collate``).
    return_mask
        Add ``_mask`` (batch, longest) from ``_lens``.
    named_tuple
        Batch keys to return, in order, as a namedtuple ``Batch``.
    device
        Move every tensor there.
    """

    def __init__(
        self,
        time_keys: Iterable[str] | None = None,
        return_mask: bool = False,
        named_tuple: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ):
        self.time_keys = None if time_keys is None else frozenset(time_keys)
        self.return_mask = return_mask
        self.named_tuple = None if named_tuple is None else tuple(named_tuple)
        self.device = device

    def __call__(self, samples: Sequence[dict[str, torch.Tensor]]) -> Any:
        if isinstance(samples, CollatedSamples):
            batch = dict(samples.batch)
        elif self.time_keys is not None:
            batch = pad_collate(samples, self.time_keys)
        else:
            batch = default_collate(list(samples))
        if self.return_mask:
            lens = batch["_lens"]
            longest = int(lens.max()) if len(lens) else 0
            # as wide as the batch's time axis, which a batch of windows (``window_length``) or of
            # whole rows (``slice_by_episode_len=False``) pads past its longest sample: the seed's
            # mask, ``longest`` wide, cannot be applied to such data
            widths = [batch[k].shape[1] for k in self.time_keys or () if k in batch and batch[k].ndim > 1]
            width = max([longest, *widths])
            batch["_mask"] = torch.arange(width, device=lens.device)[None] < lens[:, None]
        if self.named_tuple is not None:
            missing = [k for k in self.named_tuple if k not in batch]
            if missing:
                raise ValueError(
                    f"to_named_tuple: fields {missing} not found in batch. available fields: {list(batch)}"
                )
            cls = named_batch_class(named_tuple_fields(self.named_tuple))
            batch = cls(*(batch[k] for k in self.named_tuple))
        return in_shared_memory(to_device(batch, self.device))
