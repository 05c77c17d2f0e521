"""The README and the docs pages, run as written: every fenced block is either run here or says why not, and the
Quickstart's second command is the one CI runs, so following the README is what CI proves.

A block marked `<!-- snippet: NAME -->` runs as written: Python snippets in one 2-rank launch (the minimal
example also as one plain process, as its comment offers), shell commands as they are, from a workspace
folder that holds the README's placeholders (`path/to/hf-model`: a tiny Llama with its tokenizer;
`train.jsonl`/`eval.jsonl`; `recipes/`). A block marked `<!-- not run: WHY -->` says why it is not.

The README and every page under docs/ are read the same way; a snippet name belongs to one block, or to blocks that
are word for word the same (the Quickstart and the minimal example are on the README and on Getting started), so
each snippet runs once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.launch import ROOT, run

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PLAN_PAGE = os.path.join(DOCS, "plan.md")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
MARK = re.compile(r"<!-- (?:snippet: (?P<name>[\w-]+)|not run: (?P<why>.+?)) -->\s*$")
PYTHON_SNIPPETS = ("minimal", "classification", "mixin", "trl", "lora")
SHELL_SNIPPETS = ("quickstart", "own_model", "lora_recipe", "qlora_recipe", "long_context_recipe")


@dataclass
class Block:
    lang: str
    body: str
    line: int
    name: str | None  # from <!-- snippet: NAME -->
    why_not: str | None  # from <!-- not run: WHY -->
    page: str = "README.md"  # relative to the repository root


def pages() -> list[str]:
    """The README and every docs page, as paths relative to the repository root."""
    found = ["README.md"]
    for folder, _, files in sorted(os.walk(DOCS)):
        found += sorted(os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md"))
    return found


def readme_blocks() -> list[Block]:
    """Every fenced block of the README and the docs pages, with the marker on the line before it."""
    return [block for page in pages() for block in page_blocks(page)]


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of one page with the marker on the line before it."""
    text = open(os.path.join(ROOT, page)).read()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARK.search(before)
        body = "\n".join(line.removeprefix(match["indent"]) for line in match["body"].splitlines())
        blocks.append(
            Block(
                match["lang"],
                body,
                text[: match.start()].count("\n") + 1,
                mark["name"] if mark else None,
                mark["why"] if mark else None,
                page,
            )
        )
    return blocks


def snippet(name: str) -> str:
    """The code of the block marked `<!-- snippet: NAME -->` (the same wherever it appears)."""
    return next(b.body for b in readme_blocks() if b.name == name)


def shell_command(name: str) -> str:
    """A shell snippet as one line (backslash continuations joined)."""
    return snippet(name).replace("\\\n", " ")


def quickstart() -> list[str]:
    """The Quickstart commands, one per line."""
    return [line for line in snippet("quickstart").splitlines() if line.strip()]


def quickstart_main_job() -> tuple[str, list[str]]:
    """The main job's torchrun process count and arguments (script, config), as the README gives them."""
    _, command = quickstart()[0].split(" && ")
    tokens = shlex.split(command)
    assert tokens[:2] == ["torchrun", "--nproc_per_node"], command
    return tokens[2], tokens[3:]


def ci_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    unmarked = [f"{b.page}:{b.line}: {b.body.splitlines()[0][:60]}" for b in blocks if not (b.name or b.why_not)]
    assert not unmarked, "mark each block <!-- snippet: NAME --> (and run it here) or <!-- not run: WHY -->"
    names = {b.name for b in blocks if b.name}
    assert sorted(names) == sorted(PYTHON_SNIPPETS + SHELL_SNIPPETS), names
    assert all(b.lang == "python" for b in blocks if b.name in PYTHON_SNIPPETS)
    for name in names:  # a name on several pages is one snippet, word for word: it runs once
        copies = {(b.page, b.line): b.body for b in blocks if b.name == name}
        assert len(set(copies.values())) == 1, f"snippet {name} differs between {sorted(copies)}"


def test_readme_and_getting_started_show_the_same_quickstart_and_minimal_example():
    for name in ("quickstart", "minimal"):
        assert {b.page for b in readme_blocks() if b.name == name} == {"README.md", "docs/getting-started.md"}


def test_readme_is_a_front_door():
    """The README stays short: the rest is on the docs pages it links."""
    with open(README) as f:
        assert len(f.readlines()) <= 250


def test_scripts_readme_lists_every_script():
    """scripts/README.md gives each script one line, by its path under scripts/ (`benchmark/benchmark.py`), and
    lists no script that is gone."""
    folder = os.path.join(ROOT, "scripts")
    with open(os.path.join(folder, "README.md")) as f:
        listed = set(re.findall(r"^\| `([\w/]+\.(?:py|sh))` \|", f.read(), re.M))
    scripts = {
        os.path.relpath(os.path.join(where, name), folder)
        for where, _, names in os.walk(folder)
        for name in names
        if name.endswith((".py", ".sh"))
    }
    assert scripts == listed, (sorted(scripts - listed), sorted(listed - scripts))


def test_cli_reference_page_is_what_the_parser_prints():
    """docs/reference/cli.md is generated: regenerate with `python scripts/docs/cli_reference.py`."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "docs"))
    from cli_reference import PAGE, render_page

    with open(PAGE) as f:
        assert f.read() == render_page(), "stale: run python scripts/docs/cli_reference.py"


def test_configuration_reference_groups_every_field_and_is_current():
    """docs/reference/config.md shows every FSDP2Config field in its group: regenerate with
    `python scripts/docs/config_reference.py --write docs/reference/config.md`."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "docs"))
    from config_reference import page_tables, reference_tables

    assert page_tables(os.path.join(DOCS, "reference", "config.md")) == reference_tables()


def test_quickstart_is_two_commands_and_the_second_is_what_ci_runs():
    lines = quickstart()
    assert len(lines) == 2
    install, test = lines[1].split(" && ")
    assert f"python -m {install}" in ci_lines()
    assert test == ci_lines()[-1]
    assert quickstart()[0].split(" && ")[0].startswith("pip install torch==2.13.0 -e ")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny) -> str:
    """A reader's project folder: the placeholders of the README, filled with tiny things."""
    import shutil

    from tests.tiny_models import tiny_tokenizer

    root = tmp_path_factory.mktemp("readme")
    model = root / "path" / "to" / "hf-model"
    shutil.copytree(tiny("llama"), model)
    tiny_tokenizer().save_pretrained(model)
    for name, (n, offset) in {"train.jsonl": (48, 0), "eval.jsonl": (8, 7)}.items():
        with open(root / name, "w") as f:
            for i in range(n):  # prompt 'tA tB' → response 'tB+1 tB+2': learnable counting
                a, b = 3 + (i + offset) % 40, 10 + (i + offset) % 50
                f.write(json.dumps({"prompt": f"t{a} t{b}", "response": f"t{b + 1} t{b + 2}"}) + "\n")
    os.symlink(os.path.join(ROOT, "recipes"), root / "recipes")
    return str(root)


@pytest.fixture(scope="module")
def python_snippets(workspace) -> dict[str, str]:
    """Run every Python snippet at 2 ranks (one launch), the minimal example also as one process; return
    each snippet's stderr section (rank 0's log)."""
    path = os.path.join(workspace, "snippets.json")
    with open(path, "w") as f:
        json.dump({name: snippet(name) for name in PYTHON_SNIPPETS}, f)
    two = run("readme_snippets.py", 2, path, workspace, "two-ranks", *PYTHON_SNIPPETS, timeout=900)
    one = run("readme_snippets.py", 0, path, workspace, "one-process", "minimal")
    sections = re.split(r"=== README snippet ([\w-]+) ===\n", two.stderr)
    logs = dict(zip(sections[1::2], sections[2::2], strict=True))
    logs["minimal-one-process"] = one.stderr
    return logs


def outcome(folder: str) -> None:
    with open(os.path.join(folder, "outcome.json")) as f:
        result = json.load(f)
    assert result == "ok", result


@pytest.mark.parametrize("name", PYTHON_SNIPPETS)
def test_python_snippet_runs_as_written_at_two_ranks(python_snippets, workspace, name):
    outcome(os.path.join(workspace, "two-ranks", name))
    out = os.path.join(workspace, "two-ranks", name, "out")
    exported = {"trl": "adapter_model.safetensors", "lora": "adapter_model.safetensors"}.get(name, "model.safetensors")
    assert exported in os.listdir(out), os.listdir(out)


def test_minimal_example_also_runs_as_one_plain_process(python_snippets, workspace):
    outcome(os.path.join(workspace, "one-process", "minimal"))


def test_info_lines_appear_at_log_level_info_and_not_by_default(python_snippets):
    """The LoRA snippet sets log_level="info": its memory plan and checkpoint sizes are logged; the minimal
    example keeps transformers' default level (warning): neither line appears."""
    lora, minimal = python_snippets["lora"], python_snippets["minimal"]
    assert re.search(r"Memory plan: training needs (about|at most)", lora)
    assert re.search(r"checkpoint-2: [\d.]+ MiB on disk \(adapter \+ optimizer state\)", lora), lora[-3000:]
    assert "Memory plan" not in minimal and "MiB on disk" not in minimal
    assert "use_cpu" not in minimal, "the CPU process group is taken without a line at the default level"


def run_shell(workspace: str, name: str, command: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a README command as written in a folder of the workspace (placeholders and recipes/ beside it)."""
    folder = os.path.join(workspace, name)
    os.makedirs(folder, exist_ok=True)
    for entry in ("path", "recipes", "train.jsonl", "eval.jsonl"):
        if not os.path.exists(os.path.join(folder, entry)):
            os.symlink(os.path.join(workspace, entry), os.path.join(folder, entry))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # torchrun of this Python
    proc = subprocess.run(["bash", "-c", command], cwd=folder, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def summary_of(folder: str) -> dict:
    with open(os.path.join(folder, "job_summary.json")) as f:
        return json.load(f)


def test_quickstart_main_job_runs_as_written_learns_and_its_export_reloads(workspace):
    """The newcomer's first command (after the install, which CI does): the embedded task end to end."""
    run_shell(workspace, "quickstart", quickstart()[0].split(" && ")[1])
    out = os.path.join(workspace, "quickstart", "out", "full_finetune")
    summary = summary_of(out)
    before, after = summary["before"], summary["after"]
    assert before["exact_match"] == 0.0 and after["exact_match"] > 0.3
    assert after["eval_loss"] < before["eval_loss"] / 2
    # The from_pretrained folder the job exported answers exactly like the sharded model did.
    assert summary["reloaded"]["exact_match"] == after["exact_match"]
    assert {"model.safetensors", "config.json", "training_curves.png", "checkpoint-500"} <= set(os.listdir(out))
    with open(os.path.join(out, "training_curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(summary["peak_memory_mib_per_rank"]) == 2


def test_own_model_command_runs_as_written(workspace):
    run_shell(workspace, "own_model", shell_command("own_model"))
    out = os.path.join(workspace, "own_model", "out", "my-run")
    summary = summary_of(out)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    assert summary["reloaded"]["exact_match"] == summary["after"]["exact_match"]
    assert "model.safetensors" in os.listdir(out)


def test_lora_recipe_command_runs_as_written_and_its_adapter_loads_in_peft(workspace):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_shell(workspace, "lora_recipe", shell_command("lora_recipe"))
    out = os.path.join(workspace, "lora_recipe", "out", "my-lora")
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert "pytorch_model_fsdp_0" not in os.listdir(os.path.join(out, "checkpoint-100"))
    with open(os.path.join(out, "checkpoint-100", "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    assert losses and all(loss == loss for loss in losses)
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(workspace, "path", "to", "hf-model"))
    probe = torch.tensor([[1, 5, 12]])
    with torch.no_grad():
        before = base(input_ids=probe).logits
        after = PeftModel.from_pretrained(base, out)(input_ids=probe).logits
    assert not torch.allclose(before, after), "the exported adapter changes the model"


def test_qlora_recipe_command_runs_as_written_on_an_nf4_base(workspace):
    """QLoRA on the embedded default's 'qlora' model: every projection NF4 at 2 ranks, an adapter-only export."""
    pytest.importorskip("torchao", reason="the 'qlora' extra")
    proc = run_shell(workspace, "qlora_recipe", shell_command("qlora_recipe"))
    assert "NF4 base: 14 weights quantized; 1 kept dense (base_model.model.lm_head.weight" in proc.stdout + proc.stderr
    out = os.path.join(workspace, "qlora_recipe", "out", "qlora_finetune")
    summary = summary_of(out)
    assert summary["after"]["eval_loss"] < 0.5 * summary["before"]["eval_loss"]
    assert summary["after"]["exact_match"] > summary["before"]["exact_match"]
    assert "exact_match" in summary["reloaded"]  # PeftModel.from_pretrained over the original (dense) base
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)  # adapter only: no base written


def test_long_context_recipe_runs_as_written_with_rows_split_across_ranks(workspace):
    """Packed rows of the embedded default split across 2 ranks: it learns, and the export names sdpa, not ours."""
    proc = run_shell(workspace, "long_context_recipe", shell_command("long_context_recipe"))
    assert "Sequence parallelism: groups of 2 consecutive ranks share each row" in proc.stdout + proc.stderr
    out = os.path.join(workspace, "long_context_recipe", "out", "long_context")
    summary = summary_of(out)
    assert summary["after"]["eval_loss"] < 0.5 * summary["before"]["eval_loss"]
    assert summary["reloaded"]["exact_match"] == summary["after"]["exact_match"]
    with open(os.path.join(out, "config.json")) as f:
        assert "hf_fsdp2" not in f.read()


def test_plan_example_is_what_the_planner_prints():
    """The plan page's example is the planner's output, not typed: regenerate with
    scripts/docs/readme_plan_example.py."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "docs"))
    from readme_plan_example import current_block

    match, printed = current_block(PLAN_PAGE)
    assert match[3] == printed, "stale: run python scripts/docs/readme_plan_example.py"
