"""torch's flight recorder, the process group's last collectives: turned on before the group is
made (NCCL's dumped into the run's stacks folder on a timeout), and read into a hung rank's report
(runtime.hangs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENTRIES = "2000"  # collectives each rank's recorder keeps (torch's own suggestion)


def enable(backend: str, stacks: Optional[Path]) -> None:
    """Before the process group is made: torch's flight recorder on (unless the user set it), and
    NCCL's dump on a timeout into the run's stacks folder (`stacks`: runtime.hangs' folder in the
    run directory; None: an outside launch's rank, which learns the run directory only from the
    group; NCCL's dump then goes to its default place)."""
    if "nccl" in backend:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", ENTRIES)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if stacks is not None:
            stacks.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault(
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(stacks / "nccl_trace_rank_")
            )
    else:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", ENTRIES)


def dump(path: Path) -> Optional[str]:
    """The process group's flight recorder (torch's pickle, as NCCL's dump writes it), if it has
    one; its last collective, e.g. "#13 gloo:all_reduce"."""
    try:
        import pickle

        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace

        # the recorder outlives a destroyed group: its entries are not this one's
        if not dist.is_initialized():
            return None
        trace = _dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        entries = pickle.loads(trace).get("entries") or []
    except Exception:  # no recorder in this torch, or a backend without one
        return None
    path.write_bytes(trace)
    newest_group = max((e.get("pg_id", 0) for e in entries), default=0)
    last = max(
        (e for e in entries if e.get("pg_id", 0) == newest_group),
        key=lambda e: e.get("record_id", 0),
        default=None,
    )
    return f"#{last['collective_seq_id']} {last['profiling_name']}" if last else None
