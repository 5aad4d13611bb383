"""The two viewer apps: pre-rendered videos (``--serve``) and a whole buffer (``replaybuf view``).

``ReplayApp`` plays a fixed set of video files side by side. ``BufferApp`` answers questions
about a buffer (episodes with their lengths and meta values, per-timestep series of small
fields) and renders an episode's image fields to mp4 on first request, kept in a temp
folder within a byte budget (``cache.VideoCache``) for the life of the server.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from replaybuf.consistency import read_episodes_consistent
from replaybuf.video import (
    blocks_to_video,
    check_encodable,
    check_fps,
    episode_slots,
    frame_size,
    image_fields,
    to_rgb_uint8,
)
from replaybuf.view import BufferView
from replaybuf.viewer.cache import DEFAULT_CACHE_BYTES, VideoCache
from replaybuf.viewer.server import FileResponse, JsonResponse, NotFound, remove_tree

__all__ = ["BufferApp", "ReplayApp", "series_fields", "meta_columns"]

# vectors up to this many dims are plotted (one line per dim); larger ones are only listed
MAX_PLOT_DIMS = 32
# steps of an episode's series sent to the page, at most (every n-th step of a longer one): plots
# are a few thousand pixels wide, and 200,000 steps of a 32-dim field and a scalar were 133 MB of
# JSON, built in 0.5 GB and 5 s per request
MAX_SERIES_POINTS = 10_000
# meta values with up to this many elements are shown in the episode list
MAX_EXACT_PAGE_INT = 2**53  # JavaScript's numbers hold integers up to this exactly
MAX_META_ELEMENTS = 8
# videos rendered at once: each holds a block of its episode's frames and runs an encoder
MAX_RENDERS = 4
# a render reads its episode's frames this many stored bytes at a time (at least one frame), so
# that memory does not grow with the episode (3,000 float frames of 3x128x128 read whole: 1.2 GB)
RENDER_BLOCK_BYTES = 32 << 20
# locks that keep two requests from rendering one video at once (a video takes one by its path)
RENDER_LOCKS = 64

# indices in ASCII digits only, up to 18 of them (``\d`` takes any script's digits, ``$`` a newline)
_EPISODE_PATH = re.compile(r"/api/episodes/([0-9]{1,18})")
# an episode's video: of the episode the slot holds now, or (as the page asks, from the link its
# episode came with) of exactly the episode shown, named by generation, revision and buffer opened
_EPISODE_VIDEO_PATH = re.compile(
    r"/video/episodes/([0-9]{1,18})/(?:gen-([0-9]{1,20})-rev-([0-9]{1,20})-open-([0-9]{1,20})/)?([^/]+)\.mp4"
)


def _json_values(values: np.ndarray, exact: bool = False) -> Any:
    """A numeric array as nested lists with NaN / inf as None (JSON has no NaN); with ``exact``
    (meta values, shown as text: ids, seeds), integers a page's numbers cannot hold exactly
    (beyond 2**53) as their decimal text. Plotted series stay numbers (a ns timestamp plots)."""
    values = np.asarray(values)
    if values.dtype == np.bool_ or np.issubdtype(values.dtype, np.integer):
        inexact = (values > MAX_EXACT_PAGE_INT) | (values < -MAX_EXACT_PAGE_INT)
        if not (exact and inexact.any()):
            return values.tolist()
        if values.ndim == 0:
            return str(values.item())
        boxed = values.astype(object)
        boxed[inexact] = [str(value) for value in boxed[inexact]]
        return boxed.tolist()
    values = values.astype(np.float64)
    finite = np.isfinite(values)
    if finite.all():
        return values.tolist()
    boxed = values.astype(object)
    boxed[~finite] = None
    return boxed.tolist()


def _is_numeric(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return dtype == np.bool_ or np.issubdtype(dtype, np.number)


def series_fields(buffer: BufferView) -> list[str]:
    """Per-timestep fields that plot as lines: numeric scalars and vectors of <= 32 dims."""
    names = []
    for name, field in buffer.schema.fields.items():
        shape = field.shape
        small = shape == () or (len(shape) == 1 and shape[0] <= MAX_PLOT_DIMS)
        if small and _is_numeric(field.dtype):
            names.append(name)
    return names


def meta_columns(buffer: BufferView) -> list[str]:
    """User meta fields small enough to show in the episode list (internal ones start with '_')."""
    names = []
    for name in sorted(buffer.meta_fieldnames):
        if name == "episode_lens" or name.startswith("_"):
            continue
        array = buffer.meta_data[name]
        if _is_numeric(array.dtype) and int(np.prod(array.shape[1:], dtype=np.int64)) <= MAX_META_ELEMENTS:
            names.append(name)
    return names


class ReplayApp:
    """Serves already rendered videos, one per field, played in sync by ``replay.html``."""

    page = "replay.html"

    def __init__(self, videos: dict[str, Path], info: dict[str, Any], temp_dir: VideoCache | Path | None = None):
        if not videos:
            raise ValueError("videos: expected at least one field -> video path")
        missing = [str(path) for path in videos.values() if not Path(path).is_file()]
        if missing:
            raise ValueError(f"videos: no such file(s) {missing}")
        self.videos = {str(name): Path(path) for name, path in videos.items()}
        self.info = {
            **info,
            "fields": [{"name": name, **info.get("field_info", {}).get(name, {})} for name in self.videos],
        }
        self.info.pop("field_info", None)
        self._temp_dir = temp_dir

    def respond(self, path: str) -> JsonResponse | FileResponse:
        if path == "/api/info":
            return JsonResponse({**self.info, "videos": {name: f"/video/{name}" for name in self.videos}})
        if path.startswith("/video/") and path[len("/video/") :] in self.videos:
            return FileResponse(self.videos[path[len("/video/") :]])
        raise NotFound(path)

    def close(self) -> None:
        """Delete ``temp_dir`` (the folder the videos were rendered into), if given."""
        if isinstance(self._temp_dir, VideoCache):
            self._temp_dir.close()
        else:
            remove_tree(self._temp_dir)
        self._temp_dir = None


class EpisodeVersion(NamedTuple):
    """Which episode a slot held and how its rows stood: what names one video of it."""

    generation: int  # a slot a writer reused holds another generation
    revision: int  # an episode edited in place (``update``, ``data[...] = ...``) another revision
    opened: int  # a buffer created again at the location numbers its generations from 1 again


class BufferApp:
    """Browses a buffer: episode list, per-episode series and on-demand mp4 renders, of which
    at most ``cache_bytes`` are kept (least recently served deleted first)."""

    page = "browse.html"

    def __init__(
        self,
        buffer: BufferView,
        location: str = "",
        fps: float = 30,
        scale: int = 1,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        check_fps(fps, ".mp4")  # the videos it renders
        if isinstance(scale, bool) or not isinstance(scale, int | np.integer) or scale < 1:
            raise ValueError(f"scale: expected a positive integer, got {scale!r}")
        self.buffer = buffer
        self.location = location
        # Python numbers: /api/info sends them as JSON, which has no numpy scalars (a value read
        # from meta_data, np.float32(15), failed every /api/info request)
        self.fps = float(fps)
        self.scale = int(scale)
        self.image_fields = image_fields(buffer)
        self.series_fields = series_fields(buffer)
        self.meta_columns = meta_columns(buffer)
        self._cache = VideoCache(cache_bytes)
        self.cache_dir = self._cache.folder
        self._read_lock = threading.Lock()
        self._storage = buffer.storage  # the storage the buffer reads now: another after a reopen
        self._reopened = 0  # times the buffer was reopened after another process replaced it
        self._renders = threading.BoundedSemaphore(MAX_RENDERS)
        self._render_locks = [threading.Lock() for _ in range(RENDER_LOCKS)]

    # answers

    def respond(self, path: str) -> JsonResponse | FileResponse:
        if path == "/api/info":
            return JsonResponse(self.describe())
        if path == "/api/episodes":
            return JsonResponse(self.episodes())
        match = _EPISODE_PATH.fullmatch(path)
        if match:
            return JsonResponse(self.episode(int(match[1])))
        match = _EPISODE_VIDEO_PATH.fullmatch(path)
        if match:
            version = EpisodeVersion(*map(int, match.group(2, 3, 4))) if match[2] is not None else None
            video = self._pinned_video(int(match[1]), match[5], version)
            return FileResponse(video, release=partial(self._cache.release, video))
        raise NotFound(path)

    def describe(self) -> dict[str, Any]:
        """The buffer's layout: which fields are videos, plots and episode-list columns."""
        buffer = self.buffer
        return {
            "mode": "browse",
            "location": self.location,
            "fps": self.fps,
            "scale": self.scale,
            "num_episodes": int(buffer.num_episodes),
            "image_fields": self.image_fields,
            "series_fields": self.series_fields,
            "meta_columns": self.meta_columns,
            "fields": {
                name: {"shape": list(field.shape), "dtype": str(field.dtype)}
                for name, field in buffer.schema.fields.items()
            },
        }

    def episodes(self) -> dict[str, Any]:
        """Every episode slot up to the last committed one (``slots`` rows; ``num_episodes`` is
        the seed's count) with its length and small meta values, read column by column."""
        with self._read_lock:
            buffer = self._current(refresh=True)
            count = episode_slots(buffer)  # every committed episode, past a dropped one too
            lengths = np.asarray(buffer.episode_lens[:count])
            meta = {name: np.asarray(buffer.meta_data[name][:count]) for name in self.meta_columns}
        return {
            "num_episodes": int(buffer.num_episodes),
            "slots": count,
            "columns": self.meta_columns,
            "lengths": _json_values(lengths),
            "meta": {name: _json_values(values, exact=True) for name, values in meta.items()},
        }

    def episode(self, index: int) -> dict[str, Any]:
        """One episode: its length, meta values and the series of its plottable fields, read in
        one consistent read (an episode being rewritten shows as empty, never mixed). Series of
        episodes over ``MAX_SERIES_POINTS`` steps hold every ``series_stride``-th step."""
        with self._read_lock:
            buffer = self._current()
            self._length(index)
            revision = self._revision(index)  # before the rows: an edit meanwhile names them older
            got = read_episodes_consistent(buffer, [index], self.series_fields)
            opened = self._reopened
        length = int(got.lens[0]) if len(got) else 0
        meta = {
            name: _json_values(got.meta[name][0] if len(got) else self._meta_fill(name), exact=True)
            for name in self.meta_columns
        }
        stride = max(1, -(-length // MAX_SERIES_POINTS))
        series = {
            name: _json_values(
                got.data[name][0, :length:stride] if len(got) else np.zeros((0, *buffer.schema.fields[name].shape))
            )
            for name in self.series_fields
        }
        return {
            "index": index,
            "length": length,
            "meta": meta,
            "series": series,
            "series_stride": stride,
            # links to the videos of exactly this episode: a writer reusing the slot meanwhile
            # must not show its new episode's frames under this one's length, meta and plots
            "videos": self._video_links(index, EpisodeVersion(int(got.generations[0]), revision, opened))
            if length
            else {},
        }

    def _video_links(self, index: int, version: EpisodeVersion) -> dict[str, str]:
        """The URL of each image field's video of episode ``version`` of slot ``index``."""
        folder = f"gen-{version.generation}-rev-{version.revision}-open-{version.opened}"
        return {name: f"/video/episodes/{index}/{folder}/{name}.mp4" for name in self.image_fields}

    def render(self, index: int, field: str) -> Path:
        """The mp4 of one episode's image field, rendered on first request and cached (until
        the cache's budget needs its bytes for others)."""
        path = self._pinned_video(index, field)
        self._cache.release(path)
        return path

    def _pinned_video(self, index: int, field: str, version: EpisodeVersion | None = None) -> Path:
        """``render``'s video, kept from deletion until ``self._cache.release(path)``; with
        ``version``, the video of exactly that episode (``NotFound`` once the slot holds another
        and that one's video is no longer kept)."""
        if field not in self.image_fields:
            raise NotFound(f"no image field {field!r} (image fields: {self.image_fields})")
        height, width = frame_size(self.buffer.schema.fields[field].shape)
        check_encodable(-(-height // self.scale), -(-width // self.scale), ".mp4", what=f"field {field!r}")
        cached = self._rendered(index, field, version)
        if cached is not None:
            return cached
        step = min(
            max(1, RENDER_BLOCK_BYTES // self.buffer.schema.fields[field].step_nbytes), self.buffer.max_timesteps
        )
        with self._renders:  # a burst of requests holds at most MAX_RENDERS blocks of frames
            with self._read_lock:
                # refreshed: the decoded chunks a reader keeps may hold frames from before an
                # in-place edit, which its next refresh() drops
                buffer = self._current(refresh=True)
                self._length(index)
                opened = self._reopened
                revision = self._revision(index)  # before the frames: an edit meanwhile keys them older
                first = read_episodes_consistent(
                    buffer,
                    [index],
                    [field],
                    None if version is None else [version.generation],
                    t1=step,
                    with_meta=False,
                )
                now = EpisodeVersion(int(first.generations[0]) if len(first) else 0, revision, opened)
                path = self._video_path(index, now, field)
            if version is not None and now != version:
                raise self._gone(index, version)
            if len(first) == 0:
                raise ValueError(f"episode {index} is empty or being rewritten, nothing to render")
            with self._render_locks[hash(path) % RENDER_LOCKS]:
                if not self._cache.acquire(path):
                    generation, length = int(first.generations[0]), int(first.lens[0])
                    blocks = self._frame_blocks(index, field, generation, opened, length, step)
                    # near-lossless, with a keyframe every second so that stepping backwards stays
                    # quick; written whole or not at all, so a failed render is retried next time
                    blocks_to_video(
                        chain([self._scaled(first.data[field][0, :length])], blocks),
                        path,
                        fps=self.fps,
                        quality=8,
                        output_params=["-g", str(max(1, round(self.fps)))],
                    )
                    self._cache.add(path)
        return path

    def _frame_blocks(
        self, index: int, field: str, generation: int, opened: int, length: int, step: int
    ) -> Iterator[np.ndarray]:
        """The frames of episode ``generation`` of slot ``index`` past its first ``step``, read
        ``step`` at a time (scaled): a render holds one block of an episode of any length.
        Raises ValueError once the slot holds another episode, or another buffer is open."""
        for t0 in range(step, length, step):
            with self._read_lock:
                buffer = self._current()
                got = read_episodes_consistent(
                    buffer, [index], [field], [generation], t0=t0, t1=min(t0 + step, length), with_meta=False
                )
            if len(got) == 0 or self._reopened != opened:
                raise ValueError(f"episode {index} was rewritten while its {field!r} video was rendered; ask again")
            yield self._scaled(got.data[field][0])

    def _scaled(self, frames: np.ndarray) -> np.ndarray:
        """Frames as the video holds them: RGB uint8, every ``scale``-th pixel."""
        return to_rgb_uint8(frames)[:, :: self.scale, :: self.scale]

    def close(self) -> None:
        self._cache.close()

    # helpers

    def _current(self, refresh: bool = False) -> BufferView:
        """The buffer, refreshed first when asked or when another process replaced it
        (``overwrite=True``) since it was read: ``refresh()`` then opens the new one, or raises
        ``BufferReplacedError`` naming how its config differs. Counts those reopenings, which
        key the cached videos (a buffer created again numbers its generations from 1 again), so
        the new buffer's episodes never show as the old one's. Called under the read lock."""
        if refresh or self.buffer.storage.replaced():
            self.buffer.refresh()
        if self.buffer.storage is not self._storage:
            self._storage = self.buffer.storage
            self._reopened += 1
        return self.buffer

    def _meta_fill(self, name: str) -> np.ndarray:
        """What an empty slot holds in meta field ``name``: its fill in the field's shape and
        dtype, so that it reads as the episode list shows it (``false``, ``[0, 0]``; not ``0``)."""
        field = self.buffer.schema.meta_fields[name]
        return np.full(field.shape, field.fill, field.dtype)

    def _length(self, index: int) -> int:
        count = episode_slots(self.buffer)
        if not 0 <= index < count:
            raise NotFound(f"episode {index} (the buffer has {count} episodes)")
        return int(self.buffer.episode_lens[index])

    def _rendered(self, index: int, field: str, version: EpisodeVersion | None = None) -> Path | None:
        """The video already rendered from the episode slot ``index`` holds now (or from episode
        ``version`` of it, whatever it holds now), if any (pinned in the cache): served without
        reading the episode's frames again (a <video> asks for many byte ranges of it). Raises
        ``NotFound`` for a ``version`` no longer kept that the slot no longer holds."""
        with self._read_lock:
            buffer = self._current()
            self._length(index)
            generation = int(buffer.storage.read_meta_rows("_generation", np.array([index]))[0])
            now = EpisodeVersion(generation, self._revision(index), self._reopened)
        path = self._video_path(index, version or now, field)
        if (version or now).generation and self._cache.acquire(path):
            return path
        if version is not None and version != now:
            raise self._gone(index, version)
        return None

    @staticmethod
    def _gone(index: int, version: EpisodeVersion) -> NotFound:
        """The error for a video of an episode that slot ``index`` no longer holds as it was."""
        return NotFound(
            f"episode {index} as shown (generation {version.generation}, revision {version.revision}) is no "
            "longer stored: a writer replaced or edited it since; pick the episode again to see what it holds now"
        )

    def _revision(self, index: int) -> int:
        """Slot ``index``'s ``_revision`` as stored now: a new one with each in-place edit of its
        rows (``update``, ``data[...] = ...``). Called under the read lock."""
        return int(self.buffer.storage.read_meta_rows("_revision", np.array([index]))[0])

    def _video_path(self, index: int, version: EpisodeVersion, field: str) -> Path:
        """Where the video of ``field`` of episode ``generation`` of slot ``index`` is cached:
        keyed by the generation (a slot a writer reused renders its new episode), the revision
        (an episode edited in place renders its new frames) and the buffer opened (a buffer
        created again at the location counts generations from 1 again). The field goes by its
        position among the image fields, not its name: a name of up to 200 bytes, which a buffer
        takes, made the file's name longer than the 255 bytes a file system takes."""
        position = self.image_fields.index(field)
        generation, revision, opened = version
        return self.cache_dir / f"episode-{index}-gen-{generation}-rev-{revision}-open-{opened}.field-{position}.mp4"
