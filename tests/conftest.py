"""Shared fixtures: tiny models saved once per session."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile

import pytest
import torch

# torch.compile's kernel cache is keyed without ATEN_CPU_CAPABILITY: kernels compiled in a run under
# ATEN_CPU_CAPABILITY=avx2 crashed a later run at the CPU's own capability (malloc/munmap aborts inside the
# compiled kernel, reproduced with torch 2.13 on this project's AVX-512 machine; an empty cache fixed it).
# Each capability gets its own cache; every process the tests start inherits this.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"hf_fsdp2_inductor_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"),
)


# torchao (the 'qlora' extra) loads CUDA kernels when transformers or peft import it and prints a failure for each
# on a machine without CUDA; NF4 needs none of them. Set for the tests only: importing hf_fsdp2 sets no variable.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from tests import collective_sites
from tests.tiny_models import save_tiny


def _drop_empty_kernels(cache: str) -> list[str]:
    """Remove compiled kernels of 0 bytes from the kernel cache, and return their paths.

    A compile killed while it wrote its .so (a test run stopped, a timeout) leaves the file empty, and torch 2.11 then
    fails every later load of that kernel ("file too short"). Seen here: one empty kernel since a stopped run made the
    compiled parity runs of every later torch 2.11 suite fail on one rank and hang the other until the launch timed out.
    An empty shared library is never valid, so removing it only makes torch compile it again.
    """
    empty = []
    for folder, _, files in os.walk(cache):
        for name in files:
            path = os.path.join(folder, name)
            # NOTE: both pytest workers run this at once; the other may have removed it already.
            with contextlib.suppress(FileNotFoundError):
                if name.endswith(".so") and os.path.getsize(path) == 0:
                    os.remove(path)
                    empty.append(path)
    return empty


_drop_empty_kernels(os.environ["TORCHINDUCTOR_CACHE_DIR"])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """Return a function name -> folder of a saved tiny model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[tuple[str, bool], str] = {}

    def get(name: str, safetensors: bool = True) -> str:
        key = (name, safetensors)
        if key not in cache:
            cache[key] = save_tiny(name, str(root), safe_serialization=safetensors)
        return cache[key]

    return get


class _Records(logging.Handler):
    """Keep every record handed to it, in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def hf_fsdp2_records():
    """Return the list of records hf_fsdp2's loggers emit during the test, each exactly once.

    A handler on the "hf_fsdp2" logger itself sees each record once whatever the propagation state: caplog's
    count depends on it (hf_fsdp2 hangs under transformers' logger, which does not propagate; pytest 9.2 attaches
    caplog to non-propagating loggers too, so turning propagation on there made every record arrive twice).
    """
    logger = logging.getLogger("hf_fsdp2")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # not the level another test left on transformers' logger
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# The longest modules first, longest to shortest (their seconds in a whole run with an empty kernel cache, at
# ff1cf1e), then the rest: each worker (setup.cfg: -n 2 --dist loadfile) takes the next module when it runs short,
# so the two end within a short module of each other.
SLOWEST_FIRST = (
    "test_gpu_check", "test_benchmark", "test_readme", "test_parity", "test_optimizers", "test_failures",
    "test_checkpoint", "test_memory_plan", "test_recipes", "test_trainer", "test_dropin", "test_vlm",
    "test_sequence_parallel", "test_grpo", "test_muon", "test_optimizer_memory", "test_qlora",
    "test_collective_methods", "test_consolidate", "test_meshes",
)  # fmt: skip


def _start_rank(item: pytest.Item) -> int:
    name = item.path.stem
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the slowest modules first; skip tests marked `gpu` when no CUDA device is present."""
    items.sort(key=_start_rank)  # stable: each module keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection imported out of every later garbage collection (see tests/launch.py: each
    Trainer.train() runs a full gc.collect(), and tests that train in this process pay it over that heap)."""
    gc.freeze()


_REACHED = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """On the controller, make the folder where every audited worker of the session records the package lines its
    collectives came from (tests/collective_audit.py); pytest-xdist's workers and their ranks inherit it."""
    if hasattr(config, "workerinput") or collective_sites.REACHED_DIR in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="hf_fsdp2_reached_")
    os.environ[collective_sites.REACHED_DIR] = folder
    config.stash[_REACHED] = folder


def _whole_suite(config: pytest.Config) -> bool:
    """True when this session ran every test: the tests folder, nothing selected or deselected."""
    folder = os.path.dirname(os.path.abspath(__file__))
    paths = {os.path.abspath(arg.split("::")[0]) for arg in config.args}
    options = config.option
    selected = options.keyword or options.markexpr or getattr(options, "lf", False) or getattr(options, "deselect", 0)
    return paths == {folder} and not selected and not options.collectonly


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After a whole, passing suite: fail when a collective site that tests/collective_sites.py says is reached was
    not reached by any audited worker (the test that drove it was removed or changed); name the sites it gives a
    reason for that were reached after all."""
    folder = session.config.stash.get(_REACHED, None)
    if folder is None:
        return
    try:
        whole = exitstatus == 0 and _whole_suite(session.config)
        missing, reached = collective_sites.compare(folder) if whole else ([], [])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for site in reached:
        reporter.write_line(f"note: {site} was reached; tests/collective_sites.py gives a reason instead")
    if missing:
        reporter.write_sep("=", "collective sites not reached", red=True)
        for site in missing:
            reporter.write_line(f"{site}: tests/collective_sites.py says 'reached', but no audited test made it")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say in the summary when the tests that need real vLLM were skipped, and how to run them."""
    import importlib.util

    ran_vllm_module = any("test_vllm" in str(path) for path in terminalreporter.config.args) or not any(
        "::" in str(path) or str(path).endswith(".py") for path in terminalreporter.config.args
    )
    if ran_vllm_module and importlib.util.find_spec("vllm") is None:
        terminalreporter.write_line(
            "tests/test_vllm.py skipped: vLLM is not installed here; bash scripts/test_vllm.sh runs it with vLLM"
        )
