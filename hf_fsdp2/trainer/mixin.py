"""FSDP2Mixin and FSDP2Trainer: a `transformers.Trainer` (or subclass) whose model is sharded with FSDP2
when the trainer is built.

`FSDP2Mixin` composes seven mixins, each owning its own state and listing the private hooks it touches:
`PreemptionMixin` (preemption.py), `BatchSizeMixin` (batch_size.py), `ShardingMixin` (sharding.py), `PrecisionMixin`
(precision.py), `StepMixin` (step.py), `CheckpointMixin` (checkpointing.py) and `ResumeMixin` (resuming.py). Each
sets its attributes, calls the next `__init__` (the last is Trainer's), and finishes what needs the built Trainer.
This module reads the arguments, builds the skeleton of a model given by path, and touches:
- `PreTrainedModel.from_pretrained` (replaced while a subclass's `__init__` runs, for the building thread's calls
  only; `confined_patch`): the models a subclass builds from paths become our skeletons in the class it asked for,
  sharded when Trainer or `prepare_model` gets them (`loading.path_models`; tests/test_trl_built_models.py).
- `Trainer.__init__`, for this trainer only (while its `__init__` runs, when the model is a path, its class gains a
  class just before Trainer's in the MRO): a path that reaches Trainer's `__init__` unchanged (the subclass built
  nothing from it) becomes our skeleton of the path there. Whether a subclass builds its own model is thus what it
  does, not what its signature says (tests/test_trl_built_models.py).
- `TrainingArguments.fsdp` / `fsdp_plugin_args` and Accelerate's `FullyShardedDataParallelPlugin`: read once by
  `from_accelerate.resolve_config` in `__init__` (settings carried into FSDP2Config), then `fsdp` cleared so
  Trainer builds no FSDP plugin and nothing shards the model twice (tests/test_from_accelerate*.py).
- `train` resolves `resume_from_checkpoint="auto"` and logs the memory plan once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import set_seed
from transformers.utils import logging as transformers_logging

from ..checkpoints.resume import find_resume_checkpoint
from ..config import FSDP2Config
from ..distributed import init_distributed, is_rank0
from ..loading.path_models import PLACEMENT_KWARGS, check_all_sharded, skeletons_for_paths
from ..loading.skeleton import from_pretrained
from ..optim.muon_routing import Muon
from ..planning.memory_plan import log_memory_plan
from ..versions import check_versions_once
from .batch_size import BatchSizeMixin
from .checkpointing import CheckpointMixin
from .from_accelerate import resolve_config
from .precision import PrecisionMixin
from .preemption import PreemptionMixin
from .resuming import ResumeMixin
from .sharding import ShardingMixin, validate_arguments
from .step import StepMixin


class FSDP2Mixin(
    PreemptionMixin, BatchSizeMixin, ShardingMixin, PrecisionMixin, StepMixin, CheckpointMixin, ResumeMixin
):
    """Shards the model of any `Trainer` subclass with FSDP2: put it first, `class X(FSDP2Mixin, SFTTrainer)`.

    The model is sharded when `Trainer.__init__` first sees it (`create_accelerator_and_postprocess`), so
    whatever the subclass does to it before (TRL's `get_peft_model`, say) happens on the unsharded skeleton.
    A path becomes a meta skeleton first, so no rank ever loads the whole model; a subclass that turns paths into
    models itself (TRL's) builds them, and they become our skeletons of what it asked for (`path_models`).
    """

    def __init__(self, *trainer_args: Any, fsdp2_config: FSDP2Config | None = None, **trainer_kwargs: Any) -> None:
        check_versions_once()  # before any Trainer code: an untested transformers fails here in one line
        # The next class's own signature says which argument is the model (DPOTrainer's second is ref_model).
        bound = _bind(_trainer_init(type(self)), trainer_args, trainer_kwargs)
        model, args = bound.arguments.get("model"), bound.arguments.get("args")
        validate_arguments(model, bound.arguments)
        init_distributed()
        if args is not None:
            # NOTE: Trainer applies `log_level` only after building its Accelerator, i.e. after sharding; set it
            # first so the sharding's info lines (NF4 weights kept dense, what carried from Accelerate) show.
            transformers_logging.set_verbosity(args.get_process_log_level())
        self.fsdp2_config = resolve_config(fsdp2_config, args)
        path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        if path is not None:
            bound.arguments["model"] = path  # such trainers test `isinstance(model, str)`
        self._memory_plan_logged = False
        # A subclass that turns paths into models itself (TRL's) builds them as our skeletons, in the class and
        # configuration it asks for; each is sharded when Trainer or accelerator.prepare_model receives it. A path it
        # hands on unchanged becomes our skeleton when it reaches Trainer.__init__.
        with skeletons_for_paths() as built, _skeleton_if_trainer_gets(self, path, lambda: self._skeleton(path, args)):
            super().__init__(*bound.args, **bound.kwargs)
        check_all_sharded(built)

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
        return super().train(resume_from_checkpoint, *args, **kwargs)


class FSDP2Trainer(FSDP2Mixin, Trainer):
    """`Trainer` whose model is sharded with FSDP2 on construction: `Trainer(...)` → `FSDP2Trainer(...)`."""


_DEFAULT_SEED: int = TrainingArguments.__dataclass_fields__["seed"].default
_NO_INIT_KWARGS = object()


def _trainer_init(cls: type) -> Callable[..., None]:
    """The `__init__` of the first class after FSDP2Mixin's own parts in `cls`'s MRO: the trainer it is mixed into
    (Trainer, SFTTrainer, a user's subclass), whose signature names the arguments (our parts take `*args`)."""
    mro, ours = cls.__mro__, set(FSDP2Mixin.__mro__) - {object}
    after = mro[mro.index(FSDP2Mixin) + 1 :]
    return next(klass.__init__ for klass in after if klass not in ours and "__init__" in vars(klass))


def _bind(init: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """Bind a trainer's constructor arguments by name; `(*args, **kwargs)` constructors bind as Trainer's."""
    signature = inspect.signature(init)
    if "model" not in signature.parameters:
        signature = inspect.signature(Trainer.__init__)
    # Without self: the init is the class's function, not a bound method.
    signature = signature.replace(parameters=[p for name, p in signature.parameters.items() if name != "self"])
    return signature.bind_partial(*args, **kwargs)


@contextlib.contextmanager
def _skeleton_if_trainer_gets(trainer: Trainer, path: str | None, build: Callable[[], nn.Module]) -> Iterator[None]:
    """Within the block, a `model` that reaches `Trainer.__init__` still as `path` becomes `build()`: the subclass
    built nothing from it (plain Trainer, or a subclass that only declares paths), so the path is ours to load.

    NOTE: whether a subclass builds its own model from the path is only known when its `super().__init__` reaches
    Trainer's. So this one trainer's class is, while it is built, a subclass of its own class with one more class
    just before `Trainer` in the MRO, whose `__init__` swaps the path for the skeleton; the class is restored
    afterwards. Nothing else sees it: Trainer, every other trainer and every other thread are untouched.
    """
    if path is None:
        yield
        return
    cls = type(trainer)

    class PathToSkeleton(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)
            model = bound.arguments.get("model")
            if isinstance(model, str) and model == path:
                bound.arguments["model"] = build()
            Trainer.__init__(*bound.args, **bound.kwargs)

    # Same name and module: Trainer and TRL name model cards, logs and tags after the trainer's class.
    trainer.__class__ = type(
        cls.__name__, (cls, PathToSkeleton), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )
    try:
        yield
    finally:
        trainer.__class__ = cls
