#!/usr/bin/env bash
# Rerun the test suite against another torch in a throwaway virtual environment:
#     bash scripts/test_other_torch.sh 2.15.0 [pytest args...]      (default: the whole suite)
# setup.cfg's install_requires pins the torch range CI tests; to try a version outside it, the package is
# installed without dependency resolution and everything else it needs is installed beside that torch.
# Set KEEP_VENV=1 to keep the environment (printed at the end). Needs the package registry; an unpinned
# torch from PyPI is the CUDA build (several GB with its nvidia-* wheels), which also runs on a CPU.
set -euo pipefail
version="${1:?usage: test_other_torch.sh TORCH_VERSION [pytest args...]}"
shift || true
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/torch-$version"
python -m venv "$venv"
trap '[ "${KEEP_VENV:-0}" = 1 ] || rm -rf "$(dirname "$venv")"' EXIT
"$venv/bin/python" -m pip install -q "torch==$version"
# Everything setup.cfg asks for except torch, at the versions it allows, then the package itself.
requirements=$("$venv/bin/python" - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
deps = cfg["options"]["install_requires"].split("\n") + cfg["options.extras_require"]["dev"].split("\n")
print("\n".join(d.strip() for d in deps if d.strip() and not d.strip().startswith("torch")))
PY
)
echo "$requirements" > "$(dirname "$venv")/requirements.txt"
"$venv/bin/python" -m pip install -q -r "$(dirname "$venv")/requirements.txt" "torch==$version"
"$venv/bin/python" -m pip install -q --no-deps -e .
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|peft|trl) " | tr -s ' '
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
status=0
"$venv/bin/python" -m pytest "${@:-tests}" || status=$?
[ "${KEEP_VENV:-0}" = 1 ] && echo "kept $venv"
exit $status
