"""The package's public names, imported on first use: each is the object the README documents, whatever was
imported before it."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import types

import hf_fsdp2


def test_every_public_name_is_its_object_even_after_every_submodule_is_imported():
    """Importing a submodule binds its name on the package: a submodule named like a public function (the old
    `consolidate.py` beside `hf_fsdp2.consolidate`) would hand users the module instead of the function."""
    for info in pkgutil.iter_modules(hf_fsdp2.__path__, "hf_fsdp2."):
        importlib.import_module(info.name)
    assert sorted(hf_fsdp2.__all__) == sorted(hf_fsdp2._EXPORTS)
    for name in hf_fsdp2.__all__:
        value = getattr(hf_fsdp2, name)
        assert not isinstance(value, types.ModuleType), name
        assert inspect.isclass(value) or inspect.isfunction(value), name
        assert value.__name__ == name, name
        assert name in dir(hf_fsdp2)


def test_star_import_and_unknown_names_in_a_fresh_process():
    """`from hf_fsdp2 import *` gives every public name; a misspelt one fails as for any module."""
    code = (
        "from hf_fsdp2 import *\n"
        "import hf_fsdp2\n"
        "assert FSDP2Trainer.__name__ == 'FSDP2Trainer' and callable(consolidate) and callable(gathered)\n"
        "try:\n"
        "    hf_fsdp2.FSDP2Trainr\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "module 'hf_fsdp2' has no attribute 'FSDP2Trainr'" in proc.stdout


def test_the_api_page_documents_every_public_name():
    """docs/reference/api.md renders each name of `hf_fsdp2.__all__` (a `::: module.Name` line), FSDP2Config aside (its
    own page, docs/reference/config.md), so a new public name cannot be left out of the API reference."""
    import os

    import hf_fsdp2

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "reference", "api.md")) as f:
        rendered = {line.split(".")[-1].strip() for line in f if line.startswith("::: ")}
    assert set(hf_fsdp2.__all__) - rendered == {"FSDP2Config"}


def test_importing_the_package_and_its_trainer_and_using_nf4_set_no_environment_variable():
    """Configuration is the user's: `import hf_fsdp2` (and its trainer), and a first NF4 quantisation (which imports
    torchao), leave os.environ as they found it."""
    code = (
        "import os, json\n"
        "before = dict(os.environ)\n"
        "import hf_fsdp2\n"
        "from hf_fsdp2 import FSDP2Trainer, FSDP2Config\n"
        "import torch\n"
        "from hf_fsdp2.adapters.nf4 import _torchao_nf4\n"
        "_torchao_nf4().to_nf4(torch.randn(64, 256))\n"
        "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
