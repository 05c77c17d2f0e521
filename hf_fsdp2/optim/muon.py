"""Muon on FSDP2 shards: each matrix orthogonalised whole, once per step, by the rank that owns it.

Muon's step is elementwise except for the Newton–Schulz orthogonalisation of the whole update matrix (and the
learning-rate scale that reads the whole matrix's shape). Momentum runs on each rank's rows; each matrix's rows are
gathered on one owner rank of its shard group (owners balanced by size), orthogonalised there, and scattered back.
MoE expert stacks (3-D, sharded by experts) hold whole experts on every rank and are orthogonalised in place,
batched over experts. torch.optim.Muon on the DTensors computes the same math, but every rank runs every matrix's
Newton–Schulz, as DTensor matmuls whose partial products are reduced across ranks (bf16 rounding then differs from
one process: 1.3e-3 on the weights after 5 steps at 2 ranks, 6e-8 with Newton–Schulz in fp32; tests/test_muon.py).
Here each matrix's Newton–Schulz runs once, on one rank, bit-equal to one process. This module knows DTensors and
process groups, not models or the Trainer (`muon_routing` builds the groups from a model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adam import adam

from ..distributed import agree
from .row_shards import local_part, row_shard_group
from .twins import adopt_twin

# torch.optim.Muon's defaults (Keller Jordan's coefficients); `test_muon` checks they still are torch's.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NS_DTYPES = ("bfloat16", "float32")


def orthogonalise(
    update: torch.Tensor, coefficients: tuple[float, ...], steps: int, eps: float, dtype: str = "bfloat16"
) -> torch.Tensor:
    """Newton–Schulz of a matrix (or a stack of them, batched), the same arithmetic as torch.optim.Muon.

    Runs and returns in `dtype`: bf16 as torch does (the caller adds it to fp32 weights, exactly, as torch does);
    "float32" where runs must agree across world sizes (bf16 rounds apart gradients that differ in their last fp32
    bit, and Newton–Schulz amplifies that to 1e-3 on weights within a few steps, measured at 2 ranks).
    """
    a, b, c = coefficients
    x = update.to(getattr(torch, dtype))
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        # NOTE: the same ops in the same order as torch's 2-D path, so a matrix here is bit-equal to one there.
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.div(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Scale the learning rate by the whole matrix's shape (never a shard's), as torch.optim.Muon does."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is not one of {ADJUST_LR_FNS}")


def _shard_group(param: torch.Tensor) -> tuple[dist.ProcessGroup, int] | None:
    """The process group a matrix's rows are split over (and this rank's place in it); None when whole here.

    Raises:
        ValueError: for a placement other than rows (Shard(0)), which this owner exchange does not cover.
    """
    found = row_shard_group(
        param,
        "Muon",
        "it orthogonalises matrices split by rows (FSDP2's default Shard(0)). Drop shard_placement_fn for Muon's "
        "parameters.",
    )
    if found is None:
        return None
    group, mesh_dim = found
    return group, param.device_mesh.get_local_rank(mesh_dim)


class _Exchange:
    """Matrices whose rows are split over a group: gather each on its owner, orthogonalise, scatter back.

    NOTE: every rank of a group must make the same gather/scatter calls in the same order: matrices are added in
    parameter order, which is the same on every rank (FSDP2 gives every rank a gradient for every parameter or none).
    """

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.owned: dict[dist.ProcessGroup, list[int]] = {}

    def add(
        self, update: torch.Tensor, out: torch.Tensor, rows: int, ns: tuple, group: dist.ProcessGroup, rank: int
    ) -> None:
        """Queue `update` (this rank's rows of a `rows`-row matrix) to be orthogonalised whole into `out`."""
        size = dist.get_world_size(group)
        # Owner: the rank of the group with the fewest elements to orthogonalise so far (the same choice on every
        # rank: same matrices, same order), so owners' Newton–Schulz work stays balanced.
        load = self.owned.setdefault(group, [0] * size)
        owner = load.index(min(load))
        load[owner] += rows * math.prod(update.shape[1:])
        chunk = -(-rows // size)  # torch.chunk's rows per rank; the last ranks may hold fewer or none
        padded = update.new_zeros((chunk, *update.shape[1:]))
        padded[: update.size(0)] = update
        self.jobs.append(dict(padded=padded, out=out, rows=rows, group=group, owner=owner, rank=rank, size=size, ns=ns))

    def run(self, local_work: Callable[[], None]) -> None:
        """Gather every queued matrix on its owner, orthogonalise the owned ones (and run `local_work`: the matrices
        whole on this rank), scatter the results back."""
        works = []
        for job in self.jobs:
            mine = job["rank"] == job["owner"]
            job["parts"] = [torch.empty_like(job["padded"]) for _ in range(job["size"])] if mine else None
            dst = dist.get_global_rank(job["group"], job["owner"])
            works.append(dist.gather(job["padded"], job["parts"], dst=dst, group=job["group"], async_op=True))
        for work in works:
            work.wait()
        failure = self._orthogonalise_owned(local_work)
        works = []
        for job in self.jobs:
            src = dist.get_global_rank(job["group"], job["owner"])
            parts = list(job["whole"].chunk(job["size"])) if job["parts"] is not None else None
            works.append(dist.scatter(job["padded"], parts, src=src, group=job["group"], async_op=True))
        for work in works:
            work.wait()
        for job in self.jobs:
            job["out"].copy_(job["padded"][: job["out"].size(0)])
        self._agree(failure)

    def _orthogonalise_owned(self, local_work: Callable[[], None]) -> str | None:
        """Orthogonalise the matrices this rank owns and run `local_work`; the error, if any (raised once every
        rank knows of it)."""
        try:
            local_work()
            for job in self.jobs:
                if job["parts"] is not None:  # the owner: the whole matrix, sent back in the same row blocks
                    whole = torch.cat(job["parts"])
                    # NOTE: torch adds the bf16 result to fp32 weights; casting it to fp32 first is exact.
                    whole[: job["rows"]] = orthogonalise(whole[: job["rows"]], *job["ns"]).to(whole.dtype)
                    job["whole"] = whole
        except Exception as error:  # NOTE: the others wait in the scatter: send them zeros, then fail together
            for job in self.jobs:
                if job["parts"] is not None:
                    job["whole"] = torch.zeros_like(torch.cat(job["parts"]))
            return f"{type(error).__name__}: {error}"
        return None

    def _agree(self, failure: str | None) -> None:
        """Raise on every rank of every group when an owner failed (one small all-reduce per group).

        Raises:
            RuntimeError: naming this rank's error, or saying another rank failed.
        """
        failed = failure is not None
        for group in self.owned:
            failed = bool(agree([int(failed)], "max", group)[0]) or failed
        if failed:
            where = f"on this rank: {failure}" if failure else "on another rank of a shard group (see its log)"
            raise RuntimeError(f"Muon's Newton–Schulz step failed {where}")


def muon_step(state: dict[torch.Tensor, dict[str, Any]], groups: Iterable[dict[str, Any]]) -> int:
    """One Muon step of every parameter with a gradient in `groups` (keys as torch.optim.Muon's param groups).

    Returns the number of split matrices this rank orthogonalised as their owner (owner balance is checked by tests).
    """
    exchange, updates, whole = _Exchange(), [], []
    for group in groups:
        momentum = group["momentum"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], group.get("ns_dtype", "bfloat16"))
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.ndim not in (2, 3):
                raise ValueError(
                    f"Muon got a parameter of shape {tuple(param.shape)}: it updates matrices (2-D) and expert "
                    "stacks (3-D). Give the others to AdamW (optimizer_cls_and_kwargs=(hf_fsdp2.Muon, {...}) does)."
                )
            if "momentum_buffer" not in state[param]:
                state[param]["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            grad, buf = local_part(param.grad), local_part(state[param]["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            shards = _shard_group(param)
            if param.ndim == 2 and shards is not None:
                out = torch.empty_like(update)
                exchange.add(update, out, param.shape[0], ns, *shards)
            else:  # whole here: an unsharded matrix, or whole experts (a stack split by its first dim)
                out = torch.empty_like(update)
                whole.append((update, out, ns))
            updates.append((param, out, group))

    def local_work() -> None:
        for update, out, ns in whole:
            out.copy_(orthogonalise(update, *ns))

    # NOTE: the local matrices run inside the exchange, so an error there too reaches every rank before any waits.
    exchange.run(local_work)
    for param, out, group in updates:
        rows, cols = param.shape[-2:]
        local = local_part(param)
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(out, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], rows, cols))
    return sum(job["rank"] == job["owner"] for job in exchange.jobs)


def adamw_step(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> None:
    """One AdamW step of a group's parameters: torch's own functional Adam with decoupled weight decay."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        slot = state[param]
        if "step" not in slot:  # the state torch.optim.AdamW keeps, so checkpoints of either read the same
            slot["step"] = torch.tensor(0.0, dtype=torch.float32)
            slot["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            slot["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        params.append(param)
        grads.append(param.grad)
        exp_avgs.append(slot["exp_avg"])
        exp_avg_sqs.append(slot["exp_avg_sq"])
        steps.append(slot["step"])
    beta1, beta2 = group["betas"]
    adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, decoupled_weight_decay=True, amsgrad=False,
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
    )  # fmt: skip


MUON_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS,
    ns_steps=NS_STEPS, adjust_lr_fn=None, ns_dtype="bfloat16",
)  # fmt: skip
ADAMW_DEFAULTS: dict[str, Any] = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon=True`, AdamW for the others, on FSDP2 shards or whole tensors.

    Muon groups take torch.optim.Muon's keys, AdamW groups torch.optim.AdamW's; missing keys get those optimizers'
    defaults. `hf_fsdp2.Muon` (`muon_routing`) builds one from a model and its TrainingArguments.
    """

    def __init__(self, params: Iterable[dict[str, Any]]) -> None:
        groups = [dict(g) for g in params]
        for group in groups:
            if not isinstance(group.get("use_muon"), bool):
                raise ValueError(
                    "MuonAdamW takes parameter groups that each say use_muon=True or False, e.g. "
                    "[{'params': matrices, 'use_muon': True}, {'params': others, 'use_muon': False}]."
                )
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAMW_DEFAULTS).items():
                group.setdefault(key, value)
            if group["use_muon"] and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
                raise ValueError(f"adjust_lr_fn={group['adjust_lr_fn']!r} is not one of {ADJUST_LR_FNS}")
            if group["use_muon"] and group["ns_dtype"] not in NS_DTYPES:
                raise ValueError(f"ns_dtype={group['ns_dtype']!r} is not one of {NS_DTYPES}")
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Muon on the matrices (whole, on their owners), AdamW on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.owned_last_step = muon_step(self.state, [g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                adamw_step(self.state, group)
        return loss


class ShardedTorchMuon(torch.optim.Muon):
    """torch.optim.Muon with the same groups and hyper-parameters, each matrix orthogonalised on one owner rank."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Each matrix orthogonalised whole on its owner, once, bit-equal to torch's step in one process.

        torch's own step on the DTensors is right too, within rounding: every rank runs every matrix's Newton–Schulz
        as DTensor matmuls reduced across ranks (N times the work; bf16 rounding 1.3e-3 from one process after 5 steps
        at 2 ranks, tests/test_muon.py).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.owned_last_step = muon_step(self.state, self.param_groups)
        return loss


def make_shard_exact(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Turn a torch.optim.Muon, or a subclass that keeps its step, into its shard-exact twin in place.

    Raises:
        ValueError: for a subclass that overrides `step` (`twins.adopt_twin`).
    """
    adopt_twin(optimizer, torch.optim.Muon, ShardedTorchMuon)
    return optimizer
