"""Every rank joins the group, talks once, closes it, and says what it saw (tests close_distributed)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_fsdp2 import close_distributed
from hf_fsdp2.distributed import init_distributed


def main() -> None:
    init_distributed()
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    close_distributed()
    open_after_close = dist.is_initialized()
    close_distributed()  # a second call (or one without a group) is a no-op
    print(f"rank {os.environ.get('RANK', '0')}: sum {total.item():g}, open after close {open_after_close}", flush=True)


if __name__ == "__main__":
    main()
