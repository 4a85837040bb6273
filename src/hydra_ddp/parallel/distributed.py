"""The process group: backends, init methods, the rendezvous store, collectives on small values,
teardown."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from hydra_ddp.errors import UserError
from hydra_ddp.runtime.ranks import RankInfo, srun_environment, srun_task


def adopt_launcher_environment() -> None:
    """A worker started by submitit (Slurm, or its local executor) or by srun reads who it is in
    their variables: exported here as RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT."""
    if "RANK" in os.environ:
        return
    if "SUBMITIT_EXECUTOR" in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    elif srun_task(os.environ):
        os.environ.update(srun_environment(os.environ))


class Host(NamedTuple):
    """What this machine offers a run, read once on the launch side: every decision that depends on
    it (device, world size, backend, which GPU a rank takes) is a pure function of these facts."""

    cuda: bool  # a CUDA device is usable
    # GPUs this process sees (CUDA_VISIBLE_DEVICES applied: under Slurm, often a task's own)
    gpus: int
    nccl: bool
    mpi: bool

    @classmethod
    def here(cls) -> Host:
        """This machine; or, for `train.py --check --gpus=N`, a GPU host of N GPUs (a config checked
        on a laptop or a login node for the cluster it will run on)."""
        assumed = os.environ.get(CHECK_GPUS_ENV)
        if assumed:
            return cls(cuda=True, gpus=int(assumed), nccl=True, mpi=dist.is_mpi_available())
        cuda = torch.cuda.is_available()
        return cls(
            cuda=cuda,
            gpus=torch.cuda.device_count() if cuda else 0,
            nccl=dist.is_nccl_available(),
            mpi=dist.is_mpi_available(),
        )


# set by train.py --check --gpus=N (startup.take_check_flags)
CHECK_GPUS_ENV = "HYDRA_DDP_CHECK_GPUS"


def resolve_backend(
    name: str, device: str, nproc_per_node: int, host: Host, outside_launch: bool = False
) -> str:
    """The concrete backend for `name`, or a UserError saying why it cannot run here. `auto` is held
    to what it picks: nccl gets the one-GPU-per-process check an explicit backend=nccl gets."""
    if name == "auto":
        name = "nccl" if device == "cuda" else "gloo"
        if name == "nccl" and not host.nccl:
            return "gloo"  # a CUDA build without NCCL (Windows): gloo still runs on GPUs
    if name == "gloo":
        return name
    if name == "nccl":
        if not host.cuda or not host.nccl:
            raise UserError(
                "backend=nccl needs CUDA GPUs and none are "
                "available here; use backend=gloo (or auto)"
            )
        if device != "cuda":
            raise UserError(
                "backend=nccl needs trainer.device=cuda; use backend=gloo to train on the CPU"
            )
        # one GPU per process, or one line why not
        gpu_index(0, nproc_per_node, host.gpus, outside_launch)
        return name
    if name == "mpi":
        if not host.mpi:
            raise UserError(
                "backend=mpi: this torch build has no MPI support "
                "(torch.distributed.is_mpi_available() is False); use "
                "backend=gloo (or nccl on GPUs) — mpirun can still launch it"
            )
        return name
    raise UserError(f"unknown backend {name!r}; choose auto, gloo, nccl or mpi")


def gpu_index(local_rank: int, local_world_size: int, visible: int, outside_launch: bool) -> int:
    """Which of the GPUs this process sees a local rank takes: its own index when the node's ranks
    see every GPU; 0 when an outside launcher gave each task one GPU of its own (Slurm's
    --gpus-per-task=1 or --gpu-bind, submitit's gpus_per_task: CUDA_VISIBLE_DEVICES per task).
    Anything else would put two ranks on one GPU, which NCCL refuses: one line, before launch."""
    if visible >= local_world_size:
        return local_rank
    if visible == 1 and outside_launch:
        return 0
    where = "each process sees" if outside_launch else "this host has"
    raise UserError(
        f"one GPU per process: {local_world_size} process(es) on this node but "
        f"{where} {visible} GPU(s); set trainer.nproc={visible} (or auto), give "
        "each task its own GPU (srun --gpus-per-task=1), or use backend=gloo"
    )


INIT_METHODS = ("env", "tcp", "file")


def init_url(init: Any, attempt: int = 0) -> str:
    """The URL torch's own rendezvous handler for the init method reads: env:// (MASTER_ADDR and
    MASTER_PORT), tcp://host:port, file://path. `attempt`: which of the launcher's stores (one per
    torchrun attempt) a tcp:// group meets on."""
    name = init.name
    if name == "env":
        return "env://"
    if name == "tcp":
        return f"tcp://{init.host}:{init.ports[attempt] if init.ports else init.port}"
    if name == "file":
        return f"file://{os.path.abspath(init.path)}"
    raise UserError(f"unknown init_method {name!r}; choose {', '.join(INIT_METHODS)}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def serve_store(
    host: str, port: int, timeout: timedelta, setting: str = "init_method.port"
) -> dist.TCPStore:
    """A TCPStore server; port 0 takes a free port, bound here and held: nothing can take it between
    choosing and binding (read the port back from `store.port`). `setting`: what set the port, for
    the one line a busy port gets.

    TCPStore alone listens on every interface: for a loopback host we bind the socket ourselves and
    hand it over, so nothing outside this machine can reach the store."""
    listener = None
    if _is_loopback(host):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # a restarted rank 0 takes the port again
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as e:
            listener.close()
            if e.errno == errno.EADDRINUSE:
                raise _port_in_use(host, port, setting) from None
            raise
        listener.listen()
        port = listener.getsockname()[1]
    try:
        store = dist.TCPStore(
            host,
            port,
            None,
            is_master=True,
            timeout=timeout,
            use_libuv=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno() if listener else None,
        )
    except dist.DistNetworkError as e:
        if listener is not None:
            listener.close()
        if "EADDRINUSE" in str(e):
            raise _port_in_use(host, port, setting) from None
        raise
    if listener is not None:
        listener.detach()  # the store owns the descriptor now, and closes it
    return store


def _port_in_use(host: str, port: int, setting: str) -> UserError:
    if setting == "MASTER_PORT":
        return UserError(
            f"MASTER_PORT={port} (exported) is already in use on {host}; "
            "export a free port, or unset MASTER_PORT (a free one is picked)"
        )
    return UserError(
        f"port {port} on {host} is already in use; set {setting} "
        "to a free port, or to null (a free one is picked)"
    )


def restart_count() -> int:
    """How often torchrun (or Slurm's requeue) has restarted this group: 0 on the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) or int(
        os.environ.get("SLURM_RESTART_COUNT", "0")
    )


def _join_hosted_store(init: Any, attempt: int) -> None:
    """On one node the launching process holds the rendezvous store, one per torchrun attempt, each
    bound before any worker started: torch's env:// and tcp:// handlers make every rank its client
    when TORCHELASTIC_USE_AGENT_STORE is set and MASTER_ADDR/MASTER_PORT name it (torch's
    rendezvous._agent_store_serves). A restarted group meets on a fresh store: none of the dead
    group's keys are in it."""
    ports = init.ports
    if attempt >= len(ports):
        raise UserError(
            f"restart {attempt} of the group has no store: the launcher held {len(ports)} "
            f"(launcher.max_restarts={len(ports) - 1})"
        )
    os.environ.update(
        MASTER_ADDR=init.host, MASTER_PORT=str(ports[attempt]), TORCHELASTIC_USE_AGENT_STORE="True"
    )


@contextlib.contextmanager
def process_group(
    backend: str, init: Any, rank: RankInfo, timeout_s: int, device: torch.device
) -> Iterator[None]:
    """Join the group through torch's rendezvous handler for the init method's URL; always leave it,
    so the next job in a multirun starts clean. An outside launcher's env:// is its
    MASTER_ADDR/PORT."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    attempt = int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )  # torchrun's count alone (a Slurm requeue is a new job)
    if init.ports:
        _join_hosted_store(init, attempt)
    # mpirun: rank 0 serves at host:port
    elif init.name == "env" and "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR=init.host, MASTER_PORT=str(init.port))
    dist.init_process_group(
        backend,
        init_method=init_url(init, attempt),
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def broadcast_text(text: str, device: torch.device, src: int = 0) -> str:
    """Rank `src`'s string on every rank, sent as bytes (no pickled objects cross the wire)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, src=src)
    buf = (
        data
        if dist.get_rank() == src
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=src)
    return bytes(buf.tolist()).decode()


def first_error(error: Optional[str], device: torch.device) -> Optional[str]:
    """The lowest rank's error message on every rank (None when no rank has one): all ranks stop
    with the same line instead of the healthy ones failing later at a collective."""
    world = dist.get_world_size()
    lowest = torch.tensor([dist.get_rank() if error else world], dtype=torch.long, device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    src = int(lowest.item())
    return None if src == world else broadcast_text(error or "", device, src)


def most_over_ranks(values: dict[str, int], device: torch.device) -> dict[str, int]:
    """Each value's maximum over the ranks (one all-reduce)."""
    packed = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return dict(zip(values, packed.tolist()))


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
