"""SliceReader reads rows that need converting (another dtype or device) through one small reused buffer:
the values are exactly the cast of the file's, whatever the chunking."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import hf_fsdp2.loading.safetensors_reader as reader


@pytest.mark.parametrize("staging_bytes", [24, 1 << 20])  # several chunks, rows wider than the buffer; one chunk
def test_converted_reads_are_exact_casts_through_a_bounded_buffer(tmp_path, monkeypatch, staging_bytes):
    monkeypatch.setattr(reader, "STAGING_BYTES", staging_bytes)
    generator = torch.Generator().manual_seed(0)
    stored = {
        "matrix": torch.randn(37, 19, generator=generator).bfloat16(),  # a 38-byte row: wider than 24 bytes
        "vector": torch.randn(11, generator=generator).half(),
        "scalar": torch.tensor(3.5).bfloat16(),
        "same_dtype": torch.randn(5, 3, generator=generator),  # read straight into its destination
    }
    save_file(stored, str(tmp_path / "model.safetensors"))
    targets = {
        "matrix": torch.empty(37, 19),
        "vector": torch.empty(11, dtype=torch.float64),
        "scalar": torch.empty(()),
        "same_dtype": torch.empty(5, 3),
    }
    seen: list[int] = []
    staging = reader.SliceReader._staging
    monkeypatch.setattr(reader.SliceReader, "_staging", lambda self, n, d: seen.append(n) or staging(self, n, d))
    dcp.load(targets, storage_reader=reader.SliceReader(str(tmp_path)), no_dist=True)
    for name, value in stored.items():
        assert torch.equal(targets[name], value.to(targets[name].dtype)), name
    assert max(seen) <= max(staging_bytes, 19 * 2)  # a chunk of rows, or one row when a row is wider
    # 24 bytes: the matrix one row per read (37), the vector and the scalar one read each; else one per tensor
    assert len(seen) == (37 + 2 if staging_bytes == 24 else 3)
