"""``python tests/trainer/late_start.py SCRIPT ARGS...``: run the training script ``SCRIPT``
(``examples/char_lm.py``: it logs its timeline to ``--log-dir``), late in the process started
as rank 1: once the two other ranks' agents are up (their ``start`` records are in the log
directory), then ``LATE_S`` more seconds. What a loaded host that starts one process late does
to the others: they probe a member whose script does not run yet. Its heavy imports come first,
so that its agent starts right after the wait."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

LATE_S = 3.0
WAIT_S = 120.0
"""At most this long for the other ranks; then it starts anyway (the test then fails)."""


def _others_started(log_dir: Path) -> int:
    started = 0
    for path in log_dir.glob("*.jsonl"):
        with open(path) as f:
            started += any(json.loads(line).get("event") == "start" for line in f
                           if line.endswith("\n"))
    return started


if __name__ == "__main__":
    script = sys.argv[1]
    if os.environ.get("TORCHPASS_ROLE") == "rank" and os.environ.get("RANK") == "1":
        import torch  # noqa: F401  (the slow imports, before the wait)

        import torchpass_p2p.trainer  # noqa: F401
        log_dir = Path(sys.argv[sys.argv.index("--log-dir") + 1])
        deadline = time.monotonic() + WAIT_S
        while _others_started(log_dir) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(LATE_S)
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
