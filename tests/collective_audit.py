"""An audit that finds, on CPU ranks over gloo, the tensors a GPU job would hand NCCL on the wrong device.

Why gloo alone cannot: on the CPU every tensor is a CPU tensor, and gloo takes them all; on N GPUs the job's own
groups are NCCL, which rejects a CPU tensor ("No backend type associated with device type cpu"). What differs is
whether the code *chose* the device. The audit marks every tensor whose device nobody chose: made by a factory
(`torch.tensor`, `torch.zeros`, ...) without a `device`, moved with `.cpu()`, or computed from such a tensor
without naming a device. Naming a device (`device=...`, `.to(device)`) clears the mark. Every collective call on
a group that serves the accelerator on GPUs (any group but those `hf_fsdp2.distributed.new_host_group` made) is
then checked: a marked tensor there is exactly a tensor that would sit on the CPU on a GPU machine.

Only the Python collectives in `torch.distributed` are wrapped (the package's own calls and FSDP2's); DTensor's
functional collectives and DCP's object collectives choose their devices inside torch.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hf_fsdp2.distributed import made_for_host

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
    torch.randn, torch.randint, torch.eye, torch.linspace,
}  # fmt: skip
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
)  # fmt: skip
# Counted only: they pickle their payload (whatever its device) or carry none, and pick their own tensors' device.
COUNTED = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier",
           "monitored_barrier")  # fmt: skip


class HostTensorMarks(TorchFunctionMode):
    """Marks tensors whose device was left to the default (the CPU), and what is computed from them."""

    def __init__(self) -> None:
        super().__init__()
        # By id, with a weak reference to tell a live tensor from a new one at a reused address.
        self.marked: dict[int, weakref.ref] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        named = kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])
        if func in FACTORIES:
            unnamed = kwargs.get("device") is None
        elif func is torch.Tensor.cpu:
            unnamed = True
        elif func is torch.Tensor.to and named:
            unnamed = False
        else:
            unnamed = not named and any(self.is_marked(t) for t in _tensors((args, kwargs)))
        if unnamed and out.device.type == "cpu":
            self.marked[id(out)] = weakref.ref(out)
        elif not unnamed:
            self.marked.pop(id(out), None)
        return out

    def is_marked(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` is on the CPU only because nobody named a device."""
        ref = self.marked.get(id(tensor))
        return ref is not None and ref() is tensor


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class CollectiveAudit:
    """What the audited code handed to collectives: every call, and the ones with a tensor on the wrong device."""

    def __init__(self, marks: HostTensorMarks) -> None:
        self.marks = marks
        self.calls: list[str] = []
        self.violations: list[str] = []

    def wrap(self, name: str, original: Any) -> Any:
        """`original` (a torch.distributed collective), checking its tensors before it runs."""
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            self.calls.append(name)
            # NOTE: on the CPU every group is gloo; on GPUs every group but those made for the host is NCCL.
            if name not in COUNTED and not made_for_host(group):
                wrong = [t for t in _tensors(dict(bound.arguments)) if self.marks.is_marked(t)]
                if wrong:
                    where = "".join(traceback.format_stack(limit=6)[:-1])
                    self.violations.append(
                        f"{name}: tensor of shape {tuple(wrong[0].shape)} on the CPU by default, handed to a group "
                        f"that is NCCL on GPUs (backend here: {dist.get_backend(group)})\n{where}"
                    )
            return original(*args, **kwargs)

        return checked


@contextlib.contextmanager
def audited() -> Iterator[CollectiveAudit]:
    """Inside: collectives are checked and counted (see the module docstring)."""
    marks = HostTensorMarks()
    audit = CollectiveAudit(marks)
    originals = {name: getattr(dist, name) for name in COLLECTIVES + COUNTED}
    for name, original in originals.items():
        setattr(dist, name, audit.wrap(name, original))
    try:
        with marks:
            yield audit
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
