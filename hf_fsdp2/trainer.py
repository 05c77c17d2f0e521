"""FSDP2Mixin and FSDP2Trainer: a `transformers.Trainer` (or subclass) whose model is sharded with FSDP2
when the trainer is built.

With its parts (`trainer_sharding`, `trainer_step`, `trainer_checkpoint`, `trainer_resume`), the only module that
knows Trainer/Accelerate internals; each part lists the private hooks it touches. This module composes the parts
(`FSDP2Mixin`); the hooks it touches itself:
- `PreTrainedModel.from_pretrained` (patched while a subclass's `__init__` runs, when its signature takes `model` as
  a path): the models a subclass builds from paths become our skeletons in the class it asked for, sharded when
  Trainer or `prepare_model` gets them (`path_models`; tests/test_trl_built_models.py).
- `is_distributed_loading_by_transformers` (set after `__init__`): Trainer's path for models sharded
  before it sees them; `_prepare_for_training` then skips Accelerate's DDP/FSDP wrap.
  Guarded by tests/test_parity.py (a second wrap fails with "mixed torch.Tensor and DTensor").
  Set after `__init__` because `__init__` refuses checkpointing for transformers' own sharded models.
- `TrainingArguments.fsdp` / `fsdp_plugin_args` and Accelerate's `FullyShardedDataParallelPlugin`: read once by
  `from_accelerate.resolve_config` in `__init__` (settings carried into FSDP2Config), then `fsdp` cleared so
  Trainer builds no FSDP plugin and nothing shards the model twice (tests/test_from_accelerate*.py).
- `model_accepts_loss_kwargs`: cleared when the model's loss ignores `num_items_in_batch`, else
  Trainer multiplies such losses by the world size (tests/test_parity.py classification); set when a model marked
  `accepts_loss_kwargs = False` still hands **kwargs to its `loss_function` (tests/test_vlm.py qwen2_5_vl).
- `train` resolves `resume_from_checkpoint="auto"`, logs the memory plan once, and handles the preemption signals
  while it runs (`preemption.PreemptionWatcher`); a callback's `on_step_end` turns an agreed stop into
  `control.should_save`, and `_save_checkpoint` then writes that step synchronously and raises `Preempted`
  (`trainer_resume`), skipping `on_train_end` and its export (tests/test_failures.py).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import set_seed
from transformers.utils import logging as transformers_logging

from .adapter_checkpoint import check_mergeable, check_trainable_are_saved
from .adapters import check_supported
from .branches import guard_optimizer
from .callbacks import ConsolidateCallback
from .checkpoint import PartSavers
from .config import FSDP2Config
from .distributed import init_distributed, is_rank0, log_rank0
from .facts import describe, facts_of, unwrap_peft
from .from_accelerate import resolve_config
from .memory_plan import log_memory_plan
from .model import prepare_model
from .muon import Muon
from .optimizers import adapt_optimizer
from .path_models import PLACEMENT_KWARGS, check_all_sharded, loading_for_real, skeletons_for_paths
from .preemption import PreemptionCallback, PreemptionWatcher
from .resume import find_resume_checkpoint
from .sequence_parallel import SequenceParallel, check_model
from .skeleton import from_pretrained
from .trainer_checkpoint import CheckpointMixin, _consolidate_callback
from .trainer_resume import ResumeMixin
from .trainer_sharding import (
    ShardingMixin,
    _validate_args,
    _validate_training_args,  # noqa: F401  (re-exported: tests import it from here)
)
from .trainer_step import (
    StepMixin,
    _check_sequence_parallel_trainer,
    _loss_uses_num_items,
    _own_compute_loss,  # noqa: F401  (re-exported: tests import it from hf_fsdp2.trainer)
    _passes_num_items_to_loss,
    _unwrap_optimizer,
    repoint_optimizer,
)
from .versions import check_versions_once


class FSDP2Mixin(ShardingMixin, StepMixin, CheckpointMixin, ResumeMixin):
    """Shards the model of any `Trainer` subclass with FSDP2: put it first, `class X(FSDP2Mixin, SFTTrainer)`.

    The model is sharded when `Trainer.__init__` first sees it (`create_accelerator_and_postprocess`), so
    whatever the subclass does to it before (TRL's `get_peft_model`, say) happens on the unsharded skeleton.
    A path becomes a meta skeleton first, so no rank ever loads the whole model; a subclass that turns paths into
    models itself (TRL's) builds them, and they become our skeletons of what it asked for (`path_models`).
    """

    def __init__(self, *trainer_args: Any, fsdp2_config: FSDP2Config | None = None, **trainer_kwargs: Any) -> None:
        check_versions_once()  # before any Trainer code: an untested transformers fails here in one line
        # The next class's own signature says which argument is the model (DPOTrainer's second is ref_model).
        bound = _bind(super().__init__, trainer_args, trainer_kwargs)
        model, args = bound.arguments.get("model"), bound.arguments.get("args")
        _validate_args(model, bound.arguments)
        init_distributed()
        if args is not None:
            # NOTE: Trainer applies `log_level` only after building its Accelerator, i.e. after sharding; set it
            # first so the sharding's info lines (NF4 weights kept dense, what carried from Accelerate) show.
            transformers_logging.set_verbosity(args.get_process_log_level())
        self.fsdp2_config = resolve_config(fsdp2_config, args)
        builds_own = _builds_from_paths(super().__init__)
        if isinstance(model, (str, os.PathLike)) and not builds_own:
            bound.arguments["model"] = self._skeleton(model, args)
        elif isinstance(model, os.PathLike):
            bound.arguments["model"] = os.fspath(model)  # such trainers test `isinstance(model, str)`
        self._original_names: dict[int, str] = {}
        self._sequence_parallel: SequenceParallel | None = None
        self._memory_plan_logged = False
        self._savers: PartSavers | None = None
        self._pending_save: tuple[list[Any], str, str, str] | None = None
        # A subclass that turns paths into models itself (TRL's) builds them as our skeletons, in the class and
        # configuration it asks for; each is sharded when Trainer or accelerator.prepare_model receives it.
        with skeletons_for_paths() if builds_own else contextlib.nullcontext([]) as built:
            super().__init__(*bound.args, **bound.kwargs)
        check_all_sharded(built)
        self.is_distributed_loading_by_transformers = True
        if self.fsdp2_config.sequence_parallel_size > 1:
            _check_sequence_parallel_trainer(self)
        if not _loss_uses_num_items(self.model):
            self.model_accepts_loss_kwargs = False
        elif not self.model_accepts_loss_kwargs and _passes_num_items_to_loss(self.model):
            # NOTE: transformers marks many VLMs `accepts_loss_kwargs = False` (a gradient-accumulation workaround,
            # transformers#37208), so Trainer averages per-rank mean losses: N ranks then train on another loss than
            # one process whenever their token counts differ. Their forward hands **kwargs to `loss_function`, so
            # the global token count normalizes exactly (tests/test_vlm.py qwen2_5_vl).
            self.model_accepts_loss_kwargs = True
            log_rank0(
                "%s passes num_items_in_batch to its loss: losses are normalized by the global token count, as in "
                "one process.",
                type(self.model).__name__,
            )
        if self.optimizer is not None:
            repoint_optimizer(self.optimizer, self._original_names, self.model)
            adapt_optimizer(_unwrap_optimizer(self.optimizer))
            guard_optimizer(self.model, _unwrap_optimizer(self.optimizer))
        self._preemption = PreemptionWatcher(
            self.fsdp2_config.checkpoint_on_signals, self.fsdp2_config.signal_check_steps
        )
        self.add_callback(PreemptionCallback(self._preemption))
        if self.fsdp2_config.consolidate_on_train_end and not any(
            isinstance(c, ConsolidateCallback) for c in self.callback_handler.callbacks
        ):
            self.add_callback(_consolidate_callback(self.fsdp2_config))
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ConsolidateCallback):
                callback.trainer_save = self._own_save()

    @staticmethod
    def _skeleton(path: str | os.PathLike, args: TrainingArguments | None) -> nn.Module:
        """The meta skeleton of a model path, built right after seeding as a single process would load it.

        A TrainingArguments subclass that carries `model_init_kwargs` (TRL's configs) loads paths with them,
        in float32 unless they say otherwise, as that trainer itself would have.
        """
        set_seed(args.seed if args is not None else _DEFAULT_SEED)
        init_kwargs = getattr(args, "model_init_kwargs", _NO_INIT_KWARGS)
        if init_kwargs is _NO_INIT_KWARGS:
            return from_pretrained(path)
        kwargs = {k: v for k, v in (init_kwargs or {}).items() if k not in PLACEMENT_KWARGS}
        kwargs.setdefault("dtype", "float32")
        return from_pretrained(path, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's train(); `resume_from_checkpoint="auto"` resumes from the newest readable checkpoint in
        output_dir if there is one and starts fresh otherwise, so one command serves every (re)launch."""
        if resume_from_checkpoint == "auto":
            resume_from_checkpoint = find_resume_checkpoint(self.args.output_dir)
        if is_rank0() and not self._memory_plan_logged:
            self._memory_plan_logged = True
            # hf_fsdp2.Muon given as optimizer_cls_and_kwargs: plan its state, not that of args.optim.
            optim = "muon" if (self.optimizer_cls_and_kwargs or (None,))[0] is Muon else None
            log_memory_plan(self.model, self.args, self.fsdp2_config, self.train_dataset, optim)
        with self._preemption.watching():
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _shard(self, model: nn.Module) -> nn.Module:
        """Check, then shard `model` and load its weights; remember parameter names to re-point an optimizer."""
        facts = facts_of(model) if isinstance(model, FSDPModule) else describe(model)
        if facts.is_peft:
            check_supported(model)
            check_trainable_are_saved(model)
            if self.fsdp2_config.merge_adapters_on_save:
                check_mergeable(model)
        elif self.fsdp2_config.merge_adapters_on_save:
            raise ValueError(
                "FSDP2Config(merge_adapters_on_save=True) needs a PEFT model (get_peft_model(model, LoraConfig(...)) "
                "or a trainer's peft_config); this model has no adapters. Turn the option off."
            )
        size = self.fsdp2_config.sequence_parallel_size
        if size > 1:
            implementation = check_model(unwrap_peft(model), size, dist.get_world_size())
            self._sequence_parallel = SequenceParallel(size, implementation)
            log_rank0(
                "Sequence parallelism: groups of %d consecutive ranks share each row (%s attention per document, "
                "%d groups); the loss runs in chunks of %s tokens.",
                size,
                implementation,
                dist.get_world_size() // size,
                self.fsdp2_config.effective_loss_chunk_size,
            )
        self._original_names = {id(p): name for name, p in model.named_parameters()}
        with loading_for_real():
            sharded = prepare_model(model, self.fsdp2_config, bf16=self.args.bf16, fp16=self.args.fp16, facts=facts)
        if sharded is not model:
            raise RuntimeError("prepare_model must shard in place: Trainer.__init__ keeps the object it was given.")
        sharded._is_fsdp_managed_module = True
        return sharded


class FSDP2Trainer(FSDP2Mixin, Trainer):
    """`Trainer` whose model is sharded with FSDP2 on construction: `Trainer(...)` → `FSDP2Trainer(...)`."""


_DEFAULT_SEED: int = TrainingArguments.__dataclass_fields__["seed"].default
_NO_INIT_KWARGS = object()


def _bind(init: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """Bind a trainer's constructor arguments by name; `(*args, **kwargs)` constructors bind as Trainer's."""
    signature = inspect.signature(init)
    if "model" not in signature.parameters:
        signature = inspect.signature(Trainer.__init__)
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])  # without self
    return signature.bind_partial(*args, **kwargs)


def _builds_from_paths(init: Callable[..., None]) -> bool:
    """True when the trainer's own constructor declares that `model` may be a path (TRL's: `str | PreTrainedModel`):
    it builds the model itself, so the class and configuration are its own (RewardTrainer's `num_labels=1`)."""
    parameter = inspect.signature(init).parameters.get("model")
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return False
    return "str" in re.findall(r"\w+", str(parameter.annotation))
