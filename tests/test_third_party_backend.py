"""A backend of a third party (``tests/_third_party_backend.py``), installed as a package names
it, through an entry point in ``replaybuf.backends``: it passes ``StorageTests`` on the
``Storage`` defaults, and every process finds it, the ``replaybuf`` command included, without
a ``register_backend`` call of its own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer
from replaybuf.cli import main
from replaybuf.storage import base, make_storage, registry
from replaybuf.testing import StorageFactory, StorageTests


def install(site, monkeypatch, entry_points: str) -> None:
    """A package in folder ``site`` naming ``entry_points`` (lines ``name = module:Class``) in
    ``replaybuf.backends``, on ``sys.path``."""
    info = site / "npyfolder_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: npyfolder-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[replaybuf.backends]\n{entry_points}\n")
    monkeypatch.syspath_prepend(str(site))


@pytest.fixture
def fresh_registry(monkeypatch) -> Iterator[None]:
    """Entry points read again at the next lookup; the registry as it was afterwards."""
    registered = dict(base._registry)
    monkeypatch.setattr(base, "_entry_points_loaded", False)
    yield
    base._registry.clear()
    base._registry.update(registered)


@pytest.fixture
def installed(fresh_registry, tmp_path_factory, monkeypatch) -> str:
    """The backend ``npyfolder``, as an installed package's metadata names it."""
    install(tmp_path_factory.mktemp("site"), monkeypatch, "npyfolder = tests._third_party_backend:NpyFolderStorage")
    return "npyfolder"


class TestNpyFolderStorage(StorageTests):
    fields = {name: StorageTests.fields[name] for name in ("frame", "state")}  # the defaults read row by row

    @pytest.fixture
    def storage_factory(self, installed, tmp_path) -> StorageFactory:
        return lambda name="buffer": make_storage(tmp_path / name, backend=installed)


def test_every_process_finds_it_the_command_included(installed, tmp_path, capsys):
    """Created by name, the buffer is found by what was stored (``from_folder``, the command's
    ``info``, ``verify``, ``convert``) and read beside a zarr buffer in a concatenation."""
    assert registry[installed][0] == "tests._third_party_backend:NpyFolderStorage"
    path, copy = str(tmp_path / "run"), str(tmp_path / "copy")
    buffer = ReplayBuffer(path, max_episodes=4, max_timesteps=5, fields={"x": "float"}, backend=installed)
    for length in (3, 5):
        buffer.store_episode(x=np.arange(length, dtype=np.float32))
    buffer.close()
    assert ReplayBuffer.from_folder(path, read_only=True).storage.backend_name == installed
    assert main(["info", path]) == 0 and f"\nbackend    {installed}\n" in capsys.readouterr().out  # no "(None)"
    assert main(["verify", path]) == 0
    assert main(["convert", path, copy]) == 0
    both = ConcatReplayBuffer([path, copy])
    np.testing.assert_array_equal(np.asarray(both.data["x"][:, :]).sum(axis=1), [3, 10, 0, 0, 3, 10, 0, 0])


def test_a_create_over_another_backends_buffer_is_refused(installed, tmp_path):
    """The backend leaves ``check_creatable`` to the default: creating its buffer where a zarr
    buffer lives is refused before anything is written, and the zarr buffer keeps its episode."""
    path = str(tmp_path / "run")
    buffer = ReplayBuffer(path, max_episodes=2, max_timesteps=3, fields={"x": "float"})
    buffer.store_episode(x=np.ones(3, np.float32))
    buffer.close()
    with pytest.raises(ValueError, match="holds a 'zarr' buffer.*backend='zarr'"):
        ReplayBuffer(path, max_episodes=2, max_timesteps=3, fields={"x": "float"}, backend=installed)
    assert sorted(os.listdir(path)) == ["data", "meta", "replaybuf", "zarr.json"]
    assert ReplayBuffer.from_folder(path, read_only=True).data["x"][0].tolist() == [1, 1, 1]


def test_a_stale_entry_point_is_named_and_others_still_open(fresh_registry, tmp_path, monkeypatch):
    """An entry point naming a class its package no longer has is an ImportError naming it;
    buffers of every other backend are still detected and created."""
    install(tmp_path, monkeypatch, "gone = tests._third_party_backend:RenamedStorage")
    with pytest.raises(ImportError, match="'tests._third_party_backend:RenamedStorage' names no Storage subclass"):
        make_storage(tmp_path / "a", backend="gone")
    ReplayBuffer(str(tmp_path / "b"), max_episodes=1, max_timesteps=2, fields={"x": "float"}).close()
    assert ReplayBuffer.from_folder(str(tmp_path / "b")).storage.backend_name == "zarr"
