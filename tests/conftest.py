"""Shared fixtures: a buffer location per backend, so API tests run on every backend."""

from __future__ import annotations

import itertools
import os

import pytest

from ._backends import BACKENDS, make_place

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(autouse=True)
def _read_cache_dir(tmp_path_factory, monkeypatch):
    """Read caches of remote buffers go to the test's temp folder, not the user's cache."""
    monkeypatch.setenv("REPLAYBUF_CACHE_DIR", str(tmp_path_factory.mktemp("read-cache")))


_counter = itertools.count()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """The backend under test: 'memory' is the zarr backend on a ``memory://`` URL."""
    return request.param


@pytest.fixture
def make_location(backend, tmp_path):
    """A factory of fresh buffer locations plus the backend= argument for the backend under test."""

    def make(name: str = "buffer") -> tuple[str, dict]:
        place = make_place(backend, tmp_path, f"{name}-{next(_counter)}")
        return place.location, {} if place.backend == "zarr" else place.kwargs  # zarr: the default

    return make
