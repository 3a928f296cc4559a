"""A trial program for scripts/batch_search.py's tests: a process that "trains" batch B when
B <= --fits, and otherwise exits as a trial out of memory does (batch_search.OOM_EXIT).
--fail-at K makes batch K fail another way (an uncaught exception); --abort-at K kills it
with SIGABRT; --hang-at K sleeps past any test's timeout. Each run appends B to --log."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import batch_search  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("batch", type=int)
p.add_argument("--fits", type=int, required=True)
p.add_argument("--fail-at", type=int, default=-1)
p.add_argument("--abort-at", type=int, default=-1)
p.add_argument("--hang-at", type=int, default=-1)
p.add_argument("--log", default="")
a = p.parse_args()
if a.log:
    with open(a.log, "a", encoding="utf-8") as f:
        f.write("%d %d\n" % (a.batch, os.getpid()))
if a.batch == a.fail_at:
    raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED (not an out-of-memory error)")
if a.batch == a.abort_at:
    os.abort()
if a.batch == a.hang_at:
    time.sleep(60)
fits = a.batch <= a.fits
print(json.dumps({"batch": a.batch, "fits": fits}))
sys.exit(0 if fits else batch_search.OOM_EXIT)
