"""TRL's trainers with FSDP2: `FSDP2SFTTrainer`, `FSDP2DPOTrainer`, `FSDP2KTOTrainer`, `FSDP2RewardTrainer`,
`FSDP2GRPOTrainer` and `FSDP2RLOOTrainer` (install the extra: `hf_fsdp2[trl]`).

Each is `FSDP2Mixin` placed before the TRL trainer, so what TRL does to the model in its own `__init__`
(`get_peft_model` for `peft_config`, its fused LM head) happens on the unsharded skeleton, and DPO's and KTO's
reference models are sharded too (frozen, no optimizer state) instead of replicated on every rank. A model given as a
path is built by TRL itself, in the class and configuration it asks for (RewardTrainer's `num_labels=1` classifier,
`model_init_kwargs`), as our meta skeleton: each rank reads only its slices (`hf_fsdp2.loading.path_models`).
GRPO's generation goes through the sharded model's `generate`, which gathers every unit once per call
(`hf_fsdp2.gathered`); with `use_vllm=True`, vLLM generates and gets the full weights after each step, one FSDP unit
at a time (`export.engine_weights`), with LoRA merged into copies, instead of TRL's per-parameter gather, which only
knows models sharded by Accelerate.

TRL internals touched: the `vllm_generation` object of GRPO and RLOO: its `_iter_named_params`, which TRL's server
mode streams, and `sync_weights`, replaced for colocate mode by one `load_weights` call per unit (sleep mode's
wake-up and the prefix-cache reset kept as TRL does them; tests/test_vllm.py, with real vLLM). `hash_module` in
`trl.trainer.dpo_trainer` and `trl.trainer.kto_trainer` (replaced while `FSDP2DPOTrainer`/`FSDP2KTOTrainer.__init__`
runs, for that trainer's models in the building thread only; `confined_patch`), which names the cache of
precomputed reference log-probs from the weights; ours hashes the gathered full weights instead of failing on
DTensors (tests/test_trl_built_models.py dpo_precompute*, kto_precompute).
"""

from __future__ import annotations

try:
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("hf_fsdp2.trl needs TRL, which is an optional extra: pip install 'hf_fsdp2[trl]'") from error

import atexit
import hashlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer
from trl.trainer import dpo_trainer, kto_trainer

from .confined_patch import ConfinedPatch
from .export.engine_weights import named_full_weights, unit_buckets
from .loading.facts import attached_facts
from .trainer.mixin import FSDP2Mixin

__all__ = [
    "FSDP2DPOTrainer",
    "FSDP2GRPOTrainer",
    "FSDP2KTOTrainer",
    "FSDP2RLOOTrainer",
    "FSDP2RewardTrainer",
    "FSDP2SFTTrainer",
]


class FSDP2SFTTrainer(FSDP2Mixin, SFTTrainer):
    """`trl.SFTTrainer` whose model (with its `peft_config` adapters) is sharded with FSDP2."""


def full_weights_hash(module: nn.Module) -> str:
    """TRL's `hash_module` of the unsharded model: the same sha256, from each full tensor gathered in turn.

    TRL names the cache of precomputed reference log-probs with it; one process and N ranks share one name. Trainable
    weights upcast to float32 masters are hashed in the dtype they were loaded in, as one process holds them.

    NOTE: collective for a sharded module (one all-gather per sharded tensor, in sorted name order on every rank);
    TRL calls it in `__init__`, which every rank runs.
    """
    facts = attached_facts(module)
    upcast = facts.upcast_from if facts is not None else {}
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach().cpu().to(upcast.get(name, tensor.dtype))
        digest.update(str(tensor.dtype).encode())
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = tensor.to(torch.float32)  # as TRL: numpy has no such dtypes
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def _hashing_for(original: Callable[[nn.Module], str], patch: ConfinedPatch[Trainer]) -> Callable[[nn.Module], str]:
    """The `hash_module` that hashes full weights for the models of the trainer this thread is building."""

    def hash_module(module: nn.Module) -> str:
        trainer = patch.current()
        ours = trainer is not None and any(module is getattr(trainer, name, None) for name in ("model", "ref_model"))
        return full_weights_hash(module) if ours else original(module)

    return hash_module


# NOTE: TRL names the cache of precomputed reference log-probs with its module-level `hash_module`, called in the
# middle of DPOTrainer/KTOTrainer.__init__ on the already sharded model, with no argument or method to override, and
# it cannot read DTensors. Confined (confined_patch.py): replaced only while one of ours is built, and only for that
# thread's calls on that trainer's own model or reference model; any other call runs TRL's.
_DPO_HASH: ConfinedPatch[Trainer] = ConfinedPatch(dpo_trainer, "hash_module", lambda f: _hashing_for(f, _DPO_HASH))
_KTO_HASH: ConfinedPatch[Trainer] = ConfinedPatch(kto_trainer, "hash_module", lambda f: _hashing_for(f, _KTO_HASH))


class FSDP2DPOTrainer(FSDP2Mixin, DPOTrainer):
    """`trl.DPOTrainer` whose policy and reference models are sharded with FSDP2.

    With a PEFT policy there is no separate reference model: TRL disables the adapters to get it. With
    `precompute_ref_log_probs=True` the cache is named from the full weights, as in one process.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _DPO_HASH.window(self):
            super().__init__(*args, **kwargs)


class FSDP2KTOTrainer(FSDP2Mixin, KTOTrainer):
    """`trl.KTOTrainer` whose policy and reference models are sharded with FSDP2, as `FSDP2DPOTrainer`.

    KTO's KL term pairs each rank's own rows, so at N ranks it trains as TRL does under DDP at N ranks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _KTO_HASH.window(self):
            super().__init__(*args, **kwargs)


class FSDP2RewardTrainer(FSDP2Mixin, RewardTrainer):
    """`trl.RewardTrainer` whose reward model is sharded with FSDP2; given a path (a causal LM or a classifier
    checkpoint), TRL's own `num_labels=1` classifier is what gets built and sharded."""


def sync_full_weights_to_vllm(generation: Any, model: nn.Module) -> None:
    """Make TRL's vLLM generation object take the sharded model's full weights, a unit at a time.

    Server mode: TRL streams what `_iter_named_params` yields (rank 0 sends; every rank takes part in the gathers).
    Colocate mode: every rank's own vLLM engine loads each unit's weights in one `load_weights` call.
    """
    generation._iter_named_params = lambda: named_full_weights(model)
    if generation.mode != "colocate":
        return
    _shut_engine_down_first(generation.llm)

    def sync_weights() -> None:
        if generation.enable_sleep_mode:  # as TRL: map the engine's weight memory before writing into it
            generation.llm.wake_up(tags=["weights"])
            generation._llm_weights_sleeping = False
        engine_model = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for bucket in unit_buckets(model):
            engine_model.load_weights(bucket)
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def _shut_engine_down_first(llm: Any) -> None:
    """At exit, shut the colocated vLLM engine down before hf_fsdp2 ends the process group.

    NOTE: vLLM's shutdown destroys its own groups (and the default one); run after hf_fsdp2's exit handler had ended
    them, it printed "Invalid process group specified" on every rank. atexit runs handlers last-in, first-out, and
    this one is registered after hf_fsdp2 joined the group. After vLLM's shutdown hf_fsdp2 finds no group to end.
    """
    engine = weakref.ref(llm)

    def shut_down() -> None:
        alive = engine()
        if alive is not None:
            alive.llm_engine.engine_core.shutdown()

    atexit.register(shut_down)


class _FullWeightsForVLLM:
    """With `use_vllm=True`: vLLM gets the full weights of the sharded policy (`sync_full_weights_to_vllm`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except ValueError as error:
            if "Sleep mode is not supported" not in str(error):
                raise
            raise ValueError(
                "vllm_enable_sleep_mode=True: vLLM has sleep mode only on CUDA, ROCm and XPU GPUs, and refuses it "
                "here. Set vllm_enable_sleep_mode=False on this machine."
            ) from error
        if getattr(self, "vllm_generation", None) is not None:
            sync_full_weights_to_vllm(self.vllm_generation, self.model)


class FSDP2GRPOTrainer(_FullWeightsForVLLM, FSDP2Mixin, GRPOTrainer):
    """`trl.GRPOTrainer` (online RL: generate, score, update) whose policy is sharded with FSDP2.

    Completions are generated on the sharded policy with every unit gathered once per generation; with `beta > 0`
    the reference model is sharded frozen, as DPO's; with `peft_config`, checkpoints hold the adapter only.
    """


class FSDP2RLOOTrainer(_FullWeightsForVLLM, FSDP2Mixin, RLOOTrainer):
    """`trl.RLOOTrainer` (REINFORCE leave-one-out) whose policy is sharded with FSDP2, as `FSDP2GRPOTrainer`."""
