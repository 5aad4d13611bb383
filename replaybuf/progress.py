"""tqdm progress bars for long operations: ``convert``, ``verify``, ``get_all_data``, ``stats``.

Every such call takes ``progress``: ``None`` (the default) shows a bar only when stderr is a
terminal (tqdm's ``disable=None``) and only once the operation has run for ``DELAY_S``, so quick
calls and logs stay clean; ``True`` always shows one, at once; ``False`` never does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm  # text bars; tqdm.auto warns in Jupyter kernels without ipywidgets

__all__ = ["check_progress", "progress_bar", "dask_progress"]

# seconds an operation runs before its bar appears (progress=None): "a few seconds' worth"
DELAY_S = 2.0


def check_progress(progress: Any) -> None:
    """Refuse a ``progress`` argument other than True, False or None."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, got {progress!r}")


def progress_bar(progress: bool | None, **kwargs: Any) -> tqdm:
    """A tqdm bar (rates included) obeying ``progress`` as the module docstring says."""
    check_progress(progress)
    disable = None if progress is None else not progress
    return tqdm(disable=disable, delay=DELAY_S if progress is None else 0.0, dynamic_ncols=True, **kwargs)


@contextmanager
def dask_progress(progress: bool | None, desc: str) -> Iterator[None]:
    """A bar over the tasks of the dask computations run inside (threads or sync scheduler;
    a ``dask.distributed`` client has its own dashboard)."""
    from dask.callbacks import Callback

    with progress_bar(progress, desc=desc, unit="task", total=0) as bar:

        class _Tasks(Callback):
            def _start_state(self, dsk: Any, state: dict) -> None:
                bar.total += sum(len(state[k]) for k in ("ready", "waiting", "running", "finished"))
                bar.refresh()

            def _posttask(self, key: Any, result: Any, dsk: Any, state: dict, worker_id: Any) -> None:
                bar.update()

        with _Tasks():
            yield
