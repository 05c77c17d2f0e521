"""The direct writer: exact bytes across staging-buffer boundaries, with and without O_DIRECT, and errors of its
background writes raised to the caller."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from hf_fsdp2.checkpoints import direct_io
from hf_fsdp2.checkpoints.direct_io import BLOCK, DirectFileWriter

# Sizes around the block and the chunk (two blocks here), an empty write, and one spanning many chunks.
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 3, 7, 5 * BLOCK + 11, 3]


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make opening with O_DIRECT fail as it does on tmpfs."""
    real_open = os.open

    def fake_open(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", fake_open)


def write_pieces(path: str) -> bytes:
    """Write SIZES random pieces through a writer with 2-block buffers; return what should be in the file."""
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in SIZES]
    writer = DirectFileWriter(path, chunk_bytes=2 * BLOCK)
    for piece in pieces:
        writer.write(piece)
    writer.close()
    return b"".join(piece.numpy().tobytes() for piece in pieces)


@pytest.mark.parametrize("o_direct", [True, False])
def test_file_holds_exactly_the_bytes_written(tmp_path, monkeypatch, o_direct):
    if not o_direct:
        refuse_o_direct(monkeypatch)
    path = str(tmp_path / "out.bin")
    expected = write_pieces(path)
    with open(path, "rb") as f:
        assert f.read() == expected  # the padded O_DIRECT tail is cut back to the exact length
    assert os.path.getsize(path) == sum(SIZES)


def test_o_direct_is_asked_for_and_reported_truthfully(tmp_path, monkeypatch):
    import fcntl

    probe = str(tmp_path / "probe")
    fd, direct = direct_io.open_for_append(probe)
    flag = getattr(os, "O_DIRECT", 0)
    assert bool(fcntl.fcntl(fd, fcntl.F_GETFL) & flag) == direct  # the filesystem decides; the answer is true
    os.close(fd)
    refuse_o_direct(monkeypatch)
    fd, refused = direct_io.open_for_append(probe)
    os.close(fd)
    assert refused is False


def test_a_failed_background_write_is_raised_and_the_file_closed(tmp_path, monkeypatch):
    def full_disk(fd: int, data: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "pwrite_all", full_disk)
    writer = DirectFileWriter(str(tmp_path / "out.bin"), chunk_bytes=BLOCK)
    with pytest.raises(OSError, match="No space left"):
        writer.write(torch.zeros(5 * BLOCK, dtype=torch.uint8))  # the third hand-over waits on the first write
        writer.close()
    assert writer.fd == -1


def test_chunk_size_must_keep_o_direct_alignment(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        DirectFileWriter(str(tmp_path / "out.bin"), chunk_bytes=1000)


def test_stream_takes_every_bytes_like_object_and_tells_its_offset(tmp_path):
    """DCP writes bytes, memoryviews and pickles through the stream and records offsets from tell()."""
    import pickle

    from hf_fsdp2.checkpoints.direct_io import DirectStream

    path = str(tmp_path / "stream.bin")
    stream = DirectStream(path)
    pieces = [b"header", bytearray(b"x" * 5000), memoryview(b"read-only view"), torch.arange(7, dtype=torch.int64)]
    offsets = []
    for piece in pieces:
        offsets.append(stream.tell())
        stream.write(piece)
    offsets.append(stream.tell())
    pickle.dump({"k": [1, 2]}, stream)
    end = stream.tell()
    stream.close()
    stream.close()  # DCP closes inside its `with`, the context manager again after it
    data = open(path, "rb").read()
    assert len(data) == end and data[offsets[0] : offsets[1]] == b"header"
    assert data[offsets[3] : offsets[4]] == torch.arange(7, dtype=torch.int64).numpy().tobytes()
    assert pickle.loads(data[offsets[4] :]) == {"k": [1, 2]}


def test_o_direct_writes_refused_after_opening_go_on_through_the_cache(tmp_path, monkeypatch):
    """A filesystem that opens with O_DIRECT but refuses its writes (some FUSE mounts) still gets every byte."""
    import fcntl

    real = direct_io.pwrite_all

    def refuse_direct(fd: int, data: memoryview, offset: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(direct_io, "pwrite_all", refuse_direct)
    path = str(tmp_path / "out.bin")
    expected = write_pieces(path)
    with open(path, "rb") as f:
        assert f.read() == expected
