"""Train a tiny model with FSDP2Trainer (under torchrun or as one process) and record what happened.

Rank 0 writes `result.json` (per-step losses and grad norms, eval loss) and `weights.pt` (the full
trained state dict) into --out, so tests can compare runs with different world sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from datasets import Dataset
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, close_distributed, from_pretrained
from hf_fsdp2.sharding.gathering import gathered_bytes
from tests.tiny_models import tiny_tokenizer
from tests.workers.scenarios import PARITY_ADAM_EPSILON, main_with_batches

SEQ = 16


def make_dataset(n: int, vocab: int, seed: int = 0) -> Dataset:
    """Token sequences of varying length, padded with label -100, so token-count normalization matters."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        pad = SEQ - length
        rows["input_ids"].append(ids + [0] * pad)
        rows["attention_mask"].append([1] * length + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return Dataset.from_dict(rows)


def make_pattern_dataset(n: int, vocab: int, seed: int = 0) -> Dataset:
    """Counting sequences (each token is the previous + 1): learnable in a few steps, so loss must fall."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, vocab, (n,), generator=g).tolist()
    ids = [[3 + (s + i) % (vocab - 3) for i in range(SEQ)] for s in starts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ] * n, "labels": ids})


def make_classification_dataset(n: int, vocab: int, seed: int = 0) -> Dataset:
    """Padded sequences with one of 3 labels per sequence."""
    g = torch.Generator().manual_seed(seed)
    rows = make_dataset(n, vocab, seed).to_dict()
    rows["labels"] = torch.randint(0, 3, (n,), generator=g).tolist()
    return Dataset.from_dict(rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--load", default="path", choices=["path", "from_pretrained", "object", "object_rank0"])
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--defer", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--hsdp", type=int, default=1)
    p.add_argument("--wrap", default="transformer_based_wrap")
    p.add_argument("--reshard", default="true")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--loss-chunk", type=int, default=None, help="FSDP2Config(loss_chunk_size=N)")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--evaluate-first", action="store_true")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never during training)")
    p.add_argument("--user-optimizer", action="store_true")
    p.add_argument("--generate", action="store_true")
    p.add_argument("--per-token-generate", action="store_true", help="FSDP2Config(gather_for_generate=False)")
    p.add_argument("--task", default="causal", choices=["causal", "classify"])
    p.add_argument("--data", default="random", choices=["random", "pattern"])
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--resume", default=None, help="a checkpoint path, 'last' (True) or 'auto'")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--checkpoint-writes", default="cached")
    p.add_argument("--run-dir", default=None, help="output_dir of the run (default OUT/run)")
    p.add_argument("--tokenizer", action="store_true", help="pass a processing_class")
    p.add_argument("--lora", default=None, help="LoRA target modules, comma-separated (e.g. q_proj,v_proj)")
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--modules-to-save", default=None, help="comma-separated, e.g. score")
    p.add_argument("--merge-adapters", action="store_true")
    p.add_argument("--no-use-cpu", action="store_true", help="leave use_cpu off even without a GPU")
    p.add_argument("--seed-checkpoint", default=None, help="copy this checkpoint-N folder into the run dir first")
    p.add_argument("--kill-in-save", type=int, default=0, help="rank 1 SIGKILLs itself inside its N-th save")
    p.add_argument("--kill-in-copy", type=int, default=0, help="rank 1 SIGKILLs itself inside its N-th async host copy")
    p.add_argument("--kill-at", type=int, default=0, help="first attempt only: rank 1 SIGKILLs itself after step N")
    p.add_argument("--signal-at", type=int, default=0, help="after step N, --signal-rank sends SIGTERM to --signal-to")
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--signal-to", default="self", choices=["self", "agent"], help="itself, or torchrun's agent")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step takes at least")
    p.add_argument("--fill-disk-at-save", type=int, default=0, help="fill the run dir's file system in save N")
    p.add_argument("--export-to", default=None, help="trainer.save_model(this folder) after training")
    p.add_argument("--slow-staging", type=float, default=0.0, help="each async save's host copy starts this late")
    return p.parse_args(argv)


def fill_disk_at_save(nth: int, out: str) -> None:
    """Once the nth save's room check has passed, fill the file system it writes to, leaving a quarter of what the
    save needs (as another process writing there would): the save then fails mid-write on a really full disk.

    Rank 0 first records the checkpoints already there (file -> sha256) in OUT/before_fill.json; the ballast is
    the file `ballast` beside the run dir (remove it to free the space again).
    """
    import hashlib

    import torch.distributed as dist

    import hf_fsdp2.trainer.checkpointing as trainer_module

    real, calls = trainer_module.check_room, {"n": 0}

    def check_then_fill(folder: str, own: int, what: str = "checkpoint") -> int:
        need = real(folder, own, what)
        calls["n"] += 1
        if calls["n"] == nth and dist.get_rank() == 0:
            run_dir = os.path.dirname(folder)
            before = {}
            for root, _, files in os.walk(run_dir):
                for name in files:
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        before[os.path.relpath(path, run_dir)] = hashlib.sha256(f.read()).hexdigest()
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "before_fill.json"), "w") as f:
                json.dump(before, f)
            with open(os.path.join(os.path.dirname(run_dir), "ballast"), "wb") as f:
                f.write(b"\0" * (shutil.disk_usage(run_dir).free - need // 4))
        if calls["n"] == nth:
            dist.barrier()
        return need

    trainer_module.check_room = check_then_fill


@contextlib.contextmanager
def slow_staging(seconds: float):
    """Each asynchronous save's host copy starts `seconds` late (in its background thread), so the step after the save
    reaches its optimizer step first, where the trainer must wait for the copy."""
    import time

    from hf_fsdp2.checkpoints.sharded_save import HostStager

    copy = HostStager._copy

    def late(self, *args):
        time.sleep(seconds)
        return copy(self, *args)

    HostStager._copy = late if seconds else copy
    try:
        yield
    finally:
        HostStager._copy = copy


def kill_inside_copy(nth: int) -> None:
    """Make rank 1 die by SIGKILL in the background thread of its nth asynchronous save, halfway through the host
    copy that overlaps the next step (the other rank has already gone on training)."""
    import signal

    from hf_fsdp2.checkpoints.sharded_save import HostStager

    if int(os.environ.get("RANK", "0")) != 1:
        return
    copy, calls = HostStager._copy, {"n": 0}

    def copy_then_die(self, copier, state_dict):
        calls["n"] += 1
        if calls["n"] == nth:
            half = dict(list(state_dict.items())[: len(state_dict) // 2])
            copier.stage(half, non_blocking=False)
            os.kill(os.getpid(), signal.SIGKILL)
        return copy(self, copier, state_dict)

    HostStager._copy = copy_then_die


def kill_inside_save(nth: int) -> None:
    """Make rank 1 die by SIGKILL right after writing its data in the nth DCP save call (mid-checkpoint)."""
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    if int(os.environ.get("RANK", "0")) != 1:
        return
    original = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        calls["n"] += 1
        if calls["n"] == nth:
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die


class Disruptions(TrainerCallback):
    """Faults injected at a step boundary: a SIGKILLed rank, a SIGTERM to one rank or to torchrun's agent."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, int(os.environ.get("RANK", "0"))
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.steps_run = 0  # optimizer steps this process ran (fewer than global_step after a resume)

    def on_step_end(self, args, state, control, **kwargs):
        import signal
        import time

        time.sleep(self.args.step_sleep)
        self.steps_run += 1
        step = state.global_step
        if step == self.args.kill_at and self.rank == 1 and self.first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.args.signal_at and self.rank == self.args.signal_rank:
            os.kill(os.getpid() if self.args.signal_to == "self" else os.getppid(), signal.SIGTERM)
        return control


def seed_checkpoint(checkpoint: str, run_dir: str) -> None:
    """Start a run from a copy of another run's checkpoint (rank 0 copies; every rank waits for it)."""
    import shutil

    import torch.distributed as dist

    from hf_fsdp2.distributed import init_distributed

    init_distributed()
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, os.path.join(run_dir, os.path.basename(checkpoint)))
    dist.barrier()


def build_model(args: argparse.Namespace):
    """Hand the trainer a path, a meta skeleton, or a real object; with --lora, wrapped by peft."""
    # Seeded first, like a single-process script: weights the checkpoint lacks draw from this state.
    set_seed(args.seed)
    model = build_base(args)
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    if isinstance(model, str):
        model = from_pretrained(model, AutoModelForCausalLM)
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        target_modules=args.lora.split(","),
        modules_to_save=args.modules_to_save.split(",") if args.modules_to_save else None,
        lora_dropout=0.0,
        task_type="SEQ_CLS" if args.task == "classify" else "CAUSAL_LM",
    )
    return get_peft_model(model, config)


def build_base(args: argparse.Namespace):
    """A path, a meta skeleton, or a real object (on every rank or only rank 0)."""
    if args.task == "classify":
        if args.load == "object":
            return AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3)
        return from_pretrained(args.model, AutoModelForSequenceClassification, num_labels=3)
    if args.load == "path":
        return args.model
    if args.load == "from_pretrained":
        return from_pretrained(args.model, AutoModelForCausalLM)
    rank = int(os.environ.get("RANK", "0"))
    if args.load == "object_rank0" and rank != 0:
        return from_pretrained(args.model, AutoModelForCausalLM)
    return AutoModelForCausalLM.from_pretrained(args.model)


def train(argv: list[str]) -> None:
    """One training run, described by worker flags; rank 0 writes OUT/result.json and OUT/weights.pt."""
    args = parse(argv)
    if args.seed_checkpoint:
        seed_checkpoint(args.seed_checkpoint, args.run_dir or os.path.join(args.out, "run"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = args.global_batch // (world * args.grad_accum)
    assert per_device * world * args.grad_accum == args.global_batch, "global batch must split evenly"
    model = build_model(args)
    optimizers = (None, None)
    if args.user_optimizer:
        optimizers = (
            torch.optim.AdamW(model.parameters(), lr=args.lr, eps=PARITY_ADAM_EPSILON, weight_decay=0.0),
            None,
        )
    training_args = TrainingArguments(
        output_dir=args.run_dir or os.path.join(args.out, "run"),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        adam_epsilon=PARITY_ADAM_EPSILON,  # runs are compared element-wise across world sizes: see its definition
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        report_to=[],
        seed=args.seed,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available() and not args.no_use_cpu,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    config = FSDP2Config(
        defer_gradient_sync=args.defer,
        hsdp_replicate_size=args.hsdp,
        auto_wrap_policy=args.wrap,
        reshard_after_forward=args.reshard,
        fsdp_activation_checkpointing=args.ac,
        compile=args.compile,
        loss_chunk_size=args.loss_chunk,
        cpu_offload=args.offload,
        min_num_params=1000,
        async_save=args.async_save,
        checkpoint_writes=args.checkpoint_writes,
        merge_adapters_on_save=args.merge_adapters,
        gather_for_generate=not args.per_token_generate,
    )
    if args.kill_in_save:
        kill_inside_save(args.kill_in_save)
    if args.kill_in_copy:
        kill_inside_copy(args.kill_in_copy)
    if args.fill_disk_at_save:
        fill_disk_at_save(args.fill_disk_at_save, args.out)
    vocab = 96
    data = make_classification_dataset if args.task == "classify" else make_dataset
    data = make_pattern_dataset if args.data == "pattern" else data
    trainer = FSDP2Trainer(
        model,
        training_args,
        fsdp2_config=config,
        train_dataset=data(64, vocab),
        eval_dataset=data(8 * world, vocab, seed=1),
        optimizers=optimizers,
        processing_class=tiny_tokenizer() if args.tokenizer else None,
    )
    disruptions = Disruptions(args)
    trainer.add_callback(disruptions)
    result: dict = {"world": world, "direct_files": count_direct_files()}
    if args.evaluate_first:
        result["eval_before"] = trainer.evaluate()["eval_loss"]
    resume = True if args.resume == "last" else args.resume
    with _counting_collectives() as calls, slow_staging(args.slow_staging):
        trainer.train(resume_from_checkpoint=resume)
    if args.export_to:
        trainer.save_model(args.export_to)
    result["all_gathers_in_training"] = calls["all_gather"]
    result["reduce_scatters_in_training"] = calls["reduce_scatter"]
    result["steps_run"] = disruptions.steps_run
    result["use_cpu"] = training_args.use_cpu
    history = [h for h in trainer.state.log_history if "loss" in h]
    result["steps"] = [h["step"] for h in history]
    result["losses"] = [h["loss"] for h in history]
    result["grad_norms"] = [h["grad_norm"] for h in history]
    result["resharded_after_forward"] = {
        name or "<root>": module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
        for name, module in trainer.model.named_modules()
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group is not None
    }
    result["loss_chunked"] = getattr(trainer, "_chunked_loss_target", None) is not None
    result["eval_after"] = trainer.evaluate()["eval_loss"]
    probe = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]], device=training_args.device)
    trainer.model.eval()
    with torch.no_grad():
        result["logits"] = trainer.model(input_ids=probe).logits.float().cpu().tolist()
    if args.generate:
        prompt = torch.tensor([[5, 6, 7, 8]], device=training_args.device)
        with torch.no_grad(), _counting_collectives() as calls, _counting_compiled_calls(trainer.model) as compiled:
            result["generated"] = trainer.model.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
        result["compiled_calls_in_generate"] = compiled[0]
        units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
        result["all_gathers_in_generate"] = calls["all_gather"]
        result["all_reduces_in_generate"] = calls["all_reduce"]
        result["gathered_bytes"] = gathered_bytes(trainer.model)
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # whole
        result["units"] = len(units)
        result["resharded_after_generate"] = {
            name or "<root>": module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
            for name, module in trainer.model.named_modules()
            if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group is not None
        }
        result["sharded_after_generate"] = not any(g.is_unsharded for g in groups if g is not None)
    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v.float() for k, v in weights.items()}, os.path.join(args.out, "weights.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


@contextlib.contextmanager
def _counting_compiled_calls(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count calls into the compiled blocks (`nn.Module.compile()`'s `_compiled_call_impl`) inside the block: a count
    dynamo's own counters miss once its recompile limit sends frames to eager."""
    count = [0]

    def counted(call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return call(*args, **kwargs)

        return wrapper

    compiled = [(m, m._compiled_call_impl) for m in model.modules() if m._compiled_call_impl is not None]
    for module, call in compiled:
        module._compiled_call_impl = counted(call)
    try:
        yield count
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call


@contextlib.contextmanager
def _counting_collectives():
    """Count torch.distributed's all-gathers (FSDP2's parameter gathers), reduce-scatters (its gradient
    reductions) and all-reduces inside the block."""
    import torch.distributed as dist

    count = {"all_gather": 0, "all_reduce": 0, "reduce_scatter": 0}
    # torch 2.13's FSDP2 gathers and reduces through the *_single calls; earlier ones through the *_tensor ones.
    kinds = {
        "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "all_reduce": "all_reduce",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    }  # fmt: skip
    originals = {name: getattr(dist, name) for name in kinds if hasattr(dist, name)}

    def counting(name, original):
        def counted(*a, **k):
            count[kinds[name]] += 1
            return original(*a, **k)

        return counted

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def count_direct_files() -> list[str]:
    """Record every file this rank's checkpoints write through direct_io (the list fills as they are written)."""
    from hf_fsdp2.checkpoints import sharded_save as checkpoint

    written: list[str] = []

    class Counted(checkpoint.DirectStream):
        def __init__(self, path: str) -> None:
            written.append(os.path.basename(path))
            super().__init__(path)

    checkpoint.DirectStream = Counted
    return written


def main() -> None:
    main_with_batches(train)
    close_distributed()


if __name__ == "__main__":
    main()
