"""Reading folders written by memmap-replay-buffer 0.2.x (the seed library).

A seed folder holds ``metadata.pkl`` (the config, pickled), ``<field>.data.npy`` and
``<meta>.data.meta.npy`` (numpy memmaps, including ``episode_lens`` and ``_initted``) and the
counters ``num_episodes.state.npy``, ``episode_index.state.npy``, ``timestep_index.state.npy``
(int32 scalars). The pickle is read by a restricted unpickler that refuses every global, so a
crafted ``metadata.pkl`` cannot run code; the loaded object must consist of plain
dict/list/tuple/str/int/float/bool/None, and the work is bounded (MAX_PICKLE_BYTES, opcodes and
objects counted as a tree walk would meet them up to MAX_PICKLE_OBJECTS, MAX_PICKLE_DEPTH, no
cycles): a small pickle of shared references is refused at once instead of expanding.

The seed publishes an episode in progress through ``episode_lens[episode_index]`` (its
``timestep_index``); replaybuf shows it as the newest, committed episode of that length, which
is what the seed's own readers see.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import pickletools
import tokenize
from dataclasses import dataclass

import numpy as np

from ..schema import Schema
from ._kv import open_stored, own_file
from .base import BufferDamagedError

# what reading a damaged .npy header raises: numpy turns most parse failures into ValueError,
# but a header whose quote became '#' leaves a bracket open and escapes as tokenize.TokenError
NPY_HEADER_ERRORS = (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError)


def out_of_descriptors(error: BaseException) -> bool:
    """Whether ``error`` is the process (or the system) out of file descriptors: a limit to
    raise (``ulimit -n``), never damage of the file it failed to open."""
    return isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE)


METADATA_FILE = "metadata.pkl"
STATE_NAMES = ("num_episodes", "episode_index", "timestep_index")
SEED_INTERNAL_META = ("episode_lens", "_initted")
SEED_FLAGS_FILE = "_initted.data.meta.npy"  # the seed's per-slot "initialised" flags (bool)
_PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))


class UnsafePickleError(ValueError):
    """A ``metadata.pkl`` holds something other than plain Python data."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, bools and None; refuses every global."""

    def find_class(self, module: str, name: str):
        raise UnsafePickleError(
            f"refusing to load {module}.{name}: metadata.pkl may only hold plain data "
            "(dict/list/tuple/str/int/float/bool/None)"
        )

    def persistent_load(self, pid):
        raise UnsafePickleError("refusing persistent ids in metadata.pkl")


# a seed config is a few hundred bytes of field specs; these bound the work a crafted
# metadata.pkl can cause: memoized references make a DAG whose tree walk is exponential in the
# pickle's size (476 bytes can stand for 2**60 objects), so the walk below visits each object
# once and counts what a tree walk would visit
MAX_PICKLE_BYTES = 1 << 20
MAX_PICKLE_OBJECTS = 100_000
MAX_PICKLE_DEPTH = 64
# opcodes that build plain data; everything else (globals, reduce, build, persistent ids,
# extension codes, out-of-band buffers) is refused before anything is unpickled
_PLAIN_OPCODES = frozenset(
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 "
    "LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE SHORT_BINUNICODE BINUNICODE "
    "BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE TUPLE "
    "TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS GET BINGET LONG_BINGET PUT BINPUT "
    "LONG_BINPUT MEMOIZE".split()
)


def _check_opcodes(data: bytes, source: str) -> None:
    """Refuse, without building anything, a pickle with other than plain-data opcodes or with
    more opcodes than MAX_PICKLE_OBJECTS."""
    strings: list[str] = []  # the last strings pushed: STACK_GLOBAL's module and name
    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(data)):
            if isinstance(arg, str):
                strings = [*strings[-1:], arg]
            if opcode.name in ("GLOBAL", "STACK_GLOBAL"):
                target = str(arg).replace(" ", ".") if opcode.name == "GLOBAL" else ".".join(strings)
                raise UnsafePickleError(
                    f"refusing to load {target}: metadata.pkl may only hold plain data "
                    "(dict/list/tuple/str/int/float/bool/None)"
                )
            if opcode.name not in _PLAIN_OPCODES:
                raise UnsafePickleError(
                    f"refusing opcode {opcode.name} ({opcode.doc.strip().splitlines()[0]}): metadata.pkl "
                    "may only hold plain data "
                    "(dict/list/tuple/str/int/float/bool/None)"
                )
            if count >= MAX_PICKLE_OBJECTS:
                raise UnsafePickleError(f"more than {MAX_PICKLE_OBJECTS} pickle opcodes; not a seed config")
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{source}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{source} is not a readable memmap-replay-buffer config: {e}") from None


def _check_plain(value: object, source: str) -> None:
    """Check types, depth, cycles and the expanded size of an unpickled value, visiting each
    object once (shared references are counted as often as a tree walk would meet them)."""
    sizes: dict[int, int] = {}  # id -> objects in the subtree, once done
    on_path: set[int] = set()

    def size(item: object, where: str, depth: int) -> int:
        if not isinstance(item, _PLAIN_TYPES):
            raise UnsafePickleError(
                f"{source}: {where} is a {type(item).__name__}; only "
                "dict/list/tuple/str/int/float/bool/None are accepted"
            )
        if not isinstance(item, (dict, list, tuple)):
            return 1
        key = id(item)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise UnsafePickleError(f"{source}: {where} contains itself; a seed config holds no cycles")
        if depth >= MAX_PICKLE_DEPTH:
            raise UnsafePickleError(f"{source}: nested deeper than {MAX_PICKLE_DEPTH} levels; not a seed config")
        on_path.add(key)
        children = item.items() if isinstance(item, dict) else enumerate(item)
        total = 1
        for k, child in children:
            total += size(k, f"{where} key", depth + 1) if isinstance(item, dict) else 0
            total += size(child, f"{where}[{k!r}]", depth + 1)
            if total > MAX_PICKLE_OBJECTS:
                raise UnsafePickleError(
                    f"{source}: expands to more than {MAX_PICKLE_OBJECTS} objects (shared references); "
                    "not a seed config"
                )
        on_path.discard(key)
        sizes[key] = total
        return total

    size(value, "the config", 0)


def load_plain_pickle(data: bytes, source: str) -> dict:
    """Unpickle ``data`` allowing only plain Python data, bounded in size, objects and depth;
    a dict is expected."""
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafePickleError(f"{source}: {len(data)} bytes, over the {MAX_PICKLE_BYTES} of any seed config")
    _check_opcodes(data, source)
    try:
        value = _PlainDataUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{source}: {e}") from None
    except Exception as e:
        raise ValueError(f"{source} is not a readable memmap-replay-buffer config: {e}") from e
    _check_plain(value, source)
    if not isinstance(value, dict):
        raise ValueError(f"{source}: expected a dict config, got {type(value).__name__}")
    return value


def is_seed_folder(folder: str) -> bool:
    """Whether ``folder`` looks like a memmap-replay-buffer memmap folder (not its HDF5 variant)."""
    return os.path.isfile(os.path.join(folder, METADATA_FILE)) and all(
        os.path.isfile(state_path(folder, n)) for n in STATE_NAMES
    )


def state_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"{name}.state.npy")


def seed_h5_hint(location: str) -> str:
    """A hint for a local folder that memmap-replay-buffer's ReplayBufferH5PY wrote (its
    ``metadata.pkl`` beside a ``data.h5``; replaybuf's hdf5 backend writes no pickle), else ''."""
    if "://" in location or not os.path.isfile(os.path.join(location, METADATA_FILE)):
        return ""
    if not os.path.isfile(os.path.join(location, "data.h5")):
        return ""
    return (
        "; the folder is a memmap-replay-buffer ReplayBufferH5PY folder (metadata.pkl and data.h5), "
        "whose HDF5 layout replaybuf does not open: copy it into a new buffer with "
        "replaybuf.copy_seed_h5(src, dst)"
    )


def read_seed_schema(folder: str) -> Schema:
    """The seed config of ``folder`` as a replaybuf Schema."""
    path = os.path.join(folder, METADATA_FILE)
    with open(path, "rb") as f:
        config = load_plain_pickle(f.read(MAX_PICKLE_BYTES + 1), path)
    missing = [k for k in ("max_episodes", "max_timesteps", "fields") if k not in config]
    if missing:
        raise ValueError(f"{path}: config lacks {missing}; not a memmap-replay-buffer folder")
    # checked as a new config is, its errors naming the file as a replaybuf config's do
    # (``Storage._schema_from_config``): the values come from a file, not from the caller
    try:
        meta = {n: s for n, s in (config.get("meta_fields") or {}).items() if n not in SEED_INTERNAL_META}
        return Schema.build(
            config["fields"], meta, config["max_episodes"], config["max_timesteps"], bool(config.get("circular", False))
        )
    except (AttributeError, TypeError, ValueError) as e:
        raise BufferDamagedError(f"{path}: invalid memmap-replay-buffer config: {e}") from None


@dataclass(frozen=True)
class SeedState:
    """The seed's counters, and what they mean in replaybuf's terms."""

    num_episodes: int
    episode_index: int
    timestep_index: int

    @classmethod
    def read(cls, folder: str, max_episodes: int, max_timesteps: int) -> SeedState:
        """The counters of ``folder``, each checked against the config's bounds: the seed keeps
        ``num_episodes <= max_episodes``, ``episode_index < max_episodes`` and ``timestep_index
        <= max_timesteps``, so a value outside them is damage (trusted, an ``episode_index``
        past the end was taken modulo ``max_episodes`` and the next episode overwrote a
        committed one)."""
        limits = {"num_episodes": max_episodes, "episode_index": max_episodes - 1, "timestep_index": max_timesteps}
        values = []
        for name in STATE_NAMES:
            path = state_path(folder, name)
            try:
                os.close(open_stored(path))  # a FIFO there is refused, never waited on (np.load's open would)
                value = np.load(path, mmap_mode="r")
                if value.shape != () or value.dtype.kind not in "iu" or not 0 <= int(value) <= limits[name]:
                    raise ValueError(
                        f"holds {value.dtype}{list(value.shape)} {value!r}, expected an int in [0, {limits[name]}]"
                    )
            except NPY_HEADER_ERRORS as e:
                if out_of_descriptors(e):
                    raise
                raise BufferDamagedError(f"{path}: not a memmap-replay-buffer counter ({e})") from None
            values.append(int(value))
        return cls(*values)

    def episode_lens(self, stored_lens: np.ndarray) -> np.ndarray:
        """Per-slot lengths with the episode in progress (if any) published at its step count."""
        lens = np.array(stored_lens, dtype=np.int32)
        if self.timestep_index > 0:
            lens[self.episode_index] = self.timestep_index
        return lens

    def generations(self, lens: np.ndarray, max_episodes: int) -> np.ndarray:
        """1-based chronological ordinals of the filled slots (0 for empty ones).

        Once the seed has filled every slot, the oldest episode sits at ``episode_index`` (the
        slot written next), or just after it when that slot holds the episode in progress.
        """
        start = 0
        if self.num_episodes >= max_episodes:
            start = (self.episode_index + (1 if self.timestep_index > 0 else 0)) % max_episodes
        order = (np.arange(max_episodes) - start) % max_episodes
        filled = np.flatnonzero(lens > 0)
        out = np.zeros(max_episodes, dtype=np.int64)
        out[filled[np.argsort(order[filled], kind="stable")]] = np.arange(1, len(filled) + 1)
        return out

    def replaybuf_state(self, lens: np.ndarray, max_episodes: int) -> dict:
        """Counters with the episode in progress counted as committed."""
        in_progress = self.timestep_index > 0
        return {
            "num_episodes": min(self.num_episodes + int(in_progress), max_episodes),
            "episode_index": (self.episode_index + int(in_progress)) % max_episodes,
            "total_episodes": int((lens > 0).sum()),
        }


def write_seed_state(folder: str, state: dict) -> None:
    """Mirror replaybuf's counters into the seed's state files, so the seed library can keep
    using a folder replaybuf wrote to (no episode in progress: ``timestep_index`` 0)."""
    values = {"num_episodes": state["num_episodes"], "episode_index": state["episode_index"], "timestep_index": 0}
    for name, value in values.items():
        own_file(state_path(folder, name))  # written in place: never through a hard link
        array = np.load(state_path(folder, name), mmap_mode="r+")
        array[()] = value
        array.flush()
        del array
    initted = os.path.join(folder, SEED_FLAGS_FILE)
    if os.path.isfile(initted):
        own_file(initted)
        flags = np.load(initted, mmap_mode="r+")
        flags[state["episode_index"]] = False
        flags.flush()
        del flags
