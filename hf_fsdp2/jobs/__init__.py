"""The jobs behind `recipes/`: fine-tuning and classification end to end, their arguments, data, the
embedded default task, metrics, summaries and charts.

Jobs import the core (`hf_fsdp2.trainer.mixin`, `config`, `skeleton`, `distributed`); the core never imports
jobs, and jobs never import each other: shared pieces live in `args`, `jsonl`, `outputs` and `charts`.
"""
