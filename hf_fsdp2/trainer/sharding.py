"""Where `FSDP2Mixin` shards: the model Trainer is given, each model `model_init` returns, and extra models a subclass
prepares; the checks on arguments and processes that come first.

It decides when and what is sharded; how is `model.prepare_model`'s. Every private Trainer/Accelerate hook it touches:
- `create_accelerator_and_postprocess`: the first thing `Trainer.__init__` calls after storing the model;
  the model is sharded there (in place), after a subclass's own `__init__` changed it (TRL's
  `get_peft_model`) and before Trainer reads it (tests/test_trl.py, tests/test_dropin.py).
- `call_model_init`: each model `model_init` returns is sharded (tests/test_dropin.py model_init).
- `Accelerator.prepare_model` (wrapped on the instance): an extra model a subclass prepares for evaluation
  (DPO's reference) is sharded frozen instead of replicated (tests/test_trl.py dpo_full).
- `TrainingArguments._setup_devices` (its cached value dropped, then computed again): on a machine without
  accelerators under torchrun, `use_cpu` is set so Accelerate sees the CPU process group
  (tests/test_trainer.py without use_cpu at 2 ranks; tests/test_readme.py runs the README's script as written).
- `_move_model_to_device`: a no-op; sharding placed the model (moving DTensors would break offload).
- `evaluate` (and the end of `__init__`) reshard every unit: no-grad forwards leave the root gathered, and TRL's
  precomputed reference log-probs run them in `__init__` (tests/test_trl_built_models.py dpo_precompute).
- `_build_accelerator_args`: mixed_precision="no" so Accelerate adds no autocast; precision belongs to
  FSDP2's MixedPrecisionPolicy (tests/test_parity.py::bf16).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainingArguments

from ..adapters.methods import check_supported
from ..checkpoints.adapters import check_mergeable, check_trainable_are_saved
from ..config import FSDP2Config
from ..distributed import get_device, log_rank0
from ..loading.facts import describe, facts_of, unwrap_peft
from ..loading.path_models import loading_for_real
from ..loading.skeleton import from_pretrained
from ..long_rows.sequence_parallel import SequenceParallel, check_model
from ..model import prepare_model
from ..sharding.liger import check_liger_machine, check_liger_model
from ..sharding.units import reshard_all, select_units
from .argument_verdicts import refuse_arguments
from .batch_size import check_batch_size_search


class ShardingMixin:
    """`FSDP2Mixin`'s sharding entry points: Trainer's model when it first sees it, `model_init`'s, and extra models
    Accelerate prepares. Owns the parameter names before sharding (`_original_names`, to re-point an optimizer built
    over the unsharded model) and the sequence-parallel layout (`_sequence_parallel`); reads `fsdp2_config`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._original_names: dict[int, str] = {}
        self._sequence_parallel: SequenceParallel | None = None
        super().__init__(*args, **kwargs)
        # Trainer's path for models sharded before it sees them: `_prepare_for_training` then skips Accelerate's
        # DDP/FSDP wrap. Set after Trainer.__init__, which refuses checkpointing for transformers' own sharded models.
        self.is_distributed_loading_by_transformers = True
        # NOTE: a no-grad forward in a subclass's __init__ (TRL's precomputed reference log-probs) leaves the root
        # unit gathered: its parameters would read as plain tensors, not the DTensors training updates.
        reshard_all(self.model)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluate(), with every unit resharded after: its no-grad forwards leave the root gathered, so
        `trainer.model`'s parameters are the sharded DTensors again (and the gathered copy is freed)."""
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            reshard_all(self.model)

    def create_accelerator_and_postprocess(self) -> None:
        """Shard the model when Trainer first sees it, then let Accelerate shard extra models too."""
        validate_training_args(self.args, self.fsdp2_config)
        _adopt_cpu_process_group(self.args)
        _check_world_size(self.args)
        if self.model is not None:
            # NOTE: in place; Trainer.__init__ goes on with its own reference to this same object.
            self.model = self._shard(self.model)
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = _sharding_extra_models(self.accelerator.prepare_model, self)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """Shard each model `model_init` returns, as a model passed directly (Trainer seeds before the call)."""
        model = super().call_model_init(trial)
        if isinstance(model, (str, os.PathLike)):
            model = from_pretrained(model)
        return self._shard(model)

    def _shard(self, model: nn.Module) -> nn.Module:
        """Check, then shard `model` and load its weights; remember parameter names to re-point an optimizer."""
        facts = facts_of(model) if isinstance(model, FSDPModule) else describe(model)
        if facts.is_peft:
            check_supported(model)  # first: a method we refuse is named before what its parameters would break
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
        if self.args.use_liger_kernel:
            # Trainer applies Liger in train(), to the sharded model (sharding/liger.py); its fused loss must find the
            # head whole in the root unit's forward.
            units = select_units(model, self.fsdp2_config)
            check_liger_model(model, units, self.args.liger_kernel_config, self.fsdp2_config)
        self._original_names = {id(p): name for name, p in model.named_parameters()}
        with loading_for_real():
            sharded = prepare_model(model, self.fsdp2_config, bf16=self.args.bf16, fp16=self.args.fp16, facts=facts)
        if sharded is not model:
            raise RuntimeError("prepare_model must shard in place: Trainer.__init__ keeps the object it was given.")
        sharded._is_fsdp_managed_module = True
        return sharded

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Leave placement to sharding."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Keep Accelerate's autocast out: FSDP2's MixedPrecisionPolicy owns precision."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        return accelerator_args


def _sharding_extra_models(
    accelerate_prepare: Callable[..., nn.Module], trainer: ShardingMixin
) -> Callable[..., nn.Module]:
    """Wrap `Accelerator.prepare_model` so a subclass's extra model (DPO's reference) is sharded, not replicated.

    Trainer itself prepares its own (already sharded) model through it; any other model prepared for
    evaluation is frozen and sharded like the trained one (a frozen root reshards after every forward).
    """

    def prepare(model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> nn.Module:
        if evaluation_mode and model is not trainer.model and not isinstance(model, FSDPModule):
            model.requires_grad_(False)
            with loading_for_real():
                return prepare_model(model, trainer.fsdp2_config, bf16=trainer.args.bf16, fp16=trainer.args.fp16).eval()
        return accelerate_prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    return prepare


def validate_arguments(model: Any, kwargs: dict[str, Any]) -> None:
    """Reject a trainer with nothing to train before any process group is started."""
    if model is None and kwargs.get("model_init") is None:
        raise ValueError(
            "FSDP2Trainer needs `model` (a path to a Hugging Face model folder or an nn.Module) or `model_init`."
        )


def validate_training_args(args: TrainingArguments, config: FSDP2Config) -> None:
    """Reject TrainingArguments fields sharding cannot honour (`argument_verdicts`), Liger on a machine without its
    GPU backend, and activations checkpointed twice (their FSDP settings were carried into FSDP2Config already:
    from_accelerate)."""
    refuse_arguments(args)
    check_batch_size_search(args)
    if args.use_liger_kernel:
        check_liger_machine(get_device())
    if args.activation_checkpointing and config.fsdp_activation_checkpointing:
        raise ValueError(
            "Both TrainingArguments(activation_checkpointing=True) and FSDP2Config(fsdp_activation_checkpointing=True) "
            "are set; keep only FSDP2Config's, which checkpoints each FSDP unit."
        )


def _adopt_cpu_process_group(args: TrainingArguments) -> None:
    """On a machine without accelerators, let Accelerate see torchrun's CPU process group (no use_cpu=True needed).

    Accelerate counts torchrun's processes on the CPU only with `use_cpu=True`; without it every rank would
    train alone on the same batches. The same script then runs on a laptop and on a GPU cluster.
    """
    launched = dist.get_world_size()
    if args.use_cpu or launched == 1 or args.world_size == launched or torch.accelerator.is_available():
        return
    args.use_cpu = True
    args.dataloader_pin_memory = False  # what TrainingArguments itself sets for use_cpu
    args.__dict__.pop("_setup_devices", None)  # the cached device set-up made without use_cpu
    args._setup_devices  # noqa: B018  (set up again: resets Accelerate's state, which now sees the CPU group)
    log_rank0("No accelerator on this machine: training on the CPU process group of %d ranks (use_cpu=True).", launched)


def _check_world_size(args: TrainingArguments) -> None:
    """Refuse a Trainer that sees one process while torchrun started several (it would not split the data)."""
    launched = dist.get_world_size()
    if launched > 1 and args.world_size != launched:
        raise ValueError(
            f"torchrun started {launched} processes but TrainingArguments sees world_size={args.world_size} on "
            f"{args.device}, so every rank would train on the same batches. Launch one process per accelerator "
            "(torchrun --nproc_per_node = the number of devices), or pass use_cpu=True to train on the CPU."
        )
