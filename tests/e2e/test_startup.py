"""The forkserver's workers, as multiprocessing really forks them: what they inherit of its
imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import REPO, train_env

# A worker forked from the forkserver that train.py starts (startup.preload) reports on its garbage
# collector; and frozen_imports hands back the collector as it found it.
PROBE = """
import gc, json, multiprocessing, sys
from hydra_ddp.launch import startup

def report(queue):
    queue.put({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
               "torch": "torch._dynamo" in sys.modules})

if __name__ == "__main__":
    with startup.frozen_imports():
        inside = gc.isenabled()
    after = gc.isenabled()
    gc.disable()
    with startup.frozen_imports():
        pass
    stays_off = not gc.isenabled()
    gc.enable()
    startup.preload()
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    found = queue.get(timeout=60)
    worker.join(timeout=30)
    print(json.dumps({"inside": inside, "after": after, "stays_off": stays_off, "worker": found,
                      "exitcode": worker.exitcode}))
"""


def test_forkserver_workers_inherit_frozen_imports_with_the_collector_on(tmp_path: Path):
    script = tmp_path / "probe.py"  # a file: the forked worker imports its target from it
    script.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    # Off while the imports load, back on after; left off where it was off.
    assert found["inside"] is False and found["after"] is True and found["stays_off"] is True
    worker = found["worker"]
    # torch arrived imported, its objects frozen out of every collection (hundreds of thousands),
    # and the collector runs in the worker: a training loop's garbage cycles are still freed.
    assert worker["torch"] is True and worker["enabled"] is True, worker
    assert worker["frozen"] > 100_000, worker
    assert found["exitcode"] == 0
