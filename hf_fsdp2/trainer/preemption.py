"""Preemption: when a scheduler says stop (SIGTERM; SLURM's SIGUSR1), checkpoint the step reached and exit.

A signal handler only records the signal. Ranks act at a step boundary and only together: every
`signal_check_steps` optimizer steps they all-reduce one integer (the signal number, or 0) over a CPU
(gloo) group, so a signal that reached one rank first stops every rank after the same step, and no GPU
stream is synchronized for it. The trainer then writes that step's checkpoint synchronously and raises
`Preempted` (a SystemExit with a non-zero code), so the scheduler requeues the job and a relaunch with
`resume_from_checkpoint="auto"` goes on from there.

`PreemptionWatcher` knows signals and process groups; `PreemptionMixin` is all `FSDP2Mixin` does about them. The
private Trainer hook it touches: `_save_checkpoint` (after `CheckpointMixin`'s, the agreed step is written
synchronously, then `Preempted` is raised so `on_train_end` and its export are skipped; tests/test_failures.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from torch import nn
from transformers import TrainerCallback

from ..distributed import agree, alone, close_host_group, is_host_group, new_host_group, warn_rank0


class Preempted(SystemExit):
    """Raised out of `train()` after the preemption checkpoint is on disk; exits with 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class PreemptionWatcher:
    """Records the configured signals while training runs and tells every rank, together, when to stop."""

    def __init__(self, signals: list[str], check_steps: int = 1) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.check_steps = check_steps
        self.received = 0  # the first signal this rank got, 0 for none
        self.stop_signal = 0  # the signal all ranks agreed to stop on, 0 while training goes on
        self._group: Any = None
        self._previous: dict[signal.Signals, Any] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Handle the signals inside (training); restore the previous handlers after.

        NOTE: collective on multi-rank runs with a non-gloo default group (it creates a gloo group).
        """
        if not self.signals:
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            warn_rank0(
                "train() runs outside the main thread, where Python cannot handle signals: no checkpoint on %s.",
                ", ".join(s.name for s in self.signals),
            )
            yield
            return
        self.received = self.stop_signal = 0
        self._group = _cpu_group()
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}
        try:
            yield
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = {}
            if self._group is not None:
                close_host_group(self._group)
                self._group = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        """The handler: remember the first signal; the training loop acts on it at the next check."""
        if not self.received:
            self.received = signum

    def agreed_stop(self, step: int) -> int:
        """At a check step, the signal any rank received (all ranks get the same answer), else 0.

        NOTE: collective on check steps; every rank calls it after every optimizer step.
        """
        if not self.signals or not self._previous or step % self.check_steps:
            return 0
        self.stop_signal = int(agree([self.received], "max", self._group)[0])
        return self.stop_signal


def _cpu_group() -> Any:
    """A process group that reduces CPU tensors: None (the default group) when that one is gloo, else a new one."""
    if alone() or is_host_group(None):
        return None
    return new_host_group()


class PreemptionCallback(TrainerCallback):
    """After each optimizer step, ask the watcher whether any rank was signalled; if so, save and stop."""

    def __init__(self, watcher: PreemptionWatcher) -> None:
        self.watcher = watcher

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Turn an agreed stop into a save of this step (the trainer exits once it is on disk)."""
        signum = self.watcher.agreed_stop(state.global_step)
        if signum:
            warn_rank0(
                "%s received: saving checkpoint-%d (the step every rank finished), then exiting with code %d.",
                signal.Signals(signum).name,
                state.global_step,
                128 + signum,
            )
            control.should_save = True
            control.should_training_stop = True
        return control


class PreemptionMixin:
    """`FSDP2Mixin`'s preemption: the signals are handled while `train()` runs, every rank stops after the same step,
    and that step's checkpoint is on disk before `Preempted` ends the run. Owns `_preemption`; reads `fsdp2_config`
    and uses `CheckpointMixin`'s `_wait_for_pending_save`, `_close_savers` and `_checkpoint_folder`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = self.fsdp2_config
        self._preemption = PreemptionWatcher(config.checkpoint_on_signals, config.signal_check_steps)
        super().__init__(*args, **kwargs)
        self.add_callback(PreemptionCallback(self._preemption))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's train(), with the signals handled while it runs."""
        with self._preemption.watching():
            return super().train(*args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The checkpoint; after the step every rank agreed to stop on, finish writing it and end the run."""
        super()._save_checkpoint(model, trial)
        if not self._preemption.stop_signal:
            return
        self._wait_for_pending_save()
        self._close_savers()
        checkpoint = self._checkpoint_folder(trial)
        warn_rank0(
            "Preempted: %s is complete. Relaunch the same command with resume_from_checkpoint='auto' to go on.",
            checkpoint,
        )
        raise Preempted(self._preemption.stop_signal, self.state.global_step, checkpoint)
