"""The one place test buffers live: the backend list, a location per backend (``make_place``;
the ``backend``, ``place`` and ``make_location`` fixtures in conftest.py are built on it), the
check that every optional backend is installed, and snapshots of everything stored (to prove
that read-only access writes nothing).

A missing optional backend fails the run (``pytest_configure`` in conftest.py) with the command
that installs it, so CI cannot lose a backend silently. A developer without one runs the rest
with ``REPLAYBUF_TESTS_SKIP_MISSING=1``: the tests that need it are skipped: a test parametrized
with its name and any test that fails importing its library (hooks in conftest.py), and a module
or test that imports the library through ``require``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import itertools
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest

from replaybuf.testing import snapshot

__all__ = [
    "BACKENDS",
    "LOCAL_BACKENDS",
    "OPTIONAL_BACKENDS",
    "SKIP_MISSING",
    "Place",
    "make_place",
    "missing_backends",
    "require",
    "snapshot",
]


# 'memory' is the zarr backend on a memory:// URL. The list is fixed: a backend whose library is
# missing stays in it and fails (or, with SKIP_MISSING set, skips) instead of dropping out
BACKENDS = ["zarr", "memory", "memmap", "hdf5"]
LOCAL_BACKENDS = [name for name in BACKENDS if name != "memory"]
OPTIONAL_BACKENDS = {"hdf5": "h5py"}  # backend -> the library it needs (the test extra has each)
SKIP_MISSING = "REPLAYBUF_TESTS_SKIP_MISSING"
_counter = itertools.count()


def _install_hint(module: str) -> str:
    return (
        f"{module} is not installed (pip install -e '.[test]' installs every test dependency; "
        f"{SKIP_MISSING}=1 skips the tests that need it instead)"
    )


@functools.cache
def missing_backends() -> dict[str, str]:
    """The optional backends whose library does not import, with the install hint for each."""
    missing = {}
    for backend, module in OPTIONAL_BACKENDS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing[backend] = f"the {backend} backend's tests cannot run: {_install_hint(module)}"
    return missing


def require(module: str) -> ModuleType:
    """Import optional library ``module`` for a test or a test module: missing, it fails with
    the install hint, or skips (the whole module, when called at import) under SKIP_MISSING."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get(SKIP_MISSING) == "1":
            pytest.skip(_install_hint(module), allow_module_level=True)
        pytest.fail(_install_hint(module), pytrace=False)


@dataclass
class Place:
    """A buffer location for one backend: pass ``**place.kwargs`` to ReplayBuffer."""

    name: str
    location: str
    backend: str

    @property
    def kwargs(self) -> dict:
        return {"backend": self.backend}

    @property
    def on_disk(self) -> bool:
        return "://" not in self.location


def make_place(name: str, tmp_path, label: str = "buffer") -> Place:
    """Where backend ``name``'s buffer ``label`` lives: under ``tmp_path``, or a ``memory://``
    URL unique to this call."""
    if name == "memory":
        return Place(name, f"memory://replaybuf-test-{os.getpid()}-{next(_counter)}/{label}", "zarr")
    return Place(name, str(tmp_path / f"{label}-{name}"), name)


def holds_files_under(folder) -> bool:
    """Whether this process maps or has open a file under ``folder``: only then can a garbage
    collection give back space there (a deleted file keeps its space while mapped or open), so
    a test may skip the collection (tenths of a second in a large test process) otherwise."""
    root = os.path.join(str(folder), "")
    with open("/proc/self/maps") as maps:  # a line's sixth column: the file mapped, if any
        if any(line.split(maxsplit=5)[-1].startswith(root) for line in maps):
            return True
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                return True
    return False


@contextlib.contextmanager
def tmpfs(folder, size: str) -> Iterator:
    """A tmpfs of ``size`` (mount's syntax: "1m") mounted at the existing ``folder`` for the
    block: a disk that fills up. Skips the test where a mount is refused."""
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip() or result.returncode})")
    try:
        yield folder
    finally:
        gc.collect()  # maps of the tests' buffers keep the mount busy until collected
        subprocess.run(["umount", "--lazy", str(folder)], check=True)
