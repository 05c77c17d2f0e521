"""ModelFacts: what the pipeline needs to know about a model, derived once and handed down.

Built when the model enters load → shard (`prepare_model`, or the trainer just before it): after anything
a trainer subclass did to the skeleton (TRL's `get_peft_model` wraps it in `__init__`), so building it in
`from_pretrained` would describe a model that no longer exists. It is attached to the model object, and
loading, sharding, checkpointing and export read it instead of walking the model again.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..adapters.methods import adapter_tensor_names, base_root, base_spellings, is_peft_model
from .branches import find_branches
from .skeleton import PretrainedSource, first_meta_tensor, get_source, tie_groups

FACTS_ATTR = "_hf_fsdp2_facts"


@dataclass
class ModelFacts:
    """Ties, PEFT-ness and weight source of one model, as it was when it entered the pipeline."""

    tie_groups: list[list[str]]
    num_params: int
    # A PEFT model's adapter state by peft's own account (every name of each tensor: `adapters.adapter_tensor_names`)
    # and its adapter names; None and [] for a model that is not a PeftModel.
    adapter_tensors: frozenset[str] | None
    adapter_names: list[str]
    source: PretrainedSource | None
    # Modality branches (names) of a multimodal model and the language model they feed: see `branches`.
    branches: tuple[list[str], str | None] = ([], None)
    # Trainable parameters that sharding made float32 masters, with the dtype they were loaded in: exports
    # return to it, as save_pretrained of the model the user loaded would write it.
    upcast_from: dict[str, torch.dtype] = field(default_factory=dict)
    # Where a PEFT model keeps its transformers model (`adapters.base_root`); "" for a plain model.
    base_root: str = ""
    # A PEFT model's tensor names under its base model → (the base model's name, which copy), by peft's layers
    # (`adapters.base_spellings`); empty for a plain model.
    base_spellings: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    # Tensors the checkpoint lacks, initialized as from_pretrained would (filled in when each rank reads its
    # slices; on the rank-0 route from_pretrained itself reports them).
    missing: list[str] = field(default_factory=list)

    @property
    def is_peft(self) -> bool:
        """True for a `peft.PeftModel`."""
        return self.adapter_tensors is not None

    def is_adapter(self, name: str) -> bool:
        """True for a tensor of the PEFT adapters (which no base checkpoint holds), by any of its names."""
        return self.adapter_tensors is not None and name in self.adapter_tensors

    def base_name(self, name: str) -> str:
        """The base model's name for a tensor of a PEFT model (a modules_to_save copy: its original's); `name` itself
        for a plain model's tensor, or a tensor outside the base model (a prompt encoder's)."""
        spelling = self.base_spellings.get(name)
        return name if spelling is None else spelling[0]

    @property
    def tie_map(self) -> dict[str, list[str]]:
        """Each tie group under its first name (the name its tensor is saved and loaded under)."""
        return {names[0]: names for names in self.tie_groups}

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        """Walk `model` once and record what the later stages need."""
        peft = is_peft_model(model)
        return cls(
            tie_groups=tie_groups(model),
            num_params=len(list(model.parameters())),
            adapter_tensors=adapter_tensor_names(model) if peft else None,
            adapter_names=list(model.peft_config) if peft else [],
            source=get_source(model),
            branches=find_branches(model),
            base_root=base_root(model) if peft else "",
            base_spellings=base_spellings(model) if peft else {},
        )

    def verify(self, model: nn.Module) -> None:
        """Raise RuntimeError naming what loading broke: a meta tensor, an untied weight, an extra parameter.

        Raises:
            RuntimeError: when a tensor stayed on meta, a tie broke, or the number of parameters changed.
        """
        name = first_meta_tensor(model)
        if name is not None:
            raise RuntimeError(
                f"{name} is still on the meta device after loading: it is in no checkpoint and nothing "
                "initialized it. Check that the checkpoint matches the model class."
            )
        for names in self.tie_groups:
            first = model.get_parameter(names[0])
            for other in names[1:]:
                if model.get_parameter(other) is not first:
                    raise RuntimeError(f"{other} is no longer tied to {names[0]} after loading.")
        num_params = len(list(model.parameters()))
        if num_params != self.num_params:
            raise RuntimeError(
                f"the model has {num_params} unique parameters after loading, {self.num_params} before: "
                "a tied weight was duplicated or a parameter was added."
            )


def describe(model: nn.Module, facts: ModelFacts | None = None) -> ModelFacts:
    """Attach `facts` (or facts read now) to a model entering load → shard, for every later stage to read.

    Always fresh for a model that is not sharded yet: one left unsharded by a failed attempt may have
    changed since.
    """
    facts = facts if facts is not None else ModelFacts.of(model)
    # NOTE: through __dict__, not setattr/getattr: PeftModel forwards unknown attributes to the model it
    # wraps, so a wrapper would otherwise answer with the facts of the model inside it.
    model.__dict__[FACTS_ATTR] = facts
    return facts


def attached_facts(model: nn.Module) -> ModelFacts | None:
    """The facts `describe` attached to this very object, or None."""
    return model.__dict__.get(FACTS_ATTR)


def facts_of(model: nn.Module) -> ModelFacts:
    """The attached facts, or (a model that never went through prepare_model) facts read from it now."""
    facts = attached_facts(model)
    return facts if facts is not None else ModelFacts.of(model)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if facts_of(model).is_peft else model


def forward_source(model: nn.Module) -> str | None:
    """The source of the model class's forward, or None when it has none (a class built at run time)."""
    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
