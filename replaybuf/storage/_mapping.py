"""Read-only memory maps of files that hold no file descriptor.

Python's ``mmap.mmap`` keeps a duplicate of the file's descriptor for as long as the map lives.
A reader keeping one map per hot shard or cached episode (thousands, for a buffer of short
episodes) would run into the process's open-file limit (often 1024), so it kept few and
remapped the others again and again: 400 hot episodes sampled at random ran at 0.07x an
np.memmap gather. ``map_file`` maps through libc's ``mmap`` and closes nothing of the caller's:
the map outlives the descriptor, as POSIX allows, and is unmapped when the last array over it
goes.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from typing import Any

import numpy as np


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value


class _Map:
    """One mapping, exposed to numpy as bytes; unmapped when numpy lets go of it."""

    def __init__(self, address: int, size: int):
        self.address, self.size = address, size
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, True), "version": 3}
        self._munmap = _LIBC.munmap  # held: at interpreter exit the module's globals may be gone first

    def __del__(self) -> None:
        self._munmap(self.address, self.size)


def map_file(fd: int, size: int) -> np.ndarray:
    """The first ``size`` (> 0) bytes of the open file ``fd``, mapped read-only and shared, as a
    uint8 array (its views keep the map alive). The caller may close ``fd`` at once."""
    if _LIBC is None:  # no libc to call: Python's map, which keeps a descriptor
        return np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), np.uint8)
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"mmap of {size} bytes failed: {os.strerror(error)}")
    mapped = np.asarray(_Map(address, size))
    if os.fstat(fd).st_size < size:  # as Python's mmap refuses: a page past the end would fault
        raise ValueError("mmap length is greater than file size")
    return mapped


def map_array(fd: int, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only array of ``shape`` and ``dtype`` at byte ``offset`` of the open file ``fd``
    (``map_file``: the caller may close ``fd`` at once)."""
    end = offset + math.prod(shape) * dtype.itemsize
    if end == offset:
        return np.empty(shape, dtype)
    return map_file(fd, end)[offset:end].view(dtype).reshape(shape)


_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14; an older kernel refuses it, and the pages fault in as written


def map_anonymous(size: int) -> int | None:
    """The address of ``size`` bytes of fresh private memory (huge pages asked for, as numpy asks
    for its large arrays) whose pages are made present at once, or None where libc cannot be
    called or the kernel refuses; the caller unmaps it (``unmap``). The caller writes all of it:
    one populating call cost less than the page faults of those writes (a cold 213 MB
    ``get_all_data``: 90 against 106 ms median, 147 against 193 ms of CPU)."""
    if _LIBC is None:
        return None
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = _LIBC.mmap(None, size, prot, flags, -1, 0)
    if address is None or address == _FAILED:
        return None
    _LIBC.madvise(address, size, _MADV_HUGEPAGE)  # a refusal costs speed only
    _LIBC.madvise(address, size, _MADV_POPULATE_WRITE)  # so does this one (or too little memory)
    return address


def unmap(address: int, size: int) -> None:
    """Give back memory from ``map_anonymous``."""
    _LIBC.munmap(address, size)
