"""Training while a checkpoint uploads: the step time during an upload to object storage, against
the step time of the same run without checkpoints (docs/storage.md).

    .venv/bin/python bench/upload.py [--rate-mb-s 4] [--repeats 3]

An S3 server (moto's server mode) on loopback, behind a proxy that relays the client's bytes at
`--rate-mb-s` MB/s: each checkpoint of the default model (about 3.5 MB with Adam's state) takes
seconds to upload, while steps take tens of milliseconds. 2 ranks train the default run for 2400
steps with `checkpoint.dir=s3://…` and a checkpoint every 600 steps, so that an upload is under
way much of the time and done before the next save (a save that waits for it is
`checkpoint_write_wait_s`, reported beside); no validation between (a better validation would
save too). A hook writes the time each step ends on rank 0. A step is "during an upload" when the
proxy relayed checkpoint bytes for the whole of it; the step a save stalls (its snapshot,
`checkpoint_stall_s`: the save runs after a step's end, so in the next step's time) is not. The
baseline is the same run with no checkpoint, alternated with it `--repeats` times. The result
goes to bench/results/upload_COMMIT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import provenance

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS, EVERY = 2400, 600
WARMUP = 20  # steps left out at the start (the first steps build caches)


class StepTimes:
    """A hook (trainer.hooks): rank 0's wall-clock time at each step's end, written to
    RUN_DIR/steps.json."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def running(self, fit):  # noqa: ANN001
        @contextlib.contextmanager
        def around():
            yield
            if fit.rank == 0:
                (Path(fit.run_dir) / "steps.json").write_text(json.dumps(self.times))

        return around()

    def step_ended(self, event):  # noqa: ANN001
        self.times.append(time.time())
        return None


def _hook_class():
    """StepTimes as a hydra_ddp Hook (imported in the workers, from this file)."""
    from hydra_ddp.hooks import Hook

    return type("StepTimesHook", (StepTimes, Hook), {})


StepTimesHook = None  # made on first import in a worker (below)
if os.environ.get("HDDP_BENCH_WORKER"):
    StepTimesHook = _hook_class()


class Throttle:
    """A TCP proxy on loopback to `target`, relaying the client's bytes at `rate` bytes/s (shared
    by every connection) and the server's as they come; `busy`: the spans it relayed a body in."""

    CHUNK = 16 * 1024

    def __init__(self, target: int, rate: float):
        self.target, self.rate = target, rate
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.busy: list[list[float]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for relay in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._relay, args=relay, daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(self.CHUNK):
                if slow and len(data) == self.CHUNK:  # a body's bytes (a request line is short)
                    with self.lock:
                        started = time.time()
                        time.sleep(len(data) / self.rate)
                        self._mark(started, time.time())
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _mark(self, start: float, end: float) -> None:
        if self.busy and start - self.busy[-1][1] < 0.05:
            self.busy[-1][1] = end
        else:
            self.busy.append([start, end])


def train(run_dir: Path, env: dict[str, str], bucket_url: str | None) -> dict:
    checkpoints = (
        [f"checkpoint.dir={bucket_url}", f"checkpoint.every_n_steps={EVERY}"]
        if bucket_url
        else ["checkpoint.every_n_steps=null"]
    )
    subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "trainer.nproc=2",
            "trainer.epochs=1000",
            f"trainer.max_steps={STEPS}",
            "checkpoint.every_epoch=false",
            "trainer.eval_every_epoch=false",
            *checkpoints,
            "+trainer.hooks=[{_target_: upload.StepTimesHook}]",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO / "bench"), "HDDP_BENCH_WORKER": "1"},
        check=True,
        capture_output=True,
    )
    ends = json.loads((run_dir / "steps.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"ends": ends, "summary": summary}


def step_times(ends: list[float]) -> list[tuple[int, float, float, float]]:
    """(step, its start, its end, its seconds) of each step after the warm-up."""
    return [(i + 1, ends[i - 1], ends[i], ends[i] - ends[i - 1]) for i in range(WARMUP, len(ends))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mb-s", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    commit = provenance.commit()[0]
    sys.path.insert(0, str(REPO / "tests"))
    import servers

    during, without, stalls, waits, busy_share = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp, servers.s3(Path(tmp) / "moto.log") as s3:
        proxy = Throttle(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), args.rate_mb_s * 1e6)
        env = {**os.environ, **s3, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
        for repeat in range(args.repeats):
            proxy.busy.clear()
            run = train(Path(tmp) / f"upload-{repeat}", env, f"s3://runs/bench-{repeat}")
            spans = [tuple(span) for span in proxy.busy]
            steps = step_times(run["ends"])
            uploading = [
                seconds
                for step, start, end, seconds in steps
                if step % EVERY != 1 and any(a <= start and end <= b for a, b in spans)
            ]
            during += uploading
            busy_share.append(len(uploading) / len(steps))
            stalls.append(run["summary"]["checkpoint_stall_s"])
            waits.append(run["summary"]["checkpoint_write_wait_s"])
            base = train(Path(tmp) / f"none-{repeat}", env, None)
            without += [seconds for *_, seconds in step_times(base["ends"])]
    ratio = statistics.median(during) / statistics.median(without)
    result = {
        **provenance.header(),
        "what": "step time during a checkpoint's upload to S3 (moto on loopback, throttled) "
        "against the same run without checkpoints; 2 ranks, the default model and data",
        "rate_mb_s": args.rate_mb_s,
        "steps": STEPS,
        "checkpoint_every_n_steps": EVERY,
        "repeats": args.repeats,
        "steps_during_upload": len(during),
        "share_of_steps_during_upload": busy_share,
        "median_step_s_during_upload": statistics.median(during),
        "median_step_s_without_checkpoints": statistics.median(without),
        "mean_step_s_during_upload": statistics.fmean(during),
        "mean_step_s_without_checkpoints": statistics.fmean(without),
        "ratio_median": ratio,
        "ratio_mean": statistics.fmean(during) / statistics.fmean(without),
        "checkpoint_stall_s_median_save": stalls,
        "checkpoint_write_wait_s": waits,
    }
    out = REPO / "bench" / "results" / f"upload_{commit}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("ratio", "median"))}))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
