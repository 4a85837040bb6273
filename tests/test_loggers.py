"""The loggers on their own: what a resumed run leaves in TensorBoard, read back as TensorBoard reads it."""

from __future__ import annotations

import time
from pathlib import Path

from support import event_files, scalars
from hydra_ddp.reporting.loggers import TensorBoard


def test_a_resumed_runs_event_file_is_read_last_even_when_the_earlier_one_sorts_after_it(tmp_path: Path):
    # An earlier attempt logged steps 1-30, in a file whose name sorts after the one a restart in
    # the same second would get (its host and pid compare higher as text). The resumed attempt
    # continues after step 20: TensorBoard must show 1-20 from the first file and 21-25 from the new.
    first = TensorBoard(tmp_path, {"run": 1})
    for step in range(1, 31):
        first.metrics({"train/loss": float(step)}, step)
    first.close()
    (made,) = event_files(tmp_path)
    # The next second (a clock tick in between must not make this pass): the same second as the
    # restart below, or one after it, and higher than any name the restart could get in it.
    earlier = made.rename(made.with_name(f"events.out.tfevents.{int(time.time()) + 1:010d}.zzzz.99999999.0"))

    resumed = TensorBoard(tmp_path, {"run": 1}, resume_step=20)
    for step in range(21, 26):
        resumed.metrics({"train/loss": -float(step)}, step)
    resumed.close()

    names = [path.name for path in event_files(tmp_path)]
    assert len(names) == 2 and names[0] == earlier.name, names  # the resumed run's file is the last read
    assert scalars(tmp_path, "train/loss") == [(s, float(s)) for s in range(1, 21)] + [(s, -float(s)) for s in range(21, 26)]
