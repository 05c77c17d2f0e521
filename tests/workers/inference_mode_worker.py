"""Plain `fully_shard`ed modules called under torch.inference_mode(), with and without hf_fsdp2's switch.

Usage: inference_mode_worker.py OUT; rank 0 writes OUT/{WORLD}.json. Each scenario builds a fresh two-layer model
whose first forward ever runs under inference mode (as TRL's reward models' does), then trains one step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hf_fsdp2 import gathered
from hf_fsdp2.distributed import init_distributed
from hf_fsdp2.sharding.inference_mode import allow_inference_mode
from tests.workers.scenarios import run_scenarios

OUT = sys.argv[1]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
INPUTS = torch.arange(24, dtype=torch.float32).reshape(3, 8) / 24


def model(switch: bool, bf16: bool = False, compiled: bool = False) -> tuple[nn.Module, nn.Module]:
    """A sharded model (units + root, as sharding.shard_model does) and its unsharded twin (same weights); `compiled`:
    both units compiled before sharding, as FSDP2Config(compile=True) compiles (dynamo's eager backend: tracing is
    what is checked)."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sharded = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sharded.load_state_dict(whole.state_dict())
    if compiled:
        sharded[0].compile(backend="eager")
        sharded.compile(backend="eager")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    fully_shard(sharded[0], mp_policy=policy)
    fully_shard(sharded, mp_policy=policy)
    if switch:
        allow_inference_mode(sharded)
    return sharded, whole


def first_forward_in_inference_mode(switch: bool, bf16: bool = False, compiled: bool = False) -> dict[str, Any]:
    """Score twice under inference mode (inputs made there too), then one training forward and backward."""
    sharded, whole = model(switch, bf16, compiled)
    result: dict[str, Any] = {}
    try:
        with torch.inference_mode():
            inputs = INPUTS.clone()  # an inference tensor, as TRL's tokenized reward inputs are
            scores = [sharded(inputs), sharded(inputs)]
            result["still_inference_mode"] = torch.is_inference_mode_enabled()
        expected = whole(INPUTS)
        result["max_diff"] = max(float((s.float() - expected).abs().max()) for s in scores)
        sharded(INPUTS).sum().backward()
        result["grad_norm"] = float(sum(p.grad.full_tensor().norm() ** 2 for p in sharded.parameters()) ** 0.5)
        whole(INPUTS).sum().backward()
        result["expected_grad_norm"] = float(sum(p.grad.norm() ** 2 for p in whole.parameters()) ** 0.5)
    except RuntimeError as error:
        result["error"] = str(error).splitlines()[0]
    return result


def compiled_in_inference_mode() -> dict[str, Any]:
    """Compiled units with the switch: the same scores and training, and dynamo's graph breaks over all of it."""
    from torch._dynamo.utils import counters

    counters.clear()
    result = first_forward_in_inference_mode(switch=True, compiled=True)
    return {**result, "graph_breaks": {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}}


def gathered_in_inference_mode() -> dict[str, Any]:
    """`hf_fsdp2.gathered` entered under inference mode, then a training step."""
    sharded, whole = model(switch=True)
    with torch.inference_mode(), gathered(sharded):
        score = sharded(INPUTS)
    sharded(INPUTS).sum().backward()
    return {"max_diff": float((score - whole(INPUTS)).abs().max()), "trained": sharded[0].weight.grad is not None}


SCENARIOS = {
    "without_switch": lambda: first_forward_in_inference_mode(switch=False),
    "with_switch": lambda: first_forward_in_inference_mode(switch=True),
    "with_switch_bf16": lambda: first_forward_in_inference_mode(switch=True, bf16=True),
    "compiled": compiled_in_inference_mode,
    "gathered": gathered_in_inference_mode,
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    init_distributed()
    run_scenarios(SCENARIOS, [], os.path.join(OUT, f"{WORLD}.json"))
