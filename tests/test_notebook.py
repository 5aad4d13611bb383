"""examples/analysis.ipynb runs, top to bottom, against a small buffer made here."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.demo import CONFIG, rendered_frame

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("xarray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "analysis.ipynb")


def make_buffer(path) -> None:
    """The demo's fields, a few short episodes."""
    buffer = ReplayBuffer(str(path), **{**CONFIG, "max_episodes": 6, "max_timesteps": 12})
    rng = np.random.default_rng(0)
    for episode, length in enumerate((9, 12, 5, 7)):
        buffer.store_episode(
            frame=np.stack([rendered_frame(t, episode) for t in range(length)]),
            state=rng.normal(size=(length, 8)),
            action=rng.integers(0, 4, (length, 2)),
            reward=rng.random(length),
            task_id=episode % 2,
        )
    buffer.close()


def test_analysis_notebook_runs(tmp_path, monkeypatch):
    make_buffer(tmp_path / "buffer")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    first = notebook.cells[1]
    assert "parameters" in first.metadata.get("tags", []) and first.source.startswith("BUFFER = ")
    first.source = f"BUFFER = {str(tmp_path / 'buffer')!r}"
    # the kernel is a subprocess: it must import this checkout's replaybuf
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"] == []  # no warnings
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # returns, frame strip, action plot
    printed = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "4 episodes, 33 steps" in printed
    assert "mean return" in str(outputs[-1]["data"]["text/plain"])
