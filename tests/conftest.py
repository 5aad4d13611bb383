"""Shared fixtures: a buffer location per backend (built on ``tests/_backends.make_place``), so API
tests run on every backend, and the check that no optional backend is missing."""

from __future__ import annotations

import gc
import itertools
import os

import pytest
from hypothesis import HealthCheck, settings

from ._backends import BACKENDS, OPTIONAL_BACKENDS, SKIP_MISSING, Place, make_place, missing_backends

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


def pytest_runtest_setup(item):
    """Under SKIP_MISSING, a test parametrized with a missing backend's name is skipped."""
    callspec = getattr(item, "callspec", None)
    for backend, reason in missing_backends().items():  # empty unless SKIP_MISSING: see pytest_configure
        if callspec is not None and backend in callspec.id.split("-"):
            pytest.skip(reason)


def pytest_collection_finish(session):
    """What collection made (torch, zarr, dask, every test module: ~600k objects) is moved out
    of the garbage collector's sight: a full collection, explicit (tests, replaybuf's writable
    open) or automatic, walked it all, ~0.4 s each in a worker that collected the whole suite.
    Objects the tests make are collected as before; ``pytest_sessionfinish`` gives the rest back."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under SKIP_MISSING, a test that fails importing a missing backend's library is skipped."""
    report = (yield).get_result()
    if not report.failed or call.excinfo is None or not call.excinfo.errisinstance(ImportError):
        return
    for backend, reason in missing_backends().items():
        if OPTIONAL_BACKENDS[backend] in str(call.excinfo.value):
            report.outcome, report.longrepr = "skipped", (str(item.path), (item.location[1] or 0) + 1, reason)
            return


@pytest.fixture(autouse=True)
def _read_cache_dir(tmp_path_factory, monkeypatch):
    """Read caches of remote buffers go to the test's temp folder, not the user's cache."""
    monkeypatch.setenv("REPLAYBUF_CACHE_DIR", str(tmp_path_factory.mktemp("read-cache")))


_counter = itertools.count()


@pytest.fixture
def no_gc():
    """Garbage collection off for the test: what it checks is given back by reference counting
    alone, when the last reference goes (as a dropped Python file object is closed)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
