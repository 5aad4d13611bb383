"""A storage's parts refer back to it weakly, so that no reference cycle keeps a storage alive.

A storage owns its arrays and its checksums, and they call back into it (the lease check before
a write, the committed length of a slot, the open file). Strong references both ways would form
a cycle that only a garbage-collection pass frees: a writer dropped without ``close()`` would
hold its writer lease, files and background thread until then, and another process opening the
buffer would get BufferLockedError meanwhile. With the parts' references weak, the storage is
freed as soon as its last user drops it, as a Python file object is.

A part is used through its storage (``storage.array(name)``), never after it: one whose storage
is gone raises ReferenceError. Both pickle as their storage, so a pickled storage (sent to a
DataLoader worker) arrives whole.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Owner(Generic[T]):
    """A weak reference to the object that owns a part; calling it returns the owner."""

    __slots__ = ("_ref",)

    def __init__(self, owner: T):
        self._ref = weakref.ref(owner)

    def __call__(self) -> T:
        owner = self._ref()
        if owner is None:
            raise ReferenceError(
                "the storage this part (an array, the checksums) belongs to was dropped: use it through its storage"
            )
        return owner

    def __reduce__(self) -> tuple[type[Owner[T]], tuple[T]]:
        return Owner, (self(),)


class OwnerMethod:
    """A method bound to the owner of a part, the owner held weakly: a callback the part keeps
    without keeping its owner alive. Like the bound method it replaces, it calls the function
    the method had when bound."""

    __slots__ = ("_owner", "_function")

    def __init__(self, method: Callable[..., Any]):
        self._owner = Owner(method.__self__)  # type: ignore[attr-defined]
        self._function: Callable[..., Any] = method.__func__  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(self._owner(), *args, **kwargs)

    def __reduce__(self) -> tuple[type[OwnerMethod], tuple[Callable[..., Any]]]:
        return OwnerMethod, (self._function.__get__(self._owner()),)
