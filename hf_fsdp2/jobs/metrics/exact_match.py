"""Exact match as an `evaluate` metric module shipped with the package, so `evaluate.load` needs no hub.

Load it with `evaluate.load(hf_fsdp2.jobs.demo_task.EXACT_MATCH_PATH)`. Predictions and references are compared
after stripping surrounding whitespace.
"""

import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    """Fraction of predictions equal to their reference."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Fraction of predictions that equal their reference exactly (surrounding whitespace ignored).",
            citation="",
            inputs_description="predictions: list of str; references: list of str",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list, references: list) -> dict:
        hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True))
        return {"exact_match": hits / max(len(references), 1)}
