"""Rank 0 alone consolidates a checkpoint while the job's group is up (tests/test_consolidate.py).

Usage: consolidate_one_rank_worker.py CHECKPOINT OUTPUT. Offline consolidation is one process's work; called by one
rank of a running job, it must not wait in a collective the other ranks never join (it did: its disk-space check).
"""

import sys

import torch.distributed as dist

from hf_fsdp2 import consolidate
from hf_fsdp2.distributed import init_distributed

init_distributed()
if dist.get_rank() == 0:
    consolidate(sys.argv[1], sys.argv[2])
dist.barrier()
