"""What reading weights out of the page cache costs on this machine, and what leaving them memory-mapped defers.

Reads SIZE bytes of a file (cached: read once first) six ways, in one process, and prints seconds per way:
  pread into fresh memory        what loading into new shards does (the kernel faults in every page)
  pread into faulted-in memory   the same bytes into pages already touched: the copy alone
  fault in fresh memory          touching new pages, no copy (the fault cost alone)
  map, read, then write          a private memory map (transformers' native loading): reading it faults the
                                 page cache's pages in; the first write copies each page (copy-on-write), as the
                                 first optimizer step does
  pread into fresh huge pages    fresh memory advised MADV_HUGEPAGE (transparent huge pages, where the kernel
                                 offers them): one fault per 2 MiB; the first run in a process is printed apart,
                                 as a loading rank would only ever have that one
The README's Performance section quotes these figures for the load-time gap against transformers' native FSDP2.

Usage:
    python scripts/measure/measure_page_faults.py [--mib 800] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def _pread(fd: int, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], done)


def ways(path: str, nbytes: int) -> dict[str, Callable[[], float]]:
    """Each way to get the file's bytes into memory, as a function returning its seconds."""

    def timed(prepare: Callable[[], object], work: Callable[[object], object]) -> Callable[[], float]:
        def run() -> float:
            state = prepare()
            start = time.perf_counter()
            work(state)
            return time.perf_counter() - start

        return run

    fd = os.open(path, os.O_RDONLY)
    fresh = lambda: torch.empty(nbytes, dtype=torch.uint8)  # noqa: E731
    return {
        "pread into fresh memory": timed(fresh, lambda b: _pread(fd, b)),
        "pread into faulted-in memory": timed(lambda: fresh().fill_(1), lambda b: _pread(fd, b)),
        "fault in fresh memory": timed(fresh, lambda b: b.fill_(1)),
        "map, read (page cache pages)": timed(lambda: _mapped(path, nbytes), _read),
        "map, then first write (copy-on-write)": timed(lambda: _touched(path, nbytes), lambda m: m.add_(1)),
        "pread into fresh huge pages": timed(lambda: _huge(fresh()), lambda b: _pread(fd, b)),
    }


def _huge(buffer: torch.Tensor) -> torch.Tensor:
    """Advise the buffer's untouched pages to be backed by transparent huge pages (Linux; else left as it is)."""
    libc = ctypes.CDLL(None, use_errno=True)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(libc, "madvise"):
        return buffer
    page = mmap.PAGESIZE
    start = -(-buffer.data_ptr() // page) * page
    end = (buffer.data_ptr() + buffer.numel()) // page * page
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)
    return buffer


def _mapped(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=nbytes)  # MAP_PRIVATE
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


def _touched(path: str, nbytes: int) -> torch.Tensor:
    mapped = _mapped(path, nbytes)
    _read(mapped)  # read-faulted first, as the benchmark's touch does before the first step
    return mapped


def _read(mapped: torch.Tensor) -> None:
    """Read every byte (as float32: a fast reduction; the values do not matter)."""
    mapped.view(torch.float32).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as in the benchmark
    nbytes = args.mib << 20
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as file:
        file.write(os.urandom(1 << 20) * args.mib)
        file.flush()
        with open(file.name, "rb") as f:
            while f.read(1 << 24):  # into the page cache
                pass
        seconds = {name: [run() for _ in range(args.repeats)] for name, run in ways(file.name, nbytes).items()}
    print(f"{args.mib} MiB from the page cache, one thread, {args.repeats} runs: median s (min-max), first run")
    for name, values in seconds.items():
        print(f"  {name:40s} {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}), {values[0]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "seconds": seconds}, f, indent=2)


if __name__ == "__main__":
    main()
