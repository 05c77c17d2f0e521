"""`auto_find_batch_size` for `FSDP2Mixin`: an out-of-memory error on any rank makes every rank retry with the same
smaller batch, at the same step.

Trainer's retry (Accelerate's `find_executable_batch_size` around `_inner_training_loop`) is per process: the rank
that ran out of memory starts over while the others wait in that step's collectives. Here every rank meets at two
points of each step, over a gloo group that carries nothing else: after each micro-step's backward and after the
optimizer step. A rank that ran out of memory joins the next meeting from its exception handler (on that group the
next collective is always the next meeting, wherever each rank stands in the step), every rank learns of it, and all
raise the same out-of-memory error, so Accelerate's retry reduces the batch on every rank alike (x0.9, rounded down,
as for plain Trainer). The meeting is a CPU all-reduce: no accelerator sync.

Limits: the other ranks must reach the meeting without this rank, i.e. the error struck after this rank's last
collective before the meeting, or struck every rank in the same stretch between two collectives, or in an
elementwise optimizer's step. Otherwise the others wait inside a collective this rank never joins; it then fails,
naming itself and the step, after `MEETING_TIMEOUT` instead of hanging (and on GPUs a rank whose queued collectives
never finish fails after `DRAIN_TIMEOUT`).

Every private Trainer hook it touches:
- `_inner_training_loop` (wrapped): the handler that joins the meeting, the reset of FSDP's iteration state
  (`reset_iter_state`, torch's recovery path) and the agreed error; the batch size reached is logged on rank 0
  (tests/test_switches.py oom_*).
- `training_step` (wrapped): the meeting after each micro-step. A callback's `on_optimizer_step`: the meeting after
  the optimizer step.
- `_finalize_training`: the end of training ends the meeting group.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils.memory import should_reduce_batch_size
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from ..distributed import (
    agree,
    alone,
    close_host_group,
    get_rank,
    log_rank0,
    new_host_group,
    warn_rank0,
)

# How long a rank that ran out of memory waits for the others at the meeting (they may still be computing their
# micro-step), and how long queued accelerator work may take to finish once every rank stopped.
MEETING_TIMEOUT = timedelta(minutes=5)
DRAIN_TIMEOUT = timedelta(minutes=2)
_STAGES = ("forward or backward", "clipping or the optimizer step", "logging, saving or loading the next batch")
_FORWARD_BACKWARD, _OPTIMIZER, _OUTSIDE = range(len(_STAGES))


def check_batch_size_search(args: Any) -> None:
    """Refuse auto_find_batch_size where torch cannot reset FSDP's iteration state after an error mid-step.

    Raises:
        ValueError: on a torch whose FSDPModule has no `reset_iter_state` (torch 2.11: after an out-of-memory error
            mid forward, FSDP's state stays half-way and the retried step fails), naming the version and the fix.
    """
    if args.auto_find_batch_size and not hasattr(FSDPModule, "reset_iter_state"):
        raise ValueError(
            f"auto_find_batch_size=True needs torch's FSDPModule.reset_iter_state (torch 2.13 and later) to retry a "
            f"step that ran out of memory; torch {torch.__version__} has none. Upgrade torch, or set "
            "per_device_train_batch_size yourself (`hf-fsdp2 plan` estimates what fits)."
        )


class AgreedOutOfMemoryError(torch.OutOfMemoryError):
    """The out-of-memory error every rank raises together; Accelerate's retry recognises it (" out of memory.")."""


class BatchSizeMixin:
    """`FSDP2Mixin`'s `auto_find_batch_size`: the meetings and the retry every rank takes together. Owns the gloo
    group the meetings use (`_oom_group`) and where in the step this rank is (`_stage`, an index of `_STAGES`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._oom_group: dist.ProcessGroup | None = None
        self._stage = _OUTSIDE
        self._retry_reason: str | None = None  # the agreed error the current attempt retries after
        super().__init__(*args, **kwargs)
        if self.args.auto_find_batch_size:
            self.add_callback(_MeetAfterOptimizerStep(self))

    def _inner_training_loop(self, batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop; an out-of-memory error caught here is agreed on by every rank before it is raised."""
        if not self.args.auto_find_batch_size:
            return super()._inner_training_loop(batch_size, *args, **kwargs)
        if self._oom_group is None and not alone():
            self._oom_group = new_host_group()  # NOTE: collective: every rank starts train() together
        self._stage = _OUTSIDE
        if self._retry_reason is None:
            log_rank0("auto_find_batch_size: training with per_device_train_batch_size=%d.", batch_size)
        else:
            warn_rank0(
                "auto_find_batch_size: %s; every rank now trains with per_device_train_batch_size=%d.",
                self._retry_reason,
                batch_size,
            )
        try:
            output = super()._inner_training_loop(batch_size, *args, **kwargs)
            self._retry_reason = None  # a later train() starts without a retry to report
            return output
        except AgreedOutOfMemoryError:
            raise
        except Exception as error:
            if not _out_of_memory(error):
                raise
            self._meet(self._stage, cause=error)
            raise  # not reached: this rank's own report makes the meeting raise

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        """Trainer's micro-step, then the meeting: does any rank know of an out-of-memory error?"""
        if not self.args.auto_find_batch_size:
            return super().training_step(model, inputs, num_items_in_batch)
        self._stage = _FORWARD_BACKWARD
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._meet(None)
        self._stage = _OPTIMIZER  # clipping and the optimizer step come next (or the next micro-step)
        return loss

    def _meet_after_optimizer_step(self) -> None:
        """The meeting after the optimizer step (an error inside it reached `_inner_training_loop` instead)."""
        self._meet(None)
        self._stage = _OUTSIDE

    def _meet(self, phase: int | None, cause: BaseException | None = None) -> None:
        """Share with every rank whether this one ran out of memory (`phase`: a `_STAGES` index); raise the agreed
        error if any rank did.

        NOTE: collective over the meeting group; every rank meets after each micro-step and each optimizer step, and a
        rank that ran out of memory meets once from its handler instead. Only that rank waits with a timeout: the
        others may be stuck in a collective it never joins.
        """
        if phase is None:
            failed, rank_plus_one, phase_plus_one = agree([0.0, 0.0, 0.0], "max", self._oom_group)
        else:
            try:
                failed, rank_plus_one, phase_plus_one = agree(
                    [1.0, float(get_rank() + 1), float(phase + 1)], "max", self._oom_group, MEETING_TIMEOUT
                )
            except RuntimeError as timeout:  # gloo's "Operation timed out", or a peer gone
                raise RuntimeError(self._unrecoverable(phase, "the other ranks did not reach the meeting")) from (
                    cause or timeout
                )
        if failed:
            self._raise_agreed(int(rank_plus_one) - 1, int(phase_plus_one) - 1, cause)

    def _raise_agreed(self, rank: int, phase: int, cause: BaseException | None) -> None:
        """Reset FSDP's iteration and raise the error every rank raises, so every rank retries with the same batch.

        First every rank lets its queued accelerator work finish and says whether it did (a second meeting): a
        collective queued on a GPU that another rank never joined can never finish, and then no rank may retry.
        """
        stuck, _, _ = agree([0.0 if _drain_device() else 1.0, 0.0, 0.0], "max", self._oom_group)
        if stuck:
            raise RuntimeError(self._unrecoverable(phase, "collectives queued on the GPUs never finished", rank))
        self.model.zero_grad(set_to_none=True)
        if isinstance(self.model, FSDPModule):
            self.model.reset_iter_state()  # torch's recovery (on the root) after an exception mid forward/backward
        self._retry_reason = f"rank {rank} ran out of memory at step {self.state.global_step + 1} ({_STAGES[phase]})"
        raise AgreedOutOfMemoryError(
            f"{self._retry_reason}; every rank reduces its batch (auto_find_batch_size): out of memory."
        ) from cause

    def _unrecoverable(self, phase: int, why: str, rank: int | None = None) -> str:
        """The message of an out-of-memory error that every rank cannot step back from together."""
        rank = get_rank() if rank is None else rank
        return (
            f"auto_find_batch_size: rank {rank} ran out of memory at step {self.state.global_step + 1} "
            f"({_STAGES[phase]}), and "
            f"{why}: it struck while other ranks still needed this one in a collective, which no rank can leave. "
            "Lower per_device_train_batch_size (hf-fsdp2 plan estimates what fits) or make the rows of every rank "
            "the same length, so an error strikes every rank alike."
        )

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The end of training ends the meeting group."""
        if self._oom_group is not None:
            close_host_group(self._oom_group)
            self._oom_group = None
        return super()._finalize_training(*args, **kwargs)


class _MeetAfterOptimizerStep(TrainerCallback):
    """Calls the trainer's meeting right after each optimizer step, on every rank."""

    def __init__(self, trainer: BatchSizeMixin) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._meet_after_optimizer_step()


def _out_of_memory(error: BaseException) -> bool:
    """An accelerator or host out-of-memory error (what Accelerate's retry reduces the batch for), or torch's own."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, Exception) and should_reduce_batch_size(error)
    )


def _drain_device() -> bool:
    """Whether this rank's queued accelerator work finishes within DRAIN_TIMEOUT (a collective another rank never
    joined would wait forever); always True on the CPU, whose collectives block until done."""
    if not torch.cuda.is_available():
        return True
    finished = threading.Event()

    def synchronize() -> None:
        torch.cuda.synchronize()
        finished.set()

    threading.Thread(target=synchronize, daemon=True).start()
    return finished.wait(DRAIN_TIMEOUT.total_seconds())
