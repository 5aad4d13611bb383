"""Choose replaybuf's default chunking and compression by measurement.

Measures, on the rendered-like frames and the vector fields of the shared workload:

1. compression ratio and single-core encode/decode MB/s per codec and time-chunk length
   (numcodecs directly: zstd 1/3/5, blosc lz4/zstd with and without byte shuffle; per-frame
   lossless image codecs from imagecodecs when installed);
2. what a sampler pays for one random timestep (and for an n-step pair t, t+5) per chunk
   length when it reads a chunk's bytes from a file and decodes it with numcodecs directly,
   next to zarr-python's own read of the same element (plain and sharded);
3. the stored size zarr 3 writes for the same chunking, as a cross-check of (1).

Run: python benchmarks/bench_codecs.py [--episodes N --steps T --quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numcodecs
import numpy as np
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import (  # noqa: E402
    WorkloadSize,
    add_size_arguments,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)

FRAME_CHUNK_LENGTHS = (1, 2, 4, 8, 16, 32)
VECTOR_CHUNK_LENGTHS = (64, 256, 1024, 4096)
VECTOR_EPISODES = 64  # vectors are cheap: enough steps for 4096-step chunks
NSTEP = 5
MB = 1e6

# CPU time of this process (all its threads), not wall time: the machine is shared, and CPU
# time is what a codec costs whoever else is running. --wall switches to wall-clock time.
clock = time.process_time


@dataclass(frozen=True)
class Codec:
    """A named encode/decode pair working on one contiguous numpy chunk."""

    name: str
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes, np.ndarray], np.ndarray]  # (encoded, template) -> array like template
    per_frame: bool = False  # image codecs: one frame per call


def numcodecs_codec(name: str, codec: numcodecs.abc.Codec) -> Codec:
    """Wrap a numcodecs codec; decode writes into a buffer shaped like the original chunk."""

    def decode(encoded: bytes, template: np.ndarray) -> np.ndarray:
        out = np.empty_like(template)
        codec.decode(encoded, out=out)
        return out

    return Codec(name, lambda array: codec.encode(np.ascontiguousarray(array)), decode)


def general_codecs() -> list[Codec]:
    """The byte codecs zarr 3 offers natively (zstd, blosc), via numcodecs."""
    blosc = numcodecs.Blosc
    return [
        numcodecs_codec("zstd-1", numcodecs.Zstd(level=1)),
        numcodecs_codec("zstd-3", numcodecs.Zstd(level=3)),
        numcodecs_codec("zstd-5", numcodecs.Zstd(level=5)),
        numcodecs_codec("blosc-lz4", blosc(cname="lz4", clevel=5, shuffle=blosc.NOSHUFFLE)),
        numcodecs_codec("blosc-lz4-9", blosc(cname="lz4", clevel=9, shuffle=blosc.NOSHUFFLE)),
        numcodecs_codec("blosc-lz4-shuffle", blosc(cname="lz4", clevel=5, shuffle=blosc.SHUFFLE)),
        numcodecs_codec("blosc-zstd3", blosc(cname="zstd", clevel=3, shuffle=blosc.NOSHUFFLE)),
        numcodecs_codec("blosc-zstd3-shuffle", blosc(cname="zstd", clevel=3, shuffle=blosc.SHUFFLE)),
    ]


def image_codecs() -> tuple[list[Codec], str]:
    """Per-frame lossless image codecs from imagecodecs, or ([], why not)."""
    try:
        import imagecodecs
    except ImportError as error:
        return [], f"imagecodecs not importable ({error})"

    def per_frame(name: str, encode: Callable[[np.ndarray], bytes], decode: Callable[[bytes], np.ndarray]) -> Codec:
        return Codec(name, lambda frame: encode(frame), lambda encoded, template: decode(encoded), per_frame=True)

    candidates = [
        ("png-1", lambda f: imagecodecs.png_encode(f, level=1), imagecodecs.png_decode, imagecodecs.PNG),
        ("qoi", imagecodecs.qoi_encode, imagecodecs.qoi_decode, imagecodecs.QOI),
        (
            "webp-lossless-m0",
            lambda f: imagecodecs.webp_encode(f, lossless=True, method=0),
            imagecodecs.webp_decode,
            imagecodecs.WEBP,
        ),
        (
            "webp-lossless-m1",
            lambda f: imagecodecs.webp_encode(f, lossless=True, method=1),
            imagecodecs.webp_decode,
            imagecodecs.WEBP,
        ),
        (
            "jpegxl-lossless-e1",
            lambda f: imagecodecs.jpegxl_encode(f, lossless=True, effort=1),
            imagecodecs.jpegxl_decode,
            imagecodecs.JPEGXL,
        ),
        ("jpegls", imagecodecs.jpegls_encode, imagecodecs.jpegls_decode, imagecodecs.JPEGLS),
    ]
    available = [per_frame(name, enc, dec) for name, enc, dec, flag in candidates if flag.available]
    return available, f"imagecodecs {imagecodecs.__version__}"


def split_chunks(episodes: list[np.ndarray], length: int) -> list[np.ndarray]:
    """Whole time chunks of ``length`` steps, never spanning two episodes."""
    return [
        episode[start : start + length] for episode in episodes for start in range(0, len(episode) - length + 1, length)
    ]


def measure(codec: Codec, chunks: list[np.ndarray], min_seconds: float) -> tuple[float, float, float]:
    """(compression ratio, encode MB/s, decode MB/s) over ``chunks``, best of repeated passes."""
    raw_bytes = sum(chunk.nbytes for chunk in chunks)

    def encode_all() -> list[bytes]:
        if codec.per_frame:
            return [codec.encode(frame) for chunk in chunks for frame in chunk]
        return [codec.encode(chunk) for chunk in chunks]

    templates = [frame for chunk in chunks for frame in chunk] if codec.per_frame else chunks
    encode_seconds = decode_seconds = float("inf")
    spent = 0.0
    repeats = 0
    while repeats < 1 or (spent < min_seconds and repeats < 5):
        start = clock()
        encoded = encode_all()
        middle = clock()
        decoded = [codec.decode(blob, template) for blob, template in zip(encoded, templates, strict=True)]
        end = clock()
        encode_seconds = min(encode_seconds, middle - start)
        decode_seconds = min(decode_seconds, end - middle)
        spent += end - start
        repeats += 1
    if not all(np.array_equal(out, template) for out, template in zip(decoded, templates, strict=True)):
        raise RuntimeError(f"{codec.name} did not round-trip")
    stored = sum(len(blob) for blob in encoded)
    return raw_bytes / stored, raw_bytes / encode_seconds / MB, raw_bytes / decode_seconds / MB


def ratio_table(
    title: str, fields: dict[str, list[np.ndarray]], lengths: tuple[int, ...], codecs: list[Codec], min_seconds: float
) -> dict[tuple[str, str, int], tuple[float, float, float]]:
    """Print one table (rows: codec x chunk length, per field) and return the figures."""
    results = {}
    rows = []
    for field, episodes in fields.items():
        available_steps = sum(len(episode) for episode in episodes)
        for codec in codecs:
            for length in lengths:
                if codec.per_frame and length != 1:
                    continue
                chunks = split_chunks(episodes, length)
                if length > available_steps or not chunks:
                    continue
                ratio, encode_rate, decode_rate = measure(codec, chunks, min_seconds)
                results[field, codec.name, length] = (ratio, encode_rate, decode_rate)
                rows.append(
                    [
                        field,
                        codec.name,
                        length,
                        f"{ratio:.2f}",
                        f"{encode_rate:,.0f}",
                        f"{decode_rate:,.0f}",
                        f"{chunks[0].nbytes / ratio / 1024:.1f}",
                    ]
                )
    print(f"## {title}\n")
    print(
        markdown_table(
            ["field", "codec", "time chunk (steps)", "ratio", "encode MB/s", "decode MB/s", "KiB/chunk stored"], rows
        )
    )
    print()
    return results


def write_chunk_files(folder: Path, episodes: list[np.ndarray], length: int, codec: Codec) -> int:
    """Write one file per (episode, time chunk) like an unsharded zarr LocalStore; return bytes written."""
    folder.mkdir(parents=True)
    total = 0
    for episode_index, episode in enumerate(episodes):
        for chunk_index, start in enumerate(range(0, len(episode), length)):
            chunk = np.zeros((length, *episode.shape[1:]), dtype=episode.dtype)  # zarr pads edge chunks too
            part = episode[start : start + length]
            chunk[: len(part)] = part
            blob = codec.encode(chunk)
            (folder / f"{episode_index}.{chunk_index}").write_bytes(blob)
            total += len(blob)
    return total


def read_frame(
    folder: Path, codec: Codec, length: int, template: np.ndarray, episode: int, step: int
) -> tuple[np.ndarray, int]:
    """What a direct sampler does for one timestep: read the chunk file, decode, pick the frame."""
    blob = (folder / f"{episode}.{step // length}").read_bytes()
    return codec.decode(blob, template)[step % length], len(blob)


def random_read_table(
    episodes: list[np.ndarray], codecs: list[Codec], samples: int, workdir: Path, rounds: int
) -> list[list[object]]:
    """Per-sample cost of random single-timestep and n-step (t, t+5) reads vs chunk length.

    All configurations are written first, then timed in interleaved rounds (best round kept),
    so a burst of load from other users hits every configuration alike.
    """
    rng = np.random.default_rng(1)
    steps = len(episodes[0])
    episode_ids = rng.integers(0, len(episodes), samples)
    step_ids = rng.integers(0, steps - NSTEP, samples)
    configurations = []
    for codec in codecs:
        for length in FRAME_CHUNK_LENGTHS:
            folder = workdir / f"{codec.name}-{length}"
            write_chunk_files(folder, episodes, length, codec)
            template = np.empty((length, *episodes[0].shape[1:]), dtype=episodes[0].dtype)
            configurations.append((codec, length, folder, template))
    best = {(codec.name, length): [float("inf"), float("inf"), 0] for codec, length, _, _ in configurations}
    for _ in range(rounds):
        for codec, length, folder, template in configurations:
            figures = best[codec.name, length]
            bytes_read = 0
            start = clock()
            for episode, step in zip(episode_ids, step_ids, strict=True):
                frame, size = read_frame(folder, codec, length, template, episode, step)
                bytes_read += size
            figures[0] = min(figures[0], (clock() - start) / samples)
            figures[2] = bytes_read
            if not np.array_equal(frame, episodes[episode_ids[-1]][step_ids[-1]]):
                raise RuntimeError(f"{codec.name} chunk {length}: wrong frame read back")
            start = clock()
            for episode, step in zip(episode_ids, step_ids, strict=True):
                read_frame(folder, codec, length, template, episode, step)
                if (step + NSTEP) // length != step // length:
                    read_frame(folder, codec, length, template, episode, step + NSTEP)
            figures[1] = min(figures[1], (clock() - start) / samples)
    for _, _, folder, _ in configurations:
        shutil.rmtree(folder)
    return [
        [
            name,
            length,
            f"{bytes_read / samples / 1024:.1f}",
            f"{single * 1e6:.0f}",
            f"{1 / single:,.0f}",
            f"{pair * 1e6:.0f}",
        ]
        for (name, length), (single, pair, bytes_read) in best.items()
    ]


def zarr_rows(episodes: list[np.ndarray], samples: int, workdir: Path) -> list[list[object]]:
    """Stored ratio and zarr-python's per-element random read cost for zstd-3, plain and sharded."""
    from zarr.codecs import BytesCodec, ZstdCodec

    data = np.stack(episodes)
    count, steps = data.shape[:2]
    rng = np.random.default_rng(2)
    episode_ids = rng.integers(0, count, samples)
    step_ids = rng.integers(0, steps, samples)
    rows = []
    for length in (1, 4, 8, 32):
        for sharded in (False, True):
            path = workdir / f"zarr-{length}-{sharded}"
            chunk_shape = (1, length, *data.shape[2:])
            shard_shape = (1, -(-steps // length) * length, *data.shape[2:]) if sharded else None
            array = zarr.create_array(
                store=str(path),
                shape=data.shape,
                dtype=data.dtype,
                chunks=chunk_shape,
                shards=shard_shape,
                compressors=ZstdCodec(level=3),
                serializer=BytesCodec(),
                fill_value=0,
            )
            start = clock()
            array[...] = data
            write_seconds = clock() - start
            stored = sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and file.name != "zarr.json")
            files = sum(1 for file in path.rglob("c/**/*") if file.is_file())
            reader = zarr.open_array(str(path), mode="r")
            for episode, step in zip(episode_ids[:10], step_ids[:10], strict=True):
                reader[episode, step]
            start = clock()
            for episode, step in zip(episode_ids, step_ids, strict=True):
                frame = reader[episode, step]
            read_seconds = (clock() - start) / samples
            if not np.array_equal(frame, data[episode_ids[-1], step_ids[-1]]):
                raise RuntimeError("zarr read back a wrong frame")
            rows.append(
                [
                    length,
                    "yes" if sharded else "no",
                    files,
                    f"{data.nbytes / stored:.2f}",
                    f"{data.nbytes / write_seconds / MB:,.0f}",
                    f"{read_seconds * 1e6:.0f}",
                    f"{1 / read_seconds:,.0f}",
                ]
            )
            shutil.rmtree(path)
    return rows


def camera_noise(frames: np.ndarray, seed: int, static: bool) -> np.ndarray:
    """``frames`` plus Gaussian noise on every pixel (a sensitivity check).

    ``static=False``: new noise every frame (sigma 2, a real camera); ``static=True``: one
    sigma-4 pattern repeated on every frame (a textured floor or wall in a rendered scene).
    """
    rng = np.random.default_rng(seed)
    if static:
        noise = np.broadcast_to(rng.normal(0.0, 4.0, size=frames.shape[1:]).round().astype(np.int16), frames.shape)
    else:
        noise = rng.normal(0.0, 2.0, size=frames.shape).round().astype(np.int16)
    return np.clip(frames + noise, 0, 255).astype(np.uint8)


def print_recommendation(
    frame_results: dict, read_rows: list[list[object]], vector_results: dict, vectors: dict[str, list[np.ndarray]]
) -> None:
    """The defaults these figures argue for, by two stated rules."""
    print("## Recommendation (by rule; see RESULTS.md for the reasoning)\n")
    # Frames: the cheapest random read among configurations that keep >= 85% of the best ratio.
    best_ratio = max(ratio for (_, _, _), (ratio, _, _) in frame_results.items())
    candidates = [
        (float(row[3]), row[0], row[1])
        for row in read_rows
        if frame_results["frame", row[0], row[1]][0] >= 0.85 * best_ratio
    ]
    if candidates:
        cost, codec, length = min(candidates)
        ratio = frame_results["frame", codec, length][0]
        print(
            f"- frames: {codec}, time chunk {length} (ratio {ratio:.2f} vs best {best_ratio:.2f}; "
            f"{cost:.0f} us per random sample). Rule: cheapest random read keeping >= 85% of the best ratio."
        )
    # Vectors: the codec storing the fewest bytes over all vector fields at the longest chunk,
    # then the shortest chunk within 5% of its own longest-chunk size.
    raw = {field: sum(part.nbytes for part in parts) for field, parts in vectors.items()}
    lengths = sorted({length for (field, _, length) in vector_results if field in raw})
    codecs = sorted({codec for (field, codec, _) in vector_results if field in raw})

    def stored(codec: str, length: int) -> float:
        return sum(
            raw[field] / vector_results[field, codec, length][0]
            for field in raw
            if (field, codec, length) in vector_results
        )

    codec = min(codecs, key=lambda name: stored(name, lengths[-1]))
    length = next(size for size in lengths if stored(codec, size) <= 1.05 * stored(codec, lengths[-1]))
    total = sum(raw.values())
    print(
        f"- vectors: {codec}, chunk >= {length} steps ({total / stored(codec, length):.2f}x overall at {length}, "
        f"{total / stored(codec, lengths[-1]):.2f}x at {lengths[-1]}). Rule: fewest bytes, then shortest chunk within 5%."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser, episodes=8, steps=250)
    parser.add_argument(
        "--samples", type=int, default=None, help="random reads per configuration and round (default 500, quick 200)"
    )
    parser.add_argument("--wall", action="store_true", help="time with the wall clock instead of process CPU time")
    arguments = parser.parse_args()
    if arguments.wall:
        global clock
        clock = time.perf_counter
    size = size_from_arguments(arguments)
    if arguments.quick and arguments.episodes is None:
        size = WorkloadSize(episodes=2, steps=size.steps, seed=size.seed)
    samples = arguments.samples or (200 if arguments.quick else 500)
    min_seconds = 0.05 if arguments.quick else 0.3
    numcodecs.blosc.set_nthreads(1)  # per-core figures; the machine is shared
    print_header("Codec and chunk-length choice", size)
    print(
        f"timing: {'wall clock' if arguments.wall else 'process CPU time (user+sys, all threads)'}; blosc threads: 1 "
        f"(single-core figures); random reads: {samples} per row and pass, best of 5 interleaved rounds (2 quick); zarr {zarr.__version__}\n"
    )

    frames = [make_episode(size, episode)["frame"] for episode in range(size.episodes)]
    vector_size = WorkloadSize(
        episodes=max(size.episodes, 16 if arguments.quick else VECTOR_EPISODES), steps=size.steps, seed=size.seed
    )
    vector_episodes = [make_episode(vector_size, episode, frames=False) for episode in range(vector_size.episodes)]
    # Vectors are chunked along time across episodes (chunk = L consecutive steps), so 4096 fits.
    vectors = {
        name: [np.concatenate([episode[name] for episode in vector_episodes])]
        for name in ("state", "action", "reward", "done")
    }

    codecs = general_codecs()
    frame_results = ratio_table(
        "Frames: byte codecs per time-chunk length (uint8 84x84x3 per step)",
        {"frame": frames},
        FRAME_CHUNK_LENGTHS,
        codecs,
        min_seconds,
    )
    by_name = {codec.name: codec for codec in codecs}
    variants = {
        "frame+camera noise": [camera_noise(episode, seed, static=False) for seed, episode in enumerate(frames[:2])],
        "frame+static texture": [camera_noise(episode, seed, static=True) for seed, episode in enumerate(frames[:2])],
    }
    ratio_table(
        "Sensitivity: the same frames with per-frame camera noise (sigma 2 levels, new every frame) and with "
        "a static high-frequency texture (the same sigma-4 pattern on every frame of an episode)",
        variants,
        FRAME_CHUNK_LENGTHS,
        [by_name["zstd-3"], by_name["blosc-lz4"], by_name["blosc-lz4-9"]],
        min_seconds,
    )
    images, image_note = image_codecs()
    print(f"image codecs: {image_note}\n")
    if images:
        few_frames = [frames[0][: min(len(frames[0]), 100 if arguments.quick else 250)]]
        ratio_table(
            "Frames: per-frame lossless image codecs (chunk = 1 frame)",
            {"frame": few_frames},
            (1,),
            images,
            min_seconds,
        )
    vector_results = ratio_table(
        "Vectors: byte codecs per chunk length (steps)", vectors, VECTOR_CHUNK_LENGTHS, codecs, min_seconds
    )

    workdir = Path(tempfile.mkdtemp(prefix="replaybuf-bench-codecs-"))
    try:
        by_name = {codec.name: codec for codec in codecs + images}
        read_codecs = [by_name[name] for name in ("zstd-1", "zstd-3", "blosc-lz4", "blosc-lz4-9") if name in by_name]
        print("## Random frame reads: file read + numcodecs decode (what a direct sampler pays)\n")
        print("`n-step pair` = frames t and t+5 (one chunk read when both are in it).\n")
        read_rows = random_read_table(frames, read_codecs, samples, workdir, rounds=2 if arguments.quick else 5)
        print(
            markdown_table(
                ["codec", "time chunk", "KiB read/sample", "us/sample", "samples/s/core", "us/n-step pair"], read_rows
            )
        )
        print()
        print("## zarr-python 3 on the same frames (zstd-3): stored ratio, write MB/s, random element read\n")
        print(
            markdown_table(
                ["time chunk", "sharded (1 shard/episode)", "chunk files", "ratio", "write MB/s", "us/read", "reads/s"],
                zarr_rows(frames, max(samples // 4, 100), workdir),
            )
        )
        print()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_recommendation(frame_results, read_rows, vector_results, vectors)
    print(f"\ntemp folder removed: {not os.path.exists(workdir)}")


if __name__ == "__main__":
    main()
