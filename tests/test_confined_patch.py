"""The two replacements of other libraries' functions (TRL-built models by path, TRL's `hash_module`) and the path
guard of `Trainer.__init__` are seen only by the trainer being built, in the thread building it.

Each test fails with the process-wide swaps they replaced: a class-level `Trainer.__init__` swap is seen by a
subclass's `__init__`; a module-level `from_pretrained` or `hash_module` swap answers other threads' calls too."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_fsdp2.confined_patch import ConfinedPatch


def _in_thread(call):
    """Run `call` in a fresh thread and return its result."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call()))
    thread.start()
    thread.join()
    return result["value"]


def test_a_confined_patch_answers_only_its_own_thread_and_is_gone_after_the_last_window():
    owner = types.SimpleNamespace(f=lambda: "original")
    original = owner.__dict__["f"]
    patch: ConfinedPatch[str] = ConfinedPatch(owner, "f", lambda f: lambda: patch.current() or f())
    entered, release = threading.Event(), threading.Event()

    def other_window():
        with patch.window("other"):
            entered.set()
            release.wait(10)

    other = threading.Thread(target=other_window)
    other.start()
    entered.wait(10)
    with patch.window("mine"):
        assert owner.f() == "mine"
        assert _in_thread(owner.f) == "original", "a thread outside every window gets the original"
        release.set()
        other.join()
        assert owner.f() == "mine", "the other thread's window closing did not restore it under ours"
    assert owner.__dict__["f"] is original and owner.f() == "original"


def test_from_pretrained_in_another_thread_reads_the_weights_while_a_trainer_is_built(tiny):
    from hf_fsdp2.loading.path_models import skeletons_for_paths

    path = tiny("llama")
    with skeletons_for_paths() as built:
        skeleton = AutoModelForCausalLM.from_pretrained(path)
        elsewhere = _in_thread(lambda: AutoModelForCausalLM.from_pretrained(path))
    assert built == [skeleton] and next(skeleton.parameters()).is_meta
    assert not any(p.is_meta for p in elsewhere.parameters()), "another thread's model was loaded, not skeletonised"


def test_the_path_guard_changes_only_the_trainer_being_built(tmp_path, tiny):
    """A subclass's own __init__ sees Trainer.__init__ untouched; the trainer gets its class back."""
    from hf_fsdp2 import FSDP2Mixin

    original = Trainer.__dict__["__init__"]
    seen = []

    class Declares(Trainer):
        def __init__(self, model: str, args: TrainingArguments) -> None:
            seen.append(Trainer.__dict__["__init__"] is original)
            super().__init__(model=model, args=args)

    class Sharded(FSDP2Mixin, Declares):
        pass

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Sharded(tiny("llama"), args)
    assert seen == [True], "Trainer.__init__ was swapped on the class while the trainer was built"
    assert type(trainer) is Sharded and not any(p.is_meta for p in trainer.model.parameters())


def test_trl_hash_module_is_ours_only_for_the_built_trainers_models():
    pytest.importorskip("trl")
    from trl.trainer import dpo_trainer
    from trl.trainer.utils import hash_module as trl_hash

    from hf_fsdp2.trl import _DPO_HASH

    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    trainer = types.SimpleNamespace(model=model, ref_model=None)
    calls = []
    with _DPO_HASH.window(trainer):
        installed = dpo_trainer.hash_module
        assert installed is not trl_hash
        assert installed(other) == trl_hash(other)
        assert _in_thread(lambda: installed(model)) == trl_hash(model)
        calls.append(installed(model))
    assert dpo_trainer.hash_module is trl_hash
    assert calls == [trl_hash(model)], "plain tensors: ours and TRL's hashes agree"
