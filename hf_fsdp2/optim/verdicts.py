"""What each optimizer does on FSDP2 shards: a verdict per `TrainingArguments.optim` value, and `adapt_optimizer`,
which makes the optimizer FSDP2Trainer is about to step exact on shards or refuses it by name.

An elementwise update (Adam, Lion, RMSprop) is the same on each rank's rows as on the whole tensor, so it may step
the shards; one that reads whole rows, columns or matrices (Adafactor, Muon, GaLore's projections) must be given
them, or be refused. This module knows optimizer classes, not models or the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .adafactor import make_adafactor_exact
from .muon import make_shard_exact
from .row_shards import local_part

Kind = Literal["shards", "local_shards", "whole_matrix", "refused"]


class Verdict(NamedTuple):
    """How an `optim=` value runs under FSDP2Trainer, and why."""

    kind: Kind  # shards: steps DTensor shards as is; local_shards: steps each rank's plain local tensor;
    # whole_matrix: replaced by a shard-exact twin that sums/gathers what crosses ranks; refused: ValueError
    reason: str
    alternative: str = ""
    package: str = ""  # the module transformers imports for it ("" : torch's own); a missing one fails in Trainer too


_ELEMENTWISE = "elementwise: each rank's rows step as the whole tensor would"
_LOCAL = "elementwise, but bitsandbytes' kernels take plain tensors: each rank steps its local shard"
_BNB_8BIT = (
    "bitsandbytes keeps 8-bit states quantised in blocks of the flattened tensor; on a shard the blocks start at "
    "the shard's edge, so the update is not one process's, and the state cannot be resharded to another world size"
)
_PROJECTION = (
    "keeps its low-rank projection or factored state as plain tensors beside the DTensor shards (its step fails "
    "with 'mixed torch.Tensor and DTensor'), and that state is computed from whole matrices"
)
_GALORE = (
    "its SVD of each gradient matrix runs on the DTensor, which gathers the whole matrix on every rank for it "
    "(exact; each rank holds one whole gradient matrix at a time while projecting)"
)
_LAYERWISE = "steps inside backward hooks per layer; transformers refuses it under DDP too"
_FACTORED = "factored second moments over whole rows and columns (AdaLomo), computed inside backward hooks"
_LEAN = "optim='adafactor' or 'adamw_torch_8bit' (memory-lean and exact)"
_ALTERNATIVE_8BIT = "optim='adamw_torch_8bit' (torchao; shards exactly) or the 32-bit bitsandbytes variant"


def _each(names: str, verdict: Verdict) -> dict[str, Verdict]:
    """The same verdict for each of the space-separated `names`."""
    return dict.fromkeys(names.split(), verdict)


_TORCHAO = "torchao quantises each DTensor shard's state in blocks of its own (block edges move with the shard)"
OPTIM_VERDICTS: dict[str, Verdict] = {
    **_each("adamw_torch adamw_torch_fused sgd adagrad rmsprop", Verdict("shards", _ELEMENTWISE)),
    "adamw_anyprecision": Verdict("shards", _ELEMENTWISE, package="torchdistx"),
    "lomo": Verdict(
        "shards", f"{_ELEMENTWISE} (in backward, once FSDP2 has reduced the gradient)", package="lomo_optim"
    ),
    "grokadamw": Verdict("shards", _ELEMENTWISE, package="grokadamw"),
    "stable_adamw": Verdict("shards", _ELEMENTWISE, package="optimi"),
    **_each(
        "schedule_free_radam schedule_free_adamw schedule_free_sgd",
        Verdict("shards", _ELEMENTWISE, package="schedulefree"),
    ),
    **_each("adamw_torch_8bit adamw_torch_4bit", Verdict("shards", _TORCHAO, package="torchao")),
    **_each(
        "ademamix lion_32bit paged_adamw_32bit paged_ademamix_32bit paged_lion_32bit rmsprop_bnb rmsprop_bnb_32bit",
        Verdict("local_shards", _LOCAL, package="bitsandbytes"),
    ),
    **_each(
        "adamw_bnb_8bit adamw_8bit ademamix_8bit lion_8bit paged_adamw_8bit paged_ademamix_8bit paged_lion_8bit "
        "rmsprop_bnb_8bit",
        Verdict("refused", _BNB_8BIT, _ALTERNATIVE_8BIT, "bitsandbytes"),
    ),
    "adafactor": Verdict(
        "whole_matrix", "its row and column statistics and RMS values are summed over the shard group"
    ),
    "galore_adamw": Verdict("shards", _GALORE, package="galore_torch"),
    "galore_adamw_8bit": Verdict("refused", _BNB_8BIT, "optim='galore_adamw'", "galore_torch"),
    "galore_adafactor": Verdict("refused", _PROJECTION, "optim='galore_adamw' or 'adafactor'", "galore_torch"),
    "apollo_adamw": Verdict("refused", _PROJECTION, _LEAN, "apollo_torch"),
    **_each(
        "galore_adamw_layerwise galore_adamw_8bit_layerwise galore_adafactor_layerwise",
        Verdict("refused", _LAYERWISE, _LEAN, "galore_torch"),
    ),
    "apollo_adamw_layerwise": Verdict("refused", _LAYERWISE, _LEAN, "apollo_torch"),
    "adalomo": Verdict("refused", _FACTORED, "optim='lomo' (exact under FSDP2) or 'adafactor'", "lomo_optim"),
    "adamw_torch_xla": Verdict("refused", "an XLA optimizer; FSDP2Trainer runs on CUDA or CPU", "optim='adamw_torch'"),
    "adamw_torch_npu_fused": Verdict(
        "refused", "an Ascend NPU optimizer; FSDP2Trainer runs on CUDA or CPU", "optim='adamw_torch'"
    ),
}


def check_optim(optim: str) -> Verdict:
    """The verdict for a TrainingArguments.optim value.

    Raises:
        ValueError: for a refused value (naming the reason and an alternative) or one without a verdict.
    """
    optim = getattr(optim, "value", optim)  # TrainingArguments holds an OptimizerNames member
    verdict = OPTIM_VERDICTS.get(optim)
    if verdict is None:
        raise ValueError(
            f"optim={optim!r} has no verdict in hf_fsdp2 yet (is it new in transformers?): whether it is exact on "
            "FSDP2 shards is unknown. Use optim='adamw_torch', or pass your optimizer in `optimizers`."
        )
    if verdict.kind == "refused":
        raise ValueError(f"optim={optim!r} is refused under FSDP2Trainer: {verdict.reason}. Use {verdict.alternative}.")
    return verdict


# Verdicts on optimizer classes of optional packages, keyed by class as (module, qualname), so checking one imports
# nothing; an optimizer takes the verdict of the first class of its MRO found here, so a subclass is judged as its
# base whatever it is named. Classes not found step as they are (elementwise, or the user's own responsibility).
_REFUSED_CLASSES: dict[tuple[str, str], tuple[str, str]] = {
    **{
        (module, name): (f"it {_PROJECTION}", _LEAN)
        for module, name in (
            ("apollo_torch.adafactor", "GaLoreAdafactor"),
            ("apollo_torch.adamw", "GaLoreAdamW"),
            ("apollo_torch.adamw8bit", "GaLoreAdamW8bit"),
            ("apollo_torch.apollo", "APOLLOAdamW"),
            ("apollo_torch.q_apollo", "QAPOLLOAdamW"),
            ("galore_torch.adafactor", "GaLoreAdafactor"),
            ("galore_torch.adamw8bit", "GaLoreAdamW8bit"),
        )
    },
    ("lomo_optim.adalomo", "AdaLomo"): (_FACTORED, "optim='lomo' or 'adafactor'"),
}
# Every bitsandbytes optimizer (8- and 32-bit) derives from this class; the bits are each parameter's config.
_BNB_BASE = ("bitsandbytes.optim.optimizer", "Optimizer8bit")


def adapt_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer` exact on FSDP2 shards in place (Muon, Adafactor, bitsandbytes), or refuse it by class.

    Raises:
        ValueError: for an optimizer known to need whole matrices that hf_fsdp2 cannot give it.
    """
    make_shard_exact(optimizer)
    make_adafactor_exact(optimizer)
    cls = type(optimizer)
    if issubclass(cls, LocalShards):
        return optimizer  # adapted already
    bases = [(c.__module__, c.__qualname__) for c in cls.__mro__]
    refused = next((_REFUSED_CLASSES[key] for key in bases if key in _REFUSED_CLASSES), None)
    if refused is not None:
        raise ValueError(f"{cls.__name__} is refused under FSDP2Trainer: {refused[0]}. Use {refused[1]}.")
    if _BNB_BASE in bases:
        if _has_8bit_state(optimizer):
            raise ValueError(f"{cls.__name__} is refused under FSDP2Trainer: {_BNB_8BIT}. Use {_ALTERNATIVE_8BIT}.")
        optimizer.__class__ = type(f"LocalShards{cls.__name__}", (LocalShards, cls), {})
    return optimizer


def slow_host_step(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer` steps slowly on host tensors (cpu_offload), or None.

    torch's Adam and AdamW pick their for-loop for CPU tensors unless asked for `fused=True` (foreach is chosen only
    for accelerator tensors): optim='adamw_torch' (or an AdamW built without fused) steps each shard element by element
    in a chain of tensor ops. Measured (scripts/measure/measure_offload_adamw.py, 101M fp32 parameters as DTensor
    shards, 2 threads, 2026-11-28): fused 0.082 s per step, foreach 0.55 s, for-loop 0.78 s.
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    if any(group.get("fused") for group in optimizer.param_groups):
        return None
    how = "foreach" if any(group.get("foreach") for group in optimizer.param_groups) else "for-loop"
    return (
        f"cpu_offload=True steps {type(optimizer).__name__} on the host with torch's {how} implementation, 7-10x "
        "slower there than its fused one (scripts/measure/measure_offload_adamw.py); use optim='adamw_torch_fused' "
        "(TrainingArguments' default) or build it with fused=True."
    )


def _has_8bit_state(optimizer: Any) -> bool:
    """True when bitsandbytes would keep any parameter's state in 8 bits: asked of the optimizer's own per-parameter
    config (its `optim_bits`, `GlobalOptimManager` overrides included), not read from its class name."""
    return any(
        optimizer.get_config(g, p, group)["optim_bits"] == 8
        for g, group in enumerate(optimizer.param_groups)
        for p in range(len(group["params"]))
    )


class LocalShards:
    """Mixed into a bitsandbytes optimizer: each step sees each rank's local shards as plain parameters.

    The optimizer's own parameters stay the DTensors (checkpoints and schedulers read them); its per-element states
    are kept as DTensors around bitsandbytes' local tensors, so they save and reshard like Adam's.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The optimizer's own step on the local shards."""
        with _local_view(self):  # type: ignore[arg-type]
            return super().step(closure)  # type: ignore[misc]


@contextlib.contextmanager
def _local_view(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Swap each DTensor parameter for a plain Parameter over its local shard (grad and state too), then back."""
    originals = [list(group["params"]) for group in optimizer.param_groups]
    shadows: list[tuple[nn.Parameter, torch.Tensor]] = []
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            if not isinstance(param, DTensor):
                continue
            # NOTE: nn.Parameter shares the local tensor's storage, so the kernel's in-place update lands in the shard.
            shadow = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
            shadow.grad = param.grad.to_local() if param.grad is not None else None
            if param in optimizer.state:
                optimizer.state[shadow] = {k: local_part(v) for k, v in optimizer.state.pop(param).items()}
            group["params"][index] = shadow
            shadows.append((shadow, param))
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, originals, strict=True):
            group["params"] = params
        for shadow, param in shadows:
            if shadow in optimizer.state:
                optimizer.state[param] = {k: _shard_like(v, param) for k, v in optimizer.state.pop(shadow).items()}


def _shard_like(value: Any, param: DTensor) -> Any:
    """A per-element state tensor as a DTensor placed like `param` (AdEMAMix stacks two: the dims shift by one);
    a scalar (the step) as it is.

    Raises:
        RuntimeError: for any other tensor, which a checkpoint would otherwise save from one rank only.
    """
    local = param.to_local().shape
    if not torch.is_tensor(value) or value.ndim == 0:
        return value
    if value.shape == local:
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    if value.shape[1:] == local:
        shape = (value.shape[0], *param.shape)
        placements = [Shard(p.dim + 1) if p.is_shard() else p for p in param.placements]
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(value, param.device_mesh, placements, shape=torch.Size(shape), stride=stride)
    raise RuntimeError(
        f"a state tensor of shape {tuple(value.shape)} for a shard of shape {tuple(local)}: hf_fsdp2 cannot say how it "
        "is distributed, so it could not be checkpointed. Use optim='adamw_torch' (or report this optimizer)."
    )
