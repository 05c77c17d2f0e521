"""Branches: sub-modules that one rank may run in a step while another skips them (a vision-language
model's image encoder on a text-only batch), kept in step so the ranks never disagree on a collective.

FSDP2 all-gathers a unit's parameters when the unit runs and reduce-scatters the gradients its parameters
received; a branch that runs on one rank only would leave the ranks in different collectives (gloo aborts,
NCCL hangs). So a branch is never a unit of its own: its parameters live in the root unit, gathered on every
rank at the root's forward, and while training, every rank gives each trainable branch parameter a gradient
(a zero one where the branch did not run), so every rank reduce-scatters the same tensors. When no rank ran
a branch in an optimizer step, its gradients go back to None before the step, as a single process would
have them (Adam then skips them rather than moving on its moments). This module finds branches and keeps
those two promises; it knows nothing about the Trainer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..distributed import agree, alone

GUARD_ATTR = "_hf_fsdp2_branch_guard"


def find_branches(model: nn.Module) -> tuple[list[str], str | None]:
    """Name the modality branches of a multimodal model, and the language model they feed.

    A multimodal base model (its config has a `text_config`) holds the language model (a child built from
    that text config) beside encoders and projectors for the other modalities; those others are branches.
    Returns ([], None) for a model without such a base.
    """
    for name, module in model.named_modules():
        text_config = getattr(getattr(module, "config", None), "text_config", None)
        if text_config is None:
            continue
        children = dict(module.named_children())
        language = [c for c, child in children.items() if isinstance(getattr(child, "config", None), type(text_config))]
        if len(language) != 1:
            continue
        prefix = f"{name}." if name else ""
        branches = [
            prefix + c for c, child in children.items() if c != language[0] and any(True for _ in child.parameters())
        ]
        return branches, prefix + language[0]
    return [], None


def branch_names(model: nn.Module, found: Iterable[str], named: Iterable[str] | None) -> list[str]:
    """The branches found by structure (`ModelFacts.branches[0]`, from `find_branches`) plus those the user named
    (dotted module names), checked to exist.

    Raises:
        ValueError: when a named module does not exist.
    """
    names = list(found)
    modules = dict(model.named_modules())
    for name in named or []:
        matches = [m for m in modules if m == name or m.endswith("." + name)]
        if not matches:
            raise ValueError(
                f"branch_modules names {name!r}, which is no module of {type(model).__name__}; give a dotted "
                f"module name such as {next(iter(n for n in modules if n), '...')!r}."
            )
        names.extend(m for m in matches if m not in names)
    return names


def inside_branch(module_name: str, branches: list[str]) -> bool:
    """True when `module_name` is a branch or lies inside one."""
    return any(module_name == b or module_name.startswith(b + ".") for b in branches)


class BranchGuard:
    """Hooks that make every rank produce the same gradients for branch parameters, step after step."""

    def __init__(self, model: nn.Module, branches: list[str], language_model: str | None) -> None:
        self.modules = [model.get_submodule(name) for name in branches]
        self.ran_in_step = self._tied_inputs = False
        self.handles = [module.register_forward_hook(self._ran) for module in self.modules]
        # The zero terms join the graph where every forward passes after its branches ran: the language model's
        # input embeddings (one elementwise pass), which backward reaches last, after the language model's
        # activations are freed, so the zero gradients are not held through the backward pass. A language model
        # called with token ids instead (CLIP's text tower) gets them on its output.
        anchor = model.get_submodule(language_model) if language_model else model
        self.handles.append(anchor.register_forward_pre_hook(self._tie_to_inputs, with_kwargs=True))
        self.handles.append(anchor.register_forward_hook(self._tie_to_output))

    def _ran(self, module: nn.Module, args: object, output: object) -> None:
        if torch.is_grad_enabled() and module.training:
            self.ran_in_step = True

    def _zero(self, module: nn.Module) -> torch.Tensor | None:
        """0 * (sum of every trainable branch parameter) while training: zero gradients, exactly.

        Every one, not only those of branches that did not run: a branch that ran may still leave parameters
        unused (CLIP's post_layernorm when LLaVA reads a hidden layer), and those must not differ either.
        """
        if not (torch.is_grad_enabled() and module.training):
            return None
        params = [p for branch in self.modules for p in branch.parameters() if p.requires_grad]
        if not params:  # frozen after sharding
            return None
        return torch.stack([p.sum() for p in params]).sum().mul(0.0)

    def _tie_to_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        embeds = kwargs.get("inputs_embeds")
        zero = self._zero(module) if isinstance(embeds, torch.Tensor) else None
        self._tied_inputs = zero is not None
        if zero is None:
            return None
        return args, {**kwargs, "inputs_embeds": embeds + zero.to(embeds.dtype)}

    def _tie_to_output(self, module: nn.Module, args: object, output: object) -> object:
        if self._tied_inputs:
            self._tied_inputs = False
            return output
        zero = self._zero(module)
        return output if zero is None else _add_to_first_tensor(output, zero)

    def before_optimizer_step(self, *unused: object) -> None:
        """Branches no rank ran since the last step get None gradients, as in one process.

        NOTE: collective. Every rank calls it once per optimizer step, before the step.
        """
        ran = agree([int(self.ran_in_step)], "max")[0]
        self.ran_in_step = False
        if ran:
            return
        for branch in self.modules:
            for param in branch.parameters():
                param.grad = None

    def trains(self) -> bool:
        """True when some branch parameter is trainable (only then are zero gradients needed)."""
        return any(p.requires_grad for m in self.modules for p in m.parameters())


def attach_branch_guard(model: nn.Module, branches: list[str], language_model: str | None) -> None:
    """Install the guard on a sharded model whose branches hold trainable parameters (kept on the model)."""
    if not branches or alone():
        return
    guard = BranchGuard(model, branches, language_model)
    if guard.trains():
        model.__dict__[GUARD_ATTR] = guard
    else:
        for handle in guard.handles:
            handle.remove()


def guard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Let the model's branch guard put back None gradients before each step of `optimizer`."""
    guard = model.__dict__.get(GUARD_ATTR)
    if guard is not None:
        optimizer.register_step_pre_hook(guard.before_optimizer_step)


def _add_to_first_tensor(output: object, zero: torch.Tensor) -> object:
    """`output` with `zero` added to its first floating tensor (a ModelOutput, a tuple or a tensor)."""
    if isinstance(output, torch.Tensor):
        return output + zero
    if isinstance(output, tuple) and not hasattr(output, "keys"):
        return (_add_to_first_tensor(output[0], zero), *output[1:])
    for key, value in output.items():  # a ModelOutput: its first field is the hidden states (or the loss)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            output[key] = value + zero
            return output
    raise RuntimeError(f"cannot attach the branches' zero gradients to an output of type {type(output).__name__}")
