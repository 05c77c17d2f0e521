"""The CPU comm buffer pool: a buffer is handed out again only once nothing else holds it, and training with
the pooled comms is bitwise the training with FSDP2's own."""

from __future__ import annotations

import torch

from hf_fsdp2.sharding.comm_buffers import BufferPool
from tests.launch import load_result, run

CPU = torch.device("cpu")


def test_a_dropped_buffer_is_handed_out_again():
    pool = BufferPool()
    first = pool.get(1024, torch.float32, CPU)
    pointer = first.data_ptr()
    del first
    assert pool.get(1024, torch.float32, CPU).data_ptr() == pointer
    assert pool.count() == 1


def test_a_buffer_still_held_through_a_view_is_not_handed_out():
    pool = BufferPool()
    view = pool.get(1024, torch.float32, CPU).view(2, 512)[1]
    second = pool.get(1024, torch.float32, CPU)
    assert second.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert pool.count() == 2


def test_shapes_and_dtypes_get_their_own_buffers():
    pool = BufferPool()
    pool.get(1024, torch.float32, CPU)
    assert not pool.holds(1024, torch.bfloat16, CPU) and not pool.holds(512, torch.float32, CPU)
    assert pool.get(1024, torch.bfloat16, CPU).dtype == torch.bfloat16
    assert pool.holds(1024, torch.float32, CPU) and pool.count() == 2


def test_pooled_comms_train_bitwise_like_fsdp2s_own_and_stop_allocating(tmp_path):
    run("comm_buffers_worker.py", 2, str(tmp_path))
    result = load_result(str(tmp_path))
    assert result["pooled"] == result["default"]
    assert result["same_weights"]
    # Every buffer the pool will ever need exists after the first step; later steps only reuse them.
    assert result["held"][0] > 0
    assert result["held"] == [result["held"][0]] * len(result["held"])
