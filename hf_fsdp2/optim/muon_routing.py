"""`Muon`, the optimizer factory Trainer calls with the model: which parameters go to Muon, which to AdamW, and with
what hyper-parameters (TrainingArguments, `optim_args`, then the factory's own keywords).

It reads module types and the model's `_no_split_modules`, never shards or process groups (`muon` steps them).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from .muon import ADAMW_DEFAULTS, MUON_DEFAULTS, MuonAdamW

UsePredicate = Callable[[str, nn.Parameter], bool]
# Keywords of the factory besides the groups' own: the AdamW part's are `adamw_` + torch.optim.AdamW's names.
ADAMW_KEYWORDS = {f"adamw_{key}": key for key in ADAMW_DEFAULTS}
# Muon's defaults under the factory: one learning rate serves both parts, so Muon's update is scaled to AdamW's RMS
# (Moonlight's "match_rms_adamw"); torch's own default (None) expects a learning rate ~50x AdamW's.
FACTORY_MUON_DEFAULTS = {**MUON_DEFAULTS, "adjust_lr_fn": "match_rms_adamw"}
_OPTIM_ARGS_TYPES: dict[str, Callable[[str], Any]] = {
    "lr": float, "weight_decay": float, "momentum": float, "eps": float, "ns_steps": int, "ns_dtype": str,
    "adjust_lr_fn": lambda v: None if v.lower() == "none" else v, "nesterov": lambda v: _boolean(v),
    "adamw_lr": float, "adamw_weight_decay": float, "adamw_eps": float,
}  # fmt: skip


def _boolean(value: str) -> bool:
    """'true'/'false' (any case) as a bool.

    Raises:
        ValueError: for anything else.
    """
    if value.lower() not in ("true", "false"):
        raise ValueError(f"optim_args nesterov={value!r}: write nesterov=true or nesterov=false.")
    return value.lower() == "true"


def parse_optim_args(optim_args: str | None) -> dict[str, Any]:
    """`TrainingArguments.optim_args` ("momentum=0.9,ns_steps=6") as the factory's keywords, typed.

    Raises:
        ValueError: for a key the factory does not take from a string, naming those it does.
    """
    parsed: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (optim_args or "").split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in _OPTIM_ARGS_TYPES:
            raise ValueError(
                f"optim_args has {key!r}, which hf_fsdp2.Muon does not take; it takes {sorted(_OPTIM_ARGS_TYPES)} "
                "(others, e.g. ns_coefficients or adamw_betas, as keywords in optimizer_cls_and_kwargs)."
            )
        parsed[key] = _OPTIM_ARGS_TYPES[key](value.strip())
    return parsed


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: instances of its `_no_split_modules` classes that do not hold the input
    embeddings (ViT lists `ViTEmbeddings` there); a model without such instances: the members of its ModuleLists."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = getter() if callable(getter) else None
    except NotImplementedError:  # transformers' base raises it for models without a text embedding
        embeddings = None
    # NOTE: by the MRO: fully_shard turns a LlamaDecoderLayer into an FSDPLlamaDecoderLayer subclass.
    found = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if found:
        return [m for m in found if embeddings is None or all(s is not embeddings for s in m.modules())]
    return [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's transposed Linear) and its subclasses."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def muon_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters Muon takes by role: the 2-D weights of Linear layers and the 3-D parameters (MoE expert
    stacks) inside the repeated blocks, except the output embeddings. Everything else (embeddings, every head outside
    the blocks: LM, classification, score, regression; norms, biases, convolutions, ViT's cls_token) is AdamW's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    chosen: set[int] = set()
    for block in _blocks(model):
        for module in block.modules():
            for name, param in module.named_parameters(recurse=False):
                linear_weight = _is_linear(module) and name == "weight" and param.ndim == 2
                stack = param.ndim == 3 and not isinstance(module, nn.modules.conv._ConvNd)
                if (linear_weight or stack) and id(param) not in head_ids:
                    chosen.add(id(param))
    return chosen


def split_for_muon(
    model: nn.Module, use_muon: UsePredicate | None = None
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters as (Muon's, AdamW's), by role (`muon_parameters`) or by `use_muon(name, param)`."""
    by_role = muon_parameters(model) if use_muon is None else set()
    muon, adamw, seen = [], [], set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        to_muon = use_muon(name, param) if use_muon is not None else id(param) in by_role
        if to_muon and param.ndim not in (2, 3):
            raise ValueError(
                f"use_muon chose {name} of shape {tuple(param.shape)}; Muon updates matrices (2-D) and expert "
                "stacks (3-D). Return False for it."
            )
        (muon if to_muon else adamw).append(param)
    return muon, adamw


def _trainer_decay_names(model: nn.Module) -> set[str]:
    """Trainer's own weight-decay split (norms and biases excluded), for a factory called without one."""
    from transformers import Trainer

    # NOTE: Trainer.get_decay_parameter_names reads only the model; called unbound so the rule stays transformers'
    # (tests/test_muon.py compares it with a Trainer's).
    return set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]


def resolve_keywords(training_args: Any, keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Muon and AdamW hyper-parameters, each from the highest of: the factory's keywords, `optim_args`,
    TrainingArguments, the defaults. TrainingArguments' `learning_rate` and `weight_decay` serve both parts; the
    keywords `lr` and `weight_decay` are Muon's, `adamw_lr` and `adamw_weight_decay` AdamW's (without
    TrainingArguments, AdamW's follow Muon's).

    Raises:
        ValueError: for a keyword neither part takes, naming those they take.
    """
    values: dict[str, Any] = {}
    if training_args is not None:
        lr, weight_decay = training_args.learning_rate, training_args.weight_decay
        values.update(lr=lr, weight_decay=weight_decay, adamw_lr=lr, adamw_weight_decay=weight_decay)
        values.update(adamw_betas=(training_args.adam_beta1, training_args.adam_beta2))
        values.update(adamw_eps=training_args.adam_epsilon)
        values.update(parse_optim_args(training_args.optim_args))
    values.update(keywords)
    unknown = set(values) - set(FACTORY_MUON_DEFAULTS) - set(ADAMW_KEYWORDS)
    if unknown:
        raise ValueError(
            f"hf_fsdp2.Muon got unknown keyword(s) {sorted(unknown)}; it takes {sorted(FACTORY_MUON_DEFAULTS)}, "
            f"{sorted(ADAMW_KEYWORDS)}, use_muon, training_args and decay_parameter_names."
        )
    muon = {**FACTORY_MUON_DEFAULTS, **{k: v for k, v in values.items() if k not in ADAMW_KEYWORDS}}
    adamw = {**ADAMW_DEFAULTS, "lr": muon["lr"], "weight_decay": muon["weight_decay"]}
    adamw.update({ADAMW_KEYWORDS[k]: v for k, v in values.items() if k in ADAMW_KEYWORDS})
    return muon, adamw


class Muon:
    """Muon for `Trainer(optimizer_cls_and_kwargs=(hf_fsdp2.Muon, {...}))`: Muon on the hidden matrices and expert
    stacks of the repeated blocks, AdamW on everything else.

    transformers calls an optimizer factory as `Muon()(model, **kwargs)`; FSDP2Trainer adds `training_args` (its
    TrainingArguments) and `decay_parameter_names` (its `get_decay_parameter_names`). Each hyper-parameter comes from
    the highest of: the keywords in `optimizer_cls_and_kwargs` (they win), `TrainingArguments.optim_args`,
    TrainingArguments (`learning_rate` and `weight_decay` for both parts, `adam_beta1/2` and `adam_epsilon` for
    AdamW), the defaults (torch.optim.Muon's and AdamW's, with `adjust_lr_fn="match_rms_adamw"` so that one learning
    rate serves both parts). Keywords: torch.optim.Muon's for the Muon part (`lr`, `weight_decay`, `momentum`,
    `nesterov`, `ns_steps`, `ns_coefficients`, `eps`, `adjust_lr_fn`) and `ns_dtype`; `adamw_lr`,
    `adamw_weight_decay`, `adamw_betas`, `adamw_eps` for AdamW (without TrainingArguments its lr and weight decay
    follow Muon's); `use_muon(name, param) -> bool` to route parameters yourself. Parameters Trainer never decays
    (norms, biases) get weight decay 0 in both parts. The LR scheduler scales every group.
    """

    def __call__(
        self,
        model: nn.Module,
        *,
        training_args: Any = None,
        decay_parameter_names: Collection[str] | None = None,
        use_muon: UsePredicate | None = None,
        **keywords: Any,
    ) -> MuonAdamW:
        """Build MuonAdamW over `model`'s trainable parameters."""
        muon, adamw = resolve_keywords(training_args, keywords)
        muon_params, adamw_params = split_for_muon(model, use_muon)
        decay = set(decay_parameter_names) if decay_parameter_names is not None else _trainer_decay_names(model)
        decayed = {id(p) for n, p in model.named_parameters() if n in decay}
        groups = []
        for params, use, settings in ((muon_params, True, muon), (adamw_params, False, adamw)):
            for decays in (True, False):
                chosen = [p for p in params if (id(p) in decayed) == decays]
                weight_decay = settings["weight_decay"] if decays else 0.0
                groups.append({**settings, "params": chosen, "use_muon": use, "weight_decay": weight_decay})
        return MuonAdamW([g for g in groups if g["params"]])
