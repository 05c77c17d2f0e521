"""Every call site in hf_fsdp2/ that makes a collective, found in the source, and what vouches for each one.

A site is a call, read with `ast`, of: a `torch.distributed` collective (object collectives and barriers too), a
functional collective, one of `torch.distributed.nn.functional`, `distribute_tensor`, a DTensor's `full_tensor()` or
`redistribute()`, an FSDP unit's `unshard()`, DCP's `save`/`async_save`/`load`, or the state-dict API; a collective
passed on uncalled (`functools.partial(dcp.save, ...)`) counts too. Its id names the module, the enclosing function
and the callee, with `#2`, `#3` for a function's later calls of the same callee, so ids outlive line numbers:
`hf_fsdp2/optim/adafactor.py::_Group.sum::all_reduce`.

MANIFEST gives every site "reached" or a one-line reason why no CPU test ties a collective to it.
- "reached" is proven by the suite: every audited process (tests/collective_audit.py, autouse in tests/launch.py)
  records the innermost hf_fsdp2 line on the stack of each collective it runs, into the folder tests/conftest.py
  names in $HF_FSDP2_TEST_REACHED_SITES; at the end of a whole, passing run, conftest maps those lines to sites
  (`compare`) and fails the run when a "reached" site was not.
- tests/test_collective_sites.py fails at once on a site missing from MANIFEST, and on an entry whose site is gone.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hf_fsdp2")
REACHED = "reached"
# The folder where audited processes write the package lines their collectives came from (tests/conftest.py
# sets it for a session; tests/collective_audit.py writes there).
REACHED_DIR = "HF_FSDP2_TEST_REACHED_SITES"

# Callees by the module they come from (as imported, whatever the alias).
DIST = "torch.distributed"
FUNCOL = "torch.distributed._functional_collectives"
DIST_NN = "torch.distributed.nn.functional"
CALLEES: dict[str, frozenset[str]] = {
    DIST: frozenset({
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
        "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
        "all_gather_single", "reduce_scatter_single", "all_reduce_coalesced", "all_gather_coalesced",
        "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
        "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
    }),
    FUNCOL: frozenset({
        "all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor", "reduce_scatter_tensor",
        "all_to_all_single", "broadcast", "all_reduce_coalesced", "all_gather_inplace", "permute_tensor",
        "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
    }),
    DIST_NN: frozenset({
        "broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_single",
        "all_reduce",
    }),
    "torch.distributed.tensor": frozenset({"distribute_tensor"}),
    # DCP and the state-dict API exchange plans, metadata and (full state dicts) tensors over their groups.
    "torch.distributed.checkpoint": frozenset({"save", "async_save", "load"}),
    "torch.distributed.checkpoint.state_dict": frozenset({
        "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
        "set_optimizer_state_dict", "set_state_dict",
    }),
    # torchao's float8: one all-reduce of every FP8 weight's amax (DTensor ops over the weights' mesh).
    "torchao.float8": frozenset({"precompute_float8_dynamic_scale_for_fsdp"}),
}  # fmt: skip
# Methods that communicate, whatever object they are called on: DTensor's, and an FSDP unit's all-gather.
METHODS = frozenset({"full_tensor", "redistribute", "unshard"})


@dataclass(frozen=True)
class Site:
    """One call that makes a collective: its id and the lines its call spans."""

    id: str
    path: str
    first: int
    last: int


class _Finder(ast.NodeVisitor):
    """Collects the sites of one module, naming each by its enclosing function."""

    def __init__(self, path: str, aliases: dict[str, str]) -> None:
        self.path, self.aliases = path, aliases
        self.scope: list[str] = []
        self.sites: list[Site] = []
        self.seen: dict[tuple[str, str], int] = {}

    def _enter(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._enter(node, node.name)

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._callee(node.func)
        if callee is None:
            self.generic_visit(node)
            return
        self._add(node, callee)
        if isinstance(node.func, ast.Attribute):
            self.visit(node.func.value)  # `make().full_tensor()`: what it is called on may hold sites too
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        """A collective passed on uncalled (`functools.partial(dcp.save, ...)`) is a site too."""
        callee = self._callee(node)
        if callee is not None and callee not in METHODS:
            self._add(node, callee)
        else:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        """An imported collective passed on uncalled is a site too."""
        callee = self._callee(node)
        if callee is not None:
            self._add(node, callee)

    def _add(self, node: ast.expr, callee: str) -> None:
        """Record a site at `node`, numbering a function's repeated calls of one callee."""
        qualname = ".".join(self.scope) or "<module>"
        count = self.seen[(qualname, callee)] = self.seen.get((qualname, callee), 0) + 1
        suffix = f"#{count}" if count > 1 else ""
        site_id = f"{self.path}::{qualname}::{callee}{suffix}"
        self.sites.append(Site(site_id, self.path, node.lineno, node.end_lineno or node.lineno))

    def _callee(self, func: ast.expr) -> str | None:
        """The collective `func` names, or None."""
        if isinstance(func, ast.Attribute):
            if func.attr in METHODS:
                return func.attr
            module = self._module(func.value)
            return func.attr if module in CALLEES and func.attr in CALLEES[module] else None
        if isinstance(func, ast.Name) and func.id in self.aliases:
            module, _, name = self.aliases[func.id].rpartition(".")
            return name if module in CALLEES and name in CALLEES[module] else None
        return None

    def _module(self, node: ast.expr) -> str | None:
        """The dotted module an expression like `dist` or `torch.distributed` stands for."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._module(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None


def _aliases(tree: ast.AST, package: str) -> dict[str, str]:
    """Every name an import in the module binds, to the dotted thing it stands for (imports inside functions too)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level], base]).strip(".")
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def find_sites(package: str = PACKAGE) -> list[Site]:
    """Every collective call site under `package`, in file and source order."""
    sites: list[Site] = []
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(f for f in files if f.endswith(".py")):
            file = os.path.join(folder, name)
            path = os.path.relpath(file, os.path.dirname(package)).replace(os.sep, "/")
            with open(file) as f:
                tree = ast.parse(f.read(), filename=file)
            dotted = path[: -len(".py")].replace("/", ".")
            finder = _Finder(path, _aliases(tree, dotted))
            finder.visit(tree)
            sites += finder.sites
    return sites


def sites_on(sites: Iterable[Site], reached: Iterable[tuple[str, int]]) -> set[str]:
    """The ids of the sites whose call spans one of the (path, line) pairs the audit recorded."""
    by_path: dict[str, list[Site]] = {}
    for site in sites:
        by_path.setdefault(site.path, []).append(site)
    return {s.id for path, line in reached for s in by_path.get(path, ()) if s.first <= line <= s.last}


def recorded_lines(folder: str) -> Iterator[tuple[str, int]]:
    """The (path, line) pairs audited processes wrote under `folder` (tests/collective_audit.py)."""
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                path, number, _ = json.loads(line)
                yield path.replace(os.sep, "/"), number


def compare(folder: str) -> tuple[list[str], list[str]]:
    """(sites MANIFEST says are reached that no audited process recorded under `folder`, sites with a reason that
    one did reach)."""
    reached = sites_on(find_sites(), recorded_lines(folder))
    missing = [site for site, verdict in MANIFEST.items() if verdict == REACHED and site not in reached]
    return missing, sorted(site for site in reached if MANIFEST.get(site, REACHED) != REACHED)


# NOTE: a reason states why a CPU test cannot or need not tie a collective to this line; tests/conftest.py prints
# the sites with a reason that a whole-suite run did reach, so a stale reason shows.
NO_COLLECTIVE = "torch makes no collective here (sharded state dict: each rank reads or writes its own shards)"
DCP_THREAD = (
    "DCP runs this save's collectives in a thread of its own (checked there, but no hf_fsdp2 frame on its stack)"
)
MANIFEST: dict[str, str] = {
    "hf_fsdp2/distributed.py::close_distributed::barrier": REACHED,
    "hf_fsdp2/distributed.py::close_distributed::barrier#2": REACHED,
    "hf_fsdp2/distributed.py::agree::all_reduce": REACHED,
    "hf_fsdp2/distributed.py::check_same_on_all_ranks::all_gather_object": REACHED,
    "hf_fsdp2/distributed.py::first_on_any_rank::all_gather_object": REACHED,
    "hf_fsdp2/distributed.py::broadcast_from_rank0::broadcast_object_list": REACHED,
    "hf_fsdp2/model.py::clip_grad_norm::full_tensor": REACHED,
    "hf_fsdp2/trl.py::full_weights_hash::full_tensor": REACHED,
    "hf_fsdp2/adapters/nf4.py::global_mean_absmax::all_gather": REACHED,
    "hf_fsdp2/checkpoints/adapters.py::full_copy::full_tensor": REACHED,
    "hf_fsdp2/checkpoints/disk_space.py::raise_if_write_failed::barrier": REACHED,
    "hf_fsdp2/checkpoints/disk_space.py::raise_if_write_failed::barrier#2": REACHED,
    "hf_fsdp2/checkpoints/disk_space.py::_gather::all_gather_object": REACHED,
    "hf_fsdp2/checkpoints/full_state.py::load_full_optimizer_state::set_optimizer_state_dict": REACHED,
    "hf_fsdp2/checkpoints/sharded.py::model_state_dict::get_model_state_dict": NO_COLLECTIVE,
    "hf_fsdp2/checkpoints/sharded_save.py::begin_checkpoint::barrier": REACHED,
    "hf_fsdp2/checkpoints/sharded_save.py::commit_checkpoint::barrier": REACHED,
    "hf_fsdp2/checkpoints/sharded_save.py::commit_checkpoint::barrier#2": REACHED,
    "hf_fsdp2/checkpoints/sharded_save.py::sharded_parts::get_optimizer_state_dict": NO_COLLECTIVE,
    "hf_fsdp2/checkpoints/sharded_save.py::write_parts::async_save": DCP_THREAD + " (async_save's executor)",
    "hf_fsdp2/checkpoints/sharded_save.py::write_parts::save": DCP_THREAD
    + " (run_at_once's; the stack shows its line)",
    "hf_fsdp2/checkpoints/sharded_resume.py::resume_optimizer::get_optimizer_state_dict": NO_COLLECTIVE,
    "hf_fsdp2/checkpoints/sharded_resume.py::resume_optimizer::set_optimizer_state_dict": NO_COLLECTIVE,
    "hf_fsdp2/checkpoints/sharded.py::load_in_place::load": "no_dist=True: each rank reads its own shards",
    "hf_fsdp2/export/engine_weights.py::unit_buckets::unshard": REACHED,
    "hf_fsdp2/export/engine_weights.py::_full::full_tensor": "a DTensor outside every gathered unit; tests have none",
    "hf_fsdp2/export/live.py::save_pretrained_sharded::barrier": REACHED,
    "hf_fsdp2/export/owner.py::share_error::broadcast_object_list": REACHED,
    "hf_fsdp2/jobs/classify.py::resolve_defaults::barrier": REACHED,
    "hf_fsdp2/jobs/outputs.py::peak_memory_per_rank::all_gather_object": REACHED,
    "hf_fsdp2/jobs/sft.py::resolve_demo::barrier": REACHED,
    "hf_fsdp2/jobs/sft.py::generate_answers::all_gather_object": REACHED,
    "hf_fsdp2/loading/weights.py::copy_full_into::distribute_tensor": "src_data_rank=None: each rank cuts its shard",
    "hf_fsdp2/loading/safetensors_route.py::read_safetensors_shards::load": "no_dist=True: each rank reads its own"
    " slices",
    "hf_fsdp2/loading/safetensors_route.py::_read_rows::load": "no_dist=True: each rank reads its own rows",
    "hf_fsdp2/loading/rank0_route.py::broadcast_buffers::broadcast": REACHED,
    "hf_fsdp2/loading/rank0_route.py::load_parameters_from_rank0::set_model_state_dict": REACHED,
    "hf_fsdp2/long_rows/sequence_parallel.py::SequenceParallel.parts::all_gather_object": REACHED,
    "hf_fsdp2/long_rows/ulysses_attention.py::_all_to_all::all_to_all_single": REACHED,
    "hf_fsdp2/optim/adafactor.py::_Group.sum::all_reduce": REACHED,
    "hf_fsdp2/optim/muon.py::_Exchange.run::gather": REACHED,
    "hf_fsdp2/optim/muon.py::_Exchange.run::scatter": REACHED,
    "hf_fsdp2/sharding/collective_methods.py::all_ranks_join::monitored_barrier": REACHED,
    "hf_fsdp2/sharding/gathering.py::gathered::unshard": REACHED,
    "hf_fsdp2/sharding/units.py::reduce_scalar_gradients.average::all_reduce": REACHED,
    "hf_fsdp2/sharding/float8.py::refresh_float8_scales.refresh::precompute_float8_dynamic_scale_for_fsdp": (
        "torchao's own collective: its DTensor amax reduction runs inside torchao, so the audit records it as "
        "torchao's, not this line; tests/test_float8.py checks the scales it gives at 2 ranks (fp8 max / the whole "
        "weight's amax)"
    ),
    "hf_fsdp2/trainer/router_loss.py::global_router_loss::all_reduce": REACHED,
}
