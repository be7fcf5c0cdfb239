"""Nightly-size control-plane fuzzing: tests/faults/test_fuzz_wire.py under a Hypothesis profile.

    python bench/fuzz.py                      # "nightly": 10,000 cases per message kind and side
    python bench/fuzz.py --profile ci -k decode

Prints one JSON line: profile, examples per kind, test counts by outcome, wall time, git hash,
hardware. The exit status is pytest's, so a nightly job fails when the fuzzing finds something.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, emit, git_hash, hardware  # noqa: E402

EXAMPLES = {"ci": 200, "nightly": 10_000}  # as registered in tests/conftest.py


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="nightly", choices=sorted(EXAMPLES))
    parser.add_argument("-k", default=None, help="pytest -k expression to run a subset")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "tests/faults/test_fuzz_wire.py"] + (["-k", args.k] if args.k else [])
        started = time.monotonic()
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HYPOTHESIS_PROFILE": args.profile}).returncode
        seconds = time.monotonic() - started
        counts = {"passed": 0, "failed": 0, "xfailed": 0, "skipped": 0}
        for case in ET.parse(report).iter("testcase") if report.exists() else ():
            outcome = {c.tag: c for c in case}
            if "failure" in outcome or "error" in outcome:
                counts["failed"] += 1
            elif "skipped" in outcome:
                is_xfail = outcome["skipped"].get("type") == "pytest.xfail"
                counts["xfailed" if is_xfail else "skipped"] += 1
            else:
                counts["passed"] += 1
    emit({"bench": "fuzz_wire", "profile": args.profile, "examples_per_kind": EXAMPLES[args.profile],
          **counts, "seconds": round(seconds, 1), "exit_status": rc, "git": git_hash(), "hardware": hardware()})
    return rc


if __name__ == "__main__":
    sys.exit(main())
