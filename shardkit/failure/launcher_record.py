"""Tell torchrun which rank failed first, in the error file it gives each rank.

torchrun's summary names as "Root Cause (first observed failure)" the rank whose failure has the
smallest timestamp, in whole seconds, and a rank that leaves no error file gets the time the agent
noticed its exit; ties go to the lowest rank. So a survivor that stops within the same second as
the rank that raised (the usual case) was named the root cause, with its exit status 75. Each
rank that stops now writes TORCHELASTIC_ERROR_FILE in torchrun's own format: the failed rank with
its error and the time rounded down, a survivor with shardkit's line and the time rounded up (it
noticed the failure after it happened), so the failed rank is named, with its traceback.
"""

from __future__ import annotations

import json
import math
import os
import time

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record(message: str, traceback_text: str, failed_here: bool) -> None:
    """Write this rank's failure for the launcher, if the launcher asked for one (else nothing)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    stamp = math.floor(now) if failed_here else math.ceil(now)
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": traceback_text, "timestamp": str(stamp)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the launcher then falls back to the exit status, as before
