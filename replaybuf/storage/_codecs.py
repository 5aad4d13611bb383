"""The codec stack of the zarr chunks replaybuf writes, run by the direct chunk path.

``bytes`` (little-endian), at most one compressor (zstd, blosc or gzip through numcodecs) and,
from format 2, zarr v3's ``crc32c`` codec: 4 bytes after the payload, checked before decoding.
Checking costs about 1 us an 84x84x3 frame with google-crc32c (numcodecs' CRC32C: ~9 us),
against ~12 us to decode the frame with blosc-lz4. Runs of blosc chunks (a shard's frames, a
batch of sampled ones) are checked and decoded by c-blosc and crc32c called directly
(``decode_many_into``), with the GIL free for each frame.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import google_crc32c
import numcodecs
import numcodecs.blosc
import numpy as np

from ._compiled import compiled

_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
# blosc's header: byte 2 holds flags; this one says the payload follows the 16-byte header raw
BLOSC_MEMCPYED = 0x02
#: bytes of blosc's header before a chunk's payload
BLOSC_HEADER = 16


# a blosc header's decoded size (bytes 4-8) and stored size (bytes 12-16), little-endian
_BLOSC_SIZES = struct.Struct("<4xI4xI")
_CRC = struct.Struct("<I")
# what failed in a chunk of a checked run (the codes ``replaybuf/_native.c`` returns)
_SHORT, _CRC_MISMATCH, _UNDECODABLE = 1, 2, 3


class ChunkDamage(Exception):
    """A chunk's bytes fail their checksum or do not decode; the array adds where it lies.
    ``item``: which chunk of a ``decode_many_into`` call; ``checksum_only``: the stored crc32c
    is one bit away from the payload's (``crc_bit_flipped``): the checksum is damaged, not the
    data."""

    def __init__(self, reason: str, item: int = 0, checksum_only: bool = False):
        super().__init__(reason)
        self.item = item
        self.checksum_only = checksum_only


def crc_mismatch(payload: bytes | memoryview, stored: int, item: int = 0) -> ChunkDamage:
    """The ``ChunkDamage`` of a chunk whose ``payload`` fails the crc32c ``stored`` after it:
    ``checksum_only`` (and said so) when the two crcs differ in one bit."""
    computed = crc32c(payload)
    if crc_bit_flipped(computed, stored, memoryview(payload).nbytes):
        return ChunkDamage(
            f"its stored crc32c is damaged, not its data (it holds {stored:#010x}, one bit away from the "
            f"crc32c {computed:#010x} of the chunk's bytes, which damaged data cannot cause); "
            "`replaybuf verify --repair` re-seals the chunk",
            item,
            checksum_only=True,
        )
    return ChunkDamage("crc32c mismatch", item)


@functools.cache
def _native() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """c-blosc's ``blosc_decompress_ctx`` (exported by numcodecs' blosc extension) and
    google-crc32c's ``crc32c_extend``, called through ctypes: each call releases the GIL for the
    whole decode or checksum and costs ~0.5 us, where ``numcodecs.blosc.decompress`` spends
    ~5 us of Python around the decode of an 84x84x3 frame with the GIL held (and google-crc32c
    holds it throughout), so two threads decoding frames ran little faster than one. None where
    a library does not export them or fails the self-check (the modules' functions serve then)."""
    crc_extension = importlib.util.find_spec("google_crc32c._crc32c")  # absent: its pure-Python build
    if crc_extension is None or crc_extension.origin is None:
        return None
    try:
        decompress = ctypes.CDLL(numcodecs.blosc.__file__).blosc_decompress_ctx
        extend = ctypes.CDLL(crc_extension.origin).crc32c_extend
    except (OSError, AttributeError):
        return None
    decompress.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    decompress.restype = ctypes.c_int
    extend.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    extend.restype = ctypes.c_uint32
    sample = np.arange(4096, dtype=np.uint8)
    encoded = np.frombuffer(numcodecs.blosc.compress(sample, b"lz4", 5, 0), np.uint8)
    decoded = np.zeros_like(sample)
    ok = decompress(encoded.ctypes.data, decoded.ctypes.data, sample.nbytes, 1) == sample.nbytes
    if not ok or not np.array_equal(decoded, sample) or extend(0, sample.ctypes.data, sample.nbytes) != crc32c(sample):
        return None
    return decompress, extend


@functools.cache
def _native_loop() -> Callable[..., tuple[int, int]] | None:
    """``decode_many`` of the compiled extension ``replaybuf._native`` (built where a compiler
    was at install; optional), or None: the ctypes path serves, chunk by chunk."""
    return None if _native() is None else compiled("decode_many")


@functools.cache
def _native_addresses() -> tuple[int, int]:
    """The addresses of the ``_native`` functions, which the compiled loop calls."""
    native = _native()
    assert native is not None  # the loop exists only where they do
    decompress, extend = (ctypes.cast(cast(Any, function), ctypes.c_void_p).value or 0 for function in native)
    return decompress, extend


def crc32c(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """The CRC-32C (Castagnoli) of a buffer, as zarr v3's ``crc32c`` codec computes it: about
    1 us for an 84x84x3 frame (google-crc32c), ~5% of decoding it with lz4. ``value``: the
    CRC-32C of the bytes before ``data``, to checksum a buffer in pieces.

    google-crc32c holds the GIL (it gives it up only for bytes objects of 1 MiB or more)."""
    if isinstance(data, memoryview):
        data = np.frombuffer(data, np.uint8)  # google_crc32c refuses memoryviews, not arrays
    return google_crc32c.extend(value, data)


class ChunkCodec:
    """``bytes`` (little-endian), at most one compressor (zstd, blosc or gzip), then optionally
    ``crc32c`` (format 2): 4 bytes little-endian after the payload, checked on every decode."""

    def __init__(self, dtype: np.dtype, compressor: dict | None, checksum: bool = False):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.compressor = compressor
        self.checksum = checksum
        self._codec = None if compressor is None else _numcodec(compressor)
        self._blosc = isinstance(self._codec, numcodecs.Blosc)

    @property
    def compressed(self) -> bool:
        return self._codec is not None

    @property
    def label(self) -> str:
        """Short form for ``replaybuf info``: 'zstd:3', 'blosc-lz4:5', 'none'."""
        if self.compressor is None:
            return "none"
        name, config = self.compressor["name"], self.compressor.get("configuration", {})
        if name == "blosc":
            return f"blosc-{config.get('cname', 'lz4')}:{config.get('clevel', 5)}"
        return f"{name}:{config.get('level', '')}".rstrip(":")

    @property
    def writes_hot(self) -> bool:
        """Whether ``encode(hot=True)`` stores chunks raw (blosc only): a copy behind blosc's
        16-byte header that every blosc reader decodes whatever clevel the metadata names."""
        return self._blosc

    def is_hot(self, data: bytes | memoryview) -> bool:
        """Whether an encoded chunk (at least its first 3 bytes) holds its payload raw: blosc's
        MEMCPYED flag, set by ``encode(hot=True)`` (and by blosc for data it cannot compress)."""
        return self._blosc and len(data) >= 3 and bool(data[2] & BLOSC_MEMCPYED)

    def encode(self, chunk: np.ndarray, hot: bool = False) -> bytes:
        """The stored bytes of ``chunk``; ``hot``: blosc at clevel 0 (the payload copied raw,
        ~3 us an 84x84x3 frame against ~55-73 us at lz4:9), for the hot tier (``_hot.py``)."""
        raw = np.ascontiguousarray(chunk, dtype=self.dtype)
        if self._codec is None:
            data = raw.tobytes()
        elif self._blosc:
            # the module function skips the codec object's argument checks, as decode_into does
            codec = self._codec
            clevel = 0 if hot else codec.clevel
            data = numcodecs.blosc.compress(raw, codec._cname_bytes, clevel, codec.shuffle, codec.blocksize)
        else:
            data = bytes(self._codec.encode(raw))
        if self.checksum:
            return data + crc32c(data).to_bytes(4, "little")
        return data

    def _payload(self, data: bytes | memoryview) -> bytes | memoryview:
        """The bytes before the checksum, once they match it."""
        if not self.checksum:
            return data
        if len(data) < 4:
            raise ChunkDamage(f"{len(data)} bytes, too short to hold a crc32c")
        view = memoryview(data)
        stored = int.from_bytes(view[-4:], "little")
        if crc32c(view[:-4]) != stored:
            raise crc_mismatch(view[:-4], stored)
        return view[:-4]

    def decode(self, data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        payload = self._payload(data)
        try:
            raw = payload if self._codec is None else self._codec.decode(payload)
            return np.frombuffer(raw, dtype=self.dtype).reshape(shape)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ChunkDamage(f"cannot decode ({e})") from None

    @staticmethod
    def _raw_payload(payload: bytes | memoryview, nbytes: int) -> bool:
        """Whether a blosc chunk stores ``nbytes`` raw behind its header (flag MEMCPYED, sizes
        consistent): what ``encode(hot=True)`` writes."""
        return (
            len(payload) == BLOSC_HEADER + nbytes
            and bool(payload[2] & BLOSC_MEMCPYED)
            and int.from_bytes(payload[4:8], "little") == nbytes
        )

    def decode_many_into(
        self,
        data: bytes | memoryview,
        ranges: Sequence[tuple[int, int]] | np.ndarray,
        out: np.ndarray,
        offsets: Sequence[int] | np.ndarray,
        nbytes: int,
    ) -> None:
        """Decode the chunks stored at ``ranges`` ((start, stop) of ``data``, checksum included)
        into the C-contiguous ``out``, chunk k at byte ``offsets[k]``, each ``nbytes`` decoded:
        a shard's frames in one call. Blosc chunks go through c-blosc and crc32c directly
        (``_native``), in the compiled loop where it was built (the GIL released once for the
        run), else through ctypes chunk by chunk (the GIL free while each one is checked and
        decoded). ``ranges`` and ``offsets`` may be int64 arrays ((n, 2) and (n,)): a whole
        episode's frames then cost no Python step each. A failing chunk raises ``ChunkDamage``
        with ``item`` its position in ``ranges``, the chunks before it decoded."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous array, got strides {out.strides}")
        bounds, places = np.asarray(ranges, np.int64).reshape(-1), np.asarray(offsets, np.int64).reshape(-1)
        if len(bounds) != 2 * len(places):
            raise ValueError(f"{len(bounds) // 2} ranges for {len(places)} offsets")
        if len(places) and (int(places.min()) < 0 or int(places.max()) + nbytes > out.nbytes):
            raise ValueError(f"chunks of {nbytes} bytes at {places.tolist()} do not fit out ({out.nbytes} bytes)")
        native = _native() if self._blosc else None
        loop = None if native is None else _native_loop()
        if loop is not None:
            decompress, extend = _native_addresses()
            target = out.reshape(-1).view(np.uint8)
            k, code = loop(decompress, extend, data, bounds, target, places, nbytes, self.checksum)
        else:
            pairs, starts = bounds.reshape(-1, 2).tolist(), places.tolist()
            if native is None:
                self._decode_each_into(data, pairs, out, starts, nbytes)
                return
            k, code = self._check_and_decode_each(native, data, pairs, out, starts, nbytes)
        if k >= 0:
            start, stop = bounds[2 * k : 2 * k + 2].tolist()
            raise self._damage_of(k, code, data, start, stop, nbytes)

    def _check_and_decode_each(
        self,
        native: tuple[Callable[..., int], Callable[..., int]],
        data: bytes | memoryview,
        ranges: Sequence[Sequence[int]],
        out: np.ndarray,
        offsets: Sequence[int],
        nbytes: int,
    ) -> tuple[int, int]:
        """The compiled loop's work (``replaybuf/_native.c``) through ctypes, chunk by chunk, where
        the extension was not built: (-1, 0), or the failing chunk and what failed (its codes)."""
        decompress, extend = native
        source = np.frombuffer(data, np.uint8)
        base, target, size, tail = source.ctypes.data, out.ctypes.data, len(source), 4 if self.checksum else 0
        for k, ((start, stop), offset) in enumerate(zip(ranges, offsets)):
            payload = stop - start - tail
            if start < 0 or payload < BLOSC_HEADER or stop > size:
                return k, _SHORT
            if tail and extend(0, base + start, payload) != _CRC.unpack_from(data, stop - 4)[0]:
                return k, _CRC_MISMATCH
            decoded, stored = _BLOSC_SIZES.unpack_from(data, start)
            if decoded != nbytes or stored != payload or decompress(base + start, target + offset, nbytes, 1) != nbytes:
                return k, _UNDECODABLE
        return -1, 0

    def _damage_of(
        self, k: int, code: int, data: bytes | memoryview, start: int, stop: int, nbytes: int
    ) -> ChunkDamage:
        """The ``ChunkDamage`` of chunk ``k`` (stored at ``start .. stop``) failing with ``code``,
        named alike on both paths."""
        if code == _SHORT:
            return ChunkDamage(f"{max(0, min(stop, len(data)) - start)} bytes, too short for a blosc chunk", k)
        if code == _CRC_MISMATCH:
            return crc_mismatch(memoryview(data)[start : stop - 4], _CRC.unpack_from(data, stop - 4)[0], k)
        payload = stop - start - (4 if self.checksum else 0)
        decoded, stored = _BLOSC_SIZES.unpack_from(data, start) if stop - start >= BLOSC_HEADER else (0, 0)
        return ChunkDamage(f"cannot decode (blosc: {stored} bytes to {decoded}; expected {payload} to {nbytes})", k)

    def _decode_each_into(
        self,
        data: bytes | memoryview,
        ranges: Sequence[Sequence[int]],
        out: np.ndarray,
        offsets: Sequence[int],
        nbytes: int,
    ) -> None:
        """``decode_many_into`` chunk by chunk through ``decode_into``."""
        view, flat = memoryview(data), out.reshape(-1).view(np.uint8)
        for k, ((start, stop), offset) in enumerate(zip(ranges, offsets)):
            try:
                self.decode_into(view[start:stop], flat[offset : offset + nbytes].view(out.dtype))
            except ChunkDamage as e:
                raise ChunkDamage(str(e), k, e.checksum_only) from None

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decode a chunk into the contiguous array ``out`` of the same number of bytes."""
        payload = self._payload(data)
        try:
            if self._codec is None:
                out[...] = np.frombuffer(payload, dtype=self.dtype).reshape(out.shape)
            elif self._blosc:
                if self._raw_payload(payload, out.nbytes):
                    # a hot chunk: blosc would only copy the bytes behind its header (~4x faster here)
                    out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, np.uint8, out.nbytes, BLOSC_HEADER)
                else:  # the module function skips the codec object's argument checks (~5 us a frame)
                    numcodecs.blosc.decompress(payload, out)
            else:
                self._codec.decode(payload, out=out)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ChunkDamage(f"cannot decode ({e})") from None


# crc32c detects every 2-bit error in codewords under 2**31 bits (Hamming distance 4 up to
# 2,147,483,615 bits), so over data shorter than this a flipped data bit never moves the crc by
# a single bit, while a flipped bit of a stored crc always does
_ONE_BIT_APART_BYTES = (2**31 - 64) // 8


def crc_bit_flipped(computed: int, stored: int, nbytes: int) -> bool:
    """Whether a stored crc32c that fails against the crc ``computed`` over ``nbytes`` of data
    is itself damaged (one of its bits flipped), not the data: the two differ in exactly one bit."""
    return nbytes < _ONE_BIT_APART_BYTES and ((computed ^ stored) & 0xFFFFFFFF).bit_count() == 1


def _numcodec(compressor: dict):
    name, config = compressor["name"], compressor.get("configuration", {})
    if name == "zstd":
        return numcodecs.Zstd(level=config.get("level", 0))
    if name == "gzip":
        return numcodecs.GZip(level=config.get("level", 5))
    if name == "blosc":
        shuffle = config.get("shuffle", "noshuffle")
        return numcodecs.Blosc(
            cname=config.get("cname", "lz4"),
            clevel=config.get("clevel", 5),
            shuffle=_BLOSC_SHUFFLE.get(shuffle, shuffle),
            blocksize=config.get("blocksize", 0),
        )
    raise ValueError(f"compressor {name!r} is not one replaybuf writes")


def compressor_codec(spec: str, dtype: np.dtype, default_level: int):
    """The zarr codec object for a compressor spec such as 'zstd:3' (None for 'none')."""
    from zarr.codecs import BloscCname, BloscCodec, BloscShuffle, GzipCodec, ZstdCodec

    from ..schema import parse_compressor

    kind, level = parse_compressor(spec)
    if kind == "none":
        return None
    if kind == "zstd":
        return ZstdCodec(level=default_level if level is None else level)
    if kind == "gzip":
        return GzipCodec(level=5 if level is None else level)
    shuffle = BloscShuffle.noshuffle if np.dtype(dtype).itemsize == 1 else BloscShuffle.shuffle
    return BloscCodec(
        cname=BloscCname(kind.split("-")[1]),
        clevel=5 if level is None else level,
        shuffle=shuffle,
        typesize=np.dtype(dtype).itemsize,
    )


def compression_ratio(codec: ChunkCodec, frames: np.ndarray, sample: int = 16) -> float:
    """Raw over encoded bytes of up to ``sample`` of ``frames`` (first axis: one chunk each)
    spread evenly over those not all zero (padding says nothing of the data); inf when every
    frame is zero. A sample keeps the measurement ~1 ms whatever the episode's length."""
    flat = frames.reshape(len(frames), -1)
    written = np.flatnonzero(flat.any(axis=1))
    if not len(written):
        return float("inf")
    picked = written[np.unique(np.linspace(0, len(written) - 1, min(sample, len(written))).astype(np.int64))]
    encoded = sum(len(codec.encode(frames[i])) - 4 * codec.checksum for i in picked.tolist())
    return frames[0].nbytes * len(picked) / max(encoded, 1)
