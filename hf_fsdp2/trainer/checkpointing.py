"""Where `FSDP2Mixin` saves: sharded checkpoints written under a staging name and published when complete, and
from_pretrained-ready exports of the live model.

It decides when and what is written; the DCP files are `checkpoints.sharded_save`'s, the Hugging Face folders
`export.live`'s; reading a checkpoint back is not its job. Every private Trainer hook it touches:
- `_save_checkpoint`: every save is a sharded DCP save under a staging name, renamed when complete
  (tests/test_checkpoint.py). It reuses `_save_rng_state`, `_save_scaler` (fp16's `scaler.pt`, read back by Trainer's
  `_load_scaler`; tests/test_switches.py resume), `store_flos` and `_get_output_dir`.
- `_finalize_training`: waits for a pending asynchronous save before training ends.
An asynchronous save copies the state to host memory in the background while training goes on; the callback
`on_pre_optimizer_step` (Trainer's own event, right before `optimizer.step()`) waits for that copy, so the step never
changes what is being copied (tests/test_checkpoint.py: async checkpoints equal the sync run's, with a slow copy).
Its `on_step_end` publishes the save once every rank's writes are done, so a crash before the next save keeps it
(tests/test_checkpoint.py: a rank killed the step after an async save).
- `save_model`: writes a from_pretrained-ready folder, gathering one tensor at a time (a PEFT model: its
  adapter folder, or the merged model with `merge_adapters_on_save`).
- `_save` (a subclass's own, such as sentence-transformers'): `save_model` and the end-of-training export of a model
  that is not a `PreTrainedModel` run it on rank 0 with the model presented unsharded, so the folder is the
  subclass's format (`export.owner`; tests/test_sentence_transformers.py).
PEFT models get adapter-only checkpoints: peft's adapter files plus the DCP optimizer state of the
trainable parameters (tests/test_lora.py).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..checkpoints.adapters import save_adapter
from ..checkpoints.disk_space import check_room, raise_if_write_failed, tensor_bytes
from ..checkpoints.sharded_save import (
    PartSavers,
    begin_checkpoint,
    commit_checkpoint,
    sharded_parts,
    wait_for_staging,
    wait_for_writes,
    write_parts,
    writes_done,
)
from ..distributed import agree, is_rank0, log_rank0
from ..export.live import save_pretrained_sharded, write_model_files
from ..loading.facts import facts_of
from .callbacks import ConsolidateCallback
from .step import unwrap_optimizer


class PendingSave(NamedTuple):
    """A checkpoint whose writes may still run: what publishing it (or cleaning up after it) needs."""

    writes: list[Any]  # DCP's futures of an asynchronous save; [] once written
    staging: str  # the hidden folder the parts are written into
    final: str  # checkpoint-N, the name it is published under
    run_dir: str  # where rotation looks for older checkpoints
    need: int  # bytes the ranks write to this rank's file system (for a full disk's message)
    error: BaseException | None  # a failure already seen while starting the save


class AsyncSaveCallback(TrainerCallback):
    """A pending asynchronous save's two moments in the step: right before the optimizer step, wait for its host copy
    (the step would change the parameters and optimizer state being copied); at the step's end, publish it if every
    rank has written it. Holds its trainer weakly and looks its methods up at each call."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._wait_for_staging()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._publish_when_written()


class CheckpointMixin:
    """`FSDP2Mixin`'s saves: checkpoint-N (synchronous or asynchronous) and the exported model folder. Owns the save
    process groups and host buffers (`_savers`) and the save still being written (`_pending_save`); reads
    `fsdp2_config`. Adds the end-of-training export callback the config asks for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._savers: PartSavers | None = None
        self._pending_save: PendingSave | None = None
        self._unstaged: list[Any] = []  # the pending save's parts whose host copy may still run
        super().__init__(*args, **kwargs)
        self.add_callback(AsyncSaveCallback(self))
        config = self.fsdp2_config
        if config.consolidate_on_train_end and not any(
            isinstance(c, ConsolidateCallback) for c in self.callback_handler.callbacks
        ):
            self.add_callback(
                ConsolidateCallback(
                    dtype=config.export_dtype,
                    max_shard_size=config.max_shard_size,
                    merge_adapters=config.merge_adapters_on_save,
                )
            )
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ConsolidateCallback):
                callback.trainer_save = self._own_save()

    @property
    def _peft(self) -> bool:
        return facts_of(self.model).is_peft

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write checkpoint-N as a sharded DCP checkpoint under a staging name; rename it when complete."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = self._checkpoint_folder(trial)
        self._wait_for_pending_save()
        staging = begin_checkpoint(final)
        optimizer = None if self.args.save_only_model else unwrap_optimizer(self.optimizer)
        if self._savers is None:
            # NOTE: creates process groups: a collective, as is every save.
            self._savers = PartSavers(async_save=self.fsdp2_config.async_save)
        pending, need, error = [], 0, None
        try:
            parts = sharded_parts(self.model, optimizer, not self._peft)
            need = check_room(final, tensor_bytes(parts) + self._adapter_bytes())  # fails at once when plainly full
            pending = write_parts(staging, parts, self._savers, self.fsdp2_config.checkpoint_writes == "direct")
            if self._peft:
                save_adapter(self.model, staging)  # small and gathered: written before training goes on
            self._save_checkpoint_files(staging)
        except (Exception, CheckpointException) as caught:  # CheckpointException is a BaseException
            error = caught
        if self._savers.stagers:
            # NOTE: async: every rank learns of a failure here, before any goes on training (the writes in flight
            # are waited for first, so the partial folder can be removed).
            if error is not None:  # the writes' own failure first: the files they filled the disk with made ours fail
                error = wait_for_writes(pending) or error
            raise_if_write_failed(error, final, staging, need)
        self._pending_save = PendingSave(pending, staging, final, run_dir, need, error)
        self._unstaged = pending
        if not pending:
            self._wait_for_pending_save()

    def _wait_for_staging(self) -> None:
        """Wait until the pending asynchronous save's host copy is complete (before the optimizer changes the state).

        A failed copy is not raised here, on this rank alone: its writes fail with it, and the next save or the end of
        training raises that on every rank (`_wait_for_pending_save`).
        """
        unstaged, self._unstaged = self._unstaged, []
        wait_for_staging(unstaged)

    def _publish_when_written(self) -> None:
        """Publish the pending asynchronous save as soon as every rank has written it, not at the next save: a crash
        in between would lose a checkpoint that is whole on disk.

        NOTE: collective (one flag, agreed by minimum, on the savers' own gloo group: no wait for the accelerator) at
        the end of every step while an asynchronous save is pending; every rank has the same pending save, since
        every rank saves at the same steps.
        """
        if self._pending_save is None or self._savers is None or self._savers.written_flags is None:
            return
        written = writes_done(self._pending_save.writes)
        if agree([float(written)], "min", group=self._savers.written_flags)[0] == 1.0:
            self._wait_for_pending_save()

    def _checkpoint_folder(self, trial: Any) -> str:
        """checkpoint-N of this step, in the run's output folder."""
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _close_savers(self) -> None:
        """Free the save groups' host buffers once no save will follow (end of training, preemption)."""
        if self._savers is not None:
            self._savers.close()
            self._savers = None

    def _adapter_bytes(self) -> int:
        """Bytes of the adapter files rank 0 writes into a PEFT checkpoint (0 elsewhere)."""
        if not self._peft or not is_rank0():
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def _save_checkpoint_files(self, directory: str) -> None:
        """Everything beside the DCP folders: RNG (every rank), scheduler, fp16's scaler, state, args, config,
        tokenizer."""
        self._save_rng_state(directory)
        if not self.args.should_save:
            return
        if not self.args.save_only_model:
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(directory, SCHEDULER_NAME))
            # Trainer's own writer: scaler.pt when training in fp16 (the same on every rank: precision.py).
            self._save_scaler(directory)
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))
        # An adapter checkpoint gets no config.json: it is not a from_pretrained folder of the base model.
        write_model_files(None if self._peft else self.model, directory, self.processing_class)
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name = callback.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()
        self.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))

    def _wait_for_pending_save(self) -> None:
        """Finish the last save: wait for its writes, publish it under its name, rotate old checkpoints."""
        if self._pending_save is None:
            return
        pending, staging, final, run_dir, need, error = self._pending_save
        self._pending_save, self._unstaged = None, []
        error = error or wait_for_writes(pending)
        raise_if_write_failed(error, final, staging, need)  # NOTE: collective: one clear error on every rank
        commit_checkpoint(staging, final)
        if self._peft and is_rank0():
            size, base_bytes = _folder_bytes(final), _base_model_bytes(self.model)
            log_rank0(
                "%s: %.2f MiB on disk (adapter + optimizer state), %.2f%% of the %.1f MiB base model.",
                os.path.basename(final),
                size / 2**20,
                100 * size / max(base_bytes, 1),
                base_bytes / 2**20,
            )
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """The end of training waits for an asynchronous save to be complete on disk."""
        self._wait_for_pending_save()
        self._close_savers()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a from_pretrained-ready folder (weights gathered one tensor at a time, config, tokenizer)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained_sharded(
            self.model,
            output_dir,
            processing_class=self.processing_class,
            dtype=self.fsdp2_config.export_dtype,
            max_shard_size=self.fsdp2_config.max_shard_size,
            merge_adapters=self.fsdp2_config.merge_adapters_on_save,
            trainer_save=self._own_save(),
        )
        if is_rank0():
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _own_save(self) -> Callable[[str], None] | None:
        """The trainer subclass's own `_save` (sentence-transformers' writes modules.json), or None: Trainer's own
        writes what the streamed export does."""
        mro = type(self).__mro__
        own = any("_save" in vars(cls) for cls in mro[: mro.index(Trainer)] if cls is not CheckpointMixin)
        return self._save if own else None


def _base_model_bytes(model: nn.Module) -> int:
    """Bytes of the model's non-adapter parameters (global sizes), to put adapter checkpoints in proportion."""
    facts = facts_of(model)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not facts.is_adapter(n))


def _folder_bytes(folder: str) -> int:
    """Total size of the files under `folder`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
