"""Optimizers on shards: every optim= verdict, sharded Adafactor, owner-based Muon, state sizes."""
