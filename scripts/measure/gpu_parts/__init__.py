"""The parts of scripts/measure/gpu_check.py, one module each; the driver runs them in worker processes."""
