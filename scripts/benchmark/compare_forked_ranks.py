"""Check that the benchmark's forked ranks measure what fresh processes measure (scripts/benchmark/forked_ranks.py).

    python scripts/benchmark/compare_forked_ranks.py [--systems hf_fsdp2,transformers_fsdp2] [--pairs 4]

Runs the quick benchmark's training run of each system (`--quick` settings: load, 4 steps, saves, resume) as
interleaved pairs, forked then fresh (BENCHMARK_FRESH_PROCESSES=1), and prints per run the slowest rank's load
time and the worst rank's load and training peaks. No timing is asserted: read the spread of each mode against
the other's.
"""

from __future__ import annotations

import argparse
import os
import sys

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
import benchmark  # noqa: E402
import forked_ranks  # noqa: E402
from llama_model import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="hf_fsdp2,transformers_fsdp2")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_benchmark")
    options = parser.parse_args()
    args = benchmark.parse_args(["--quick", "--workdir", options.workdir])
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"llama-{args.layers}l-{args.hidden}h-{args.vocab}v-tied")
    build_model(path, args.layers, hidden=args.hidden, vocab=args.vocab, tied=True)
    benchmark.read_through(path)
    benchmark.warm_up(args, options.systems.split(",")[0], path)
    print("| pair | mode | system | load (s) | load peak (MiB) | training peak (MiB) |\n|---|---|---|---:|---:|---:|")
    for pair in range(options.pairs):
        for mode in ("forked", "fresh"):
            os.environ[forked_ranks.FRESH_ENV] = "1" if mode == "fresh" else "0"
            for system in options.systems.split(","):
                ranks = benchmark.run_training(args, system, path, "compare")["ranks"]
                load = max(r["load_s"] for r in ranks)
                peaks = [max(r[key] for r in ranks) for key in ("load_peak_mib", "train_peak_mib")]
                print(f"| {pair + 1} | {mode} | {system} | {load:.3f} | {peaks[0]:.0f} | {peaks[1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
