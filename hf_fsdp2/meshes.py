"""The device meshes and the groups over all ranks that hf_fsdp2's own collectives use: each takes CPU tensors too.

CPU offload makes the gradients CPU DTensors, and what reduces them (a grad norm, Muon's exchange, Adafactor's
statistics, the scalar-gradient hook) hands them to these groups; so each has gloo for the CPU beside the job's
backend, even when another library started an NCCL-only default group. It knows nothing about models.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .distributed import get_device


def build_mesh(replicate_size: int = 1) -> DeviceMesh:
    """Build the 1-D shard mesh, or the 2-D (replicate, shard) mesh for HSDP.

    Raises:
        ValueError: when `replicate_size` does not divide the world size.
    """
    world = dist.get_world_size()
    if replicate_size == 1:
        return mesh_carrying_cpu((world,), ("shard",))
    if world % replicate_size:
        raise ValueError(
            f"hsdp_replicate_size={replicate_size} does not divide the world size {world}; "
            f"choose a divisor of {world} (e.g. the number of nodes)."
        )
    return mesh_carrying_cpu((replicate_size, world // replicate_size), ("replicate", "shard"))


def mesh_carrying_cpu(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh on this rank's device whose every group also takes CPU tensors.

    NOTE: with CPU offload the gradients are CPU DTensors, and a grad norm, Muon's exchange and Adafactor's
    statistics hand them to the mesh's groups; an NCCL-only group (what Accelerate starts under torchrun) refuses
    them: "No backend type associated with device type cpu" on 2+ GPUs, never at one (pytorch#148532). So the mesh
    gets groups with gloo for the CPU beside the job's backend. Several dimensions on an accelerator always get new
    groups with the backends named: torch's split of the default group is only known to keep NCCL.

    Raises:
        RuntimeError: when a group of the mesh still cannot take CPU tensors.
    """
    device_type = get_device().type
    backend = backend_with_cpu()
    if backend is None and len(shape) > 1 and device_type != "cpu":
        backend = str(dist.get_backend_config())
    if backend is None:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    elif len(shape) == 1:
        mesh = DeviceMesh.from_group(world_group(), device_type, mesh_dim_names=names)
    else:
        override = dict.fromkeys(names, backend)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
    for name in names:
        group = mesh.get_group(name)
        if backend_with_cpu(group) is not None:
            raise RuntimeError(
                f"the {name!r} group of hf_fsdp2's device mesh has the backends {dist.get_backend_config(group)} and "
                "cannot take the CPU tensors CPU offload makes; please report this with the output of `hf-fsdp2 env`."
            )
    return mesh


def backend_with_cpu(group: dist.ProcessGroup | None = None) -> str | None:
    """The backend string that adds gloo for CPU tensors to `group`'s backends; None when it has one already."""
    return add_cpu_backend(str(dist.get_backend_config(group)))


def add_cpu_backend(config: str) -> str | None:
    """`config` ("cuda:nccl") with gloo for the CPU added ("cpu:gloo,cuda:nccl"); None when it has a CPU backend."""
    pairs = [pair.split(":") for pair in config.split(",")]
    backends = {pair[0]: pair[1] for pair in pairs if len(pair) == 2}
    if not backends or "cpu" in backends:
        return None
    return ",".join(f"{device}:{name}" for device, name in {"cpu": "gloo", **backends}.items())


# The group over all ranks made when the default group cannot take CPU tensors, and (weakly) that default group.
_world_group: tuple[weakref.ref, dist.ProcessGroup] | None = None


def world_group() -> dist.ProcessGroup | None:
    """All ranks, in a group that takes CPU tensors too: the default group (None) when it does, else one made once.

    NOTE: collective on its first call under a default group (every rank makes the group in the same order).
    """
    global _world_group
    backend = backend_with_cpu()
    if backend is None:
        return None
    if _world_group is None or _world_group[0]() is not dist.group.WORLD:
        _world_group = (weakref.ref(dist.group.WORLD), dist.new_group(backend=backend))
    return _world_group[1]
