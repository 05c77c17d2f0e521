"""Accuracy as an `evaluate` metric module shipped with the package (loaded by path; no hub)."""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    """Fraction of predicted labels equal to the reference labels."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their reference label.",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list, references: list) -> dict:
        hits = sum(int(p) == int(r) for p, r in zip(predictions, references, strict=True))
        return {"accuracy": hits / max(len(references), 1)}
