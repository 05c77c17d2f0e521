"""pytest plugin for `test_upstream_trainer.py`: transformers' own Trainer tests, run against `FSDP2Trainer`.

Loaded with `-p upstream_trainer_plugin` (this folder on PYTHONPATH) in both of the driver's runs, so it runs before
pytest imports any test module. `UPSTREAM_TRAINER_SIDE` says which run this is:

- `control`: nothing is replaced; `transformers.Trainer` is transformers' own.
- `ours`: `hf_fsdp2.FSDP2Trainer` is imported (its class statement binds the real `transformers.Trainer` as its base)
  and the name `Trainer` is rebound where the test files look it up: `transformers.Trainer` (`from transformers
  import Trainer`, in the test modules and in `trainer_test_utils.py`, whose `get_regression_trainer` builds the
  regression tests' trainers) and `transformers.trainer.Trainer` (`from transformers.trainer import Trainer`).
  Test-local subclasses (`CustomDataloaderTrainer(Trainer)`) thus subclass FSDP2Trainer, as a user's would after
  changing `Trainer` to `FSDP2Trainer`. `Seq2SeqTrainer` keeps its base: it is bound when `transformers.
  trainer_seq2seq` is imported, and the Seq2Seq test file is not in the default selection (it needs hub models).

In both runs, each test records whether it built a Trainer (`builds_trainer` in the JUnit XML's properties): the
driver tells the tests that exercise a trainer from those that test a helper (a sampler, a collator) and pass alike
whatever `Trainer` is. The count wraps `Trainer.__init__` with `functools.wraps`, so its signature, which
FSDP2Trainer binds arguments by, stays the same.

Each run is one plain process: FSDP2Trainer starts a world of one itself (`hf_fsdp2.distributed.init_distributed`),
so no torchrun is needed, as in tests/test_parity.py.
"""

from __future__ import annotations

import functools
import os
from typing import Any

# Cosmetic: torchao (an optional extra) otherwise prints a line for every CUDA kernel it cannot load on a CPU
# machine; tests/conftest.py sets the same. The driver sets it for both runs.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402
import transformers.trainer  # noqa: E402

SIDE = os.environ.get("UPSTREAM_TRAINER_SIDE", "ours")
if SIDE not in ("control", "ours"):
    raise ValueError(f"UPSTREAM_TRAINER_SIDE={SIDE!r}: expected 'control' or 'ours'")

ORIGINAL_TRAINER = transformers.trainer.Trainer
_built = False


def _counting(init: Any) -> Any:
    @functools.wraps(init)  # keeps __wrapped__: inspect.signature(Trainer.__init__) is Trainer's own
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _built
        _built = True
        init(self, *args, **kwargs)

    return __init__


ORIGINAL_TRAINER.__init__ = _counting(ORIGINAL_TRAINER.__init__)

if SIDE == "ours":
    import hf_fsdp2

    FSDP2Trainer = hf_fsdp2.FSDP2Trainer
    assert FSDP2Trainer is not ORIGINAL_TRAINER and issubclass(FSDP2Trainer, ORIGINAL_TRAINER)
    # `transformers` is a lazy module: an attribute set on it shadows its lazy lookup for every later import.
    transformers.Trainer = FSDP2Trainer
    transformers.trainer.Trainer = FSDP2Trainer


def pytest_report_header(config: pytest.Config) -> str:
    trainer = transformers.Trainer
    return f"upstream_trainer_plugin ({SIDE}): transformers.Trainer is {trainer.__module__}.{trainer.__qualname__}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _built
    _built = False  # a class's setUpClass runs in its first test's setup and counts for that test


def pytest_runtest_teardown(item: pytest.Item) -> None:
    # Before the teardown report is made: JUnit XML takes the properties from it.
    item.user_properties.append(("builds_trainer", str(_built)))
