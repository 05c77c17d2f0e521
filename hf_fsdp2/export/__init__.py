"""Hugging Face folders from a live model or a checkpoint, streamed unit by unit."""
