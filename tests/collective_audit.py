"""An audit that finds, on CPU ranks over gloo, the tensors a GPU job would hand NCCL on the wrong device.

Why gloo alone cannot: on the CPU every tensor is a CPU tensor, and gloo takes them all; on N GPUs the job's own
groups are NCCL, which rejects a CPU tensor ("No backend type associated with device type cpu"). What differs is
whether the code put the tensor on the CPU. The audit (a TorchFunctionMode) *marks* every tensor that would be on
the CPU on a GPU machine too:
- made by a factory (`torch.tensor`, `torch.zeros`, ...) without a device, or by a CPU-only source
  (`torch.from_numpy`, `torch.get_rng_state`);
- moved with `.cpu()`, or given a device that the calling line writes out as the CPU (`.to("cpu")`,
  `device="cpu"`, `torch.device("cpu")`; here `.to("cpu")` of a CPU tensor returns it, and it is marked itself);
- computed from marked tensors without naming a device: arithmetic, views, and each piece of `chunk`, `split`,
  `unbind`, `tensor_split` (an unmarked input other than a 0-dim one decides otherwise: on GPUs the result is on
  its device, or the op fails); an in-place op keeps its target's state.
Naming a device any other way clears the mark: a device from `get_device()`, `collective_device()`,
`TrainingArguments.device`, a mesh's `device_type` or another tensor (`.to(t)`, `device=t.device`) is the accelerator
on GPUs, even though on this machine it equals "cpu". Telling them apart is why the calling line is read (once per
line: a string "cpu" or a `.cpu(` there). A CPU device written on one line and used on another escapes the audit,
and so does code compiled by `torch.compile` (Dynamo must not trace the mode; its collectives are still checked).

Every collective is checked as it runs: the tensor collectives of `torch.distributed` (FSDP2's `all_gather_single`
and `reduce_scatter_single` too), the functional collectives behind DTensor's `redistribute` and `full_tensor()`,
`distribute_tensor`'s scatter and broadcast, and `torch.distributed.nn.functional` (Ulysses' `all_to_all_single`).
A marked tensor handed to any group but those `hf_fsdp2.distributed.new_host_group` made (gloo even on GPUs) is a
violation. The payload of an object collective (`all_gather_object`, `broadcast_object_list`, ...) is pickled once
more to find its tensors: one that is not marked is a violation, because on GPUs it is an accelerator tensor and
the receiving ranks unpickle it onto the sender's device (send Python numbers, or `.cpu()` copies). Barriers are
counted. A violation names the collective, the innermost hf_fsdp2 line that called it, where its tensor was put on
the CPU, and the stack.

Each call also records that innermost `hf_fsdp2/` line: `tests/collective_sites.py` turns the records into the
package's call sites the suite reached. `tests/launch.py` runs every worker inside `audited()` and fails a rank with
violations (AUDIT_FAILED); an audit nested inside another (a worker checking its own paths) takes the violations
made inside it, so the outer one does not fail the rank for them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import os
import pickle
import re
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
import torch.distributed.tensor._collective_utils as dtensor_collectives
from torch._dynamo.eval_frame import OptimizeContext
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import hf_fsdp2
from hf_fsdp2.distributed import made_for_host
from tests.collective_sites import REACHED_DIR

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.empty_strided,
}  # fmt: skip
# Tensor collectives, by module: their tensors must not be marked unless the group is a host group.
COLLECTIVES: dict[ModuleType, tuple[str, ...]] = {
    dist: (
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
        "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
        "all_gather_single", "reduce_scatter_single", "all_reduce_coalesced", "all_gather_coalesced",
        "_all_gather_base", "_reduce_scatter_base", "batch_isend_irecv",
    ),
    funcol: (
        "all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor", "reduce_scatter_tensor",
        "all_to_all_single", "broadcast", "all_reduce_coalesced", "all_gather_inplace", "permute_tensor",
        "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
        "all_gather_single_autograd", "reduce_scatter_single_autograd",
    ),
    dist_nn: ("broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather", "all_to_all",
              "all_to_all_single", "all_reduce"),
    # distribute_tensor's scatter or broadcast from rank 0 (bound by name there, so not dist's).
    dtensor_collectives: ("broadcast", "scatter"),
}  # fmt: skip
# Object collectives: the argument that holds what is pickled, and the argument naming the rank that sends it
# (None: every rank sends its own).
OBJECT_COLLECTIVES: dict[str, tuple[str, str | None]] = {
    "all_gather_object": ("obj", None),
    "gather_object": ("obj", None),
    "broadcast_object_list": ("object_list", "src"),
    "scatter_object_list": ("scatter_object_input_list", "src"),
    "send_object_list": ("object_list", None),
}
COUNTED = ("barrier", "monitored_barrier")
# Functions whose tensors live on the CPU whatever the machine.
HOST_SOURCES: tuple[tuple[ModuleType, str], ...] = (
    (torch, "from_numpy"), (torch, "frombuffer"), (torch, "get_rng_state"), (torch.random, "get_rng_state"),
)  # fmt: skip
PACKAGE = os.path.dirname(os.path.abspath(hf_fsdp2.__file__)) + os.sep
ROOT = os.path.dirname(PACKAGE.rstrip(os.sep)) + os.sep
# Frames of torch's own Python wrappers between a caller and the mode (torch.split, Tensor.split, ...).
_TORCH_WRAPPERS = tuple(
    os.path.join(os.path.dirname(torch.__file__), name) for name in ("overrides.py", "_tensor.py", "functional.py")
)
_CPU_WRITTEN = re.compile(r"""["']cpu(:\d+)?["']|\.cpu\(""")
# Whether a (code, line) writes the CPU out: read once per line, since `.to(device)` runs every step.
_writes_cpu: dict[tuple[CodeType, int], bool] = {}


class HostTensorMarks(TorchFunctionMode):
    """Marks the tensors that stay on the CPU on a GPU machine too (see the module docstring), each with where the
    first of its line was put on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        # By id: a weak reference to tell a live tensor from a new one at a reused address (its callback forgets the
        # entry when the tensor dies, so a whole training run does not grow the table), and the mark's origin.
        self.marked: dict[int, tuple[weakref.ref, str]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # NOTE: runs for every torch call of a training run (~3 us each here): the common cases return early.
        out = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(out, torch.Tensor):
            if torch.compiler.is_compiling():
                return out
            origin = self._origin(func, args, kwargs or {}, out)
            if origin is not _KEEP:
                self.set(out, origin)
        elif (type(out) is tuple or type(out) is list) and self.marked:  # not torch.Size
            origin = self._inherited(args, kwargs)
            for piece in out if origin is not None else ():  # chunk, split, unbind, tensor_split: every piece
                if isinstance(piece, torch.Tensor):
                    self.set(piece, origin)
        return out

    def _origin(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> Any:
        """Where `out` was put on the CPU for good; None when it was not; _KEEP for in-place ops and `.to(dtype)`."""
        device = _device_argument(func, args, kwargs)
        if isinstance(device, torch.Tensor):  # `.to(other)`: other's device
            return self.origin(device)
        if device is not None:
            return _where(_caller()) if _names_host(device) else None
        if func is torch.Tensor.cpu or (func in FACTORIES and not (args and isinstance(args[0], torch.Tensor))):
            return _where(_caller())
        if args and out is args[0]:
            return _KEEP
        return self._inherited(args, kwargs) if self.marked else None

    def _inherited(self, args: tuple, kwargs: dict | None) -> str | None:
        """The origin of a result computed from these arguments (lists one level down): that of its marked inputs,
        unless an unmarked one decides the device on GPUs.

        NOTE: an op's output sits where its tensors are; a 0-dim CPU tensor may join accelerator tensors (the result
        is theirs), and a marked index tensor with an unmarked weight fails on GPUs before any collective.
        """
        origin = scalar_origin = None
        unmarked_scalar = False
        for value in (*args, *kwargs.values()) if kwargs else args:
            for tensor in (
                (value,) if isinstance(value, torch.Tensor) else value if type(value) in (list, tuple) else ()
            ):
                if not isinstance(tensor, torch.Tensor):
                    continue
                found = self.origin(tensor)
                if tensor.ndim:
                    if found is None:
                        return None
                    origin = origin or found
                elif found is None:
                    unmarked_scalar = True
                else:
                    scalar_origin = scalar_origin or found
        return origin or (None if unmarked_scalar else scalar_origin)

    def set(self, tensor: torch.Tensor, origin: str | None) -> None:
        """Mark `tensor` (and a DTensor's local tensor) with `origin` when it is on the CPU here; None clears it."""
        key = id(tensor)
        if origin is not None and tensor.device.type == "cpu":
            self.marked[key] = (weakref.ref(tensor, lambda ref, key=key: self._forget(key, ref)), origin)
            if isinstance(tensor, DTensor):
                self.set(tensor._local_tensor, origin)
        else:
            self.marked.pop(key, None)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """Drop a dead tensor's entry, unless a newer tensor at the same address took it."""
        entry = self.marked.get(key)
        if entry is not None and entry[0] is ref:
            del self.marked[key]

    def origin(self, tensor: torch.Tensor) -> str | None:
        """Where `tensor` (or the tensor it was computed from) was put on the CPU for good; None when unmarked."""
        entry = self.marked.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return self.origin(tensor._local_tensor) if isinstance(tensor, DTensor) else None

    def is_marked(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` would sit on the CPU on a GPU machine too."""
        return self.origin(tensor) is not None


_KEEP = object()  # an op that leaves its output's mark as it was


def _where(frame: FrameType) -> str:
    """`path:line (function)` of a frame, the path relative to the checkout when it is inside it."""
    path = frame.f_code.co_filename
    path = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
    return f"{path}:{frame.f_lineno} ({getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)})"


def _device_argument(func: Any, args: tuple, kwargs: dict) -> Any:
    """The device a call names: its `device=`, or `Tensor.to`'s positional device, string, index or tensor."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    if func is torch.Tensor.to:
        for arg in args[1:]:
            if isinstance(arg, (torch.device, str, int, torch.Tensor)) and not isinstance(arg, bool):
                return arg
    return None


def _names_host(device: Any) -> bool:
    """True when `device` is the CPU and the calling line writes it out ("cpu", `.cpu(`).

    NOTE: a string is no proof: `mesh.device_type` and `get_device().type` are "cpu" here and "cuda" on GPUs.
    """
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device) or device.type != "cpu":
        return False
    frame = _caller()
    key = (frame.f_code, frame.f_lineno)
    if key not in _writes_cpu:
        import linecache

        _writes_cpu[key] = bool(_CPU_WRITTEN.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno)))
    return _writes_cpu[key]


def _caller() -> FrameType:
    """The frame that called the torch function being marked (past the mode and torch's Python wrappers)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH_WRAPPERS)
    ):
        frame = frame.f_back
    return frame


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


class _TensorFinder(pickle.Pickler):
    """Pickles a payload as an object collective would, keeping its tensors and writing none of their data."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.found.append(obj)
            return int, ()
        return NotImplemented


def payload_tensors(payload: Any) -> list[torch.Tensor]:
    """The tensors an object collective would pickle inside `payload` (none when it does not pickle)."""
    finder = _TensorFinder()
    try:
        finder.dump(payload)
    except Exception:  # NOTE: the collective itself then fails, with pickle's own error
        return []
    return finder.found


class CollectiveAudit:
    """What the audited code handed to collectives: every call, and the ones with a tensor on the wrong device."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.violations: list[str] = []


class _Auditor:
    """The wrappers, the marks and the audits open now; installed once however deeply `audited()` nests."""

    def __init__(self) -> None:
        self.marks = HostTensorMarks()
        self.open: list[CollectiveAudit] = []
        self.reached: set[tuple[str, int, str]] = set()
        self.originals: list[tuple[ModuleType | type, str, Any]] = []
        self.inside = threading.local()  # a collective that calls another (object collectives, nn.functional)
        # Groups any code made with backend="gloo" spelled out (vLLM's cpu_group, ours): gloo on GPUs too.
        self.gloo_groups: dict[int, weakref.ref] = {}

    def install(self) -> None:
        """Wrap every audited function in its module."""
        for module, names in COLLECTIVES.items():
            for name in names:
                self._replace(module, name, self._tensor_check(name))
        for name, (payload, sender) in OBJECT_COLLECTIVES.items():
            self._replace(dist, name, self._payload_check(name, payload, sender))
        for name in COUNTED:
            self._replace(dist, name, lambda bound, name=name: None)
        for module, name in HOST_SOURCES:
            original = getattr(module, name)
            self.originals.append((module, name, original))
            setattr(module, name, self._host_source(original))
        self.originals.append((dist, "new_group", dist.new_group))
        dist.new_group = self._noting_gloo_groups(dist.new_group)
        self.originals.append((OptimizeContext, "__call__", OptimizeContext.__dict__.get("__call__")))
        OptimizeContext.__call__ = self._compile_unaudited(OptimizeContext.__call__)

    def uninstall(self) -> None:
        """Put every original back."""
        for owner, name, original in reversed(self.originals):
            if original is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, original)
        self.originals.clear()

    def _compile_unaudited(self, original: Callable) -> Callable:
        """`torch.compile`'s wrapping of a function, made to run its compiled code with the marks set aside.

        NOTE: Dynamo traces the torch function modes it finds and guards on them: with the marks on its stack,
        activation checkpointing's recompute picked another graph than the forward ("A different number of tensors
        was saved") and a traced `.shape` came back as a device. Compiled code is therefore not marked; the
        collectives it reaches are still checked.
        """
        marks = self.marks

        def call(context: Any, fn: Any) -> Any:
            compiled = original(context, fn)
            if not isinstance(compiled, FunctionType):  # a module: its forward comes back through here
                return compiled

            @functools.wraps(compiled)
            def unaudited(*args: Any, **kwargs: Any) -> Any:
                with _set_aside(marks):
                    return compiled(*args, **kwargs)

            return unaudited

        return call

    def _replace(self, module: ModuleType, name: str, check: Callable[[inspect.BoundArguments], str | None]) -> None:
        """Wrap `module.name` (when this torch has it) so that `check` sees its arguments before it runs."""
        original = getattr(module, name, None)
        if original is None:
            return
        self.originals.append((module, name, original))
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.inside, "depth", 0):
                return original(*args, **kwargs)
            self.inside.depth = 1
            try:
                self._record(name, check(signature.bind(*args, **kwargs)))
                return original(*args, **kwargs)
            finally:
                self.inside.depth = 0

        checked.__wrapped__ = original
        setattr(module, name, checked)

    def _host_source(self, original: Callable) -> Callable:
        """`original`, marking what it returns: a CPU tensor on every machine."""

        def marked(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.marks.set(out, _where(sys._getframe(1)))
            return out

        return marked

    def _noting_gloo_groups(self, new_group: Callable) -> Callable:
        """`dist.new_group` that remembers the groups made with backend="gloo" spelled out."""

        @functools.wraps(new_group)
        def noting(*args: Any, **kwargs: Any) -> Any:
            group = new_group(*args, **kwargs)
            backend = inspect.signature(new_group).bind(*args, **kwargs).arguments.get("backend")
            if isinstance(group, dist.ProcessGroup) and str(backend) == "gloo":
                self.gloo_groups[id(group)] = weakref.ref(group)
            return group

        return noting

    def _is_host(self, group: Any) -> bool:
        """True for a group that is gloo on GPUs too: hf_fsdp2's host groups, or any made with backend="gloo"."""
        known = self.gloo_groups.get(id(group))
        return made_for_host(group) or (known is not None and known() is group)

    def _tensor_check(self, name: str) -> Callable[[inspect.BoundArguments], str | None]:
        """The check of a tensor collective: no marked tensor on a group that is NCCL on GPUs."""

        def check(bound: inspect.BoundArguments) -> str | None:
            arguments = dict(bound.arguments)
            if name == "batch_isend_irecv":
                pairs = [(op.tensor, op.group) for op in arguments["p2p_op_list"]]
            else:
                group = _process_group(arguments.pop("group", None))
                pairs = [(t, group) for t in _tensors(arguments)]
            # NOTE: on the CPU every group is gloo; on GPUs every group but those made for the host is NCCL.
            wrong = [(t, g) for t, g in pairs if not self._is_host(g) and self.marks.is_marked(t)]
            if not wrong:
                return None
            tensor, group = wrong[0]
            return (
                f"a tensor of shape {tuple(tensor.shape)} is on the CPU (its device was left to the default, or "
                f"written as the CPU, at {self.marks.origin(tensor)}), handed to a group that is NCCL on GPUs "
                f"(backend here: {_backend(group)})"
            )

        return check

    def _payload_check(self, name: str, payload: str, sender: str | None) -> Callable:
        """The check of an object collective: what it pickles holds no tensor that is an accelerator's on GPUs."""

        def check(bound: inspect.BoundArguments) -> str | None:
            arguments = bound.arguments
            if sender is not None and not _sends(arguments.get(sender), arguments):
                return None
            for tensor in payload_tensors(arguments.get(payload)):
                if tensor.device.type != "cpu" or not self.marks.is_marked(tensor):
                    return (
                        f"its payload holds a tensor of shape {tuple(tensor.shape)} on {tensor.device} whose device "
                        "was chosen (an accelerator on GPUs): the receiving ranks unpickle it onto the sender's "
                        "device; send Python numbers (or .cpu() tensors) instead"
                    )
            return None

        return check

    def _record(self, name: str, problem: str | None) -> None:
        """Count the call in every open audit, note the package line that made it, and keep a violation."""
        for audit in self.open:
            audit.calls.append(name)
        frame = _package_frame()
        where = f"{_where(sys._getframe(2))}, outside hf_fsdp2"
        if frame is not None:
            self.reached.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_lineno, name))
            where = _where(frame)
        if problem is not None and self.open:
            stack = "".join(traceback.format_stack(sys._getframe(2), limit=12))
            self.open[-1].violations.append(f"{name} at {where}: {problem}\n{stack}")


@contextlib.contextmanager
def _set_aside(mode: TorchFunctionMode) -> Iterator[None]:
    """Inside: `mode` is off the torch function mode stack (the modes above it stay, in order)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(m is mode for m in stack):
        yield
        return
    above = stack[[id(m) for m in stack].index(id(mode)) + 1 :]
    for _ in range(len(above) + 1):
        torch._C._pop_torch_function_stack()
    for m in above:
        torch._C._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        for _ in above:
            torch._C._pop_torch_function_stack()
        for m in [mode, *above]:
            torch._C._push_on_torch_function_stack(m)


def _package_frame() -> FrameType | None:
    """hf_fsdp2's frame that made the collective: the first frame outside torch and this audit, if it is the package's.

    NOTE: a collective another library makes (vLLM's, Trainer's) is not the package's, even when hf_fsdp2 code is
    further up the stack (a mixin's `__init__` around TRL's).
    """
    frame = sys._getframe(1)
    while frame is not None and _inside_torch_or_audit(frame.f_code.co_filename):
        frame = frame.f_back
    return frame if frame is not None and frame.f_code.co_filename.startswith(PACKAGE) else None


def _inside_torch_or_audit(filename: str) -> bool:
    return filename.startswith(_TORCH) or filename == __file__ or filename.endswith(("functools.py", "contextlib.py"))


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _process_group(group: Any) -> Any:
    """The ProcessGroup behind any way a collective names one (None: the default group)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    try:
        resolved = funcol._resolve_group(group)
    except Exception:  # NOTE: a group the audit cannot name is checked as the job's own (NCCL on GPUs)
        return group
    if isinstance(resolved, str):
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(resolved)
    return resolved


def _backend(group: Any) -> str:
    """The group's backend, or a word when it cannot be told."""
    try:
        return str(dist.get_backend(group))
    except Exception:
        return "unknown"


def _sends(source: Any, arguments: dict) -> bool:
    """True on the rank whose payload a broadcast or scatter of objects sends."""
    group = _process_group(arguments.get("group"))
    if source is None and arguments.get("group_src") is not None:
        source = dist.get_global_rank(group, arguments["group_src"]) if group is not None else arguments["group_src"]
    return source is None or dist.get_rank() == source


_auditor: _Auditor | None = None


@contextlib.contextmanager
def audited() -> Iterator[CollectiveAudit]:
    """Inside: collectives are checked and counted (see the module docstring); nested audits share one install."""
    global _auditor
    outermost = _auditor is None
    if outermost:
        _auditor = _Auditor()
        _auditor.install()
    auditor, audit = _auditor, CollectiveAudit()
    auditor.open.append(audit)
    try:
        if outermost:
            with auditor.marks:
                yield audit
        else:
            yield audit
    finally:
        auditor.open.remove(audit)
        if outermost:
            auditor.uninstall()
            _auditor = None
            _save_reached(auditor.reached)


# The exit code of an audited process whose code succeeded but handed a collective a tensor on the wrong device.
AUDIT_FAILED = 3


def _save_reached(reached: set[tuple[str, int, str]]) -> None:
    """Append what this process reached to its file under $HF_FSDP2_TEST_REACHED_SITES, when that is set."""
    folder = os.environ.get(REACHED_DIR)
    if not folder or not reached or not os.path.isdir(folder):
        return
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        for path, line, name in sorted(reached):
            f.write(json.dumps([path, line, name]) + "\n")


def report(audit: CollectiveAudit) -> str:
    """The audit's violations as one text for a rank's stderr, each once with how many times it happened."""
    counts: dict[str, int] = {}
    for violation in audit.violations:
        counts[violation] = counts.get(violation, 0) + 1
    lines = [f"collective audit: {len(audit.violations)} violation(s) (tests/collective_audit.py)"]
    for violation, count in counts.items():
        lines.append(f"[{count}x] {violation}" if count > 1 else violation)
    return "\n".join(lines)
