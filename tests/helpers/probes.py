"""Test-only models that write down what the process group was built from, read from torch itself."""

import json
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hydra_ddp.models import MnistCNN


class RendezvousProbe(MnistCNN):
    """Writes probe_dir/rank{R}.json: the init_method init_process_group received, and the address of
    the TCP store the group's store wraps (none for a file store), as torch holds them."""

    def __init__(self, probe_dir: str, **kwargs):
        super().__init__(**kwargs)
        store = distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        tcp = isinstance(store, dist.TCPStore)
        seen = {"init_method": distributed_c10d._default_pg_init_method, "store": type(store).__name__,
                "host": store.host if tcp else None, "port": store.port if tcp else None}
        Path(probe_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
