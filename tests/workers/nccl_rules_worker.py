"""What CPU offload puts in collectives, on a default group that refuses CPU tensors as NCCL does (test_meshes.py).

The default group is gloo registered for CUDA only (`cuda:gloo`): like the NCCL-only group Accelerate starts on N
GPUs, it fails a CPU tensor with "No backend type associated with device type cpu". On these CPU ranks every tensor
is a CPU tensor, as offloaded gradients are on a GPU machine; so each path below is one that offload hands CPU
tensors: FSDP2's own collectives, the grad norm, Muon's exchange, Adafactor's statistics, the scalar-gradient hook,
HSDP's two groups and the sequence-parallel group. The control shards on torch's plain mesh over the same group.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_fsdp2.meshes import build_mesh
from hf_fsdp2.model import clip_grad_norm
from hf_fsdp2.sharding.units import reduce_scalar_gradients


def pair() -> nn.Module:
    """The same two layers on every rank, and a whole 0-dim scale outside FSDP (as CLIP's logit_scale)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Tanh(), nn.Linear(40, 24, bias=False))
    model.scale = nn.Parameter(torch.tensor(1.5))
    return model


def backward(model: nn.Module) -> None:
    """One backward on the same rows on every rank, so averaged gradients equal one process's."""
    torch.manual_seed(1)
    (model(torch.randn(6, 24)) * model.scale).square().mean().backward()


def sharded(mesh: DeviceMesh) -> nn.Module:
    """`pair()` sharded per layer and at the root, the scale left whole and averaged by hf_fsdp2's hook."""
    model = pair()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.scale})
    reduce_scalar_gradients(model)
    return model


def control() -> dict:
    """torch's plain mesh over the default group: FSDP2's first all-gather gets CPU tensors and must fail."""
    model = sharded(init_device_mesh("cpu", (dist.get_world_size(),)))
    backward(model)
    return {}


def grad_norm_and_clip() -> dict:
    """The grad norm and clipping over hf_fsdp2's mesh, against one process's norm of the same gradients."""
    model, reference = sharded(build_mesh()), pair()
    backward(model)
    backward(reference)
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.01)
    total = clip_grad_norm(list(model.parameters()), 0.01)
    clipped = torch.cat([p.grad.full_tensor().flatten() for p in (model[0].weight, model[2].weight)])
    wanted = torch.cat([reference[0].weight.grad.flatten(), reference[2].weight.grad.flatten()])
    return {
        "norm": float(total),
        "norm_error": abs(float(total) - float(expected)),
        "clipped_error": float((clipped - wanted).abs().max()),
        "scale_grad_error": abs(float(model.scale.grad) - float(reference.scale.grad)),
    }


def muon_step() -> dict:
    """MuonAdamW's gather/scatter of whole matrices on their owner, over hf_fsdp2's mesh."""
    from hf_fsdp2.optim.muon import MuonAdamW

    model = sharded(build_mesh())
    backward(model)
    matrices = [model[0].weight, model[2].weight]
    optimizer = MuonAdamW([{"params": matrices, "use_muon": True}, {"params": [model.scale], "use_muon": False}])
    optimizer.step()
    return {"owned": optimizer.owned_last_step}


def adafactor_step() -> dict:
    """transformers' Adafactor made exact on shards: its statistics summed over hf_fsdp2's shard group."""
    from transformers.optimization import Adafactor

    from hf_fsdp2.optim.adafactor import make_adafactor_exact

    model = sharded(build_mesh())
    backward(model)
    optimizer = Adafactor([model[0].weight, model[2].weight], lr=1e-2, relative_step=False)
    make_adafactor_exact(optimizer)
    optimizer.step()
    return {"weight_sum": float(model[0].weight.full_tensor().sum())}


def hsdp_groups() -> dict:
    """HSDP's (replicate, shard) mesh: both of its groups carry CPU tensors."""
    mesh = build_mesh(replicate_size=dist.get_world_size())
    model = sharded(mesh)
    backward(model)
    return {"norm": float(clip_grad_norm(list(model.parameters()), float("inf")))}


def sequence_group() -> dict:
    """The sequence-parallel group: a row gathered from every member and sliced."""
    from hf_fsdp2.long_rows.sequence_parallel import SequenceParallel

    world = dist.get_world_size()
    ids = torch.arange(4 * world).reshape(1, -1)
    inputs = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1])[None]}
    parts = list(SequenceParallel(world, "sdpa").parts(inputs, ids.numel()))
    return {"parts": len(parts)}


CASES: dict[str, Callable[[], dict]] = {
    "control": control, "grad_norm_and_clip": grad_norm_and_clip, "muon_step": muon_step,
    "adafactor_step": adafactor_step, "hsdp_groups": hsdp_groups, "sequence_group": sequence_group,
}  # fmt: skip


def main() -> None:
    out = sys.argv[1]
    # NOTE: the stand-in for Accelerate's NCCL-only group: registered for CUDA tensors, none for the CPU.
    dist.init_process_group("cuda:gloo")
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = {"outcome": "ok", **case()}
        except Exception as error:  # noqa: BLE001 - each case's outcome is the result
            if name != "control":
                traceback.print_exc()
            results[name] = {"outcome": f"{type(error).__name__}: {error}"[:400]}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
