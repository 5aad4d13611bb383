"""Buffer-level attributes: a small JSON object about the dataset as a whole.

What holds for every episode (the frame rate, feature names, task texts, the environment a
dataset was recorded in) belongs neither in a per-step field nor in a per-episode meta field.
``buffer.attrs`` keeps it as one JSON object at ``replaybuf/attrs.json``, written through the
Storage blob API: every backend, S3 and GCS included, stores it, and each change replaces the
object whole in one atomic write (a reader sees the old or the new attributes, never a mix).

Only JSON goes in (no pickle: opening a buffer never runs code): None, bool, int, float
(finite), str, lists (tuples read back as lists) and dicts with str keys, at most
``MAX_ATTRS_BYTES`` encoded. A value outside that is refused before anything is written, with
the key path that holds it.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from .storage.base import ATTRS_KEY, BufferDamagedError, Storage, parse_json

__all__ = ["ATTRS_KEY", "MAX_ATTRS_BYTES", "BufferAttrs", "encode_attrs", "load_attrs"]

#: the encoded attributes' size limit: they are read whole on every ``buffer.attrs``, so arrays
#: belong in fields, not here
MAX_ATTRS_BYTES = 1 << 20
_MAX_DEPTH = 64


def _check_value(value: Any, where: str, depth: int = 0) -> None:
    """Raise TypeError/ValueError naming ``where`` when ``value`` is not plain JSON."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where} nests deeper than {_MAX_DEPTH} levels (a container holding itself?)")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}: JSON has no NaN or infinity")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_value(item, f"{where}[{index}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the key {key!r} ({type(key).__name__}): JSON object keys are str")
            _check_value(item, f"{where}[{key!r}]", depth + 1)
        return
    kind = type(value)
    hint = "; convert numpy values with .item() or .tolist()" if kind.__module__ == "numpy" else ""
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__} ({str(value)[:60]!r}): buffer attrs hold JSON "
        f"values only (None, bool, int, float, str, list, dict with str keys){hint}"
    )


def encode_attrs(attrs: Mapping[str, Any]) -> bytes:
    """The JSON bytes of ``attrs``, after checking every key and value and the total size."""
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise TypeError(f"buffer attrs keys are str, got {key!r} ({type(key).__name__})")
        _check_value(value, f"attrs[{key!r}]")
    raw = json.dumps(dict(attrs), allow_nan=False, separators=(",", ":")).encode()
    if len(raw) > MAX_ATTRS_BYTES:
        raise ValueError(
            f"buffer attrs take {len(raw)} bytes as JSON, more than the {MAX_ATTRS_BYTES} allowed: "
            "keep arrays and large tables in fields or meta fields"
        )
    return raw


def load_attrs(storage: Storage) -> dict[str, Any]:
    """The attributes stored with the buffer of ``storage`` (empty when it has none);
    BufferDamagedError naming the object when it holds what ``encode_attrs`` never writes (over
    ``MAX_ATTRS_BYTES``, refused unread; NaN or infinity, too deep a nesting)."""
    raw = storage.read_blob(ATTRS_KEY, limit=MAX_ATTRS_BYTES)
    if raw is None:
        return {}
    where = storage.describe_key(ATTRS_KEY)
    attrs = parse_json(raw, where)
    try:
        for key, value in attrs.items():
            _check_value(value, f"attrs[{key!r}]")
    except ValueError as error:
        raise BufferDamagedError(f"{where}: {error}") from None
    return attrs


class BufferAttrs(MutableMapping[str, Any]):
    """A buffer's attributes as a dict that writes through: each assignment, deletion,
    ``update`` or ``clear`` checks the result and replaces the stored object in one write.

    Reads come from the attributes as loaded when the view was made (``buffer.attrs`` makes a
    new view each time, so it sees what writers stored since) and return copies: change a nested
    value by assigning it again (``attrs["lerobot"] = {**attrs["lerobot"], "fps": 15}``).
    ``check_writable(call)`` raises on a read-only buffer before anything is written.
    """

    def __init__(self, storage: Storage, check_writable: Callable[[str], None]):
        self._storage = storage
        self._check_writable = check_writable
        self._data = load_attrs(storage)

    def __getitem__(self, key: str) -> Any:
        return copy.deepcopy(self._data[key])

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def __setitem__(self, key: str, value: Any) -> None:
        self._change(f"attrs[{key!r}] = ...", lambda attrs: attrs.__setitem__(key, value))

    def __delitem__(self, key: str) -> None:
        self._change(f"del attrs[{key!r}]", lambda attrs: attrs.__delitem__(key))

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Set several attributes in one checked write (all or none)."""
        new = dict(other, **kwargs)
        self._change("attrs.update", lambda attrs: attrs.update(new))

    def clear(self) -> None:
        """Remove every attribute in one write."""
        self._change("attrs.clear", dict.clear)

    def _change(self, call: str, edit: Callable[[dict[str, Any]], Any]) -> None:
        self._check_writable(call)
        # start from the stored object, not this view's copy: another view may have written since
        attrs = load_attrs(self._storage)
        edit(attrs)
        raw = encode_attrs(attrs)
        self._storage.write_blob(ATTRS_KEY, raw)
        self._data = json.loads(raw)

    def __repr__(self) -> str:
        return f"BufferAttrs({self._data!r})"
