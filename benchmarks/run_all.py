"""Run every benchmark in sequence: codecs, write, sample.

Run: python benchmarks/run_all.py [--quick] [--backends zarr memmap] [--frame-chunks 4 16]

Each script prints its own command, machine info and markdown tables; paste them into
benchmarks/RESULTS.md. Extra flags are passed on to the write and sample benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("bench_codecs.py", "bench_write.py", "bench_sample.py")


def main() -> int:
    flags = sys.argv[1:]
    quick = ["--quick"] if "--quick" in flags else []
    start = time.perf_counter()
    for script in SCRIPTS:
        arguments = quick if script == "bench_codecs.py" else flags
        command = [sys.executable, str(HERE / script), *arguments]
        print(f"\n$ {' '.join(command)}\n", flush=True)
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            print(f"{script} exited with {result.returncode}")
            return result.returncode
    print(f"\nall benchmarks: {time.perf_counter() - start:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
