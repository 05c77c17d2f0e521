"""Part "checkpoints": what a save blocks, and how close saves and resumes come to the disk; the 1B model, a world of
one, on the workdir's disk.

In order (each mode in its own folder, keeping only its last checkpoint: 1B is 13.8 GiB on a 64 GiB disk):
- async: saves at steps 3, 6 and 9, each after the last one's write has finished (waited for outside the timed
  calls, as enough steps between saves would), then one at step 10, while the 9th's is still being written (the
  back-to-back save, reported apart), and a step after it. Per save: seconds `_save_checkpoint` blocked, seconds the
  next optimizer step waited for the host copy (`_wait_for_staging`), the step-end check that published it once every
  rank had written it (`_publish_when_written`, when that check found it done), their sum, the stages inside the save,
  seconds until its write was on disk, and whether its copy went into the previous save's host buffers.
- sync: saves at steps 1 and 2, the first with DCP's buffered files (checkpoint_writes="cached"), the second with
  O_DIRECT ("direct"); each with its stages: state collection, DCP's planning, its data (copy to host, serialise,
  write, fsync inside), of which fsync (summed over the two parts' threads), DCP's metadata, the small files, and the
  commit (fsync of the tree, rename).
- the disk: a file of one rank's share of the checkpoint written sequentially and fsynced, through the page cache and
  with O_DIRECT, then read after its pages are dropped (posix_fadvise DONTNEED): bytes/s.
- resume from the sync checkpoint with its pages dropped first (a cold read), and consolidation.
Sync saves and the resume are reported as fractions of the disk's write and read rates (issue 63's goal: 0.8 or more).
Timings wait for the compute stream only (`torch.cuda.current_stream().synchronize()`): a whole-device synchronize
would also wait for the host copy's own stream and bill it to the wrong call.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import traceback
from typing import Any

from gpu_parts.common import dataset, free_memory, model_path
from gpu_parts.training import hf_fsdp2_trainer

SPACED = (3, 6, 9)  # async saves with their last write finished first
BACK_TO_BACK = 10  # a save one step after the 9th: it waits for that one's write
SYNC = (1, 2)  # sync saves: DCP's buffered files, then O_DIRECT
BLOCK = 1 << 24  # the disk yardstick writes and reads 16 MiB at a time


def checkpoints(spec: dict) -> dict:
    """Every measurement of the part; a failure of one mode is recorded and the others still run."""
    from benchmark_worker import folder_bytes
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path(spec["model"])).vocab_size
    data = dataset(dict(spec, steps=BACK_TO_BACK + 2), vocab)
    workdir = os.environ["GPU_CHECK_WORKDIR"]
    root = os.path.join(workdir, "checkpoints")
    shutil.rmtree(root, ignore_errors=True)
    record: dict[str, Any] = {"disk": disk_of(workdir)}
    stages = Stages()
    for mode, measure in (("async", async_saves), ("sync", sync_saves)):
        try:
            record |= measure(spec, data, os.path.join(root, mode), stages)
        except Exception as error:  # noqa: BLE001 - recorded; the other measurements still run
            traceback.print_exc()
            record[f"{mode}_error"] = f"{type(error).__name__}: {error}"[-1000:]
        free_memory()
    shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)
    stages.remove()
    checkpoint = os.path.join(root, "sync", f"checkpoint-{SYNC[-1]}")
    record["checkpoint_bytes"] = folder_bytes(checkpoint)  # 0 when the sync saves failed
    record["checkpoint_files"] = sum(len(files) for _, _, files in os.walk(checkpoint))
    record["rank_share_bytes"] = record["checkpoint_bytes"]  # a world of one: the rank's share is all of it
    record["disk_rates"] = disk_rates(workdir, record["rank_share_bytes"])
    if os.path.isdir(checkpoint):
        record |= resume_and_consolidate(spec, data, checkpoint, SYNC[-1])
        record |= fractions(record)
    shutil.rmtree(root, ignore_errors=True)
    return record


def compute_sync() -> None:
    """Wait for the compute stream's queued work (not the host copy's stream)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


class Stages:
    """Seconds spent in the calls a save makes, per save: hf_fsdp2.trainer.checkpointing's functions replaced by
    timed ones (in this worker process only), DCP's `FileSystemWriter.write_data` and `os.fsync` timed while a
    sync save's parts are written. `begin()` opens a save's record, `end()` closes it."""

    NAMES = {
        "begin_checkpoint": "begin",
        "sharded_parts": "collect",
        "check_room": "room",
        "write_parts": "write_parts",
        "wait_for_writes": "wait_writes",
        "commit_checkpoint": "commit",
        "rotate_checkpoints": "rotate",
    }

    def __init__(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        import hf_fsdp2.trainer.checkpointing as module
        from hf_fsdp2.checkpoints.sharded_save import HostStager

        self.module, self.writer, self.stager = module, FileSystemWriter, HostStager
        self.saved = {name: getattr(module, name) for name in self.NAMES}
        self.saved_write_data, self.saved_fsync, self.saved_copy = (
            FileSystemWriter.write_data,
            os.fsync,
            HostStager._copy,
        )
        self.current: dict[str, float] | None = None
        self.dcp: list[tuple[float, float]] | None = None  # (start, end) of each write_data while a part is written
        self.fsyncs: list[float] = []
        self.copies: list[float] = []  # seconds of each part's host copy (staging thread), until taken
        for name, label in self.NAMES.items():
            setattr(module, name, self._timed(self.saved[name], label))
        FileSystemWriter.write_data = lambda writer, *args, **kwargs: self._write_data(writer, *args, **kwargs)
        HostStager._copy = lambda stager, *args: self._copy(stager, *args)
        os.fsync = self._fsync

    def _timed(self, function: Any, label: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if label == "write_parts" and self.current is not None:
                self.dcp, self.fsyncs = [], []
            try:
                return function(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if self.current is not None:
                    self.current[label] = round(self.current.get(label, 0.0) + end - start, 4)
                    if label == "write_parts" and self.dcp:
                        self._dcp_stages(start, end)
                if label == "write_parts":
                    self.dcp = None

        return timed

    def _dcp_stages(self, start: float, end: float) -> None:
        """Inside a sync save's write_parts: DCP's planning until the first data write, the data writes (both parts
        at once), their fsyncs summed over the parts' threads, and the metadata after the last."""
        if self.current is None or not self.dcp:
            return
        first, last = min(s for s, _ in self.dcp), max(e for _, e in self.dcp)
        self.current |= {"dcp_plan": round(first - start, 4), "dcp_data": round(last - first, 4)}
        self.current |= {"dcp_fsync_summed": round(sum(self.fsyncs), 4), "dcp_finish": round(end - last, 4)}

    def _write_data(self, writer: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.saved_write_data(writer, *args, **kwargs)
        finally:
            if self.dcp is not None:
                self.dcp.append((start, time.perf_counter()))

    def _copy(self, stager: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.saved_copy(stager, *args)
        finally:
            self.copies.append(round(time.perf_counter() - start, 4))

    def take_copies(self) -> list[float]:
        """The host copies' seconds since the last call (model, optimizer)."""
        taken, self.copies = self.copies, []
        return taken

    def _fsync(self, fd: int) -> None:
        start = time.perf_counter()
        try:
            self.saved_fsync(fd)
        finally:
            if self.dcp is not None:
                self.fsyncs.append(time.perf_counter() - start)

    def begin(self) -> None:
        self.current = {}

    def end(self) -> dict[str, float]:
        done, self.current = self.current or {}, None
        return done

    def remove(self) -> None:
        """Put back what was replaced."""
        for name, function in self.saved.items():
            setattr(self.module, name, function)
        self.writer.write_data, os.fsync, self.stager._copy = self.saved_write_data, self.saved_fsync, self.saved_copy


class SaveAt:
    """A TrainerCallback asking for a save after the given steps; before each of `settle` it finishes the last save
    (its writes, commit and rotation), outside any timed call: what enough steps between saves would give."""

    def __new__(cls, trainer: Any, steps: tuple[int, ...], settle: tuple[int, ...]) -> Any:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
                if state.global_step + 1 in settle:
                    trainer._wait_for_pending_save()
                if state.global_step in steps:
                    control.should_save = True
                return control

        return Callback()


class StepTimes:
    """A TrainerCallback recording each step's seconds (the compute stream waited for at both ends)."""

    def __new__(cls, record: list[float]) -> Any:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
                compute_sync()
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
                compute_sync()
                record.append(round(time.perf_counter() - self.start, 4))

        return Callback()


def instrument(trainer: Any, stages: Stages, saves: list[dict]) -> None:
    """Time the trainer's saves: each `_save_checkpoint` (its stages, when its write ends) and, for an async save, the
    wait for its host copy at the next optimizer step, each part's copy (seconds in the staging thread), and whether
    the copy went into the last save's buffers and pinned ones."""
    save_checkpoint, wait_for_staging = trainer._save_checkpoint, trainer._wait_for_staging
    save_files, wait_pending = trainer._save_checkpoint_files, trainer._wait_for_pending_save

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        compute_sync()
        stages.begin()
        start = time.perf_counter()
        save = {"step": trainer.state.global_step, "written_s": None}
        try:
            return save_checkpoint(*args, **kwargs)
        finally:
            compute_sync()
            save["blocked_s"] = round(time.perf_counter() - start, 4)
            save["stages"] = stages.end()
            save["staging_wait_s"] = 0.0
            saves.append(save)
            pending = trainer._pending_save
            if pending is not None and pending.writes:
                for write in pending.writes:
                    write.upload_completion.add_done_callback(lambda _, s=save: written(s, start))
            else:
                save["written_s"] = save["blocked_s"]

    def written(save: dict, start: float) -> None:
        save["written_s"] = round(max(save["written_s"] or 0.0, time.perf_counter() - start), 4)

    def timed_wait() -> None:
        if not trainer._unstaged:
            return wait_for_staging()
        compute_sync()
        start = time.perf_counter()
        wait_for_staging()
        saves[-1]["staging_wait_s"] = round(time.perf_counter() - start, 4)
        saves[-1]["copy_s"] = stages.take_copies()
        if trainer._savers is not None:
            saves[-1]["buffers_reused"] = trainer._savers.buffers_reused()
            saves[-1]["pinned"] = all(stager.pinned for stager in trainer._savers.stagers.values())

    def stage(label: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if stages.current is not None:
                    stages.current[label] = round(stages.current.get(label, 0.0) + time.perf_counter() - start, 4)

        return timed

    publish = trainer._publish_when_written

    def timed_publish() -> None:
        """The step-end check that publishes a save once every rank wrote it: its seconds count as that save's."""
        if trainer._pending_save is None:
            return publish()
        compute_sync()
        start = time.perf_counter()
        publish()
        if trainer._pending_save is None and saves:
            saves[-1]["publish_s"] = round(time.perf_counter() - start, 4)

    trainer._save_checkpoint, trainer._wait_for_staging = timed_save, timed_wait
    trainer._publish_when_written = timed_publish
    trainer._save_checkpoint_files = stage("files", save_files)
    trainer._wait_for_pending_save = stage("pending", wait_pending)


def async_saves(spec: dict, data: Any, folder: str, stages: Stages) -> dict:
    """The spaced async saves and the back-to-back one (module docstring)."""
    saves: list[dict] = []
    step_s: list[float] = []
    steps = BACK_TO_BACK + 1
    trainer = hf_fsdp2_trainer(dict(spec, steps=steps, lr=1e-5), data, folder, [], async_save=True)
    trainer.args.save_total_limit = 1  # saves come from SaveAt (save_strategy stays "no")
    trainer.add_callback(SaveAt(trainer, (*SPACED, BACK_TO_BACK), SPACED[1:]))
    trainer.add_callback(StepTimes(step_s))
    instrument(trainer, stages, saves)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    del trainer
    for save in saves:
        save["total_blocked_s"] = round(save["blocked_s"] + save["staging_wait_s"] + save.get("publish_s", 0.0), 4)
    after = [step_s[s["step"]] for s in saves if s["step"] < len(step_s)]  # the step after each save
    return {
        "async_saves": saves[: len(SPACED)],
        "async_back_to_back": saves[len(SPACED) :],
        "async_step_s": {"median": round(statistics.median(step_s), 4), "after_each_save": after},
        "async_train_with_saves_s": round(seconds, 2),
    }


def sync_saves(spec: dict, data: Any, folder: str, stages: Stages) -> dict:
    """Two sync saves, DCP's buffered files then O_DIRECT, with their stages."""
    saves: list[dict] = []
    trainer = hf_fsdp2_trainer(dict(spec, steps=SYNC[-1], lr=1e-5), data, folder, [], checkpoint_writes="cached")
    trainer.args.save_total_limit = 1
    trainer.add_callback(SaveAt(trainer, SYNC, ()))
    instrument(trainer, stages, saves)

    from transformers import TrainerCallback

    config = trainer.fsdp2_config

    class DirectFromTheSecond(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            config.checkpoint_writes = "direct" if state.global_step >= SYNC[1] else "cached"

    trainer.add_callback(DirectFromTheSecond())
    trainer.train()
    del trainer
    for save, writes in zip(saves, ("cached", "direct"), strict=True):
        save["writes"] = writes
    return {"sync_saves": saves}


def drop_cached_pages(path: str) -> None:
    """Drop the page cache's copy of a file, or of every file under a folder (fsynced first: clean pages go)."""
    paths = [os.path.join(d, name) for d, _, names in os.walk(path) for name in names] or [path]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rates(directory: str, nbytes: int) -> dict:
    """The disk's sequential rates in bytes/s for a file of `nbytes` (rounded up to 16 MiB): written and fsynced
    through the page cache, written with O_DIRECT and fsynced (scripts/benchmark/benchmark_sweep.py's yardstick;
    None where the filesystem refuses O_DIRECT), and read back after its pages were dropped."""
    from benchmark_sweep import direct_write_rate, write_then_read

    path = os.path.join(directory, "disk_yardstick.bin")
    block = os.urandom(BLOCK)  # incompressible
    nbytes = max(-(-nbytes // BLOCK), 1) * BLOCK
    buffered, read = write_then_read(path, block, nbytes, before_read=drop_cached_pages)
    direct = direct_write_rate(path, block, nbytes)
    return {
        "bytes": nbytes,
        "write": round(max(buffered, direct or 0.0)),
        "write_buffered": round(buffered),
        "write_direct": None if direct is None else round(direct),
        "read_cold": round(read),
    }


def resume_and_consolidate(spec: dict, data: Any, checkpoint: str, steps: int) -> dict:
    """Seconds to load a checkpoint into a fresh trainer (its pages dropped first: read from the disk), and to
    consolidate it into a Hugging Face folder."""
    from benchmark_worker import _timed, folder_bytes

    import hf_fsdp2

    resume: list[float] = []
    trainer = hf_fsdp2_trainer(dict(spec, steps=steps + 1, lr=1e-5), data, os.path.dirname(checkpoint), [])
    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"):
        setattr(trainer, name, _timed(resume, getattr(trainer, name)))
    drop_cached_pages(checkpoint)
    trainer.train(resume_from_checkpoint=checkpoint)
    del trainer
    free_memory()
    output = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "consolidated")
    shutil.rmtree(output, ignore_errors=True)
    start = time.perf_counter()
    hf_fsdp2.consolidate(checkpoint, output)
    seconds = time.perf_counter() - start
    written = folder_bytes(output)
    shutil.rmtree(output, ignore_errors=True)
    return {"resume_s": round(sum(resume), 3), "consolidate_s": round(seconds, 2), "consolidated_bytes": written}


def fractions(record: dict) -> dict:
    """Each sync save's and the resume's rate (the rank's share of the checkpoint over its seconds) as a fraction of
    the disk's write and cold read rates."""
    rates, share = record["disk_rates"], record["rank_share_bytes"]
    out = {"resume_vs_disk_read": round(share / record["resume_s"] / rates["read_cold"], 3)}
    for save in record.get("sync_saves", []):
        out[f"sync_save_{save['writes']}_vs_disk_write"] = round(share / save["blocked_s"] / rates["write"], 3)
    return out


def disk_of(path: str) -> str:
    """Which filesystem the checkpoints went to (tmpfs would make the save times RAM times)."""
    best = ("", "?")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if os.path.abspath(path).startswith(point) and len(point) > len(best[0]):
                best = (point, kind)
    return f"{best[0]} ({best[1]})"


def checkpoint_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("checkpoints", {})
    if not run:
        return []
    if "checkpoint_bytes" not in run:  # the whole run failed (a first version kept one record for every mode)
        return ["", "| checkpoints | seconds |", "|---|---:|", f"| failed | {run.get('error', '?')[:100]} |"]
    if "sync_save_blocked_s" in run or "async_save_blocked_s" in run:
        return _first_table(run)
    gib = run["checkpoint_bytes"] / 2**30
    rates = run["disk_rates"]
    lines = ["", f"| checkpoints ({gib:.1f} GiB, on {run['disk']}) | seconds | what it is |", "|---|---:|---|"]
    if "async_error" in run:
        lines.append(f"| async saves | failed | {run['async_error'][:100]} |")
    else:
        for label, saves in (("async save", run["async_saves"]), ("back-to-back save", run["async_back_to_back"])):
            for index, save in enumerate(saves, 1):
                copies = " + ".join(f"{s:.2f}" for s in save.get("copy_s", []))
                reused = {True: "buffers reused", False: "buffers allocated"}.get(save.get("buffers_reused"), "")
                what = f"save call {save['blocked_s']:.2f} + wait for the copy {save['staging_wait_s']:.2f}"
                if "publish_s" in save:
                    what += f" + publish at a step's end {save['publish_s']:.2f}"
                written = save.get("written_s")
                what += f"; copy {copies} s in the background; "
                what += f"written after {written:.2f} s; {reused}" if written is not None else f"not written; {reused}"
                lines.append(f"| {label} {index}, blocked | {save['total_blocked_s']:.2f} | {what.rstrip('; ')} |")
    for save in run.get("sync_saves", []):
        fraction = run.get(f"sync_save_{save['writes']}_vs_disk_write")
        lines.append(
            f"| sync save ({save['writes']} writes) | {save['blocked_s']:.2f} | {fraction}x the disk's write |"
        )
    if "sync_error" in run:
        lines.append(f"| sync saves | failed | {run['sync_error'][:100]} |")
    if "resume_s" in run:  # not when the sync saves failed: there is no checkpoint to resume
        lines.append(f"| resume, pages dropped | {run['resume_s']} | {run['resume_vs_disk_read']}x the disk's read |")
        lines.append(f"| consolidate | {run['consolidate_s']} | |")
    direct = "refused" if rates["write_direct"] is None else f"{rates['write_direct'] / 2**30:.2f}"
    lines.append(
        f"| the disk, {rates['bytes'] / 2**30:.1f} GiB | | GiB/s: write {rates['write_buffered'] / 2**30:.2f} "
        f"(O_DIRECT {direct}), read {rates['read_cold'] / 2**30:.2f} (pages dropped) |"
    )
    return lines


def _first_table(run: dict) -> list[str]:
    """The table of results from before issue 63 (two saves per mode, no disk yardstick)."""

    def saves(mode: str) -> str:
        if f"{mode}_error" in run:
            return "failed: " + run[f"{mode}_error"][:100]
        return ", ".join(map(str, run[f"{mode}_save_blocked_s"]))

    return [
        "",
        f"| checkpoints ({run['checkpoint_bytes'] / 2**30:.1f} GiB, on {run['disk']}) | seconds |",
        "|---|---:|",
        f"| sync save, blocked (1st, 2nd) | {saves('sync')} |",
        f"| async save, blocked (1st, 2nd) | {saves('async')} |",
        f"| resume | {run['resume_s']} |",
        f"| consolidate | {run['consolidate_s']} |",
    ]
