#!/usr/bin/env bash
# Rerun the test suite against another torch in a throwaway virtual environment (scripts/test_other_versions.sh,
# which installs every other requirement, torchao and torch-optimi included, at the versions the package allows):
#     bash scripts/test_other_torch.sh 2.15.0 [pytest args...]      (default: the whole suite)
set -euo pipefail
version="${1:?usage: test_other_torch.sh TORCH_VERSION [pytest args...]}"
shift
exec bash "$(dirname "$0")/test_other_versions.sh" "torch==$version" -- "$@"
