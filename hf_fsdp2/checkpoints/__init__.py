"""Sharded DCP checkpoints: write, read, resume, adapters, a full disk."""
