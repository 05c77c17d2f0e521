"""Optimizers that read whole matrices, on fully_shard'ed parameters, against their own one-process runs: hf_fsdp2's
Muon against torch.optim.Muon + AdamW, ShardedAdafactor against transformers' Adafactor.

Usage: whole_matrix_worker.py OUT [--save DIR] [--resume DIR]. Every rank also computes the one-process reference itself
(the model is tiny). Gradients are a fixed function of the weights (`synthetic_grads`), elementwise, so every rank
and the reference see the same gradient bits: what is compared is the optimizer alone, and it must be bit-exact.
Scenarios: 1-D mesh (FSDP) and, at 4 ranks, a 2x2 mesh (HSDP). `--save` writes a DCP checkpoint of model and
optimizer after SAVE_AT steps; `--resume` loads one (written at any world size) and runs the remaining steps.
Rank 0 writes OUT/result.json: {scenario: {"max_diff": ...}}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.optim._muon as torch_muon
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.optimization import Adafactor

from hf_fsdp2.optim.adafactor import ShardedAdafactor
from hf_fsdp2.optim.muon import make_shard_exact, orthogonalise
from hf_fsdp2.optim.muon_routing import Muon, _trainer_decay_names
from hf_fsdp2.optim.verdicts import _local_view

STEPS, SAVE_AT = 5, 3
HPARAMS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn=None)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


class Block(nn.Module):
    """33 rows (uneven over 2 and 4 ranks), a norm, a biased Linear and a 3-D stack of 3 experts."""

    def __init__(self, experts_as_list: bool) -> None:
        super().__init__()
        self.up = nn.Linear(24, 33, bias=False)
        self.norm = nn.LayerNorm(33)
        self.down = nn.Linear(33, 24)
        stack = torch.randn(3, 24, 24) * 0.1
        # The reference holds each expert as its own 2-D parameter, which torch.optim.Muon accepts.
        self.experts = nn.ParameterList(list(stack.unbind(0))) if experts_as_list else nn.Parameter(stack)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        experts = torch.stack(list(self.experts)) if isinstance(self.experts, nn.ParameterList) else self.experts
        return h + self.down(torch.tanh(self.norm(self.up(h)))) + torch.einsum("bd,edf->bf", h, experts)


class Net(nn.Module):
    def __init__(self, experts_as_list: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.blocks = nn.ModuleList(Block(experts_as_list) for _ in range(2))
        self.lm_head = nn.Linear(24, 50, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def synthetic_grads(model: nn.Module, step: int) -> None:
    """Set every gradient to an elementwise function of the weight (the same bits sharded or whole)."""
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        value = torch.sin(local.detach() * 7 + step) * 0.5 + 0.1 * step
        if isinstance(param, DTensor):  # uneven row blocks: the global shape must be given
            value = DTensor.from_local(
                value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        param.grad = value


@contextlib.contextmanager
def torch_newton_schulz_in_fp32() -> Iterator[None]:
    """torch.optim.Muon's Newton–Schulz in fp32 instead of its bf16 (torch has no option for it: patched)."""
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = lambda grad, ns, steps, eps: orthogonalise(grad, ns, steps, eps, "float32")
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


def reference(steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the hidden matrices and experts, torch.optim.AdamW on the rest, one process."""
    torch.manual_seed(0)
    model = Net(experts_as_list=True)
    matrices = [p for n, p in model.named_parameters() if ("up" in n or "down" in n or "experts" in n) and p.ndim == 2]
    optimizers = [torch.optim.Muon(matrices, **HPARAMS), adamw(model, matrices)]
    for step in range(steps):
        synthetic_grads(model, step)
        for optimizer in optimizers:
            optimizer.step()
    state = {}
    for name, param in model.named_parameters():
        key = name.rsplit(".", 1)[0] if ".experts." in name else name
        state.setdefault(key, []).append(param.detach().clone())
    return {k: torch.stack(v) if k.endswith("experts") else v[0] for k, v in state.items()}


def adafactor(mesh: dist.DeviceMesh | None) -> float | nn.Module:
    """transformers' Adafactor (as Trainer's optim='adafactor' builds it) in one process, or ShardedAdafactor."""
    torch.manual_seed(0)
    model = Net()
    if mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    cls = ShardedAdafactor if mesh is not None else Adafactor
    optimizer = cls(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False, weight_decay=0.01)
    run(0, STEPS, model, optimizer)
    return model


def owned_per_rank(mesh: dist.DeviceMesh) -> list[int]:
    """How many split matrices each rank orthogonalised as owner in one step (NOTE: collective)."""
    model, optimizer = sharded(mesh)
    run(0, 1, model, optimizer)
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, optimizer.owned_last_step)
    return counts


def owner_failure(mesh: dist.DeviceMesh) -> str:
    """Newton–Schulz raising on rank 1 only: every rank must raise, none may wait for the others forever."""
    import hf_fsdp2.optim.muon as muon

    model, optimizer = sharded(mesh)
    original = muon.orthogonalise
    if dist.get_rank() == 1:
        muon.orthogonalise = lambda *args: (_ for _ in ()).throw(FloatingPointError("injected on rank 1"))
    try:
        run(0, 1, model, optimizer)
    except RuntimeError as error:
        return str(error)
    finally:
        muon.orthogonalise = original
    return "no error"


def sharded(mesh: dist.DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model (same seed) under fully_shard, each block its own unit, and hf_fsdp2's routed Muon."""
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    muon = {k: v for k, v in HPARAMS.items()}
    optimizer = Muon()(model, **muon, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"])
    return model, optimizer


def torch_optimizers(mesh: dist.DeviceMesh, shard_exact: bool) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The reference's own optimizers (torch.optim.Muon + AdamW) over the sharded reference model; torch's Muon
    steps the DTensors as they are unless `shard_exact` makes it hf_fsdp2's owner-based step."""
    torch.manual_seed(0)
    model = Net(experts_as_list=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    matrices = [p for n, p in model.named_parameters() if ("up" in n or "down" in n or "experts" in n) and p.ndim == 2]
    muon = torch.optim.Muon(matrices, **HPARAMS)
    return model, [make_shard_exact(muon) if shard_exact else muon, adamw(model, matrices)]


def adamw(model: nn.Module, matrices: list[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW on the parameters that are not `matrices`, without weight decay on norms and biases (Trainer's rule)."""
    decay = _trainer_decay_names(model)
    others = [(n, p) for n, p in model.named_parameters() if all(p is not m for m in matrices)]
    groups = [
        {"params": [p for n, p in others if n in decay]},
        {"params": [p for n, p in others if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **ADAMW)


def run(start: int, steps: int, model: nn.Module, *optimizers: torch.optim.Optimizer, rows_only: bool = False) -> None:
    """`rows_only`: the first optimizer (torch's Muon) steps each rank's local rows as if they were whole matrices."""
    for step in range(start, steps):
        synthetic_grads(model, step)
        for index, optimizer in enumerate(optimizers):
            with _local_view(optimizer) if rows_only and index == 0 else contextlib.nullcontext():
                optimizer.step()


def torch_muon_controls(mesh: dist.DeviceMesh, expected: dict[str, torch.Tensor]) -> dict[str, dict]:
    """torch.optim.Muon on the shards three ways, each against its one-process run (NOTE: collective).

    On DTensors (torch's own path) the math is right: its Newton–Schulz matmuls reduce partial products across
    ranks, in another order than one process, so only rounding separates them (bf16 rounding with torch's default,
    fp32 rounding with Newton–Schulz in fp32). Each rank orthogonalising its own rows alone is wrong math: the
    negative control, far off. hf_fsdp2's owner-based step is bit-equal.
    """
    results = {}
    for name, exact, rows_only in (("dtensor_bf16", False, False), ("rows_only", False, True), ("ours", True, False)):
        model, optimizers = torch_optimizers(mesh, exact)
        run(0, STEPS, model, *optimizers, rows_only=rows_only)
        results[name] = {"max_diff": max_diff(model, expected), "class": type(optimizers[0]).__name__}
    with torch_newton_schulz_in_fp32():
        fp32_reference = reference(STEPS)
        model, optimizers = torch_optimizers(mesh, False)
        run(0, STEPS, model, *optimizers)
        results["dtensor_fp32"] = {"max_diff": max_diff(model, fp32_reference)}
    first = reference(1)  # how far one step moves any weight: the scale the drifts are judged against
    results["one_step"] = max((first[k] - v).abs().max().item() for k, v in reference(0).items())
    return results


def max_diff(model: nn.Module, expected: dict[str, torch.Tensor]) -> float:
    """Largest difference of any gathered weight from the reference (NOTE: collective)."""
    worst = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        key = name.rsplit(".", 1)[0] if ".experts." in name else name
        value = expected[key][int(name.rsplit(".", 1)[1])] if key != name else expected[name]
        worst = max(worst, (full.detach() - value).abs().max().item())
    return worst


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    meshes = {"fsdp": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    expected, results = reference(STEPS), {}
    groups = [len(g["params"]) for g in sharded(meshes["fsdp"])[1].param_groups]
    results["groups"] = groups  # [Muon's, AdamW's decayed, AdamW's not]
    for name, mesh in meshes.items():
        model, optimizer = sharded(mesh)
        run(0, STEPS, model, optimizer)
        results[name] = {"max_diff": max_diff(model, expected)}
    results["owned"] = owned_per_rank(meshes["fsdp"])
    results["owner_failure"] = owner_failure(meshes["fsdp"])
    whole_adafactor = {n: p.detach().clone() for n, p in adafactor(None).named_parameters()}
    for name, mesh in meshes.items():
        results[f"adafactor_{name}"] = {"max_diff": max_diff(adafactor(mesh), whole_adafactor)}
    results["torch_muon"] = torch_muon_controls(meshes["fsdp"], expected)
    if "--save" in args:
        model, optimizer = sharded(meshes["fsdp"])
        run(0, SAVE_AT, model, optimizer)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=args[args.index("--save") + 1])
    if "--resume" in args:
        model, optimizer = sharded(meshes["fsdp"])
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=args[args.index("--resume") + 1])
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        momentum = [k for k in optimizer.state.values() if "momentum_buffer" in k]
        results["resumed_momentum_is_dtensor"] = all(isinstance(s["momentum_buffer"], DTensor) for s in momentum)
        run(SAVE_AT, STEPS, model, optimizer)
        results["resume"] = {"max_diff": max_diff(model, expected)}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
