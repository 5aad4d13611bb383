"""BufferView: what a reader of a buffer uses, implemented by ReplayBuffer and ConcatReplayBuffer.

Sampling (``sampling/``), analysis (``analysis.py``) and the viewer (``viewer/``) are typed
against this protocol and use nothing else of a buffer: its schema, its storage, and the
committed snapshot it holds in RAM (per-slot lengths, generations and meta values as of the
last ``refresh()``, or of the last commit for a writer). ``SchemaAttributes`` derives the
seed's per-field attributes (``fieldnames``, ``shapes``, ``meta_dtypes``, ...) from ``schema``,
and ``CommittedViews`` adds the snapshot's read-only views and the analyses (``get_all_data``,
``stats``, ...); both implementations inherit them.
"""

from __future__ import annotations

import os
import threading
from collections import namedtuple
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from ._lazy import feature_imports
from .schema import Field, Schema
from .storage import Storage, bookkeeping_fields

if TYPE_CHECKING:
    import torch

    from .analysis import BufferStats
    from .buffer import MetaView
    from .sampling.loader import make_dataloader, make_dataset

__all__ = [
    "BufferView",
    "CommittedViews",
    "RefreshLock",
    "SchemaAttributes",
    "frozen",
    "mirror_lock",
    "read_only_message",
]


@runtime_checkable
class BufferView(Protocol):
    """The read side of a buffer: schema, storage and the committed snapshot.

    The snapshot is what ``refresh()`` loaded (a reader) or what this process committed (a
    writer): ``episode_lens`` (0: an empty slot), ``generations`` (the 1-based ordinal of the
    commit that filled each slot, 0 when empty; it only grows, so a reader re-checks it to
    notice a slot rewritten under it) and the meta values of every slot.
    """

    @property
    def schema(self) -> Schema: ...

    @property
    def storage(self) -> Storage: ...

    @property
    def read_only(self) -> bool:
        """True for a reader beside a writer: its reads re-check generations (``consistency.py``)."""
        ...

    @property
    def max_episodes(self) -> int: ...

    @property
    def max_timesteps(self) -> int: ...

    @property
    def fieldnames(self) -> set[str]: ...

    @property
    def meta_fieldnames(self) -> set[str]:
        """The user's meta fields and ``episode_lens``."""
        ...

    @property
    def meta_data(self) -> Mapping[str, MetaView]: ...

    @property
    def num_episodes(self) -> int: ...

    @property
    def episode_lens(self) -> np.ndarray:
        """Committed length of every slot, a read-only view of the snapshot."""
        ...

    @property
    def generations(self) -> np.ndarray:
        """Generation of every slot (0: empty), a read-only view of the snapshot."""
        ...

    def meta_values(self, name: str) -> np.ndarray:
        """Values of meta field ``name`` (one of ``meta_fieldnames``) for every slot, a read-only
        view of the snapshot."""
        ...

    def listed_slots(self) -> np.ndarray: ...

    def empty_episodes(self) -> np.ndarray: ...

    def valid_episodes(self) -> np.ndarray: ...

    def unsettled_slots(self) -> np.ndarray:
        """Slots a writer was changing while the last ``refresh()`` found no episode besides."""
        ...

    def unfinished_edit_slots(self) -> np.ndarray:
        """Committed slots holding an in-place edit a stopped writer left part applied."""
        ...

    def refresh(self) -> BufferView:
        """Reload the snapshot from storage: pick up what writers committed since."""
        ...

    def flush(self) -> None: ...

    def __len__(self) -> int: ...


class SchemaAttributes:
    """The seed's per-field attributes, derived from ``schema`` (fixed for a buffer's life)."""

    schema: Schema

    @property
    def max_episodes(self) -> int:
        return self.schema.max_episodes

    @property
    def max_timesteps(self) -> int:
        return self.schema.max_timesteps

    @property
    def circular(self) -> bool:
        return self.schema.circular

    @cached_property
    def fieldnames(self) -> set[str]:
        return set(self.schema.fields)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: f.shape for n, f in self.schema.fields.items()}

    @cached_property
    def dtypes(self) -> dict[str, type]:
        return {n: f.dtype.type for n, f in self.schema.fields.items()}

    @cached_property
    def defaults(self) -> dict[str, Any]:
        return {n: f.default for n, f in self.schema.fields.items()}

    @cached_property
    def _listed_meta(self) -> dict[str, Field]:
        """The meta fields a user sees: theirs and ``episode_lens`` (not ``_generation``)."""
        return {**self.schema.meta_fields, "episode_lens": bookkeeping_fields(self.schema)["episode_lens"]}

    @cached_property
    def meta_fieldnames(self) -> set[str]:
        return set(self._listed_meta)

    @cached_property
    def internal_meta_fieldnames(self) -> set[str]:
        """The meta fields the buffer keeps itself (as the seed's attribute, so user code that
        skips them in ``meta_data`` runs unchanged)."""
        return {"episode_lens"}

    @cached_property
    def meta_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: f.shape for n, f in self._listed_meta.items()}

    @cached_property
    def meta_dtypes(self) -> dict[str, type]:
        return {n: f.dtype.type for n, f in self._listed_meta.items()}

    @cached_property
    def meta_defaults(self) -> dict[str, Any]:
        return {n: f.default for n, f in self._listed_meta.items()}

    @cached_property
    def memory_namedtuple(self) -> Any:
        """The namedtuple ``store()`` returns: one value per data field (made at run time, so
        not pickled: ``__getstate__`` drops it and it is made again on first use). A name it
        cannot hold (a keyword, a leading underscore: refused for new buffers, kept by older
        ones) is renamed positionally (``_0``)."""
        return namedtuple("Memory", list(self.schema.fields), rename=True)


def read_only_message(kind: str, call: str) -> str:
    """The error text of a write ``call`` on a read-only view of kind ``kind``."""
    return (
        f"{kind} is read-only: `{call}` is not allowed; "
        "write to one of its member buffers (ReplayBuffer.from_folder(path)) instead"
    )


V = TypeVar("V")


class FieldViews(Mapping[str, V]):
    """``buffer.data`` / ``buffer.meta_data``: each field's view by name, made when asked for.
    A view refers to its buffer and the buffer keeps no view, so dropping the buffer frees it
    at once (no reference cycle for garbage collection to find). Assigning a name
    (``buffer.meta_data["task"] = values``) would only replace the view in this mapping, the
    stored values unchanged and later reads returning the assigned object, so it raises,
    saying how to write the values."""

    def __init__(self, attribute: str, names: Collection[str], view: Callable[[str], V]):
        self._attribute = attribute
        self._names = names
        self._view = view

    def __getitem__(self, name: str) -> V:
        if name not in self._names:  # a KeyError still (``get``, ``in``), naming what there is
            raise KeyError(f"{self._attribute}[{name!r}]: no such field; the fields are {sorted(self._names)}")
        return self._view(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __setitem__(self, name: str, value: Any) -> None:
        raise TypeError(
            f"{self._attribute}[{name!r}] = ... would replace the field's view, not its stored values, so "
            f"nothing was written; write them with {self._attribute}[{name!r}][...] = values (or buffer.update)"
        )

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"del {self._attribute}[{name!r}]: a buffer's fields are fixed when it is created")

    def __repr__(self) -> str:
        return f"{self._attribute}{dict(self)!r}"


def mirror_lock(buffer: Any, writer_only: bool = False) -> AbstractContextManager[Any]:
    """The lock of a ``ReplayBuffer`` object (``buffer._serialized``), held by every write and
    ``refresh()`` of it: a plan holding it copies lengths, generations and meta rows of one
    state of the mirror, though another thread of the process commits or refreshes through
    the same object. ``writer_only``: only a writable object's, for a whole read (rows no
    commit, edit or close() of another thread changes meanwhile), and a reader's whose refresh
    closes what its reads use (``Storage.closes_at_refresh``: hdf5); a reader's reads are checked
    against writers anywhere (``consistency.py``). No lock for other buffers."""
    lock = getattr(buffer, "_lock", None)
    closes = getattr(getattr(buffer, "storage", None), "closes_at_refresh", False)  # not of a Storage's own lock
    if lock is None or (writer_only and buffer.read_only and not closes):
        return nullcontext()
    return lock


class RefreshLock:
    """What a read through a buffer's storage alone holds (each ``to_dask`` block, each
    ``stats()`` task): the lock of a read-only ``ReplayBuffer`` whose ``refresh()`` closes what
    its reads use (``Storage.closes_at_refresh``: hdf5), so a refresh of another thread waits
    for the read (which then reopens the file) instead of closing the file under it; no lock
    for other buffers, whose reads run in parallel. It pickles as no lock: a copy of the graph
    in another process reads through a storage of its own, which no refresh of this one closes."""

    def __init__(self, buffer: Any = None):
        closes = getattr(getattr(buffer, "storage", None), "closes_at_refresh", False)
        owned = closes and getattr(buffer, "read_only", False) and hasattr(buffer, "_lock")
        self._buffer = buffer if owned else None

    def __call__(self) -> AbstractContextManager[Any]:
        return nullcontext() if self._buffer is None else self._buffer._lock

    def __reduce__(self) -> tuple[type[RefreshLock], tuple[()]]:
        return RefreshLock, ()


def frozen(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array``: how a buffer hands out its snapshot without a copy."""
    view = array.view()
    view.flags.writeable = False
    return view


class CommittedViews(SchemaAttributes):
    """The seed's attributes and ``BufferView``'s read-only views of the committed snapshot,
    over ``_committed()``: what ReplayBuffer and ConcatReplayBuffer share."""

    def _committed(self) -> Mapping[str, np.ndarray]:
        """Every slot's committed meta rows by name, ``episode_lens`` and ``_generation`` among them."""
        raise NotImplementedError

    _rlock: threading.RLock
    _lock_pid: int

    @property
    def _lock(self) -> threading.RLock:
        """The lock every write and ``refresh()`` of this object hold, and the plans of its
        reads (and, of a writable object or one whose refresh closes what its reads use, the
        reads: ``buffer._serialized``, ``mirror_lock``), so threads of this process share the
        object. A forked child (a DataLoader worker) or an unpickled copy makes its own: a
        thread of the parent holding it at the fork does not run there, and would hold it forever."""
        if self.__dict__.get("_lock_pid") != os.getpid() or "_rlock" not in self.__dict__:
            self._rlock, self._lock_pid = threading.RLock(), os.getpid()
        return self._rlock

    @property
    def episode_lens(self) -> np.ndarray:
        """Committed length of every slot (0: empty); read-only view."""
        return frozen(self._committed()["episode_lens"])

    @property
    def generations(self) -> np.ndarray:
        """Generation of every slot (0: empty); read-only view."""
        return frozen(self._committed()["_generation"])

    # The loaders' methods have make_dataset's and make_dataloader's signatures (the buffer
    # first) for type checkers; at run time they import torch and the loaders on first use.
    if TYPE_CHECKING:
        dataset = make_dataset
        dataloader = make_dataloader
    else:

        def dataset(self, *args, **kwargs):
            """A trajectory, timestep (``timestep_level``) or n-step (``n_steps``) dataset of the
            episodes committed now: ``replaybuf.sampling.make_dataset`` of this buffer."""
            with feature_imports("dataset"):
                from .sampling import make_dataset

            return make_dataset(self, *args, **kwargs)

        def dataloader(self, batch_size, *args, **kwargs):
            """A torch DataLoader over the episodes committed now (``sampler='prioritized'`` for
            prioritized timesteps; over all members of a ConcatReplayBuffer):
            ``replaybuf.sampling.make_dataloader`` of this buffer."""
            with feature_imports("dataloader"):
                from .sampling.loader import make_dataloader, warn_if_no_batch

            loader = make_dataloader(self, batch_size, *args, **kwargs)
            warn_if_no_batch(loader)
            return loader

    def meta_values(self, name: str) -> np.ndarray:
        """Values of meta field ``name`` for every slot, as committed; read-only view."""
        if name not in self.meta_fieldnames:
            raise ValueError(
                f"meta_values: invalid meta field name {name!r} - must be one of {sorted(self.meta_fieldnames)}"
            )
        return frozen(self._committed()[name])

    # ---- analysis (``analysis.py``, imported on first use: it needs torch and dask) ----------------

    def _view(self) -> BufferView:
        """This buffer as the ``BufferView`` the analyses take: both classes that inherit these
        methods implement it (a type checker sees only this mixin)."""
        return cast(BufferView, self)

    def get_all_data(
        self,
        fields: Sequence[str] | None = None,
        meta_fields: Sequence[str] | None = None,
        device: torch.device | str | None = None,
        lazy: bool = False,
        progress: bool | None = None,
    ):
        """One row per slot ``0 .. num_episodes - 1`` (row i = slot i, as the seed; a concatenation
        member by member) as tensors, time-padded to the longest with the field's default (else
        zeros); an empty slot, or one a writer in another process is rewriting, is a row of padding
        with length 0. Read consistently and decoded on the storage's thread pool straight into
        the results, through dask where a ``dask.distributed`` client is active
        (``analysis.get_all_data``); ``lazy=True`` returns the dask arrays instead. ``progress``: a tqdm bar (default: on a terminal, for reads longer than two
        seconds).
        """
        with feature_imports("get_all_data"):
            from .analysis import get_all_data

        return get_all_data(self._view(), fields, meta_fields, device=device, lazy=lazy, progress=progress)

    def to_dask(
        self,
        fields: Sequence[str] | None = None,
        meta_fields: Sequence[str] | None = None,
        order: str = "chronological",
    ):
        """Committed episodes as dask arrays: data (episodes, time, *shape), meta (episodes, *shape)."""
        with feature_imports("to_dask"):
            from .analysis import to_dask

        return to_dask(self._view(), fields, meta_fields, order=order)

    def to_xarray(
        self,
        fields: Sequence[str] | None = None,
        meta_fields: Sequence[str] | None = None,
        order: str = "chronological",
    ):
        """Committed episodes as a lazy ``xarray.Dataset``: the ``to_dask`` arrays with named dims,
        lengths, the valid-step mask and meta fields as coordinates (``pip install 'replaybuf[xarray]'``)."""
        with feature_imports("to_xarray"):
            from .analysis import to_xarray

        return to_xarray(self._view(), fields, meta_fields, order=order)

    def episode_mask(self):
        """Dask bool array (episodes, time): True where a committed episode has a step."""
        with feature_imports("episode_mask"):
            from .analysis import episode_mask

        return episode_mask(self._view())

    def stats(
        self,
        fields: Sequence[str] | None = None,
        progress: bool | None = None,
        *,
        episodes: Any = None,
        exact: bool = False,
    ) -> BufferStats:
        """Per-field mean/std/min/max (and ``quantile()``) over the valid steps of ``episodes``
        (slots; None: every committed episode), lengths and returns: merged from the sketches
        a writer's first ``stats()`` stored (a concatenation's across its members) without
        reading data, sketching from the data the episodes without one, or
        ``exact=True`` recomputed from the data with dask (``analysis.stats``)."""
        with feature_imports("stats"):
            from .analysis import stats

        return stats(self._view(), fields, progress=progress, episodes=episodes, exact=exact)
