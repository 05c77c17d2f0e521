"""The benchmark's phases that move checkpoint bytes (load, save, resume, consolidation) at three model sizes, every
system, with each phase's time set against this machine's physical limit for the bytes it moves; and the training
step at each size (compute and collectives: no byte limit) and load + first step (transformers' native loading leaves
the weights mapped from the file and copies them in its first step).

Each size is a Llama of the benchmark's shape (vocab 16000, tied embeddings, fp32): about 100M, 400M and 1.2B
parameters. Every system loads it, trains 6 steps of 64 tokens saving after the 3rd and the 6th (the first 3 steps
are warm-up and not in the step time; the step time is the median of the last 3, slowest rank: measured at 400M,
both FSDP systems' steps 1-3 took 18.6-20.2, 15.3-16.9 and 12.5-15.5 s before settling at 13-14 s, so a median of
steps 2 and 3 timed the warm-up, not the step), resumes from the last checkpoint
(each system its own way, as in `scripts/benchmark/benchmark.py`), and the sharded systems consolidate it. Where
Adam's state
would not fit this machine's RAM (the optimizer state of every system at 1.2B on 24 GiB), the size trains with
plain SGD (no optimizer state: the same for every system); where a system would not fit at all (DDP holds the
whole model, its gradients and its optimizer on every rank) it is left out of that size, and the table says so.

The physical limit of a phase is the time its bytes take at rates the script measures before each size's runs, with a
file of that size's model bytes: writes at the disk's fsync'd write rate (the faster of writing through the page
cache and with O_DIRECT: on the development VM O_DIRECT wrote 1.7-1.8 GiB/s when the buffered writer got 0.3-0.4 GiB/s),
reads at the rate of reading a file just
written (the page cache: every checkpoint here is read right after it was written), and consolidation's read + write
the same way; the best of two measurements. The size matters: on the development VM a 1 GiB fsync'd write ran at
1.9 GiB/s and a 5 GiB one at 0.4 GiB/s a minute later (a write cache in front of the disk; the sweep's best of two
for 4.6 GiB came out 1.25 GiB/s), so a 1 GiB yardstick says little about multi-GiB phases. A load's bytes land
in memory the process never held, which the kernel must fault in page by page: its reads count at the slower of the
cached read and the memory copy (a 1 GiB tensor copied into a new one, 3.3-3.6 GiB/s on the development VM against
12.5-13.1 GiB/s for the cached read, which reads into one 16 MiB buffer that stays in the CPU's caches).
A phase within 1x of its limit moves bytes as fast as this machine can; the ratio says how far each system is from
that.

Usage:
    python scripts/benchmark/benchmark.py --sweep                        # all three sizes (about 32 min on 2 CPU cores)
    python scripts/benchmark/benchmark.py --sweep --sizes 100M,400M --json sweep.json --png sweep.png
    python scripts/benchmark/benchmark.py --sweep --from-json scripts/results/sweep.json   # re-render, run nothing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
from benchmark_report import MIB, emit_markdown  # noqa: E402
from benchmark_runs import CONSOLIDATES, NO_RESUME, read_through, run_consolidation, run_training, warm_up  # noqa: E402
from llama_model import build_model  # noqa: E402

# name: (layers, hidden); intermediate 8/3 hidden, one head per 64 channels (llama_model.build_model).
SIZES = {"100M": (12, 768), "400M": (24, 1152), "1.2B": (24, 2048)}
SYSTEMS = ("hf_fsdp2", "accelerate_fsdp2", "transformers_fsdp2", "ddp")
PHASES = ("load_s", "save_s", "resume_s", "consolidate_s")  # the phases that move bytes, set against a limit
# Phases whose every byte lands in memory the process did not hold before. Resume keeps the stricter cached-read
# limit (it refills the model's tensors in place; only the optimizer state it reads is new); consolidation streams
# through reused buffers.
INTO_NEW_MEMORY = ("load_s",)
STEP = "step_s"
READY = "ready_s"  # load + the first step: transformers' native loading defers copying the weights into it
TIMED = (STEP, READY)  # measured where the runs train, with no byte limit
LABELS = {READY: "load + first step"}
# The fastest FSDP peer each phase is held against (issue 24).
PEERS = {
    "load_s": "transformers_fsdp2",
    "save_s": "accelerate_fsdp2",
    "resume_s": "accelerate_fsdp2",
    "consolidate_s": "accelerate_fsdp2",
    STEP: "accelerate_fsdp2",
    READY: "transformers_fsdp2",
}
# Share of the machine's RAM a run may plan to hold (the rest: page cache, the other processes).
RAM_SHARE = 0.7
# Steps per run and how many of the first are warm-up (saves every steps // 2: after the 3rd and the 6th).
SCHEDULE = {"steps": 6, "warmup": 3}
OLD_SCHEDULE = {"steps": 3, "warmup": 1}  # results saved before the schedule was recorded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ", ".join(SIZES))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_sweep")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="cost against model bytes, one line per system and phase")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--from-json", default=None, help="re-render a --json file, run nothing")
    args = parser.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    for name in args.sizes.split(","):
        try:
            shape(name)
        except ValueError:
            parser.error(f"unknown size {name!r}; choose from {', '.join(SIZES)} or give LAYERSxHIDDEN (e.g. 2x64)")
    return args


def shape(name: str) -> tuple[int, int]:
    """(layers, hidden) of a named size, or of "LAYERSxHIDDEN" (the tests' tiny sizes)."""
    if name in SIZES:
        return SIZES[name]
    layers, hidden = name.split("x")
    return int(layers), int(hidden)


def best_rates(directory: str, nbytes: int, repeats: int = 2) -> dict[str, float]:
    """The fastest of `repeats` measurements of each rate: the limit is what this machine can do, not its noise."""
    runs = [measure_bandwidth(directory, nbytes) for _ in range(repeats)]
    return {key: max(run[key] for run in runs) for key in runs[0]}


def measure_bandwidth(directory: str, nbytes: int = 1 << 30) -> dict[str, float]:
    """This machine's rates in bytes/s: a file written and fsync'd (the faster of through the page cache and
    O_DIRECT: the disk's rate is what its fastest writer gets), the same file read back (page cache), and a
    memory copy."""
    import torch

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "bandwidth.bin")
    block = os.urandom(1 << 24)  # incompressible, 16 MiB written again and again
    nbytes = max(nbytes // len(block), 1) * len(block)
    buffered, read = write_then_read(path, block, nbytes)
    direct = direct_write_rate(path, block, nbytes)
    source = torch.empty(min(nbytes, 1 << 30) // 4, dtype=torch.float32).fill_(1.0)  # a rate: 1 GiB shows it
    target = torch.empty_like(source)
    start = time.perf_counter()
    target.copy_(source)
    copy = source.numel() * 4 / (time.perf_counter() - start)
    rates = {"disk_write": max(buffered, direct or 0.0), "disk_write_buffered": buffered}
    if direct is not None:
        rates["disk_write_direct"] = direct
    return {**rates, "cached_read": read, "memory_copy": copy}


def write_then_read(
    path: str, block: bytes, nbytes: int, before_read: Callable[[str], None] | None = None
) -> tuple[float, float]:
    """Bytes/s of writing `nbytes` of `block` through the page cache and fsyncing it, then of reading the file back
    (after `before_read(path)`, e.g. dropping its cached pages; without it the read comes from the page cache). The
    file is removed."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    written = nbytes / (time.perf_counter() - start)
    if before_read is not None:
        before_read(path)
    buffer = bytearray(len(block))
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    read = nbytes / (time.perf_counter() - start)
    os.remove(path)
    return written, read


def direct_write_rate(path: str, block: bytes, nbytes: int) -> float | None:
    """Bytes/s of writing `nbytes` of `block` with O_DIRECT from one aligned buffer, fsync'd; None where the
    filesystem refuses O_DIRECT."""
    import mmap

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (AttributeError, OSError):  # no O_DIRECT on this OS, or EINVAL from this filesystem
        return None
    aligned = mmap.mmap(-1, len(block))  # page-aligned, as O_DIRECT asks
    aligned[:] = block
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, len(block)):
            os.pwrite(fd, aligned, offset)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        aligned.close()
        os.remove(path)


def phase_bytes(model_bytes: int, checkpoint_bytes: int) -> dict[str, tuple[int, int]]:
    """(bytes read, bytes written) of each phase, all ranks together: the model file is read once whatever the
    ranks do; a save writes the checkpoint; a resume reads it; consolidation reads the model's part and writes the
    model."""
    return {
        "load_s": (model_bytes, 0),
        "save_s": (0, checkpoint_bytes),
        "resume_s": (checkpoint_bytes, 0),
        "consolidate_s": (model_bytes, model_bytes),
    }


def limit_seconds(read: int, written: int, rates: dict[str, float], into_new_memory: bool = False) -> float:
    """The time these bytes take at the measured rates: reads from the page cache, writes to disk.

    A load's bytes land in memory the process never touched: they can come no faster than this machine copies
    into such memory (the memory copy rate: a 1 GiB tensor copied into a new one), nor than the page cache reads.
    """
    read_rate = min(rates["cached_read"], rates["memory_copy"]) if into_new_memory else rates["cached_read"]
    return read / read_rate + written / rates["disk_write"]


def plan_size(name: str, systems: list[str], nproc: int) -> tuple[str, list[str], list[str]]:
    """The optimizer a size trains with ("adamw" or "sgd") and the systems that fit this machine's RAM, with notes
    for the table."""
    layers, hidden = shape(name)
    params = layers * (4 * hidden * hidden + 3 * hidden * (hidden * 8 // 3)) + 16000 * hidden
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * RAM_SHARE
    notes = []
    # Sharded: parameters, gradients and Adam's two states, all fp32, split over the ranks (whole on the machine).
    optim = "adamw" if 4 * 4 * params <= ram else "sgd"  # adamw: Trainer's default (adamw_torch_fused)
    if optim == "sgd":
        notes.append(f"{name}: SGD for every system (Adam's state would not fit {ram / 2**30:.0f} GiB)")
    states = 2 if optim == "adamw" else 0
    kept = []
    for system in systems:
        whole = (2 + states) * 4 * params * (nproc if system == "ddp" else 1)  # DDP: everything on every rank
        if whole > ram:
            notes.append(f"{name}: {system} left out (it would hold {whole / 2**30:.0f} GiB)")
            continue
        kept.append(system)
    return optim, kept, notes


def run_size(name: str, args: argparse.Namespace) -> dict:
    """Every system at one size: load, SCHEDULE's steps and saves, resume, consolidation; after an uncounted
    warm-up run (benchmark_runs.warm_up).

    NOTE: the warm-up is at every size, not only the first: the first system after a size's model was written and
    its rates measured (several GiB written and fsync'd) ran slower in every phase. Measured, hf_fsdp2 first at
    400M: load 1.25 s (native 0.65 s), resume 1.73 s (0.73 s in the sweep before), consolidation 3.24 s (0.95 s),
    first step 18.0 s against its steady 15.5 s (19.4 against 12.2 in the sweep before that).
    """
    layers, hidden = shape(name)
    workdir = os.path.join(args.workdir, name)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "model")
    model_bytes = build_model(path, layers, hidden=hidden, vocab=16000, tied=True)
    os.sync()
    rates = best_rates(workdir, model_bytes)
    # NOTE: the first system (always hf_fsdp2) must neither compete with the new file's write-back nor read it
    # from disk.
    os.sync()
    read_through(path)
    optim, systems, notes = plan_size(name, args.systems.split(","), args.nproc)
    run_args = argparse.Namespace(
        workdir=workdir, nproc=args.nproc, batch=1, seq_len=64, vocab=16000, samples=SCHEDULE["steps"] * args.nproc,
        resume=True, optim=None if optim == "adamw" else optim, **SCHEDULE,
    )  # fmt: skip
    result = {"model_bytes": model_bytes, "rates": rates, "optim": optim, "notes": notes, "systems": {}, **SCHEDULE}
    warm_up(run_args, systems[0], path)
    for system in systems:
        print(f"  {name}: {system}", flush=True)
        run = run_training(run_args, system, path, "sweep")
        figures = {
            "load_s": max(r["load_s"] for r in run["ranks"]),
            "load_peak_mib": max(r["load_peak_mib"] for r in run["ranks"]),
            "save_s": statistics.median(max(s) for s in zip(*(r["save_s"] for r in run["ranks"]), strict=True)),
            STEP: statistics.median(slowest_steps(run["ranks"], run_args.warmup)),
            READY: max(r["load_s"] + r["step_s"][0] for r in run["ranks"]),
            "checkpoint_bytes": run["checkpoint_bytes"],
        }
        if system not in NO_RESUME:
            figures["resume_s"] = max(sum(r["resume_s"]) for r in run["ranks"])
        if system in CONSOLIDATES:
            consolidated = run_consolidation(run_args, system, run["checkpoint"], "sweep")
            figures["consolidate_s"] = consolidated["seconds"]
            figures["consolidate_peak_mib"] = consolidated["peak_mib"]
            shutil.rmtree(os.path.join(workdir, f"consolidated-{system}"), ignore_errors=True)
        shutil.rmtree(os.path.join(workdir, f"run-{system}"), ignore_errors=True)  # a 1.2B run writes ~10 GB
        result["systems"][system] = figures
    shutil.rmtree(path, ignore_errors=True)
    return result


def slowest_steps(ranks: list[dict], warmup: int) -> list[float]:
    """Each step's time on its slowest rank (the step ends for everyone when it ends there), warm-up left out."""
    return [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)][warmup:]


def add_limits(results: dict, rates: dict[str, float] | None = None) -> None:
    """Each phase's physical limit and the ratio of its time to it, at the rates measured for its size (or
    `rates`, for results measured before the sweep measured per size)."""
    for size in results.values():
        size["into_new_memory"] = list(INTO_NEW_MEMORY)  # how these limits were taken: saved for the caption
        for figures in size["systems"].values():
            moved = phase_bytes(size["model_bytes"], figures["checkpoint_bytes"])
            for phase in PHASES:
                if phase in figures:
                    into_new = phase in INTO_NEW_MEMORY
                    figures[f"{phase}_limit"] = limit_seconds(*moved[phase], size.get("rates", rates), into_new)
                    figures[f"{phase}_x_limit"] = figures[phase] / figures[f"{phase}_limit"]


def render_markdown(saved: dict) -> str:
    """One table per phase: seconds (x the physical limit, for the phases that move bytes) per size and system,
    our ratio to the peer."""
    results = saved["results"]
    lines = [
        f"Measured rates: {rates_text(saved)}. {saved['nproc']} ranks; one run per size and system. Cells: seconds "
        f"(x the physical limit{limit_text(results)}); step: {schedule_text(results)}; load + first step: the slowest "
        "rank's.",
        "",
    ]
    systems = [s for s in SYSTEMS if any(s in r["systems"] for r in results.values())]
    for phase in panels(results):
        peer = PEERS[phase]
        header = f"| {LABELS.get(phase, phase[:-2])} | model MiB | " + " | ".join(systems) + f" | hf_fsdp2 vs {peer} |"
        lines += [header, "|---|---:|" + "---:|" * len(systems) + "---:|"]
        for name, size in results.items():
            cells = []
            for system in systems:
                figures = size["systems"].get(system, {})
                value = figures.get(phase)
                if value is None:
                    cells.append("-")
                    continue
                limit = f" ({figures[phase + '_x_limit']:.1f}x)" if phase in PHASES else ""
                cells.append(f"{value:.2f}{limit}")
            ours = size["systems"].get("hf_fsdp2", {}).get(phase)
            theirs = size["systems"].get(peer, {}).get(phase)
            ratio = f"**{ours / theirs:.2f}x**" if ours and theirs else "-"
            lines.append(f"| {name} | {size['model_bytes'] / MIB:.0f} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    notes = [n for r in results.values() for n in r["notes"]]
    if notes:
        lines.append("Notes: " + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"


def schedule_text(results: dict) -> str:
    """Which steps the step time is the median of (the same schedule at every size)."""
    size = next(iter(results.values()))
    steps, warmup = (size.get(key, OLD_SCHEDULE[key]) for key in ("steps", "warmup"))
    return f"the median of steps {warmup + 1} to {steps}, after {warmup} warm-up step{'s' if warmup > 1 else ''}"


def limit_text(results: dict) -> str:
    """How the load's limit was taken: results from before it counted the landing in new memory say nothing."""
    if "into_new_memory" not in next(iter(results.values())):
        return ""
    return (
        ": the bytes read at the cached read rate, written at the disk write rate; a load's bytes land in new "
        "memory, so at the slower of cached read and memory copy"
    )


def rates_text(saved: dict) -> str:
    """The yardsticks in GiB/s: per size (a file of that size's model bytes), or the one rate of older results."""

    def text(rates: dict[str, float]) -> str:
        gib = {key: value / 2**30 for key, value in rates.items()}
        writes = f"disk write (fsync'd) {gib['disk_write']:.2f}"
        if "disk_write_direct" in gib:  # measured both ways since the consolidation writes with O_DIRECT
            writes += f" (buffered {gib['disk_write_buffered']:.2f}, O_DIRECT {gib['disk_write_direct']:.2f})"
        return f"{writes}, cached read {gib['cached_read']:.2f}, memory copy {gib['memory_copy']:.2f} GiB/s"

    sized = {name: size["rates"] for name, size in saved["results"].items() if "rates" in size}
    if not sized:
        return text(saved["rates"])
    return "; ".join(
        f"{name} ({saved['results'][name]['model_bytes'] / MIB:.0f} MiB files): {text(r)}" for name, r in sized.items()
    )


def panels(results: dict) -> list[str]:
    """The phases to show: those that move bytes, then the timed ones the runs measured."""
    measured = {key for size in results.values() for figures in size["systems"].values() for key in figures}
    return [*PHASES, *(phase for phase in TIMED if phase in measured)]


def render_png(saved: dict, path: str) -> None:
    """Seconds against model bytes, one panel per phase, one line per system, the physical limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = saved["results"]
    phases = panels(results)
    fig, axes = plt.subplots(1, len(phases), figsize=(4.2 * len(phases), 3.6))
    for ax, phase in zip(axes, phases, strict=True):
        for system in SYSTEMS:
            points = [
                (size["model_bytes"] / 2**30, size["systems"][system][phase])
                for size in results.values()
                if phase in size["systems"].get(system, {})
            ]
            if points:  # one colour per system in every panel, whichever systems a phase has
                ax.plot(*zip(*points, strict=True), marker="o", label=system, color=f"C{SYSTEMS.index(system)}")
        limits = [
            (size["model_bytes"] / 2**30, size["systems"]["hf_fsdp2"][f"{phase}_limit"])
            for size in results.values()
            if f"{phase}_limit" in size["systems"].get("hf_fsdp2", {})
        ]
        if limits:
            ax.plot(*zip(*limits, strict=True), linestyle="--", color="grey", label="physical limit (hf_fsdp2's bytes)")
        ax.set_title(LABELS.get(phase, phase[:-2]))
        ax.set_xlabel("model (GiB, fp32)")
        ax.set_ylabel("seconds")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
    else:
        results = {}
        started = time.perf_counter()
        for name in args.sizes.split(","):
            print(f"[{time.perf_counter() - started:6.0f} s] size {name}", flush=True)
            results[name] = run_size(name, args)
        add_limits(results)
        saved = {"nproc": args.nproc, "results": results, "wall_s": time.perf_counter() - started}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(saved, f, indent=1)
    emit_markdown(render_markdown(saved), args.markdown)
    if args.png:
        render_png(saved, args.png)


if __name__ == "__main__":
    main()
