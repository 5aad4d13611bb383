"""Shared fixtures: a buffer location per backend (built on ``tests/_backends.make_place``), so API
tests run on every backend, and the check that no optional backend is missing."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, settings

from ._backends import BACKENDS, SKIP_MISSING, Place, make_place, missing_backends

# ``--hypothesis-profile=long``: many more examples, e.g. for the differential tests against
# memmap-replay-buffer (tests/test_differential.py); CI uses each test's own bounded settings
settings.register_profile(
    "long",
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def pytest_configure(config):
    """A missing optional backend fails the run before any test, unless SKIP_MISSING allows it
    (see tests/_backends.py): CI never passes without a backend's tests."""
    missing = missing_backends()
    if missing and os.environ.get(SKIP_MISSING) != "1":
        raise pytest.UsageError("\n".join(missing.values()))


@pytest.fixture(autouse=True)
def _skip_missing_backend(request):
    """Under SKIP_MISSING, a test parametrized with a missing backend's name is skipped."""
    missing = missing_backends()
    callspec = getattr(request.node, "callspec", None)
    if missing and callspec is not None:
        for value in callspec.params.values():
            if isinstance(value, str) and value in missing:
                pytest.skip(missing[value])


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


@pytest.fixture
def place(backend, tmp_path) -> Place:
    """A buffer location for the backend under test: pass ``**place.kwargs`` to ReplayBuffer."""
    return make_place(backend, tmp_path)
