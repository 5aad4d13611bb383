"""``replaybuf import`` and ``replaybuf export`` (``CLI_COMMANDS``, registered by ``replaybuf.cli``)."""

from __future__ import annotations

import argparse

__all__ = ["CLI_COMMANDS"]

IMPORT_FORMATS = ("diffusion_policy", "robomimic", "d4rl", "lerobot", "minari")
EXPORT_FORMATS = ("diffusion_policy", "lerobot")
# the meta fields each export writes (the others are left out, and the command says so)
EXPORTED_META = {"diffusion_policy": (), "lerobot": ("task_index", "fps")}


def _add_import_arguments(parser: argparse.ArgumentParser) -> None:
    from ..cli import add_store_arguments

    parser.add_argument("format", choices=IMPORT_FORMATS, help="the source's format")
    parser.add_argument("src", help="source dataset: folder or file")
    parser.add_argument("dst", help="destination buffer folder or URL (an existing one resumes the import)")
    parser.add_argument(
        "--backend",
        default=None,
        help="destination backend: zarr (default), memmap, hdf5 or one an installed package names",
    )
    parser.add_argument("--verify", action="store_true", help="read every imported episode back and compare")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal by default)")
    add_store_arguments(parser, what="the destination's")


def _run_import(args: argparse.Namespace) -> int:
    from ..cli import store_options
    from . import load

    result = load(
        args.format,
        args.src,
        args.dst,
        backend=args.backend,
        storage_options=store_options(args),
        verify=args.verify,
        progress=False if args.quiet else None,
    )
    checked = ", verified" if args.verify else ""
    print(
        f"imported {result.imported} episodes ({result.frames} steps) into {args.dst}{checked}; "
        f"{result.skipped} were already there"
    )
    if result.empty:
        print(f"{result.empty} source episodes have no steps and were left out (a buffer episode holds at least one)")
    return 0


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    from ..cli import add_store_arguments

    parser.add_argument("format", choices=EXPORT_FORMATS, help="the format to write")
    parser.add_argument("src", help="source buffer folder or URL")
    parser.add_argument("dst", help="destination folder: a new or empty one (an export writes into nothing else)")
    parser.add_argument(
        "--video", action="store_true", help="lerobot: image fields as H.264 mp4 videos (lossy) instead of PNG"
    )
    add_store_arguments(parser, what="the source buffer's")


def _run_export(args: argparse.Namespace) -> int:
    from ..cli import store_options
    from . import export

    options = {"video": True} if args.video else {}
    if args.video and args.format != "lerobot":
        raise ValueError(f"--video applies to the lerobot format, not {args.format!r}")
    count = export(args.format, args.src, args.dst, storage_options=store_options(args), **options)
    print(f"exported {count} episodes to {args.dst} ({args.format})")
    from ..cli import open_buffer

    with open_buffer(args.src, store_options(args)) as buffer:
        left_out = [name for name in buffer.schema.meta_fields if name not in EXPORTED_META[args.format]]
    if left_out:
        print(f"meta fields {left_out} have no place in the {args.format} layout and were left out")
    return 0


# (name, help, add_arguments, run): the fields of replaybuf.cli.Command, in order
CLI_COMMANDS = (
    (
        "import",
        "import a dataset (diffusion_policy zarr, robomimic or D4RL HDF5, LeRobot v3 folder, Minari) into a buffer",
        _add_import_arguments,
        _run_import,
    ),
    ("export", "export a buffer as a diffusion_policy zarr or a LeRobot v3 folder", _add_export_arguments, _run_export),
)
