"""LeRobot v3 dataset folders (``codebase_version`` ``v3.0``), read and written with pyarrow and PyAV.

Layout (LeRobot's ``datasets/utils.py``): ``meta/info.json`` (fps, features, path patterns),
``meta/episodes/chunk-XXX/file-YYY.parquet`` (one row per episode: length, which data file
and, per camera, which video file and from/to timestamps), ``meta/tasks.parquet`` (task text
as the index, ``task_index``), ``data/chunk-XXX/file-YYY.parquet`` (one row per frame, several
episodes per file) and ``videos/<key>/chunk-XXX/file-YYY.mp4`` (several episodes per file).

Mapping: each feature becomes a field named with ``.`` replaced by ``_``
(``observation.images.top`` -> ``observation_images_top``, ``next.reward`` -> ``next_reward``);
``image`` and ``video`` features become (H, W, C) uint8 image fields (videos decoded); shape
``[1]`` features become scalar fields, except where the feature records a field of shape (1,)
(``"replaybuf_shape": [1]``, written by the exporter). ``timestamp``, ``frame_index``, ``index`` and
``episode_index`` are not stored (they follow from the step and the slot); ``task_index`` (of
the episode's first frame) and ``fps`` become meta fields, LeRobot's ``episode_index`` is
``source_episode``. What holds for the whole dataset goes to ``buffer.attrs``: ``fps`` and
``lerobot`` (``codebase_version``, ``robot_type``, ``features`` as in ``info.json``, ``fields``:
field -> feature name, ``tasks``: task_index -> task text, ``left_out``: the data files' columns
no field holds). Non-numeric per-frame features are not kept: replaybuf fields store numbers
only; nor are columns ``info.json`` does not declare.

The exporter takes feature names, their ``names`` entries, task texts, robot type and fps from
those attributes when the buffer has them; otherwise it maps field names back
(``observation_images_X`` -> ``observation.images.X``, ``observation_X`` -> ``observation.X``,
``next_X`` -> ``next.X``) and names tasks ``task_<task_index>``.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ..storage.base import ConcurrentWriteError
from ._engine import ImportSourceError, Source, exported_episodes, new_folder

__all__ = ["LeRobotSource", "export_lerobot"]

INSTALL_HINT = "LeRobot datasets need pyarrow and PyAV: pip install 'replaybuf[lerobot]'"
# columns LeRobot adds to every frame; replaybuf derives them from the slot and the step
FRAME_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
CHUNK_SIZE = 1000
# the key of an exported feature of shape [1] that came from a field of shape (1,), not a scalar:
# LeRobot stores both as one value per frame, so the shape a round trip gives back is kept here
FIELD_SHAPE = "replaybuf_shape"
ONE_TASK = (
    "a buffer keeps one task_index per episode, so which frames had which task would be lost: "
    "split such episodes at their task changes in the source"
)


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return pyarrow


def _av() -> Any:
    try:
        import av
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return av


def _field_name(feature: str) -> str:
    return feature.replace(".", "_")


def _feature_name(field: str) -> str:
    for prefix, replacement in (
        ("observation_images_", "observation.images."),
        ("observation_", "observation."),
        ("next_", "next."),
    ):
        if field.startswith(prefix):
            return replacement + field[len(prefix) :]
    return field


def _numeric(dtype: str) -> bool:
    try:
        return np.dtype(dtype).kind in "biuf"
    except TypeError:
        return False


def _episode_column(column: str) -> bool:
    """The columns of LeRobot's episodes files an import needs (not stats, not task texts)."""
    return not column.startswith(("stats/", "meta/")) and column != "tasks"


def _image_shape(feature: dict[str, Any]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in feature["shape"])
    if list(feature.get("names") or [])[:1] == ["channels"]:
        return (*shape[1:], shape[0])
    return shape


def _column(table: Any, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A (possibly nested list) parquet column as a (rows, *shape) array of the feature's
    ``dtype``; ValueError where a row holds another number of values than ``shape`` (a reshape
    would shift values across rows), an empty value (it read as NaN, or as -2**63 in an integer
    feature), or a value ``dtype`` cannot hold (0.5 in an int64 feature read as 0, 1e300 in a
    float32 one as inf, 300 in a uint8 one as 44, 2, 0.5 or NaN in a bool one as true)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = table.column(name).combine_chunks()
    rows = np.arange(len(table))  # the row each value of the current nesting level belongs to
    while hasattr(array, "flatten") and hasattr(array.type, "value_type"):
        rows = rows[pc.list_parent_indices(array).to_numpy(zero_copy_only=False)]
        array = array.flatten()
    counts = np.bincount(rows, minlength=len(table))
    if (counts != math.prod(shape)).any():
        bad = int(np.flatnonzero(counts != math.prod(shape))[0])
        raise ValueError(
            f"column {name!r}: frame {bad} holds {counts[bad]} values, the feature's shape {shape} holds {math.prod(shape)}"
        )
    if array.null_count:
        bad = int(rows[np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0]])
        raise ValueError(f"column {name!r}: frame {bad} holds an empty value; a field holds numbers only")
    try:
        cast = pc.cast(array, pa.from_numpy_dtype(np.dtype(dtype)), safe=True)
    except pa.ArrowInvalid as error:
        raise ValueError(f"column {name!r} of type {array.type}: {error}; the feature's dtype is {dtype}") from error
    values = np.asarray(cast.to_numpy(zero_copy_only=False), dtype=dtype)
    if values.dtype == np.bool_ and not pa.types.is_boolean(array.type):  # arrow reads any nonzero as true
        raw = np.asarray(array.to_numpy(zero_copy_only=False))
        other = np.flatnonzero((raw != 0) & (raw != 1))  # NaN too
        if len(other):
            bad = int(other[0])
            raise ValueError(
                f"column {name!r}: frame {int(rows[bad])} holds {array[bad].as_py()!r}, not a flag (0 or 1) "
                f"the feature's dtype {dtype} holds as it is"
            )
    # a number narrowed: arrow's safe cast lets a finite value become inf (the source is read again
    # only where the result holds an inf)
    if values.dtype.kind == "f" and np.isinf(values).any():
        grown = np.isinf(values) & np.isfinite(np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.float64))
        if grown.any():
            bad = int(np.flatnonzero(grown)[0])
            raise ValueError(
                f"column {name!r}: frame {int(rows[bad])} holds {array[bad].as_py()!r}, out of the range of "
                f"the feature's dtype {dtype}"
            )
    return values.reshape(len(table), *shape)


def _check_frame_size(path: Path, width: int, height: int, shape: tuple[int, ...]) -> None:
    """ValueError naming ``path`` where its frames are not of the feature's (H, W, 3) ``shape``,
    checked before a frame is decoded: a crafted video of another resolution was decoded whole
    (an episode's frames at its size: gigabytes for a 4K video) before the episode's check."""
    if (height, width, 3) != tuple(shape):
        raise ValueError(
            f"{path} holds frames of {width} x {height} pixels (decoded as RGB), the feature's shape is {tuple(shape)}"
        )


def decode_frames(path: Path, start_s: float, count: int, fps: float, shape: tuple[int, ...]) -> np.ndarray:
    """``count`` RGB frames of the video at ``path`` from time ``start_s`` on, as (count, *shape);
    ValueError before decoding where the video's frames are of another size than ``shape``, and
    where frame i is not at ``start_s + i / fps`` (within half a frame, as LeRobot's reader
    checks its queries): a negative ``from_timestamp`` took the video's first frames, another
    episode's, and a gap in the frames' times took the frames after it."""
    av = _av()
    frames: list[np.ndarray] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        _check_frame_size(path, stream.codec_context.width, stream.codec_context.height, shape)
        container.seek(int(start_s / stream.time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            if frame.time is not None and frame.time < start_s - 0.5 / fps:
                continue
            _check_frame_size(path, frame.width, frame.height, shape)  # a stream may change resolution
            expected = start_s + len(frames) / fps
            if frame.time is not None and abs(frame.time - expected) > 0.5 / fps:
                raise ValueError(
                    f"{path}: frame {len(frames)} of the episode is at {frame.time:.3f} s, expected {expected:.3f} s "
                    f"(from_timestamp {start_s:.3f} s at {fps:g} fps): a frame missing, or the episode outside the video"
                )
            frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) == count:
                break
    if len(frames) < count:
        raise ValueError(f"{path} holds {len(frames)} frames from {start_s:.3f} s, expected {count} (truncated?)")
    return np.stack(frames)


def _inside(root: Path, relative: str, what: str) -> Path:
    """``root / relative``, refused (ValueError) where a crafted dataset names a file outside
    its folder, absolute or through ``..``: an import reads only what the dataset holds. The
    check is on the name, not the resolved path, so datasets made of links (a hub cache) read."""
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise ValueError(f"{what} {relative!r} leaves the dataset folder {str(root)!r}")
    return root / relative


def _decode_image(cell: dict[str, Any] | None, root: Path, shape: tuple[int, ...]) -> np.ndarray:
    from PIL import Image

    if cell is None:
        raise ValueError("an image cell is empty")
    source = cell.get("bytes")
    with Image.open(io.BytesIO(source) if source else _inside(root, cell["path"], "image path")) as image:
        width, height = image.size  # from the header: another size is refused before it is decoded
        if len(shape) != 3 or shape[-1] not in (1, 3) or (height, width) != tuple(shape[:2]):
            raise ValueError(f"an image of {width} x {height} pixels, the feature's shape is {shape}")
        return _pixels(image, shape[-1]).reshape(shape)


# PIL modes of 8-bit channels, which a uint8 image feature holds as they are (palette: its colours)
EIGHT_BIT_MODES = ("1", "L", "P", "RGB", "RGBA", "LA", "PA")


def _pixels(image: Any, channels: int) -> np.ndarray:
    """The pixels of PIL ``image`` as (H, W, ``channels``) uint8; ValueError where that would
    change them, as PIL's ``convert`` did without a word: a 16-bit or float image (a depth
    camera's) clipped to 255, colours into one channel read as their luminance, an alpha channel
    that is not opaque dropped."""
    if image.mode == ("L" if channels == 1 else "RGB"):  # what LeRobot (and the exporter) write
        return np.asarray(image).reshape(*image.size[::-1], channels)
    if image.mode not in EIGHT_BIT_MODES:
        raise ValueError(
            f"an image of mode {image.mode!r}: a uint8 image feature holds 8-bit channels "
            f"({', '.join(EIGHT_BIT_MODES)}), which it would not hold as they are"
        )
    rgba = np.asarray(image.convert("RGBA"))
    if (rgba[..., 3] != 255).any():
        raise ValueError(f"an image of mode {image.mode!r} with transparent pixels; the feature's channels drop alpha")
    if channels == 1 and ((rgba[..., 0] != rgba[..., 1]) | (rgba[..., 1] != rgba[..., 2])).any():
        raise ValueError(f"an image of mode {image.mode!r} in colour; the feature's shape holds one channel")
    return rgba[..., :channels]


class LeRobotSource(Source):
    format = "lerobot"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._pa = _pyarrow()
        self.root = Path(self.path)
        info_path = self.root / "meta" / "info.json"
        try:
            self.info = json.loads(info_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ImportSourceError(f"{info_path}: cannot read LeRobot info: {error}") from error
        if not isinstance(self.info, dict):
            raise ImportSourceError(f"{info_path}: expected a JSON object, got {type(self.info).__name__}")
        version = str(self.info.get("codebase_version", ""))
        if not version.startswith("v3"):
            raise ImportSourceError(f"{info_path}: codebase_version {version!r}, expected a v3 dataset (v3.0)")
        try:
            self._read_features(info_path)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, ImportSourceError):
                raise
            what = f"missing key {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
            raise ImportSourceError(
                f"{info_path}: malformed LeRobot info ({what}); expected 'fps' and 'features' with each "
                "feature's 'dtype' and 'shape'"
            ) from error
        self._episodes = self._read_episodes()
        self._check_lengths()
        self._tasks = self._read_tasks()

    def _read_features(self, info_path: Path) -> None:
        """The fields of ``info.json``'s features (KeyError, TypeError, ValueError where malformed)."""
        if not _is_fps(self.info["fps"]):  # "10" or true read as a frame rate, and a string failed LeRobot's reader
            raise ValueError(f"fps must be a number > 0 and finite, got {self.info['fps']!r}")
        self.fps = float(self.info["fps"])
        self._data_pattern = self._path_pattern("data_path", DATA_PATH, chunk_index=0, file_index=0)
        self._fields: dict[str, dict[str, Any]] = {}
        self._features: dict[str, str] = {}  # field -> feature
        for feature, spec in self.info["features"].items():
            if feature in FRAME_COLUMNS:
                continue
            name = _field_name(feature)
            if not name.isidentifier():
                raise ImportSourceError(f"{info_path}: feature {feature!r} does not map to a field name ({name!r})")
            if name in self._features:  # one of the two would be dropped without a word
                raise ImportSourceError(
                    f"{info_path}: features {self._features[name]!r} and {feature!r} map to one field name {name!r}"
                )
            if spec["dtype"] in ("image", "video"):
                self._fields[name] = {"dtype": "uint8", "shape": _image_shape(spec)}
            elif _numeric(spec["dtype"]):
                shape = tuple(int(d) for d in spec["shape"])
                scalar = shape == (1,) and spec.get(FIELD_SHAPE) != [1]
                self._fields[name] = {"dtype": spec["dtype"], "shape": () if scalar else shape}
            else:
                continue  # text features: a buffer stores numbers only
            self._features[name] = feature
        if any(spec["dtype"] == "video" for spec in self.info["features"].values()):  # null in image datasets
            self._video_pattern = self._path_pattern(
                "video_path", VIDEO_PATH, video_key="key", chunk_index=0, file_index=0
            )

    def _path_pattern(self, key: str, default: str, **sample: Any) -> str:
        """``info.json``'s ``key`` (``default`` where absent), a pattern of the names given in
        ``sample``; ValueError where it is not (a number, or ``{0}``, or another name, raised a
        bare AttributeError, IndexError or KeyError that named no file)."""
        pattern = self.info.get(key) or default
        if not isinstance(pattern, str):
            raise ValueError(f"{key} must be a path pattern such as {default!r}, got {pattern!r}")
        try:
            pattern.format(**sample)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:
            raise ValueError(
                f"{key} {pattern!r} is no path pattern of {sorted(sample)} ({type(error).__name__}: {error}), "
                f"such as {default!r}"
            ) from error
        return pattern

    def _read_episodes(self) -> list[dict[str, Any]]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise ImportSourceError(f"{self.root / 'meta' / 'episodes'}: no episode files (chunk-*/file-*.parquet)")
        rows = []
        for file in files:
            try:
                names = self._pa.parquet.read_schema(file).names
                table = self._pa.parquet.read_table(
                    file, columns=[c for c in names if _episode_column(c) or c == "tasks"]
                )
            except (OSError, self._pa.ArrowException) as error:
                raise ImportSourceError(f"{file}: cannot read LeRobot episodes: {error}") from error
            self._check_episode_columns(file, table)
            if "tasks" in table.column_names:
                self._check_one_task(file, table)
                table = table.drop_columns(["tasks"])
            rows.extend(table.to_pylist())
        return sorted(rows, key=lambda row: row["episode_index"])

    def _check_one_task(self, file: Path, table: Any) -> None:
        """Refuse episodes whose ``tasks`` name more than one task, before a destination is
        created: a buffer keeps one ``task_index`` per episode (its first frame's), so which
        frames had which task would be lost without a word."""
        import pyarrow.compute as pc

        if not self._pa.types.is_list(table.schema.field("tasks").type):
            return
        counts = pc.fill_null(pc.list_value_length(table.column("tasks")), 0).to_numpy(zero_copy_only=False)
        several = table.column("episode_index").to_numpy(zero_copy_only=False)[counts > 1].tolist()
        if several:
            raise ImportSourceError(f"{file}: episodes {several[:10]} have more than one task; {ONE_TASK}")

    def _check_episode_columns(self, file: Path, table: Any) -> None:
        """The columns of an episodes file that an import reads are there, numbers, and
        without empty cells (a bare KeyError or TypeError otherwise)."""
        types = self._pa.types
        videos = [f for f in self._features.values() if self.info["features"][f]["dtype"] == "video"]
        columns = {
            name: types.is_integer for name in ("episode_index", "length", "data/chunk_index", "data/file_index")
        }
        for feature in videos:
            columns.update(
                {f"videos/{feature}/chunk_index": types.is_integer, f"videos/{feature}/file_index": types.is_integer}
            )
            columns[f"videos/{feature}/from_timestamp"] = lambda kind: types.is_floating(kind) or types.is_integer(kind)
        missing = [name for name in columns if name not in table.column_names]
        if missing:
            raise ImportSourceError(f"{file}: LeRobot episodes without the columns {missing}")
        wrong = {
            name: str(table.schema.field(name).type)
            for name, is_kind in columns.items()
            if not is_kind(table.schema.field(name).type)
        }
        if wrong:
            raise ImportSourceError(
                f"{file}: LeRobot episode columns of the wrong type {wrong}; expected integers "
                "(from_timestamp: numbers)"
            )
        empty = [name for name in columns if table.column(name).null_count]
        if empty:
            raise ImportSourceError(f"{file}: LeRobot episode columns with empty cells {empty}")

    def _check_lengths(self) -> None:
        """Refuse an episode whose length is more than its data file's rows (read from the
        parquet footer), or whose data file cannot be read (its rows cannot be counted), before a
        destination is sized from it: a lying length would reserve its size there (the memmap and
        hdf5 backends reserved gigabytes on disk for a length whose data file was missing). So are
        episodes claiming more frames in all than their data file's rows (a crafted episodes file
        of 10**6 episodes, each of a 15-row file's length, reserved a slot for each)."""
        rows: dict[Path, int] = {}
        claimed: dict[Path, list[int]] = {}  # data file -> lengths of the episodes in it
        self._columns: set[str] = set()  # of every data file: the columns no field holds are listed
        for row in self._episodes:
            try:
                file = self._data_file(row)
            except ValueError:  # an escaping data_path: every episode's, named when the first is read
                continue
            if file not in rows:
                try:
                    footer = self._pa.parquet.read_metadata(file)
                except (OSError, self._pa.ArrowException) as error:
                    why = f"no such file {str(file)!r}" if isinstance(error, FileNotFoundError) else str(error)
                    raise ImportSourceError(
                        f"{file}: episode {row['episode_index']}: cannot read its frames: {why} (so its length "
                        f"{row['length']} cannot be checked against the file's rows; nothing was imported)"
                    ) from error
                rows[file] = footer.num_rows
                self._columns.update(footer.schema.to_arrow_schema().names)
            if int(row["length"]) > rows[file]:
                raise ImportSourceError(
                    f"{self.root / 'meta' / 'episodes'}: episode {row['episode_index']} has length {row['length']}, "
                    f"more than the {rows[file]} rows of its data file {str(file)!r}"
                )
            claimed.setdefault(file, []).append(int(row["length"]))
        for file, lengths in claimed.items():
            if sum(lengths) > rows[file]:
                raise ImportSourceError(
                    f"{self.root / 'meta' / 'episodes'}: its {len(lengths)} episodes in data file {str(file)!r} "
                    f"have {sum(lengths)} frames in all, more than the file's {rows[file]} rows"
                )

    def _read_tasks(self) -> dict[str, str]:
        """task_index (as a str, a JSON key) -> task text, from ``meta/tasks.parquet``, where
        LeRobot writes the text as the pandas index ``task``; empty when the file is absent."""
        path = self.root / "meta" / "tasks.parquet"
        if not path.exists():
            return {}
        try:
            table = self._pa.parquet.read_table(path)
        except (OSError, self._pa.ArrowException) as error:
            raise ImportSourceError(f"{path}: cannot read LeRobot tasks: {error}") from error
        text = next((c for c in ("task", "__index_level_0__") if c in table.column_names), None)
        if text is None or "task_index" not in table.column_names:
            raise ImportSourceError(f"{path}: expected columns 'task' and 'task_index', got {table.column_names}")
        indices, texts = table.column("task_index").to_pylist(), table.column(text).to_pylist()
        return {str(index): str(task) for index, task in zip(indices, texts)}

    def fields(self) -> dict[str, dict[str, Any]]:
        return self._fields

    def meta_fields(self) -> dict[str, str]:
        return {"task_index": "int64", "fps": "float64"}

    def attrs(self) -> dict[str, Any]:
        return {
            "fps": self.info["fps"],
            "lerobot": {
                "codebase_version": self.info["codebase_version"],
                "robot_type": self.info.get("robot_type"),
                "features": self.info["features"],
                "fields": dict(self._features),
                "tasks": self._tasks,
                "left_out": sorted(self._columns - set(self._features.values()) - set(FRAME_COLUMNS)),
            },
        }

    def episode_ids(self) -> list[int]:
        return [int(row["episode_index"]) for row in self._episodes]

    def lengths(self) -> list[int]:
        return [int(row["length"]) for row in self._episodes]

    def _data_path(self, row: dict[str, Any]) -> str:
        return self._data_pattern.format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])

    def _data_file(self, row: dict[str, Any]) -> Path:
        return _inside(self.root, self._data_path(row), "data file")

    def _video_file(self, row: dict[str, Any], feature: str) -> Path:
        relative = self._video_pattern.format(
            video_key=feature,
            chunk_index=row[f"videos/{feature}/chunk_index"],
            file_index=row[f"videos/{feature}/file_index"],
        )
        return _inside(self.root, relative, "video file")

    def where(self, position: int) -> str:
        return str(self.root / self._data_path(self._episodes[position]))

    def _missing_columns(self, row: dict[str, Any], wanted: list[str]) -> str:
        """What a data file lacks of the columns ``wanted`` (features info.json declares), as a
        message; empty where it has them all or cannot be read (arrow's message says more)."""
        try:
            held = set(self._pa.parquet.read_schema(self._data_file(row)).names)
        except (OSError, self._pa.ArrowException):
            return ""
        missing = [column for column in [*wanted, "episode_index"] if column not in held]
        expected = "one per feature of meta/info.json, and frame_index, task_index and episode_index"
        return f"it has no columns {missing}; expected {expected}" if missing else ""

    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        row = self._episodes[position]
        episode, length = int(row["episode_index"]), int(row["length"])
        video = {name for name, feature in self._features.items() if self.info["features"][feature]["dtype"] == "video"}
        columns = [self._features[name] for name in self._fields if name not in video]
        try:
            wanted = [*columns, "frame_index", "task_index"]
            table = self._pa.parquet.read_table(
                self._data_file(row), columns=wanted, filters=[("episode_index", "=", episode)]
            )
        except FileNotFoundError as error:
            raise ValueError(f"cannot read its frames: no such file {str(self._data_file(row))!r}") from error
        except self._pa.ArrowException as error:
            raise ValueError(f"cannot read its frames: {self._missing_columns(row, wanted) or error}") from error
        table = table.sort_by("frame_index")
        if len(table) != length:
            raise ValueError(f"{len(table)} frames in the data file, the episode index says {length} (truncated?)")
        frames = np.asarray(table.column("frame_index").to_numpy(zero_copy_only=False))
        if not np.array_equal(frames, np.arange(length)):  # a frame twice, and another missing
            missing = sorted(set(range(length)) - set(frames.tolist()))[:5]
            raise ValueError(f"frame_index is not 0 .. {length - 1}: frames {missing} are missing")
        data = {}
        for name, spec in self._fields.items():
            feature = self._features[name]
            kind = self.info["features"][feature]["dtype"]
            if kind == "video":
                path = self._video_file(row, feature)
                data[name] = decode_frames(
                    path, float(row[f"videos/{feature}/from_timestamp"]), length, self.fps, spec["shape"]
                )
            elif kind == "image":
                cells = table.column(feature).to_pylist()
                data[name] = np.stack([_decode_image(cell, self.root, spec["shape"]) for cell in cells])
            else:
                data[name] = _column(table, feature, spec["shape"], spec["dtype"])
        tasks = np.unique(np.asarray(table.column("task_index").to_numpy(zero_copy_only=False)))
        if len(tasks) > 1:  # an episodes file without a tasks column does not say so
            raise ValueError(f"its frames have task_index {tasks[:10].tolist()}; {ONE_TASK}")
        return data, {"task_index": int(tasks[0]) if length else 0, "fps": self.fps}


# ---- export -----------------------------------------------------------------------------------


def _column_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-frame shape of a field's column: (1,) fields as one value per frame, as LeRobot
    stores every feature of shape [1] (a list column there fails its reader's cast to a value)."""
    return () if shape == (1,) else shape


def _arrow_type(pa: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    kind = pa.from_numpy_dtype(dtype)
    for size in reversed(_column_shape(shape)):
        kind = pa.list_(kind, size)
    return kind


def _arrow_column(pa: Any, values: np.ndarray, kind: Any) -> Any:
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat.cast(kind)


def _png(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame).save(out, format="PNG")
    return out.getvalue()


def encode_frames(path: Path, frames: np.ndarray, fps: float) -> None:
    """Write (T, H, W, 3) uint8 frames as an H.264 mp4 (yuv420p, as LeRobot's players expect)."""
    av = _av()
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _image_features(buffer: Any, video: bool) -> dict[str, str]:
    """image field -> 'video' or 'image', for (H, W, C) uint8 fields of 1 or 3 channels: what a
    PNG (and LeRobot's image features) hold as they are. Other frames ((C, H, W), (H, W), 2 or 4
    channels) are exported as arrays: as images they failed in PIL or read back with another shape."""
    out = {}
    for name, field in buffer.schema.fields.items():
        if field.dtype == np.uint8 and len(field.shape) == 3 and field.shape[-1] in (1, 3):
            if video and (field.shape[-1] != 3 or field.shape[0] % 2 or field.shape[1] % 2):
                raise ValueError(
                    f"field {name!r}: video mode needs (H, W, 3) frames with even H and W, got {field.shape}"
                )
            out[name] = "video" if video else "image"
    return out


class _ExportNames:
    """What an export calls features and tasks: the ``lerobot`` attributes an import left in
    the buffer where they apply, else names derived from the field names."""

    def __init__(self, attrs: Mapping[str, Any]):
        lerobot = attrs.get("lerobot")
        lerobot = lerobot if isinstance(lerobot, dict) else {}
        self._fields = _dict_or_empty(lerobot.get("fields"))
        self._features = _dict_or_empty(lerobot.get("features"))
        self._tasks = _dict_or_empty(lerobot.get("tasks"))
        robot_type = lerobot.get("robot_type")
        self.robot_type = robot_type if isinstance(robot_type, str) else None

    def feature(self, field: str) -> str:
        return self._fields.get(field) or _feature_name(field)

    def task(self, index: int) -> str:
        return str(self._tasks.get(str(index), f"task_{index}"))

    def names(self, field: str, spec: dict[str, Any]) -> Any:
        """The ``names`` entry of ``spec`` (a feature as the export writes it): the imported
        feature's when its dtype and shape are the same, else ``spec``'s own."""
        stored = self._features.get(self.feature(field))
        if isinstance(stored, dict) and stored.get("dtype") == spec["dtype"] and stored.get("shape") == spec["shape"]:
            return stored.get("names")
        return spec["names"]


def _check_feature_names(names: _ExportNames, fields: list[str]) -> None:
    """ValueError where two fields would be written as one feature, or a field as one of the
    columns LeRobot adds to every frame (one column would be lost without a word)."""
    hint = "rename the field, or fix buffer.attrs['lerobot']['fields']"
    taken: dict[str, str] = {}
    for field in fields:
        feature = names.feature(field)
        if not isinstance(feature, str) or feature in ("", ".", "..") or "/" in feature or "\\" in feature:
            # a video's feature name is a folder of the export: '../../x' wrote outside it
            raise ValueError(
                f"field {field!r} would be exported as feature {feature!r}, which is no folder name inside the "
                f"export (LeRobot keeps videos under videos/<feature>/); {hint}"
            )
        if feature in FRAME_COLUMNS:
            raise ValueError(
                f"field {field!r} would be exported as {feature!r}, a column LeRobot adds to every frame; {hint}"
            )
        if feature in taken:
            raise ValueError(
                f"fields {taken[feature]!r} and {field!r} would both be exported as feature {feature!r}; {hint}"
            )
        taken[feature] = field


def _dict_or_empty(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def export_lerobot(
    src: Any,
    dst: str | os.PathLike,
    *,
    video: bool = False,
    fps: float | None = None,
    storage_options: dict | None = None,
) -> int:
    """Write the committed episodes of buffer ``src`` (oldest first) as a LeRobot v3 folder at
    ``dst``: image fields as PNG images in the data files (lossless) or, with ``video=True``, as
    H.264 mp4 files (lossy). ``fps`` defaults to the buffer's ``fps`` attribute, else its
    ``fps`` meta field, else 30. Feature names, task texts and the robot type come from the
    ``lerobot`` attributes of an imported buffer (module docstring); without them tasks are
    ``task_<task_index>``. Meta fields other than ``task_index`` and ``fps`` are left out.
    A failed export removes what it wrote. Returns the number of episodes."""
    if fps is not None and not _is_fps(fps):
        raise ValueError(f"fps must be a number > 0 and finite, got {fps!r}")
    with new_folder(dst, src):
        return _write_lerobot(src, Path(dst), video, fps, storage_options)


def _write_lerobot(src: Any, root: Path, video: bool, fps: float | None, storage_options: dict | None) -> int:
    """The body of ``export_lerobot``."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    buffer, _lengths, episodes = exported_episodes(src, storage_options)
    with buffer:
        images = _image_features(buffer, video)
        attrs = dict(buffer.attrs)
        names = _ExportNames(attrs)
        _check_feature_names(names, list(buffer.schema.fields))
        if fps is None:
            fps = _default_fps(buffer, attrs)
        fields = {name: f for name, f in buffer.schema.fields.items()}
        columns = {
            names.feature(name): (
                pa.struct([("bytes", pa.binary()), ("path", pa.string())])
                if name in images
                else _arrow_type(pa, f.dtype, f.shape)
            )
            for name, f in fields.items()
            if images.get(name) != "video"
        }
        schema = pa.schema(
            [
                *columns.items(),
                ("timestamp", pa.float32()),
                ("frame_index", pa.int64()),
                ("episode_index", pa.int64()),
                ("index", pa.int64()),
                ("task_index", pa.int64()),
            ]
        )
        data_path = root / DATA_PATH.format(chunk_index=0, file_index=0)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        numbers = _task_numbers(buffer)
        rows, total = [], 0
        with pq.ParquetWriter(data_path, schema) as writer:
            for episode, (slot, data, meta) in enumerate(episodes):
                length = len(next(iter(data.values())))
                task = int(meta.get("task_index", 0))
                if task not in numbers:  # its value edited in place since the buffer was opened
                    raise ConcurrentWriteError(buffer.storage.location, [slot], 0)
                steps = np.arange(length, dtype=np.int64)
                values = {}
                for name in fields:
                    feature = names.feature(name)
                    if images.get(name) == "image":
                        values[feature] = pa.array(
                            [{"bytes": _png(frame), "path": None} for frame in data[name]], columns[feature]
                        )
                    elif name not in images:
                        column = data[name].reshape(length, *_column_shape(fields[name].shape))
                        values[feature] = _arrow_column(pa, column, columns[feature])
                values.update(
                    timestamp=pa.array((steps / fps).astype(np.float32)),
                    frame_index=pa.array(steps),
                    episode_index=pa.array(np.full(length, episode, np.int64)),
                    index=pa.array(total + steps),
                    task_index=pa.array(np.full(length, numbers[task], np.int64)),
                )
                writer.write_table(pa.table(values, schema=schema))
                row = {
                    "episode_index": episode,
                    "tasks": [names.task(task)],
                    "length": length,
                    "data/chunk_index": 0,
                    "data/file_index": 0,
                    "dataset_from_index": total,
                    "dataset_to_index": total + length,
                }
                for name in (n for n, kind in images.items() if kind == "video"):
                    feature = names.feature(name)
                    chunk, file = divmod(episode, CHUNK_SIZE)
                    encode_frames(
                        root / VIDEO_PATH.format(video_key=feature, chunk_index=chunk, file_index=file), data[name], fps
                    )
                    row.update(
                        {
                            f"videos/{feature}/chunk_index": chunk,
                            f"videos/{feature}/file_index": file,
                            f"videos/{feature}/from_timestamp": 0.0,
                            f"videos/{feature}/to_timestamp": length / fps,
                        }
                    )
                rows.append(row)
                total += length
        _write_meta(root, buffer, names, images, rows, list(numbers), total, fps)
    return len(rows)


def _task_numbers(buffer: Any) -> dict[int, int]:
    """Each ``task_index`` of the buffer's committed episodes -> the one an export writes: its
    position among them, sorted. LeRobot's reader takes ``task_index`` as a row of
    ``meta/tasks.parquet`` (``tasks.iloc[task_index]``), so indices with gaps (a buffer holding
    some tasks' episodes only, or ids of the user's own) read as another task's text, or failed.
    ValueError naming the slot where one is no integer (2.7 was written as 2)."""
    if "task_index" not in buffer.schema.meta_fields:
        return {0: 0}
    slots = buffer.valid_episodes()
    values = np.asarray(buffer.meta_data["task_index"][:])[slots]
    if values.dtype.kind == "f":
        other = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if len(other):
            raise ValueError(
                f"meta field 'task_index' of slot {int(slots[other[0]])} holds {values[other[0]]}, which is no "
                "task index (an integer): LeRobot keeps one task per episode by its index"
            )
    return {task: number for number, task in enumerate(sorted({int(value) for value in values.tolist()}))}


def _is_fps(value: Any) -> bool:
    """Whether ``value`` is a frame rate: a number > 0 and finite (timestamps divide by it)."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and bool(0 < value < math.inf)


def _default_fps(buffer: Any, attrs: dict[str, Any]) -> float:
    """The buffer's ``fps`` attribute, else the ``fps`` meta field of its first episode, else 30
    (each where it is a frame rate: a 0 or negative ``fps`` meta value is no default)."""
    fps: Any = attrs.get("fps")
    if _is_fps(fps):
        return fps  # as stored: LeRobot writes an int
    valid = buffer.valid_episodes()
    stored: Any = buffer.meta_data["fps"][valid[0]] if "fps" in buffer.schema.meta_fields and len(valid) else None
    return float(stored) if _is_fps(stored) else 30.0


def _write_meta(
    root: Path,
    buffer: Any,
    names: _ExportNames,
    images: dict[str, str],
    rows: list[dict],
    tasks: list[int],
    total: int,
    fps: float,
) -> None:
    """The episodes file, ``meta/tasks.parquet`` (``tasks``: the buffer's task indices, in the
    order of those written, 0, 1, ...) and, last (an export killed before it is no LeRobot
    dataset), ``meta/info.json`` of an export."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    features: dict[str, dict[str, Any]] = {}
    for name, field in buffer.schema.fields.items():
        spec: dict[str, Any]
        if name in images:
            spec = {"dtype": images[name], "shape": list(field.shape), "names": ["height", "width", "channels"]}
        else:
            spec = {"dtype": str(field.dtype), "shape": list(field.shape) or [1], "names": None}
            if field.shape == (1,):  # not a scalar: an import gives back (1,)
                spec[FIELD_SHAPE] = [1]
        features[names.feature(name)] = {**spec, "names": names.names(name, spec)}
    for column, dtype in zip(FRAME_COLUMNS, ("float32", "int64", "int64", "int64", "int64")):
        features[column] = {"dtype": dtype, "shape": [1], "names": None}
    info = {
        "codebase_version": "v3.0",
        "robot_type": names.robot_type,
        "total_episodes": len(rows),
        "total_frames": total,
        "total_tasks": len(tasks),
        "chunks_size": CHUNK_SIZE,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": fps,
        "splits": {"train": f"0:{len(rows)}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if "video" in images.values() else None,
        "features": features,
    }
    meta = root / "meta"
    (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    for row in rows:
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
    pq.write_table(pa.Table.from_pylist(rows), root / EPISODES_PATH.format(chunk_index=0, file_index=0))
    # pandas' layout, as LeRobot's write_tasks: the task text is the index, task_index a column
    import pandas as pd

    frame = pd.DataFrame({"task_index": range(len(tasks))}, index=pd.Index([names.task(t) for t in tasks], name="task"))
    frame.to_parquet(meta / "tasks.parquet")
    (meta / "info.json").write_text(json.dumps(info, indent=4))
