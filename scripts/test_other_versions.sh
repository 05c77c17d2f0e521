#!/usr/bin/env bash
# Rerun the test suite against other releases of the libraries it depends on, in a throwaway virtual environment:
#     bash scripts/test_other_versions.sh transformers==5.25.0                       (a new transformers release)
#     bash scripts/test_other_versions.sh torch==2.11.0 transformers==5.24.0 -- tests/test_checkpoint.py -x
# Every requirement the package and its dev extra name (hf_fsdp2/requirements/*.txt, setup.cfg) is installed at the
# versions they allow, except the pinned packages, which get exactly the version given, so a release outside the
# tested range can be tried before the range is widened: the package itself is installed without dependency
# resolution, and HF_FSDP2_ALLOW_UNTESTED=1 turns hf_fsdp2's refusal of an untested version into a warning.
# A whole-suite run (no pytest arguments) is recorded in scripts/results/versions/, the source of the Tested versions
# table (python scripts/docs/versions_table.py renders it). VENV=/path reuses (or keeps) that environment; otherwise
# it is removed at the end. An unpinned torch from PyPI is
# the CUDA build (several GB with its nvidia-* wheels), which also runs on a CPU. Needs the package registry.
set -euo pipefail
pins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    pins+=("$1")
    shift
done
[ $# -gt 0 ] && shift  # the "--"
[ ${#pins[@]} -gt 0 ] || { echo "usage: test_other_versions.sh PACKAGE==VERSION... [-- pytest args]" >&2; exit 2; }
cd "$(dirname "$0")/.."
if [ -n "${VENV:-}" ]; then
    venv="$VENV"
else
    venv="$(mktemp -d)/venv"
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
[ -x "$venv/bin/python" ] || python -m venv "$venv"
# The pins are what this environment is for: a machine-wide pip constraint file (some images cap torch) must not
# override them.
export PIP_CONSTRAINT=/dev/null
# Every requirement but those of the pinned packages (compared by exact name: torchao is not torch), then the pins.
requirements="$(dirname "$venv")/requirements-$$.txt"
"$venv/bin/python" - "${pins[@]}" > "$requirements" <<'PY'
import configparser
import re
import sys

pinned = {re.split(r"[=<>!~ ]", pin, maxsplit=1)[0].lower() for pin in sys.argv[1:]}
lines = []
for name in ("core", "trl", "qlora"):
    with open(f"hf_fsdp2/requirements/{name}.txt") as f:
        lines += f.read().splitlines()
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines += cfg["options.extras_require"]["dev"].splitlines()
for line in (line.split("#", 1)[0].strip() for line in lines):
    if line and re.split(r"[=<>!~ \[]", line, maxsplit=1)[0].lower() not in pinned:
        print(line)
print("\n".join(sys.argv[1:]))
PY
"$venv/bin/python" -m pip install -q -r "$requirements"
rm -f "$requirements"
"$venv/bin/python" -m pip install -q --no-deps -e .
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|peft|trl|torchao|torch-optimi) " | tr -s ' '
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_FSDP2_ALLOW_UNTESTED=1
status=0
junit="$(dirname "$venv")/junit-$$.xml"
start=$(date +%s)
"$venv/bin/python" -m pytest "${@:-tests}" --junitxml "$junit" || status=$?
# Only a whole-suite run becomes a row of the Tested versions table (scripts/results/versions/; render the table
# with python scripts/docs/versions_table.py).
if [ $# -eq 0 ] && [ -s "$junit" ]; then
    "$venv/bin/python" scripts/docs/versions_table.py --record "$junit" --seconds $(( $(date +%s) - start ))
fi
rm -f "$junit"
[ -n "${VENV:-}" ] && echo "kept $venv"
exit $status
