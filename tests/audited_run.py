"""Run a script under the collective audit: what `tests/launch.py` starts in fresh interpreters.

    python -m tests.audited_run SCRIPT [ARGS...]
    torchrun --nproc_per_node N -m tests.audited_run SCRIPT [ARGS...]

The script runs as `python SCRIPT ARGS` would (its argv, `__main__`, its exit code and traceback), inside
`tests.collective_audit.audited()`. When it ends normally but handed a collective a tensor on the wrong device for
a GPU job, the violations go to stderr and the process exits with AUDIT_FAILED (3); a script that fails
keeps its own failure (and the violations are printed too).
"""

from __future__ import annotations

import runpy
import sys

from tests.collective_audit import AUDIT_FAILED, audited, report


def main() -> None:
    """Run sys.argv[1] with the rest of the arguments, audited."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.audited_run SCRIPT [ARGS...]")
    sys.argv = sys.argv[1:]
    with audited() as audit:
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as exit_:
            if audit.violations and exit_.code in (0, None):
                raise SystemExit(AUDIT_FAILED) from None
            raise
        finally:
            if audit.violations:
                print(report(audit), file=sys.stderr, flush=True)
    if audit.violations:
        raise SystemExit(AUDIT_FAILED)


if __name__ == "__main__":
    main()
