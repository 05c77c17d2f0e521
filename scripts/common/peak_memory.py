"""Memory readings the benchmark and the measurements share: a field of /proc/self/status, the peak since a reset
(CPU: VmHWM; GPU: torch's allocator), and the most bytes torch's allocator held while a call ran.

Imported by bare name (`from peak_memory import vm_kib`): a script puts scripts/common on sys.path first.
"""

from __future__ import annotations

MIB = 2**20


def vm_kib(field: str) -> int:
    """Read a VmXXX field (KiB) of this process from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Bytes resident now, with the high-water mark reset to now (GPU: allocated; CPU: /proc/self/clear_refs 5)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return vm_kib("VmRSS") * 1024


def peak_bytes() -> int:
    """The high-water mark since the last `reset_peak` (GPU: max allocated; CPU: VmHWM)."""
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else vm_kib("VmHWM") * 1024


def allocated_peak(fn) -> int:
    """The most bytes torch's allocator held above the start while `fn()` ran (GPU: max allocated; CPU: the torch
    profiler's allocation events), so freed buffers the C library keeps do not count as they do in VmHWM."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The kineto events keep every allocation and free in time order; prof.events() attributes allocations to ops.
    changes = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak
