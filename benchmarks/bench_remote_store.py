"""GET latency and concurrent-GET throughput of the stores `open_store` returns, on loopback servers.

Run from the repository root::

    python benchmarks/bench_remote_store.py [--repeats 2] [--latency-ms 0 20] [--skip-s3fs]

Prints, per client (obstore and s3fs on moto's S3, gcsfs on gcp-storage-emulator): the median
latency of one small GET through ``Store.get``, and the time of 256 concurrent small GETs under
in-flight limits 8/16/32/64 next to the concurrency bound (256 / limit x median GET latency).
moto runs in its own process (so it does not share the client's GIL), once as is and once with a
delay per request standing in for a network round trip (``--latency-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zarr.core.buffer import default_buffer_prototype  # noqa: E402
from zarr.core.sync import sync  # noqa: E402
from zarr.storage import FsspecStore  # noqa: E402

from replaybuf.storage._remote import open_store  # noqa: E402
from tests._servers import GCSTestServer, S3TestServer  # noqa: E402

OBJECTS = 256
OBJECT_BYTES = 4096
LIMITS = (8, 16, 32, 64)


def _serve_s3(port_queue: multiprocessing.Queue, latency: float) -> None:
    server = S3TestServer(latency=latency)
    server.start()
    server.create_bucket()
    port_queue.put(server.endpoint_url)
    while True:
        time.sleep(3600)


def _fill(store) -> list[str]:
    prototype = default_buffer_prototype()
    keys = [f"bench/{i}" for i in range(OBJECTS)]
    payload = prototype.buffer.from_bytes(bytes(OBJECT_BYTES))

    async def put_all():
        slots = asyncio.Semaphore(16)

        async def put(key):
            async with slots:
                await store.set(key, payload)

        await asyncio.gather(*(put(key) for key in keys))

    sync(put_all())
    return keys


def _single_get_ms(store, keys: list[str], samples: int = 100) -> float:
    prototype = default_buffer_prototype()
    sync(store.get(keys[0], prototype))
    times = []
    for i in range(samples):
        start = time.perf_counter()
        sync(store.get(keys[i % len(keys)], prototype))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _concurrent_ms(
    store, keys: list[str], limit: int, repeats: int, server: psutil.Process
) -> tuple[float, float, float]:
    """Median wall ms of all GETs at ``limit`` in flight, and client / server CPU ms per GET."""
    prototype = default_buffer_prototype()

    async def get_all():
        slots = asyncio.Semaphore(limit)

        async def get(key):
            async with slots:
                return await store.get(key, prototype)

        return await asyncio.gather(*(get(key) for key in keys))

    sync(get_all())
    times = []
    client_cpu, server_cpu = time.process_time(), sum(server.cpu_times()[:2])
    for _ in range(repeats):
        start = time.perf_counter()
        sync(get_all())
        times.append(time.perf_counter() - start)
    requests = repeats * len(keys)
    client_cpu = (time.process_time() - client_cpu) / requests * 1e3
    server_cpu = (sum(server.cpu_times()[:2]) - server_cpu) / requests * 1e3
    return statistics.median(times) * 1e3, client_cpu, server_cpu


def _report(name: str, store, repeats: int, server_pid: int) -> None:
    server = psutil.Process(server_pid)
    keys = _fill(store)
    latency = _single_get_ms(store, keys)
    print(f"\n{name}: median single GET {latency:.2f} ms ({OBJECT_BYTES} B objects)", flush=True)
    print(
        f"  {'in-flight':>9} {'256 GETs ms':>12} {'bound ms':>9} {'ratio':>6} {'GET/s':>7} "
        f"{'client CPU ms/GET':>18} {'server CPU ms/GET':>18}"
    )
    for limit in LIMITS:
        elapsed, client_cpu, server_cpu = _concurrent_ms(store, keys, limit, repeats, server)
        bound = OBJECTS / limit * latency
        print(
            f"  {limit:>9} {elapsed:>12.1f} {bound:>9.1f} {elapsed / bound:>6.2f} {OBJECTS / elapsed * 1e3:>7.0f} "
            f"{client_cpu:>18.2f} {server_cpu:>18.2f}",
            flush=True,
        )


def _start_s3_process(latency: float) -> tuple[multiprocessing.Process, dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_serve_s3, args=(queue, latency), daemon=True)
    process.start()
    return process, {**S3TestServer().storage_options, "endpoint_url": queue.get(timeout=120)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs="*",
        default=[0.0],
        help="extra delay moto adds to every request (a network round trip)",
    )
    parser.add_argument("--skip-s3fs", action="store_true")
    args = parser.parse_args()

    url = f"s3://{S3TestServer().bucket}/bench"
    for latency_ms in args.latency_ms:
        process, options = _start_s3_process(latency_ms / 1e3)
        try:
            where = f"moto S3 in its own process, +{latency_ms:g} ms per request"
            _report(f"obstore -> {where}", open_store(url, options), args.repeats, process.pid)
            if not args.skip_s3fs:
                _report(
                    f"s3fs -> {where}", FsspecStore.from_url(url, storage_options=options), args.repeats, process.pid
                )
        finally:
            process.terminate()
    gcs = GCSTestServer()
    gcs.start()
    try:
        gcs.create_bucket()
        _report(
            "gcsfs -> gcp-storage-emulator", open_store(gcs.url("bench"), gcs.storage_options), args.repeats, gcs.pid
        )
    finally:
        gcs.stop()


if __name__ == "__main__":
    main()
