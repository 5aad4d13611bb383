"""Command line: ``inspect-replay-buffer`` and the ``replaybuf`` command with its subcommands.

``replaybuf`` is a table of subcommands filled with ``register_command``: ``inspect`` (the same
as ``inspect-replay-buffer``) and ``view`` here, ``convert``, ``info`` and ``verify`` from
``replaybuf.maintenance``, ``import`` and ``export`` from ``replaybuf.importers``. Bad input ends with an argparse-style
message and exit status 2, a damaged buffer or one another process holds (a live writer),
replaced or kept changing faster than it could be read with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import codecs
import errno
import io
import json
import os
import select
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from replaybuf.importers._cli import CLI_COMMANDS as IMPORT_COMMANDS
from replaybuf.maintenance import CLI_COMMANDS, WriterOutpacedError
from replaybuf.storage.base import (
    BufferDamagedError,
    ConcurrentWriteError,
    CorruptChunkError,
    StorageError,
    UnfinishedEditError,
)
from replaybuf.storage.lease import BufferLockedError
from replaybuf.video import (
    IMAGE_FIELD_RULE,
    VIDEO_SUFFIXES,
    check_encodable,
    check_fps,
    check_sheet_size,
    check_writable,
    episode_frames_by_field,
    episode_slots,
    frame_size,
    frames_to_sheet,
    image_fields,
    scaled_frame_shape,
    to_rgb_uint8,
    trajectory_to_video,
    write_atomically,
)

__all__ = [
    "Command",
    "add_store_arguments",
    "commands",
    "inspect_main",
    "main",
    "open_buffer",
    "register_command",
    "store_options",
]

# what the --serve page's <video> elements play (Chromium, Firefox); an --output in another format
# (gif, webp, png, apng, avi) is served as an mp4 copy rendered into the viewer's temp folder
BROWSER_VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov")

# the errors a command turns into a usage message: bad values, missing files, unreachable stores
USER_ERRORS = (ValueError, TypeError, KeyError, OSError, ImportError, StorageError)
# what the disk answered midway (full, over a quota or size limit, read-only, failing): no usage
# mistake, so no usage text; exit status 1, as a damaged or locked buffer
DISK_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


@dataclass(frozen=True)
class Command:
    """One ``replaybuf`` subcommand: its arguments and what it runs (returning an exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


_commands: dict[str, Command] = {}
commands = MappingProxyType(_commands)


def register_command(command: Command, clobber: bool = False) -> Command:
    """Add a subcommand to ``replaybuf``; an existing name is only replaced with ``clobber=True``."""
    if command.name in _commands and not clobber:
        raise ValueError(f"command {command.name!r} is already registered (pass clobber=True to replace it)")
    _commands[command.name] = command
    return command


def open_buffer(location: str, storage_options: dict[str, Any] | None = None) -> Any:
    """Open a buffer folder or URL read-only, whichever backend stored it."""
    from replaybuf import ReplayBuffer

    return ReplayBuffer.from_folder(location, read_only=True, storage_options=storage_options)


def _location_name(location: str) -> str:
    """The last path component of a folder (resolved, as the seed names it: ``.`` is the current
    folder's name) or URL, for default output names."""
    if "://" in location:
        return Path(location.rstrip("/")).name or "replay"
    return Path(location).resolve().name or "replay"


# argument types


def episode_list(value: str) -> list[int]:
    """A comma-delimited list of episode indices, e.g. ``0,3,5``."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    try:
        episodes = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid episode list {value!r}: expected comma-delimited indices such as 0,3,5"
        ) from None
    if not episodes:
        raise argparse.ArgumentTypeError(f"invalid episode list {value!r}: expected at least one index")
    negative = [episode for episode in episodes if episode < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"invalid episode list {value!r}: indices must be >= 0, got {negative}")
    return episodes


def field_list(value: str) -> list[str]:
    """A comma-delimited list of field names, e.g. ``front,wrist``."""
    fields = [part.strip() for part in value.split(",") if part.strip()]
    if not fields:
        raise argparse.ArgumentTypeError(f"invalid field list {value!r}: expected at least one field name")
    return fields


def _positive(value: str, kind: type[int] | type[float], what: str) -> float:
    """``value`` as a finite number > 0 of ``kind``, else an argparse error expecting ``what``."""
    try:
        number: float | None = kind(value)
    except ValueError:
        number = None
    if number is None or not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return number


def positive_int(value: str) -> int:
    return int(_positive(value, int, "a positive integer"))


def positive_number(value: str) -> float:
    number = _positive(value, float, "a positive number")
    return int(number) if number.is_integer() else number


def port_number(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid port {value!r}: expected an integer in 0..65535 (0 picks a free one)"
        ) from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"invalid port {value!r}: expected an integer in 0..65535 (0 picks a free one)"
        )
    return port


def json_object(value: str) -> dict[str, Any]:
    """A JSON object, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {error.msg}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"anon\": true}}', got {value!r}")
    return parsed


def add_store_arguments(parser: argparse.ArgumentParser, prefix: str = "", what: str = "the buffer's") -> None:
    """``--storage-options JSON``, ``--anon`` and ``--endpoint-url URL`` (each with ``prefix``,
    e.g. ``--dst-anon``) for a location's store; ``store_options`` merges them."""
    dest = prefix.replace("-", "_")
    parser.add_argument(
        f"--{prefix}storage-options",
        dest=f"{dest}storage_options",
        type=json_object,
        default=None,
        metavar="JSON",
        help=f'options for {what} remote store as a JSON object, e.g. \'{{"endpoint_url": "http://127.0.0.1:9000"}}\'',
    )
    parser.add_argument(
        f"--{prefix}anon",
        dest=f"{dest}anon",
        action="store_true",
        help=f"access {what} object store without credentials (storage option anon=true)",
    )
    parser.add_argument(
        f"--{prefix}endpoint-url",
        dest=f"{dest}endpoint_url",
        default=None,
        metavar="URL",
        help=f"endpoint of {what} S3-compatible store or GCS emulator (storage option endpoint_url)",
    )


def store_options(args: argparse.Namespace, prefix: str = "") -> dict[str, Any] | None:
    """The storage options given by ``add_store_arguments``: the JSON object, with ``--anon``
    and ``--endpoint-url`` set on top of it; None when none was given."""
    dest = prefix.replace("-", "_")
    options = dict(getattr(args, f"{dest}storage_options") or {})
    if getattr(args, f"{dest}anon"):
        options["anon"] = True
    if getattr(args, f"{dest}endpoint_url") is not None:
        options["endpoint_url"] = getattr(args, f"{dest}endpoint_url")
    return options or None


def add_location_arguments(parser: argparse.ArgumentParser) -> None:
    """The buffer to open: a folder or URL, and options for its store."""
    parser.add_argument("location", metavar="FOLDER_OR_URL", help="buffer folder or URL (s3://..., gs://...)")
    add_store_arguments(parser)


def _suffixed(path: Path, field: str, several: bool) -> Path:
    """With several fields, insert the field before the suffix: ``replay.mp4`` -> ``replay.front.mp4``."""
    return path.with_name(f"{path.stem}.{field}{path.suffix}") if several else path


# inspect


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add_location_arguments(parser)
    parser.add_argument(
        "-e",
        "--episode",
        type=episode_list,
        default=[0],
        help="comma-delimited episodes to render one after another, e.g. 0,3,5 (default 0)",
    )
    parser.add_argument(
        "-f",
        "--field",
        type=field_list,
        default=None,
        help="comma-delimited image fields, e.g. front,wrist (default: every image-like field)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="video path (.mp4, .webm, .gif, ...); with several fields one video per field, <name>.<field>.<ext>",
    )
    parser.add_argument("--fps", type=positive_number, default=30, help="frames per second (default 30)")
    parser.add_argument(
        "--scale", type=positive_int, default=1, help="downsample frames by this integer factor (default 1)"
    )
    parser.add_argument(
        "--sheet", type=Path, default=None, help="also write a contact sheet (e.g. sheet.png) per field"
    )
    parser.add_argument("--rows", type=positive_int, default=2, help="contact sheet rows (default 2)")
    parser.add_argument("--columns", type=positive_int, default=5, help="contact sheet columns (default 5)")
    parser.add_argument(
        "--serve",
        type=port_number,
        nargs="?",
        const=8000,
        default=None,
        metavar="PORT",
        help="serve the videos on a local page at 127.0.0.1:PORT (default 8000; 0 picks a free port)",
    )
    parser.add_argument("--no-browser", action="store_true", help="with --serve, do not open a browser")


def _check_inspect_outputs(args: argparse.Namespace) -> None:
    if args.output is not None and args.output.suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"--output {str(args.output)!r}: unsupported suffix, expected one of {VIDEO_SUFFIXES}")
    if args.sheet is not None and args.sheet.suffix.lower() not in (".png", ".jpg", ".jpeg", ".webp", ".bmp"):
        raise ValueError(f"--sheet {str(args.sheet)!r}: expected an image path such as sheet.png")


def _check_selection(buffer: Any, episodes: Sequence[int], fields: Sequence[str]) -> None:
    count = episode_slots(buffer)
    outside = [episode for episode in episodes if episode >= count]
    if outside:
        valid = f"0..{count - 1}" if count else "none, the buffer is empty"
        raise ValueError(
            f"--episode: {outside} out of range, the buffer has {buffer.num_episodes} episodes (valid: {valid})"
        )
    candidates = image_fields(buffer)
    unknown = [field for field in fields if field not in buffer.fieldnames]
    if unknown:
        raise ValueError(f"--field: unknown field(s) {unknown}, image-like fields are {candidates}")
    not_images = [field for field in fields if field not in candidates]
    if not_images:
        held = ", ".join(
            f"{field}: {np.dtype(buffer.dtypes[field])} {tuple(buffer.shapes[field])}" for field in not_images
        )
        raise ValueError(
            f"--field: {not_images} do not hold image frames ({held} per step; frames are {IMAGE_FIELD_RULE}), "
            f"image-like fields are {candidates}"
        )


def run_inspect(args: argparse.Namespace) -> int:
    """Render the chosen episodes per field to videos (and sheets), then optionally serve them."""
    from replaybuf.viewer import ReplayApp, ViewerServer
    from replaybuf.viewer.cache import VideoCache
    from replaybuf.viewer.server import check_port

    _check_inspect_outputs(args)
    if args.serve is not None:
        check_port(args.serve)  # a busy port fails now, not after rendering every video
    buffer = open_buffer(args.location, store_options(args))
    fields = args.field or image_fields(buffer)
    if not fields:
        raise ValueError("--field: this buffer has no image-like field; pass --field explicitly")
    _check_selection(buffer, args.episode, fields)
    if args.sheet is not None:  # a sheet too large to build fails before anything is rendered
        for field in fields:
            height, width = frame_size(buffer.shapes[field])
            check_sheet_size(
                args.rows, args.columns, -(-height // args.scale), -(-width // args.scale), ("--rows", "--columns")
            )

    several = len(fields) > 1
    if args.output is not None:
        base: Path | None = args.output
    elif args.serve is not None:
        base = None  # only the videos served are written, in the temp folder
    else:
        slug = "-".join(str(episode) for episode in args.episode)
        base = Path(f"{_location_name(args.location)}-episode-{slug}.mp4")
    # the page's <video> elements play the outputs, or mp4s rendered beside them in a temp folder
    # (a gif, webp, png or avi output showed as a video that could not be loaded)
    serve_copies = args.serve is not None and (base is None or base.suffix.lower() not in BROWSER_VIDEO_SUFFIXES)
    suffixes = ([base.suffix] if base is not None else []) + ([".mp4"] if serve_copies else [])
    for suffix in suffixes:  # an fps or frames the encoder cannot take fail before any episode is read
        check_fps(args.fps, suffix)
        for field in fields:
            height, width = frame_size(buffer.shapes[field])
            check_encodable(-(-height // args.scale), -(-width // args.scale), suffix, what=f"--field {field}")
    outputs = [_suffixed(base, field, several) for field in fields] if base is not None else []
    if args.sheet is not None:
        outputs += [_suffixed(args.sheet, field, several) for field in fields]
    for output in outputs:  # a bad output path or a folder it may not write in fails before anything is written
        check_writable(output)
    temp_dir = VideoCache() if serve_copies else None  # a folder a later viewer cleans if this one is killed

    videos: dict[str, Path] = {}
    field_info: dict[str, dict[str, str]] = {}
    frame_count = 0
    sheets: list[tuple[Path, np.ndarray]] = []  # written after every video, in the seed's order
    try:
        # every field from the same episodes (one read), each converted once its turn comes; a
        # field named twice is rendered once, as the seed's
        stored_frames = episode_frames_by_field(buffer, args.episode, list(dict.fromkeys(fields)))
        for field in list(stored_frames):
            frames = to_rgb_uint8(stored_frames.pop(field))[:, :: args.scale, :: args.scale]
            frame_count = len(frames)
            written = []
            if base is not None:
                written.append(trajectory_to_video(frames, _suffixed(base, field, several), fps=args.fps))
            if temp_dir is not None:
                served = _suffixed(temp_dir.folder / "replay.mp4", field, several)
                written.append(
                    trajectory_to_video(frames, served, fps=args.fps, progress=None if base is None else False)
                )
            videos[field] = written[-1]
            shape = scaled_frame_shape(buffer.shapes[field], args.scale)  # as stored: the seed's report
            field_info[field] = {"shape": " x ".join(map(str, shape)), "dtype": str(np.dtype(buffer.dtypes[field]))}
            print(f"wrote {written[0]} ({len(frames)} frames of {shape} at {args.fps} fps)")
            if args.sheet is not None:  # a sheet, not the frames, is kept until the videos are done
                sheets.append((_suffixed(args.sheet, field, several), frames_to_sheet(frames, args.rows, args.columns)))
        for sheet_path, sheet in sheets:
            import imageio.v3 as iio

            write_atomically(sheet_path, partial(iio.imwrite, image=sheet))
            print(f"wrote {sheet_path} ({args.rows}x{args.columns} contact sheet)")
    except BaseException:  # nothing to serve: the temp folder goes now
        if temp_dir is not None:
            temp_dir.close()
        raise

    if args.serve is not None:
        info = {
            "location": args.location,
            "episodes": args.episode,
            "frames": frame_count,
            "fps": args.fps,
            "scale": args.scale,
            "field_info": field_info,
        }
        ViewerServer(ReplayApp(videos, info, temp_dir=temp_dir), port=args.serve).serve_forever(
            open_browser=not args.no_browser
        )
    return 0


INSPECT = register_command(
    Command(
        name="inspect",
        help="render episodes of image fields to videos and contact sheets, optionally served in a local page",
        add_arguments=add_inspect_arguments,
        run=run_inspect,
    )
)


# view


def add_view_arguments(parser: argparse.ArgumentParser) -> None:
    add_location_arguments(parser)
    parser.add_argument(
        "--port", type=port_number, default=8000, help="port on 127.0.0.1 (default 8000; 0 picks a free port)"
    )
    parser.add_argument(
        "--fps", type=positive_number, default=30, help="frames per second of the rendered videos (default 30)"
    )
    parser.add_argument(
        "--scale", type=positive_int, default=1, help="downsample frames by this integer factor (default 1)"
    )
    parser.add_argument(
        "--cache-mb",
        type=positive_int,
        default=1024,
        help="rendered videos kept, in MiB; the least recently watched are deleted first (default 1024)",
    )
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")


def run_view(args: argparse.Namespace) -> int:
    """Browse a buffer in a local page: episode list, synced videos and plots."""
    from replaybuf.viewer import BufferApp, ViewerServer

    buffer = open_buffer(args.location, store_options(args))
    app = BufferApp(buffer, location=args.location, fps=args.fps, scale=args.scale, cache_bytes=args.cache_mb << 20)
    ViewerServer(app, port=args.port).serve_forever(open_browser=not args.no_browser)
    return 0


VIEW = register_command(
    Command(
        name="view",
        help="browse a buffer in a local web page: episodes, videos of image fields, plots of the others",
        add_arguments=add_view_arguments,
        run=run_view,
    )
)

for _spec in (*CLI_COMMANDS, *IMPORT_COMMANDS):
    register_command(Command(*_spec))


# entry points


def _escape_unencodable(error: UnicodeError) -> tuple[str | bytes, int]:
    """Codec error handler of the commands' output: the bytes of a name Python read from the
    system (a path in argv, undecodable in the locale: surrogateescape), else a backslash
    escape, so that a name the terminal's encoding cannot show never fails a command."""
    try:
        return codecs.lookup_error("surrogateescape")(error)
    except UnicodeError:
        return codecs.lookup_error("backslashreplace")(error)


codecs.register_error("replaybuf.escape", _escape_unencodable)


@contextmanager
def output_never_fails_to_encode() -> Iterator[None]:
    """Within it, stdout and stderr escape what their encoding cannot write (an ASCII or
    Latin-1 locale, ``PYTHONIOENCODING=ascii``) rather than raise: ``info`` of a buffer with a
    non-ASCII field name, or ``convert``'s report after a copy to ``données/``, said "error"
    with exit status 2 (the copy made)."""
    streams = [stream for stream in (sys.stdout, sys.stderr) if isinstance(stream, io.TextIOWrapper)]
    handlers = [stream.errors for stream in streams]
    for stream in streams:
        stream.reconfigure(errors="replaybuf.escape")
    try:
        yield
    finally:
        for stream, handler in zip(streams, handlers):
            stream.reconfigure(errors=handler)


def _run(command: Command, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with output_never_fails_to_encode():
        return _run_reporting_errors(command, args, parser)


def _run_reporting_errors(command: Command, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        status = command.run(args)
        sys.stdout.flush()  # here, so that a reader that stopped early is seen below, not at exit
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as error:
        if not _stdout_reader_gone():  # another pipe or socket: an error like any other
            parser.error(str(error))
        _discard_stdout()  # the output's reader stopped (`replaybuf info ... | head`): not an error of ours
        return 141  # as a shell reports a process ended by SIGPIPE
    except (BufferDamagedError, CorruptChunkError) as error:  # a finding about the buffer, not a usage error
        print(f"{parser.prog}: the buffer is damaged: {error}", file=sys.stderr)
        return 1
    # refused: another process writes it, replaced it, or kept changing it faster than it was read
    except (BufferLockedError, ConcurrentWriteError, UnfinishedEditError, WriterOutpacedError) as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    except USER_ERRORS as error:
        if _disk_failed(error):
            print(f"{parser.prog}: {error}", file=sys.stderr)
            return 1
        message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        parser.error(message or type(error).__name__)
    return 0 if status is None else int(status)


def _disk_failed(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is the disk failing a write: full, read-only, ..."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, OSError) and error.errno in DISK_FAILURES:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports POLLERR for it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file
        return False


def _discard_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's flush at exit does not fail
    again on the closed pipe (and print an "Exception ignored" traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def inspect_main(argv: Sequence[str] | None = None) -> int:
    """``inspect-replay-buffer``: render episodes to videos, optionally ``--serve`` them."""
    parser = argparse.ArgumentParser(
        prog="inspect-replay-buffer",
        description="Render episodes of image fields stored in a replay buffer to videos and contact sheets, "
        "optionally served in a local page with frame-level controls.",
    )
    INSPECT.add_arguments(parser)
    return _run(INSPECT, parser.parse_args(argv), parser)


def build_parser() -> argparse.ArgumentParser:
    """The ``replaybuf`` parser with one subparser per registered command."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="replaybuf", description="Inspect, browse and manage replaybuf episode stores."
    )
    parser.add_argument("--version", action="version", version=f"replaybuf {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _commands.values():
        subparser = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(subparser)
        subparser.set_defaults(_command=command, _parser=subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``replaybuf COMMAND ...``."""
    args = build_parser().parse_args(argv)
    return _run(args._command, args, args._parser)


if __name__ == "__main__":
    # run the importable module, so that commands registered by other modules share its table
    from replaybuf.cli import main as replaybuf_main

    sys.exit(replaybuf_main())
