"""SliceReader: torch DCP's Hugging Face safetensors reader, reading each rank's rows with positioned
reads straight into its shard.

torch's reader slices through a memory map, and every page it touches counts in the process's resident
memory until the file is closed; with the slice copy on top, a rank peaked at ~1.2x the model size
(measured: scripts/measure/measure_load_memory.py). Reading the bytes of a row range with `os.preadv` into the
destination keeps the peak at the shard plus at most one tensor's slice. It keeps torch's metadata and
planning; it knows nothing about models.

Rows that need converting (a bf16 checkpoint into fp32 masters, or rows bound for an accelerator) go through one
reused host buffer of at most STAGING_BYTES (pinned for an accelerator), a chunk of rows at a time.

NOTE: re-measured against the libraries (scripts/measure/measure_load_memory.py, 2 CPU ranks, 110M Llama,
torch 2.13, safetensors 0.8; two runs each): this reader 226 MiB = 0.54x per rank; torch's reader
unchanged 492/513 MiB = 1.18x/1.23x; safetensors' `safe_open(..., backend="pread")` with
`get_slice(name)[rows]` copied into the shard loads the same weights but peaks at 249 MiB = 0.60x, because
each slice is a new tensor and glibc keeps the freed ~23 MiB embedding/lm_head slice in its heap (0.55x
with MALLOC_MMAP_THRESHOLD_ pinned). safetensors cannot read into a given buffer, so this reader stays.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_HEADER_LEN_BYTES = 8
STAGING_BYTES = 16 << 20  # rows read at once when they need converting: small, and faulted in once per read


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """Return a safetensors file's JSON header and the offset where tensor data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(_HEADER_LEN_BYTES))
        header = json.loads(f.read(length))
    return header, _HEADER_LEN_BYTES + length


def rows_are_contiguous(shape: torch.Size, offsets: torch.Size, lengths: torch.Size) -> bool:
    """True when the requested block is a range of whole rows (FSDP2's dim-0 shards always are)."""
    return all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True))


def pread_into(fd: int, buffer: torch.Tensor, offset: int) -> None:
    """Fill a contiguous CPU tensor with the file's bytes at `offset`."""
    view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}: the safetensors file is truncated")
        done += count


class SliceReader(HuggingFaceStorageReader):
    """Load planner items from safetensors files with positioned reads instead of a memory map.

    One reader may serve several `dcp.load` calls (loading reads NF4 weights one at a time): it parses the
    files' headers once, not once per call and file (2 ms per call for the benchmark's one-file 100M Llama).
    """

    def read_metadata(self) -> Metadata:
        """The checkpoint's tensors, from the files' headers parsed on the first call only."""
        if getattr(self, "_metadata", None) is None:
            self._metadata = super().read_metadata()
        return self._metadata

    def _header(self, path: str) -> tuple[dict[str, Any], int]:
        """`read_header(path)`, parsed once per reader and file."""
        headers = self.__dict__.setdefault("_headers", {})
        if path not in headers:
            headers[path] = read_header(path)
        return headers[path]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for path, items in per_file.items():
            header, data_start = self._header(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                for item in items:
                    self._read_item(fd, header, data_start, item, planner)
            finally:
                os.close(fd)
        self._staging_buffer = None
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(
        self, fd: int, header: dict[str, Any], data_start: int, item: ReadItem, planner: LoadPlanner
    ) -> None:
        """Copy one planned block of one tensor into its destination."""
        info = self.storage_data[item.storage_index]
        entry = header[item.storage_index.fqn]
        shape = torch.Size(entry["shape"])
        target = planner.resolve_tensor(item).detach()
        if not rows_are_contiguous(shape, item.storage_offsets, item.lengths):
            # Not a row range: fall back to torch's memory-mapped slicing for this block.
            from safetensors import safe_open

            with safe_open(info.relative_path, framework="pt") as f:
                slices = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
                target.copy_(f.get_slice(item.storage_index.fqn)[slices])
        else:
            row_bytes = math.prod(shape[1:]) * info.dtype.itemsize
            offset = data_start + entry["data_offsets"][0] + (item.storage_offsets[0] if shape else 0) * row_bytes
            if target.device.type == "cpu" and target.dtype == info.dtype and target.is_contiguous():
                pread_into(fd, target, offset)
            else:
                self._read_staged(fd, target, offset, info.dtype)
        planner.commit_tensor(item, target)

    def _read_staged(self, fd: int, target: torch.Tensor, offset: int, dtype: torch.dtype) -> None:
        """Read whole rows into one reused host buffer, a chunk at a time, and copy each chunk into `target`
        (another dtype, such as a bf16 checkpoint into fp32 masters, or another device).

        NOTE: a new buffer per tensor was faulted in page by page every time (the kernel zeroes each fresh page)
        and held a whole slice at once; this one is faulted in once per read and holds at most STAGING_BYTES.
        """
        rows = target.reshape(1, -1) if target.dim() == 0 else target
        row_numel = math.prod(rows.shape[1:])
        per_chunk = max(1, STAGING_BYTES // max(1, row_numel * dtype.itemsize))
        for start in range(0, rows.shape[0], per_chunk):
            count = min(per_chunk, rows.shape[0] - start)
            chunk = self._staging(count * row_numel * dtype.itemsize, target.device).view(dtype)
            pread_into(fd, chunk, offset + start * row_numel * dtype.itemsize)
            rows[start : start + count].copy_(chunk.view(count, *rows.shape[1:]))

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first `nbytes` of this reader's host buffer, grown when a single row needs more (pinned when
        the rows go to an accelerator, so each copy is a direct transfer)."""
        buffer: torch.Tensor | None = getattr(self, "_staging_buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, STAGING_BYTES)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=device.type != "cpu")
            self._staging_buffer = buffer
        return buffer[:nbytes]
