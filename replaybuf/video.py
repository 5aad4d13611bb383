"""Episodes of image frames to videos, animated images and contact sheets.

The functions here take plain frame arrays (``trajectory_to_video``, ``frames_to_sheet``) or
a buffer (``image_fields``, ``episode_frames``, ``save_video``); ``ReplayBuffer`` exposes the
latter as methods. Frames may be uint8 or float in [0, 1] (bool is read as 0 / 255), laid out
channel-last ``(T, H, W, C)``, channel-first ``(T, C, H, W)`` or grayscale ``(T, H, W)``
with C in {1, 3, 4}. Videos go through imageio: ``.mp4`` / ``.webm`` / ``.mkv`` / ``.mov``
need the ffmpeg plugin (``pip install replaybuf[video]``); ``.gif`` and the animated images
``.webp`` / ``.png`` / ``.apng`` (which the seed wrote through imageio too) go through Pillow.
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import subprocess
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import numpy as np
from tqdm import tqdm  # not tqdm.auto: it warns in every Jupyter kernel without ipywidgets

from ._lazy import feature_imports
from .consistency import read_episodes_consistent

__all__ = [
    "ANIMATED_IMAGE_FORMATS",
    "FFMPEG_SUFFIXES",
    "IMAGE_FIELD_RULE",
    "MAX_SHEET_PIXELS",
    "VIDEO_SUFFIXES",
    "blocks_to_video",
    "MAX_H264_SIDE",
    "check_encodable",
    "check_fps",
    "check_sheet_size",
    "check_output_path",
    "check_writable",
    "default_image_field",
    "episode_frames",
    "episode_frames_by_field",
    "episode_slots",
    "frames_to_sheet",
    "image_fields",
    "is_image_field",
    "is_image_shape",
    "field_path",
    "frame_size",
    "main",
    "open_buffer",
    "parse_episodes",
    "parse_fields",
    "save_video",
    "to_rgb_uint8",
    "to_uint8",
    "trajectory_to_video",
    "write_atomically",
]

CHANNEL_COUNTS = (1, 3, 4)
# what makes a field's per-step values frames (``is_image_field``), said where a field is refused
IMAGE_FIELD_RULE = f"uint8, bool or float values of shape (H, W), (H, W, C) or (C, H, W) with C in {CHANNEL_COUNTS}"
FFMPEG_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")
FFMPEG_MAX_RATE = 2**31 - 1  # ffmpeg's AVRational holds ints
# animated images Pillow writes whole, as the seed's imageio call did: suffix -> Pillow format
ANIMATED_IMAGE_FORMATS = {".webp": "WEBP", ".png": "PNG", ".apng": "PNG"}
VIDEO_SUFFIXES = (*FFMPEG_SUFFIXES, ".gif", *ANIMATED_IMAGE_FORMATS)

# pixels (from all frames) that a gif's single palette is built from
GIF_PALETTE_PIXELS = 1 << 18
# renders of at least this many frames show a tqdm progress bar unless told otherwise
PROGRESS_MIN_FRAMES = 300
# float frames are converted to uint8 this many values at a time (whole frames, at least one)
CONVERT_BLOCK_ELEMENTS = 1 << 22
# a contact sheet holds at most this many pixels (64 Mi: 192 MiB of RGB, e.g. 256 x 256 frames of
# 32x32, or 85 of 1024x768); a larger one is refused before any frame is read or the sheet is built
MAX_SHEET_PIXELS = 1 << 26
# libx264, imageio's codec for every ffmpeg suffix but .webm, refuses frames wider or taller than
# this ("invalid width x height") and writes nothing
MAX_H264_SIDE = 16384


# frames


def is_image_shape(shape: Sequence[int]) -> bool:
    """Whether a per-timestep shape reads as one frame: (H, W), (H, W, C) or (C, H, W)."""
    shape = tuple(shape)
    if len(shape) == 2:
        return min(shape) >= 2
    if len(shape) == 3:
        return shape[-1] in CHANNEL_COUNTS or shape[0] in CHANNEL_COUNTS
    return False


def is_image_field(shape: Sequence[int], dtype: Any) -> bool:
    """Whether a field of this per-timestep shape and dtype holds frames (uint8, bool or float)."""
    dtype = np.dtype(dtype)
    return is_image_shape(shape) and (dtype == np.uint8 or dtype == np.bool_ or np.issubdtype(dtype, np.floating))


def _float_to_uint8(values: np.ndarray) -> np.ndarray:
    return (np.nan_to_num(values).clip(0.0, 1.0) * 255.0).round().astype(np.uint8)


def to_uint8(frames: Any) -> np.ndarray:
    """Frames as uint8, as the seed's ``to_uint8``: uint8 as is, floats in [0, 1] scaled by 255
    and rounded (clipped; NaN reads as 0), bools as 0 / 255 (the seed refuses bools)."""
    frames = np.asarray(frames)
    if frames.dtype == np.uint8:
        return frames
    if frames.dtype == np.bool_:
        return frames.astype(np.uint8) * 255
    if np.issubdtype(frames.dtype, np.floating):
        if frames.ndim == 0:
            return _float_to_uint8(frames)
        # frame blocks into one output: the float temporaries stay one block, not four episodes
        out = np.empty(frames.shape, np.uint8)
        step = max(1, CONVERT_BLOCK_ELEMENTS // max(1, frames[0].size))
        for start in range(0, len(frames), step):
            out[start : start + step] = _float_to_uint8(frames[start : start + step])
        return out
    raise TypeError(f"frames: expected uint8, bool or float in [0, 1], got dtype {frames.dtype}")


def to_rgb_uint8(frames: Any) -> np.ndarray:
    """Frames of any supported layout and dtype as a (T, H, W, 3) uint8 array.

    Alpha channels are dropped and grayscale is repeated to three channels, so that every
    output format (yuv420p video, gif, png) receives the same thing.
    """
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[..., None]
    elif frames.ndim == 4:
        if frames.shape[-1] not in CHANNEL_COUNTS:
            if frames.shape[1] not in CHANNEL_COUNTS:
                raise ValueError(
                    f"frames: expected (T, H, W, C) or (T, C, H, W) with C in {CHANNEL_COUNTS}, "
                    f"got shape {frames.shape}"
                )
            frames = np.moveaxis(frames, 1, -1)
    else:
        raise ValueError(
            f"frames: expected (T, H, W), (T, H, W, C) or (T, C, H, W), got shape {frames.shape} ({frames.ndim} dims)"
        )
    if frames.shape[0] == 0:
        raise ValueError("frames: got 0 frames, expected at least one")
    frames = to_uint8(frames)
    channels = frames.shape[-1]
    if channels == 1:
        return np.repeat(frames, 3, axis=-1)
    if channels == 4:
        return np.ascontiguousarray(frames[..., :3])
    return frames


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Pad height and width to even sizes by repeating the edge (yuv420p needs even sizes)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _check_video_path(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(
            f"path: unsupported video suffix {suffix or '(none)'!r} in {str(path)!r}, expected one of {VIDEO_SUFFIXES}"
        )
    return suffix


def check_output_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path, after checking that a file can be written there: its folder exists
    and ``path`` is not itself a folder. Raised before any frame is read or rendered."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output {str(path)!r} is a folder, expected the path of a file to write")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise FileNotFoundError(f"output {str(path)!r}: its folder {str(path.parent)!r} {what}; create it first")
    return path


def check_fps(fps: Any, suffix: str | None = None) -> None:
    """Raise ValueError unless ``fps`` is a finite number > 0 (not a bool) and, for an ffmpeg
    ``suffix``, a frame rate ffmpeg takes: imageio-ffmpeg passes it as a fraction of
    denominator at most 10**6 (below 5e-7 that is 0) and ffmpeg's rationals hold 32-bit ints;
    out of that, ffmpeg only said "the encoder wrote nothing", once every frame was read."""
    number = isinstance(fps, int | float | np.integer | np.floating) and not isinstance(fps, bool | np.bool_)
    if not (number and 0 < fps and math.isfinite(fps)):
        raise ValueError(f"fps: expected a finite positive number, got {fps!r}")
    if suffix is not None and suffix.lower() in FFMPEG_SUFFIXES:
        rate = Fraction(float(fps)).limit_denominator()  # as imageio-ffmpeg passes it to ffmpeg's -r
        if not 0 < rate.numerator <= FFMPEG_MAX_RATE:
            raise ValueError(
                f"fps: {fps!r} is outside the frame rates ffmpeg takes for {suffix} "
                f"(expected 1e-06 .. {FFMPEG_MAX_RATE})"
            )


def check_encodable(height: int, width: int, suffix: str, codec: str | None = None, what: str = "frames") -> None:
    """Raise ValueError for frames of ``height`` x ``width`` that the encoder of ``suffix`` (or
    ``codec``) cannot take, before any frame is read or converted (ffmpeg would only say it
    wrote nothing). Sizes are those written: odd ones are padded to even for ffmpeg formats."""
    if suffix.lower() not in FFMPEG_SUFFIXES:
        return
    codec = codec or ("libvpx-vp9" if suffix.lower() == ".webm" else "libx264")
    height, width = height + height % 2, width + width % 2
    if codec == "libx264" and max(height, width) > MAX_H264_SIDE:
        raise ValueError(
            f"{what}: {width}x{height} frames are larger than the {MAX_H264_SIDE} pixels a side that libx264 "
            f"(the {suffix} encoder) takes; render a smaller scale, or write .webm (vp9) or .gif"
        )


def _partial_path(path: Path) -> Path:
    """A temp file's path beside ``path``, hidden, with its suffix (``write_atomically``)."""
    return path.with_name(f".{path.stem}.{secrets.token_hex(4)}.partial{path.suffix}")


def check_writable(path: str | os.PathLike) -> Path:
    """``check_output_path``, then a file made and removed beside ``path``: a folder it may not
    write in (permissions, a read-only file system) is refused naming the output, before
    anything is rendered, by every output of a command before the first is written."""
    path = check_output_path(path)
    probe = _partial_path(path)
    try:
        probe.open("xb").close()
        probe.unlink()
    except OSError as error:
        raise OSError(error.errno, f"cannot write {str(path)!r}: {error.strerror}") from None
    return path


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write`` on a temp file beside ``path`` (same suffix, so that writers pick the same
    format) and rename it over ``path`` once complete: a failed or interrupted write leaves no
    partial file and keeps a file already at ``path``; a writer that silently wrote nothing (an
    encoder that could not open its output) is an error, not a success."""
    path = check_writable(path)
    temp = _partial_path(path)
    try:
        write(temp)
        if not temp.is_file() or temp.stat().st_size == 0:
            raise OSError(f"writing {str(path)!r}: the encoder wrote nothing")
        os.replace(temp, path)
    except OSError as error:
        if error.filename is None and error.errno is not None:  # a writer's reason naming no file
            raise OSError(error.errno, f"writing {str(path)!r} failed: {error.strerror}") from error
        raise
    finally:
        temp.unlink(missing_ok=True)
    return path


def _pack_rgb(pixels: np.ndarray) -> np.ndarray:
    """RGB values (..., 3) as one uint32 each, for exact colour lookups."""
    pixels = pixels.astype(np.uint32, copy=False)
    return (pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2]


def _write_gif(frames: np.ndarray, path: Path, fps: float, bar: str | None, kwargs: dict[str, Any]) -> None:
    """Write an animated gif with Pillow, using one palette for the whole clip.

    The palette comes from pixels of every frame (subsampled to at most ~262k pixels,
    median cut, ~0.2 s) and each frame is mapped onto it without dithering (exactly where all
    its colours are in the palette, as in a clip of at most 256 colours): no colour
    flicker between frames, and far faster than quantizing every frame on its own
    (measured: 500 frames of 128x128 noise, ~3 s against 148 s through imageio). Consecutive
    frames that come out identical are merged by Pillow into one longer frame.
    """
    from PIL import Image

    step = max(1, int(np.ceil(np.sqrt(frames[..., 0].size / GIF_PALETTE_PIXELS))))
    mosaic = frames[:, ::step, ::step].reshape(-1, frames[:, ::step, ::step].shape[2], 3)
    palette = Image.fromarray(np.ascontiguousarray(mosaic)).quantize(256, method=Image.Quantize.MEDIANCUT)
    entries = palette.getpalette()
    assert entries is not None, "a quantized image has a palette"
    keys, first = np.unique(_pack_rgb(np.asarray(entries, np.uint32).reshape(-1, 3)), return_index=True)
    first = first.astype(np.uint8)

    def to_palette(frame: np.ndarray) -> Any:
        # Pillow's palette mapping looks colours up at reduced precision (a 256-gray frame comes
        # back up to ~4 levels off); a frame whose colours are all in the palette is mapped
        # exactly, as the seed's per-frame gifs kept every frame of at most 256 colours
        packed = _pack_rgb(frame)
        at = np.searchsorted(keys, packed).clip(max=len(keys) - 1)
        if not (keys[at] == packed).all():
            return Image.fromarray(frame).quantize(palette=palette, dither=Image.Dither.NONE)
        image = Image.frombytes("P", (frame.shape[1], frame.shape[0]), first[at].tobytes())
        image.putpalette(entries)
        return image

    images = [to_palette(frame) for frame in tqdm(frames, desc=bar, unit="frame", disable=bar is None, leave=False)]
    given = "duration" in kwargs
    kwargs.setdefault("duration", 1000.0 / fps)  # no ``loop``: it plays once, as the seed's gifs
    try:
        images[0].save(path, format="GIF", save_all=True, append_images=images[1:], **kwargs)
    except OverflowError as error:  # Pillow's 16-bit delay field, deep in its writer
        raise _duration_error(".gif", fps, given, error) from None


def _duration_error(suffix: str, fps: float, given: bool, error: Exception) -> ValueError:
    """The ValueError for a frame longer than Pillow can store in ``suffix`` (a GIF frame at most
    655.35 s, a WebP frame 16777.215 s, an APNG frame's delay a 16-bit fraction of a second),
    naming ``fps`` (or the ``duration`` given instead): Pillow fails deep inside its writer
    (OverflowError: int too big to convert) only once every frame is converted. Identical
    consecutive frames are merged into one frame of their summed duration, so a static stretch
    of an episode can pass the bound at an fps whose single frames fit."""
    what = "the duration given" if given else f"fps={fps!r} ({1000.0 / fps:.6g} ms a frame)"
    return ValueError(
        f"fps: {what} makes a frame longer than {suffix} can store (identical consecutive frames "
        f"are stored as one, their durations summed); expected a higher fps, or write .mp4 / .webm "
        f"({type(error).__name__}: {error})"
    )


def _write_animated_image(frames: np.ndarray, path: Path, suffix: str, fps: float, kwargs: dict[str, Any]) -> None:
    """Write an animated webp / png with Pillow, one frame every ``1000 / fps`` ms, looping."""
    from PIL import Image

    given = "duration" in kwargs
    kwargs.setdefault("duration", round(1000.0 / fps))
    images = [Image.fromarray(frame) for frame in frames]
    try:
        images[0].save(path, format=ANIMATED_IMAGE_FORMATS[suffix], save_all=True, append_images=images[1:], **kwargs)
    except (OverflowError, ValueError, RuntimeError) as error:
        # Pillow's messages: OverflowError (webp), "cannot write duration" (png),
        # "timestamps must be non-decreasing" (webp, libwebp's int timestamps overflowing)
        if isinstance(error, OverflowError) or "duration" in str(error) or "timestamps" in str(error):
            raise _duration_error(suffix, fps, given, error) from None
        raise


def _write_ffmpeg(
    frames: Iterable[np.ndarray], path: Path, suffix: str, fps: float, bar: str | None, kwargs: dict[str, Any]
) -> None:
    with feature_imports(f"writing {suffix} videos"):
        import imageio.v2 as imageio
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError as error:
        raise ImportError(f"writing {suffix} videos needs imageio-ffmpeg: pip install 'replaybuf[video]'") from error
    kwargs.setdefault("fps", float(fps))  # imageio-ffmpeg asserts a Python float (not np.float32)
    kwargs.setdefault("macro_block_size", 1)
    kwargs.setdefault("ffmpeg_log_level", "error")
    if suffix == ".webm":
        kwargs.setdefault("codec", "libvpx-vp9")
    writer = imageio.get_writer(str(path), format="FFMPEG", mode="I", **kwargs)
    written, stopped, process = 0, None, None
    try:
        for frame in tqdm(frames, desc=bar, unit="frame", disable=bar is None, leave=False):
            try:
                writer.append_data(frame)
            except OSError as error:  # ffmpeg stopped reading frames ("Broken pipe"): why, below
                stopped = error
                break
            written += 1
            process = process or _ffmpeg_process(writer)
    finally:
        writer.close()
    if stopped is None and (process.returncode == 0 if process is not None else _reads_back(path, written)):
        return  # (no frame: no process, no file; ``write_atomically`` says the encoder wrote nothing)
    full = os.statvfs(path.parent).f_bavail == 0
    raise OSError(
        errno.ENOSPC if full else errno.EIO,
        f"ffmpeg did not finish the video ({written} frames sent"
        f"{', then it stopped taking more' if stopped else ''}){': no space left on device' if full else ''}",
    ) from stopped


def _ffmpeg_process(writer: Any) -> subprocess.Popen | None:
    """The ffmpeg process of imageio's ``writer`` (started by its first frame), whose exit status
    imageio-ffmpeg never checks: ffmpeg failing to write a file's end (a full disk, a file size
    limit, a quota) left a file no player opens, which passed for a finished render (and the
    viewer's cache served it). None where imageio keeps it elsewhere than this version."""
    frame = getattr(getattr(writer, "_write_gen", None), "gi_frame", None)
    process = frame.f_locals.get("p") if frame is not None else None
    return process if isinstance(process, subprocess.Popen) else None


def _reads_back(path: Path, frames: int) -> bool:
    """Whether the video at ``path`` reads back with its ``frames`` frames (~60 ms: where the
    ffmpeg process that wrote it is unknown)."""
    import imageio_ffmpeg

    try:
        return frames == 0 or imageio_ffmpeg.count_frames_and_secs(str(path))[0] == frames
    except RuntimeError:  # ffmpeg cannot open it at all (an mp4 without its index)
        return False


def trajectory_to_video(
    frames: Any,
    path: str | os.PathLike,
    fps: float = 30,
    progress: bool | None = None,
    **kwargs: Any,
) -> Path:
    """Write a trajectory of frames to a video, animated gif or animated webp / png; the format
    follows the suffix (``VIDEO_SUFFIXES``).

    ``frames`` is (T, H, W, C), (T, C, H, W) or (T, H, W), uint8 or float in [0, 1]. Extra
    keyword arguments go to the writer: imageio's ffmpeg writer (e.g. ``codec``, ``quality``)
    or, for the others, Pillow's ``save`` (e.g. ``duration`` in ms, ``loop``: a gif plays once
    unless given ``loop=0``, a webp / png loops, as the seed wrote them). Odd frame sizes
    are padded by one edge pixel for ffmpeg formats. ``progress=None`` shows a tqdm bar for
    renders of at least 300 frames. The file appears whole or not at all (``write_atomically``);
    a file already at ``path`` is replaced. Returns the path written.
    """
    path = Path(path)
    suffix = _check_video_path(path)
    check_fps(fps, suffix)
    check_output_path(path)
    frames = to_rgb_uint8(frames)
    if progress is None:
        progress = len(frames) >= PROGRESS_MIN_FRAMES
    bar = f"rendering {path.name}" if progress else None  # the bar's text, None for no bar
    if suffix == ".gif":
        return write_atomically(path, lambda temp: _write_gif(frames, temp, fps, bar, dict(kwargs)))
    if suffix in ANIMATED_IMAGE_FORMATS:
        return write_atomically(path, lambda temp: _write_animated_image(frames, temp, suffix, fps, dict(kwargs)))
    check_encodable(frames.shape[1], frames.shape[2], suffix, kwargs.get("codec"))
    padded = _pad_to_even(frames)
    return write_atomically(path, lambda temp: _write_ffmpeg(padded, temp, suffix, fps, bar, dict(kwargs)))


def blocks_to_video(blocks: Iterable[Any], path: str | os.PathLike, fps: float = 30, **kwargs: Any) -> Path:
    """``trajectory_to_video`` for the ffmpeg formats, from frames that come block by block (each
    a ``(t, ...)`` array that ``trajectory_to_video`` takes): one block at a time is converted and
    held, so an episode of any length renders in the memory of a block, not of the episode. A
    block that raises stops the render and leaves nothing at ``path``. Returns the path written."""
    path = Path(path)
    suffix = _check_video_path(path)
    if suffix not in FFMPEG_SUFFIXES:
        raise ValueError(
            f"path: {str(path)!r}: frames given in blocks are written to {FFMPEG_SUFFIXES} only; "
            "a gif's palette needs every frame at once (trajectory_to_video)"
        )
    check_fps(fps, suffix)
    check_output_path(path)

    def frames() -> Iterable[np.ndarray]:
        for block in blocks:
            rgb = to_rgb_uint8(block)
            check_encodable(rgb.shape[1], rgb.shape[2], suffix, kwargs.get("codec"))
            yield from _pad_to_even(rgb)

    return write_atomically(path, lambda temp: _write_ffmpeg(frames(), temp, suffix, fps, None, dict(kwargs)))


def frame_size(shape: Sequence[int]) -> tuple[int, int]:
    """(height, width) of one frame of per-frame ``shape`` (H, W), (H, W, C) or (C, H, W), read as
    ``to_rgb_uint8`` reads it."""
    shape = tuple(int(n) for n in shape)
    if len(shape) == 3 and shape[-1] not in CHANNEL_COUNTS and shape[0] in CHANNEL_COUNTS:
        return shape[1], shape[2]
    if len(shape) in (2, 3):
        return shape[0], shape[1]
    raise ValueError(f"frames: expected a frame shape (H, W), (H, W, C) or (C, H, W), got {shape}")


def scaled_frame_shape(shape: Sequence[int], scale: int) -> tuple[int, ...]:
    """Per-frame ``shape`` in its stored layout, its height and width downsampled by ``scale``:
    what ``inspect-replay-buffer`` reports for a field, as memmap-replay-buffer's did."""
    shape = tuple(int(n) for n in shape)
    height, width = (-(-n // scale) for n in frame_size(shape))
    if len(shape) == 3 and shape[-1] not in CHANNEL_COUNTS and shape[0] in CHANNEL_COUNTS:
        return shape[0], height, width
    return height, width, *shape[2:]


def check_sheet_size(
    rows: int, columns: int, height: int, width: int, names: tuple[str, str] = ("rows", "columns")
) -> None:
    """Refuse a contact sheet of ``rows`` x ``columns`` frames of ``height`` x ``width`` larger
    than ``MAX_SHEET_PIXELS``, before anything is read or built (``names``: how the caller
    calls rows and columns, e.g. the CLI's options)."""
    for name, value in zip(names, (rows, columns)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    pixels = int(rows) * int(columns) * int(height) * int(width)
    if pixels > MAX_SHEET_PIXELS:
        raise ValueError(
            f"{names[0]} {rows} x {names[1]} {columns}: a contact sheet of {int(rows) * int(columns)} frames of "
            f"{width}x{height} has {pixels} pixels, over the bound of {MAX_SHEET_PIXELS} "
            f"(MAX_SHEET_PIXELS, {MAX_SHEET_PIXELS * 3 >> 20} MiB of RGB); pass fewer {names[0]} or {names[1]}"
        )


def frames_to_sheet(frames: Any, rows: int = 2, columns: int = 5) -> np.ndarray:
    """Evenly sample ``rows * columns`` frames into one (rows*H, columns*W, 3) uint8 image.

    The frames are those the seed picks (``linspace`` indices rounded down); unlike the seed's,
    the sheet is always RGB uint8, whatever the frames' layout and dtype. A sheet over
    ``MAX_SHEET_PIXELS`` is refused (ValueError) before any frame is converted."""
    frames = np.asarray(frames)
    height, width = frame_size(frames.shape[1:]) if frames.ndim in (3, 4) else (1, 1)
    check_sheet_size(rows, columns, height, width)
    frames = to_rgb_uint8(frames)
    indices = np.linspace(0, len(frames) - 1, rows * columns).astype(int)
    height, width = frames.shape[1:3]
    grid = frames[indices].reshape(rows, columns, height, width, 3)
    return np.ascontiguousarray(grid.transpose(0, 2, 1, 3, 4).reshape(rows * height, columns * width, 3))


# buffers


def _data_fields(buffer: Any) -> list[str]:
    """Per-timestep field names of ``buffer`` in declaration order."""
    return [name for name in buffer.shapes if name in buffer.fieldnames]


def image_fields(buffer: Any) -> list[str]:
    """Fields whose per-timestep shape is one frame, in declaration order."""
    fields = []
    for name in _data_fields(buffer):
        if is_image_field(buffer.shapes[name], buffer.dtypes[name]):
            fields.append(name)
    return fields


def default_image_field(buffer: Any) -> str:
    """The only image field of ``buffer``; a ValueError lists the candidates otherwise."""
    candidates = image_fields(buffer)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        shapes = {name: tuple(buffer.shapes[name]) for name in _data_fields(buffer)}
        raise ValueError(
            f"field: no image-like field in this buffer (fields and shapes: {shapes}); pass field= explicitly"
        )
    raise ValueError(f"field: several image-like fields {candidates}; pass field= one of them")


def _as_episode(index: Any) -> int | None:
    """``index`` as an episode index: an int, a numpy integer or a 0-d integer array or tensor
    (what iterating ``torch.tensor([0, 3])`` gives, which the seed takes); None for anything
    else (bools, floats, strings)."""
    if isinstance(index, bool | np.bool_):
        return None
    if isinstance(index, int | np.integer):
        return int(index)
    if hasattr(index, "__array__") and getattr(index, "ndim", None) == 0:
        array = np.asarray(index)
        if array.dtype.kind in "iu":
            return int(array)
    return None


def _episode_list(buffer: Any, episode_index: int | Sequence[int]) -> list[int]:
    single = _as_episode(episode_index)
    if single is not None:
        indices: list[Any] = [single]
    elif isinstance(episode_index, bool | np.bool_) or getattr(episode_index, "ndim", None) == 0:
        raise TypeError(f"episode_index: expected an int or a sequence of ints, got {episode_index!r}")
    else:
        try:
            indices = list(cast(Iterable[Any], episode_index))  # an int was taken above
        except TypeError:
            raise TypeError(
                f"episode_index: expected an int or a sequence of ints, got {type(episode_index).__name__}"
            ) from None
    if not indices:
        raise ValueError("episode_index: got an empty list, expected at least one episode")
    slots = episode_slots(buffer)
    for position, given in enumerate(indices):
        index = _as_episode(given)
        if index is None:
            raise TypeError(f"episode_index: expected ints, got {given!r} ({type(given).__name__})")
        indices[position] = index
        if not 0 <= index < slots:
            raise ValueError(
                f"episode_index: episode {index} is out of range, the buffer has {buffer.num_episodes} episodes "
                f"(valid: 0..{slots - 1})"
                if slots
                else f"episode_index: episode {index} is out of range, the buffer is empty"
            )
    return [int(index) for index in indices]


def episode_slots(buffer: Any) -> int:
    """How many episode indices (slots ``0 .. n-1``) there are to look at: ``num_episodes``, or
    up to the last slot holding a committed episode where one lies past it (after
    ``drop_episodes``, an ``episode_index`` jump, or a ConcatReplayBuffer's later members)."""
    valid = np.asarray(buffer.valid_episodes())
    return max(int(buffer.num_episodes), int(valid.max()) + 1 if len(valid) else 0)


def episode_frames(buffer: Any, episode_index: int | Sequence[int] = 0, field: str | None = None) -> np.ndarray:
    """The stored frames of one episode, or of several concatenated in time, as a numpy array.

    Each episode is read whole and consistently beside a writer in another process
    (``read_episodes_consistent``: one committed episode, never parts of two); the array keeps
    the field's dtype and layout (convert with ``to_rgb_uint8``).
    """
    if field is None:
        field = default_image_field(buffer)
    return episode_frames_by_field(buffer, episode_index, [field])[field]


def episode_frames_by_field(
    buffer: Any, episode_index: int | Sequence[int], fields: Sequence[str]
) -> dict[str, np.ndarray]:
    """``episode_frames`` of several fields, read in one consistent read: every field's frames
    come from the same episodes (fields read one by one beside a writer reusing the slot showed
    one camera of the old episode beside another of the new one under one label)."""
    unknown = [field for field in fields if field not in buffer.fieldnames]
    if unknown:
        raise ValueError(
            f"field: unknown field {unknown[0]!r}, expected one of {_data_fields(buffer)} "
            f"(image-like: {image_fields(buffer)})"
        )
    episodes = _episode_list(buffer, episode_index)
    got = read_episodes_consistent(buffer, np.unique(episodes), list(fields), with_meta=False)
    rows = {int(slot): row for slot, row in zip(got.slots, range(len(got)))}
    for episode in episodes:
        if episode not in rows:
            raise ValueError(
                f"episode_index: episode {episode} is empty (length 0) or being rewritten, nothing to render"
            )
    frames = {}
    for field in fields:
        slabs = [got.data[field][rows[episode], : int(got.lens[rows[episode]])] for episode in episodes]
        frames[field] = slabs[0] if len(slabs) == 1 else np.concatenate(slabs, axis=0)
    return frames


def save_video(
    buffer: Any,
    path: str | os.PathLike,
    episode_index: int | Sequence[int] = 0,
    field: str | None = None,
    fps: float = 30,
    **kwargs: Any,
) -> Path:
    """Render episode(s) of ``buffer`` to ``path`` (several episodes play one after another)."""
    check_fps(fps, _check_video_path(Path(path)))  # the path and fps before reading any frame
    check_output_path(path)
    candidates = image_fields(buffer)
    if field is not None and field in buffer.fieldnames and field not in candidates:  # before reading it
        raise ValueError(
            f"field: {field!r} holds values of shape {tuple(buffer.shapes[field])} per step, not image frames; "
            f"its dtype is {np.dtype(buffer.dtypes[field])}, frames are {IMAGE_FIELD_RULE}; image-like fields: {candidates}"
        )
    return trajectory_to_video(episode_frames(buffer, episode_index, field), path, fps=fps, **kwargs)


# the seed's command-line helpers; they live in ``replaybuf.cli``, imported on first use (the cli
# imports this module)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``inspect-replay-buffer`` command (``replaybuf.cli.inspect_main``)."""
    from .cli import inspect_main

    return inspect_main(argv)


def open_buffer(folder: str | Path) -> Any:
    """Open a buffer folder read-only, whichever backend stored it."""
    from .cli import open_buffer as open_read_only

    return open_read_only(str(folder))


def parse_episodes(value: str) -> list[int]:
    """A comma-delimited episode list such as ``0,3,5`` (``replaybuf.cli.episode_list``)."""
    from .cli import episode_list

    return episode_list(value)


def parse_fields(value: str) -> list[str]:
    """A comma-delimited field list such as ``front,wrist`` (``replaybuf.cli.field_list``)."""
    from .cli import field_list

    return field_list(value)


def field_path(base: Path, field: str, multiple: bool) -> Path:
    """With several fields, the field name goes before the suffix: ``out.mp4`` -> ``out.front.mp4``."""
    from .cli import _suffixed

    return _suffixed(base, field, multiple)


if __name__ == "__main__":
    raise SystemExit(main())
