"""Local `evaluate` metric modules (loaded by path with `evaluate.load`, never from a hub)."""
