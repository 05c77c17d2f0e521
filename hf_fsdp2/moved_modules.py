"""The module paths of hf_fsdp2 0.1, when every module sat in one folder, kept importable after the move to rooms.

`import hf_fsdp2.checkpoint` (or `from hf_fsdp2.disk_space import CheckpointDiskFull`) still works and gives the very
module that now lives in its room (`hf_fsdp2.checkpoints.sharded`), so a patch or an isinstance check on either name
sees the same object. Two old names are rooms now and name the package instead: `hf_fsdp2.loading` (its module is
`hf_fsdp2.loading.weights`) and `hf_fsdp2.trainer` (which still exports FSDP2Trainer and FSDP2Mixin).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

# Old module name (under hf_fsdp2) -> where it lives now.
MOVED = {
    "activation_trace": "planning.activation_trace",
    "adafactor": "optim.adafactor",
    "adapter_checkpoint": "checkpoints.adapters",
    "adapters": "adapters.methods",
    "argument_verdicts": "trainer.argument_verdicts",
    "branches": "loading.branches",
    "callbacks": "trainer.callbacks",
    "checkpoint": "checkpoints.sharded",
    "chunked_loss": "long_rows.chunked_loss",
    "collective_methods": "sharding.collective_methods",
    "comm_buffers": "sharding.comm_buffers",
    "consolidation": "export.consolidation",
    "direct_io": "checkpoints.direct_io",
    "disk_space": "checkpoints.disk_space",
    "distcp_reader": "checkpoints.distcp_reader",
    "facts": "loading.facts",
    "from_accelerate": "trainer.from_accelerate",
    "full_state_checkpoint": "checkpoints.full_state",
    "gathering": "sharding.gathering",
    "hf_export": "export.hf_folder",
    "live_export": "export.live",
    "memory_plan": "planning.memory_plan",
    "muon": "optim.muon",
    "muon_routing": "optim.muon_routing",
    "nf4": "adapters.nf4",
    "nf4_nearest": "adapters.nf4_nearest",
    "optimizer_memory": "optim.state_sizes",
    "optimizers": "optim.verdicts",
    "owner_export": "export.owner",
    "path_models": "loading.path_models",
    "preemption": "trainer.preemption",
    "resume": "checkpoints.resume",
    "router_loss": "trainer.router_loss",
    "safetensors_reader": "loading.safetensors_reader",
    "sequence_parallel": "long_rows.sequence_parallel",
    "sharding": "sharding.units",
    "skeleton": "loading.skeleton",
    "trainer_checkpoint": "trainer.checkpointing",
    "trainer_resume": "trainer.resuming",
    "trainer_sharding": "trainer.sharding",
    "trainer_step": "trainer.step",
    "ulysses_attention": "long_rows.ulysses_attention",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old module path with the module at its new path."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for `hf_fsdp2.<old name>`; None for every other name."""
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """The default module; `exec_module` puts the real one in its place."""
        return None

    def exec_module(self, module: ModuleType) -> None:
        """Import the module at its new path and register it under the old one too."""
        # NOTE: the import system reads sys.modules[name] back after exec_module, so the old name binds the real module.
        sys.modules[module.__name__] = importlib.import_module(
            f"{__package__}.{MOVED[module.__name__.rpartition('.')[2]]}"
        )


def install() -> None:
    """Answer old module paths (once per interpreter)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
