"""The report: markdown that reads as well in a terminal as on GitHub, rendered from the results alone.

`render(results)` takes the dict that run.py writes to <timestamp>.json, so a report can be
rebuilt from any saved results.
"""

from __future__ import annotations

import statistics
from math import comb
from typing import Any, Optional

# the floors' keys in the results, in the order shown (older results hold the first)
from measure import FLOORS

_DISCLAIMER = (
    "Absolute figures vary between machines, and with whatever else runs on them: only the ratios "
    "(taken within one run of this benchmark) compare."
)
_DEFINITIONS = """\
- **samples/s**: steady-state global throughput, warm-up steps excluded (min–max over repetitions in brackets)
- **step**: median step time after warm-up, on rank 0
- **first step**: from the command's start (this harness's clock, so interpreter start-up and imports count) to the end of the first training step
- **peak RSS**: the largest peak resident set size (ru_maxrss) of any rank
- **×** columns: this row / the reference row; **Δ**: this row − the reference row"""

_STARTUP_INTRO = (
    "The first step's time in two parts, medians over the repetitions (min–max of the first step in brackets). "
    "**workers ready**: from the command's start until the last worker's own code began, its interpreter and "
    "imports done (the project's workers are forks of the forkserver, so its imports of torch and torch._dynamo "
    "come first); **then to the first step**: the process group, data, model and the first step, and whatever a "
    "worker imports only then (the hand-written loop's DDP imports torch._dynamo in its constructor). **floor**: "
    "one interpreter importing torch and torch._dynamo and nothing else, timed the same way: as Python runs it, "
    "and with the garbage collector off while they load, as the project's processes load them "
    "(`startup.frozen_imports`, which spares the collector its full passes over the imports' half a million "
    "objects; the table gives both times). A cold start of a DDP script that imports them so cannot start sooner; what a configuration takes "
    "beyond it is its own start-up."
)
_TITLES = {
    "default": "The default run (`make train`)",
    "comm": "Communication hooks",
    "checkpoint": "Checkpoints off the critical path",
    "strategy": "Strategies: DDP and FSDP",
    "strategy_gpt": "Strategies on the transformer: DDP, FSDP and tensor parallel",
    "ceiling": "The no-communication ceiling: the CNN",
    "ceiling_gpt": "The no-communication ceiling: the transformer",
}
_CEILING = (
    "The limit of data-parallel training on one host: the same processes when they do not communicate. "
    "`bench/ceiling.py` composes and settles the project's config exactly as `train.py` does (batch, threads "
    "per rank, channels_last), builds the same objects from it in each of 2 independent processes (the "
    "rank's data loader, the model, the optimizer with its parameter groups, the schedule, the task's loss) "
    "and trains them in a bare loop: no process group, no DDP, no all-reduce, no wait for a peer, none of "
    "the loop's own work. Its samples/s count the window in which every process was in its steady steps. "
    "Each repetition runs the cases back to back (A B C D, then D C B A), so the paired ratios below are "
    "the figures: the machine's own speed drifts more between repetitions than the gap measured here. "
)
_CEILING_PHASES = (
    "Where a step's time goes, in ms per step (every step of a run, warm-up included; the mean over the "
    "ranks, the median over the repetitions): the project's summary (`ranks`, src/hydra_ddp/training/meter.py) "
    "and the ceiling's processes, timed at the same boundaries. **backward** is the fastest rank's, "
    "**sync wait** what the others spent beyond it (at DDP's all-reduce); **other**: the project's loop "
    "between steps (logging, checks)."
)
_INTROS = {
    "ceiling": _CEILING
    + "**ceiling in lockstep**: the same processes meeting after each backward, exchanging "
    "nothing (`bench/ceiling.py --lockstep`): what moving in step costs by itself, each step waiting for the "
    "slower process's jitter. **ceiling with the exchange**: in lockstep, and each gradient averaged through "
    "shared memory in two passes, as the project's all-reduce does, with no DDP and no loop around it "
    "(`--exchange`): the least a synchronous data-parallel step adds here, so the best share of the ceiling "
    "any such loop can reach on this machine. The project's gap beyond it is DDP's and its loop's. "
    "Workload: the CNN of the parity section; reference: the ceiling.",
    "ceiling_gpt": _CEILING
    + "Workload: the transformer of `+experiment=text_gpt` (AdamW, warmup-cosine per step, "
    "gradient clipping), a global batch of 64 sequences, with its own number of steps (the section's "
    "`workload`); reference: the ceiling.",
    "strategy_gpt": "The transformer (`+experiment=text_gpt`: 4 blocks of width 128, AdamW) at 2 ranks under "
    "`ddp`, `fsdp` and `tp`, on the same global batch of sequences (64 bytes each; `tp`'s two ranks form one "
    "replica and read the same batch). **samples/s**: sequences (tokens/s is 64 times this). **model state / "
    "rank** as above (AdamW: two moments per parameter). Reference: ddp.",
    "strategy": "The project at 2 ranks under each `strategy` (src/hydra_ddp/parallel/strategies/). **model state / rank**: "
    "the bytes of parameters, gradients and optimizer state (SGD's momentum) one rank holds, counting local "
    "shards only (the summary's `model_state_bytes`, the largest rank's). FSDP cannot shard channels_last "
    "weights, so it runs without them: the second row is DDP on the same footing. Reference: ddp.",
    "parity": "The project's `train.py` against `bench/handwritten.py`, a minimal DDP loop in the style of "
    "pytorch/examples, on the same workload at 2 ranks: with its default launcher (spawn), with torchrun's, "
    "with workers started as fresh interpreters (`launcher.start_method=spawn`) instead of forks of the "
    "forkserver that imported torch while the config was composed, with every `auto` fast setting "
    "turned off (channels_last, DDP's gradient_as_bucket_view and static_graph, the shared-memory all-reduce), "
    "and as the second job of a "
    "two-job sweep (`-m trainer.seed=0,1`: Hydra's own launcher runs the jobs one after the other in one "
    "process, and they share the forkserver), its start timed from the end of the first job (its summary "
    "written). Reference: the hand-written loop.",
    "default": "What `make train` runs (`train.py` with no overrides: the seeds' CNN on the digits, 12 epochs, "
    "a validation and a checkpoint each epoch, the test at the end), timed by this harness from the command's "
    "start to its end. **training**: the summary's `train_time_s` (the steps); **beyond training**: wall − "
    "training, what a user waits for besides the steps: start-up to the first step, evaluation, checkpoint "
    "stalls, the end.",
    "scaling": "The project at each world size; every rank takes cores ÷ ranks intra-op threads, so each row "
    "uses the whole machine. Reference: 1 rank.",
    "options": "The project at 2 ranks with each set of performance overrides (`OPTIONS` in bench/run.py). "
    "Reference: the first.",
    "comm": "The project at 2 ranks with each DDP communication hook (`strategy.comm_hook`, src/hydra_ddp/parallel/comm.py; "
    "PowerSGD at rank 1, compressing from the first step); "
    "**all-reduce / step**: the gradient bytes each rank all-reduces per step. On one machine the all-reduce "
    "is a memory copy: what compression saves in bytes it may cost in compute; it pays off on slow links "
    "between nodes. "
    "A hook replaces the default shared-memory all-reduce (`strategy.shared_memory`, src/hydra_ddp/parallel/shared_memory.py), "
    "so the reference is DDP's own fp32 all-reduce through gloo; the last row is the default. "
    "Reference: none through gloo.",
    "checkpoint": "The project at 2 ranks saving a checkpoint every few steps: rank 0 copies the state to memory "
    "at the step boundary and a background thread writes, fsyncs and renames it while training goes on "
    "(src/hydra_ddp/training/checkpointing.py). **stall / save**: how long one save held rank 0 at its step boundary (the "
    "summary's `checkpoint_stall_s`, the median save's); **stall / step**: that over the median step time. "
    "The samples/s of the saving run include its stalls (a mid-epoch save is inside its step's time). "
    "Reference: one checkpoint, after the timed steps.",
}


# The parity section's second reference, where its results have one (bench/expert.py).
_EXPERT = (
    " Second reference: `bench/expert.py`, the same loop tuned by hand as an expert would, with stock "
    "PyTorch only: the model and its inputs in channels_last, DDP's `gradient_as_bucket_view=True` and "
    "`static_graph=True`, and workers forked from a forkserver that imported torch and torch._dynamo, "
    "started before the parent imports torch (one thread per rank, as in the plain loop). Beyond those the "
    "project adds: the shared-memory all-reduce on the CPU (`strategy.shared_memory`, "
    "src/hydra_ddp/parallel/shared_memory.py) in place of gloo's, which the tuned loop uses; the config "
    "machinery (Hydra's composition, resolution and checks before launch, overlapped with the forkserver's "
    "imports), whose start-up cost is the first step's Δ against the tuned loop; and exact resume "
    "(a run stopped and resumed equals one uninterrupted), which neither loop has."
)

# From f282f07 on, the default section runs the same work by hand beside make train.
_DEFAULT_REFERENCE = (
    " Reference: the same work written by hand in the style of pytorch/examples "
    "(`bench/handwritten_train.py`: mp.spawn, the digits read as the project reads them, the same "
    "network, optimizer, schedule, batch and epochs, a validation each epoch, TensorBoard scalars and "
    "a `torch.save` checkpoint on rank 0, the test at the end; nothing else: no config, no resume, no "
    "failure handling), timed the same way; its **training** is its steps' times summed as the "
    "project sums them. Its **evaluation** and **checkpoint** columns stay empty: it does not time "
    "them."
)
_DEFAULT_NO_REFERENCE = " No reference: nothing else does the same."
# From 5fa226c on, each of the default section's runs follows a timing of the floor.
_DEFAULT_FLOORS = (
    " **floor**: the collector-off floor (as in the parity section), timed just before each repetition; "
    "**beyond training − floor**: the median of that difference run by run, what the run adds "
    "to importing torch at the machine's speed of the moment."
)
_CEILING_AGAINST = (
    " **project at COMMIT** (`bench/run.py --against COMMIT`): `train.py` in a worktree of that commit, "
    "with its own `src`, in the same turns: what the changes since bought, as a share of the same ceiling."
)
_DEFAULT_AGAINST = (
    " **make train at COMMIT** (`bench/run.py --against COMMIT`): the same command in a worktree of that "
    "commit, with its own `src`, in turns with today's: whether the first step comes as soon and the run "
    "takes no longer."
)


def render(results: dict[str, Any]) -> str:
    machine, workload, sections = results["machine"], results["workload"], results["sections"]
    lines = [
        "# hydra-ddp benchmark",
        "",
        f"{results['date']} · commit `{results['commit']}` · `{results['invocation']}`",
        "",
    ]
    if results["quick"]:
        lines += ["**--quick: a smoke test of the harness; its figures mean nothing.**", ""]
    lines += [
        _DISCLAIMER,
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}",
        f"- cores: {machine['cpu_count']} (`os.cpu_count()`), {machine['usable_cores']} usable "
        f"(`len(os.sched_getaffinity(0))`)",
        f"- torch {machine['torch']}, Python {machine['python']}, {machine['platform']}",
        "",
        "## Workload",
        "",
        f"The MNIST CNN (`hydra_ddp.models.MnistCNN`) on random 1×28×28 images held in memory, batch "
        f"{workload['batch_size']} per rank, gloo on the CPU, cores ÷ ranks intra-op threads per rank unless "
        f"an option says otherwise. {workload['steps']} steps per run, all in one epoch (steps × batch × ranks "
        f"training images); the first {workload['warmup_steps']} steps (10, or a tenth of a shorter run) are warm-up, "
        f"left out of samples/s and step time. Each configuration "
        f"ran {results['reps']} time(s){_parity_reps(results)}, interleaved "
        f"{'(A B C, then C B A, …)' if results.get('order') == 'forward, reversed' else 'A B A B …'}; every figure "
        "is the median over the repetitions.",
        "",
        _DEFINITIONS,
        "",
    ]
    if "parity" in sections:
        lines += _parity_headline(sections["parity"])
    if "default" in sections:
        lines += _default_headline(sections["default"])
    for name in ("ceiling", "ceiling_gpt"):
        if name in sections:
            lines += _ceiling_headline(name, sections[name])
    for name, cases in sections.items():
        table = (
            _default_table(cases)
            if name == "default"
            else _table(cases, stalls=name == "checkpoint")
        )
        intro = _INTROS[name]
        # a section with a workload of its own (the transformer's ceiling)
        if cases[0].get("workload"):
            intro += f" {cases[0]['workload']['steps']} steps per run, {cases[0]['workload']['warmup_steps']} of warm-up."
        if name == "parity" and _expert(cases):
            intro += _EXPERT
        if name == "ceiling" and any(case.get("against") for case in cases):
            intro += _CEILING_AGAINST
        if name == "default":
            by_hand = any(case["side"] == "handwritten_train" for case in cases)
            intro += (_DEFAULT_REFERENCE if by_hand else _DEFAULT_NO_REFERENCE) + (
                _DEFAULT_FLOORS if _has_floors(cases) else ""
            )
            if any(case.get("against") for case in cases):
                intro += _DEFAULT_AGAINST
        lines += [f"## {_TITLES.get(name, name.capitalize())}", "", intro, "", table, ""]
        lines += _default_paired(cases) if name == "default" else _paired(cases)
        if name == "parity" and _expert(cases):
            lines += _paired(
                [_expert(cases), *(case for case in cases if case["side"] in ("project", "sweep"))],
                "the loop tuned by hand's",
            )
        lines += _aborts_at_exit(cases)
        if name in ("ceiling", "ceiling_gpt"):
            lines += ["### Where the time goes", "", _CEILING_PHASES, "", _phase_table(cases), ""]
        if name == "parity" and all("time_to_workers_ready_s" in case["median"] for case in cases):
            tuned = (
                " The loop tuned by hand's workers are forks of its own forkserver."
                if _expert(cases)
                else ""
            )
            lines += [
                "### Where the start-up goes",
                "",
                _STARTUP_INTRO + tuned,
                "",
                _startup_table(cases, [results[key] for key in FLOORS if key in results]),
                "",
            ]
    lines += [
        "## Commands",
        "",
        "One run of each side (`RUN_DIR`: a fresh temporary directory per run):",
        "",
    ]
    shown = [
        case
        for name in ("parity", "default", "ceiling", "ceiling_gpt")
        for case in sections.get(name, [])
    ]
    lines += [f"    {case['command']}" for case in shown]
    return "\n".join(lines) + "\n"


def _expert(cases: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The parity section's loop tuned by hand (bench/expert.py), if its results have one."""
    return next((case for case in cases if case["side"] == "expert"), None)


def _parity_headline(cases: list[dict[str, Any]]) -> list[str]:
    project = [c for c in cases if c["side"] in ("project", "sweep")]
    vs = project[0]["vs_reference"]
    others = "".join(
        f"; {c['label'].removeprefix('project, ')} {c['vs_reference']['startup_difference_s']:+.1f} s"
        for c in project[1:]
    )
    expert = _expert(cases)
    if expert:  # against both references: the plain loop, then the tuned one
        p, e, t = project[0]["median"], expert["median"], expert["vs_reference"]
        return [
            f"**Project (train.py): throughput {vs['throughput_ratio']:.2f}× a plain DDP loop, "
            f"{p['steady_samples_per_sec'] / e['steady_samples_per_sec']:.2f}× one tuned by hand; step time "
            f"{vs['step_time_ratio']:.2f}× / {p['median_step_time_s'] / e['median_step_time_s']:.2f}×; time to "
            f"first step {vs['startup_difference_s']:+.1f} s / "
            f"{p['time_to_first_step_s'] - e['time_to_first_step_s']:+.1f} s; peak RSS {vs['rss_ratio']:.2f}× / "
            f"{p['peak_rss_mb'] / e['peak_rss_mb']:.2f}×. The loop tuned by hand against the plain one: throughput "
            f"{t['throughput_ratio']:.2f}×, time to first step {t['startup_difference_s']:+.1f} s. Time to first "
            f"step against the plain loop{others.replace('; ', ': ', 1)}.**",
            "",
        ]
    return [
        f"**Project / hand-written: throughput {vs['throughput_ratio']:.2f}×, step time "
        f"{vs['step_time_ratio']:.2f}×, time to first step {vs['startup_difference_s']:+.1f} s{others}, "
        f"peak RSS {vs['rss_ratio']:.2f}×.**",
        "",
    ]


def paired_ratios(case: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """The case's samples/s over the reference's, repetition by repetition."""
    return [
        run["steady_samples_per_sec"] / ref["steady_samples_per_sec"]
        for run, ref in zip(case["runs"], reference["runs"])
    ]


def _ceiling_headline(name: str, cases: list[dict[str, Any]]) -> list[str]:
    """Each loop's share of the ceiling: the median of the paired ratios and their range."""
    ceiling, others = cases[0], cases[1:]
    figures = []
    for case in others:
        ratios = paired_ratios(case, ceiling)
        label = case["label"].removeprefix("gpt: ")
        figures.append(f"{label} {statistics.median(ratios):.2f}{_spread(ratios, 2)}")
    what = "the transformer" if name == "ceiling_gpt" else "the CNN"
    pairs = len(ceiling["runs"])
    return [
        f"**Share of the no-communication ceiling, {what} ({pairs} pair{'s' if pairs != 1 else ''}, the median "
        f"of the paired ratios, min–max): {'; '.join(figures)}.**",
        "",
    ]


def _phase_table(cases: list[dict[str, Any]]) -> str:
    """ms per step by phase for the cases that report phases, with the project's excess over the ceiling."""
    timed = [case for case in cases if all(run.get("ranks") for run in case["runs"])]
    phases = ("data", "forward", "backward", "sync_wait", "optimizer", "other")

    def ms(case: dict[str, Any], phase: str) -> float:
        per_run = [
            statistics.mean(rank.get(f"{phase}_s", 0.0) for rank in run["ranks"])
            for run in case["runs"]
        ]
        return statistics.median(per_run) * 1000

    headers = ["phase", *(case["label"] for case in timed)]
    if len(timed) == 2:
        headers.append("Δ")
    rows = []
    for phase in (*phases, "total"):
        values = [
            sum(ms(case, p) for p in phases) if phase == "total" else ms(case, phase)
            for case in timed
        ]
        row = [phase.replace("_", " "), *(f"{v:.2f}" for v in values)]
        if len(timed) == 2:
            row.append(f"{values[1] - values[0]:+.2f}")
        rows.append(row)
    return _markdown_table(headers, rows)


def _default_headline(cases: list[dict[str, Any]]) -> list[str]:
    m = next(case for case in cases if case["side"] == "default")["median"]
    line = (
        f"**`make train`: {m['wall_time_s']:.1f} s of wall time for {m['train_time_s']:.1f} s of training "
        f"({m['beyond_training_s']:+.1f} s), the first step at {m['time_to_first_step_s']:.1f} s"
    )
    by_hand = [case["median"] for case in cases if case["side"] == "handwritten_train"]
    if by_hand:  # none up to this line's commit
        h = by_hand[0]
        line += (
            f"; the same work by hand: {h['wall_time_s']:.1f} s for {h['train_time_s']:.1f} s "
            f"({h['beyond_training_s']:+.1f} s), the first step at {h['time_to_first_step_s']:.1f} s"
        )
    return [line + ".**", ""]


def _default_paired(cases: list[dict[str, Any]]) -> list[str]:
    """make train's wall time and time beyond training less the hand-written run's of the same
    repetition (the runs follow one floor timing, back to back): medians and ranges; and against
    make train at another commit (--against), its wall time and first step likewise."""
    return _default_by_hand(cases) + _default_against(cases)


def _default_against(cases: list[dict[str, Any]]) -> list[str]:
    today = [case for case in cases if case["side"] == "default" and not case.get("against")]
    before = [case for case in cases if case.get("against")]
    if not today or not before:
        return []
    figures = _differences(
        today[0]["runs"], before[0]["runs"], ("wall time", "first step", "time beyond training")
    )
    return [
        f"Against an earlier commit, repetition by repetition: `make train` less `{before[0]['label']}` of the "
        f"same repetition, medians over {len(before[0]['runs'])} repetitions (min–max): {'; '.join(figures)}.",
        "",
    ]


# A default run's figures, in seconds, by name.
_RUN_SECONDS = {
    "wall time": lambda run: run["wall_time_s"],
    "first step": lambda run: run["time_to_first_step_s"],
    "time beyond training": lambda run: run["wall_time_s"] - run["train_time_s"],
}


def _differences(
    runs: list[dict[str, Any]], references: list[dict[str, Any]], whats: tuple[str, ...]
) -> list[str]:
    """Each figure of `runs` less the same repetition's of `references`: the median, min–max."""
    figures = []
    for what in whats:
        of = _RUN_SECONDS[what]
        differences = [of(run) - of(ref) for run, ref in zip(runs, references)]
        figures.append(
            f"{what} **{statistics.median(differences):+.2f} s**{_spread(differences, 2)}"
        )
    return figures


def _default_by_hand(cases: list[dict[str, Any]]) -> list[str]:
    if len(cases) < 2 or cases[0]["side"] != "handwritten_train":
        return []
    reference = cases[0]["runs"]
    figures = []
    for case in cases[1:]:
        if not case.get("against"):
            figures += _differences(case["runs"], reference, ("wall time", "time beyond training"))
    return [
        f"Paired, repetition by repetition: `make train` less the hand-written run of the same repetition, "
        f"medians over {len(reference)} repetitions (min–max): {'; '.join(figures)}.",
        "",
    ]


def _parity_reps(results: dict[str, Any]) -> str:
    """How many times the parity section ran, where that differs from the others (--parity-reps)."""
    reps = results.get("parity_reps", results["reps"])
    return (
        f" ({reps} in the parity section)"
        if reps != results["reps"] and "parity" in results["sections"]
        else ""
    )


def _paired(cases: list[dict[str, Any]], against: str = "the reference's") -> list[str]:
    """Each case's samples/s over the reference's (the first case's) in the same repetition: the median
    of those ratios, with a 95 % confidence interval of that median, where there are repetitions enough for one."""
    bounds = median_interval(len(cases[0]["runs"]))
    if len(cases) < 2 or bounds is None:
        return []
    low, high = bounds
    reference = [run["steady_samples_per_sec"] for run in cases[0]["runs"]]
    figures = []
    for case in cases[1:]:
        ratios = sorted(
            run["steady_samples_per_sec"] / ref for run, ref in zip(case["runs"], reference)
        )
        middle = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
        figures.append(f"{case['label']} **{middle:.2f}×** ({ratios[low]:.2f}–{ratios[high]:.2f})")
    return [
        f"Paired, repetition by repetition: samples/s over {against} in the same repetition, the "
        f"median of {len(reference)} ratios (95 % confidence interval of that median, from the order "
        f"statistics): {'; '.join(figures)}.",
        "",
    ]


def median_interval(n: int, confidence: float = 0.95) -> Optional[tuple[int, int]]:
    """Indices (0-based, into n sorted values) of a distribution-free confidence interval for their
    median: the k-th smallest and k-th largest, k as large as keeps the coverage at `confidence`.
    None under 6 values, where even the whole range covers less than 95 %."""
    tail, k = 0.0, 0
    while True:  # P(Binomial(n, 1/2) <= k) on each side stays within the allowed miss
        next_tail = tail + comb(n, k) / 2**n
        if next_tail > (1 - confidence) / 2:
            break
        tail, k = next_tail, k + 1
    return (k - 1, n - k) if k >= 1 else None


def _aborts_at_exit(cases: list[dict[str, Any]]) -> list[str]:
    """A line for each configuration whose runs aborted at their exit after writing their result."""
    lines = []
    for case in cases:
        aborted = sum(bool(run.get("aborted_at_exit")) for run in case["runs"])
        if aborted:
            lines += [
                f"The {case['label']} loop's workers aborted at their exit in {aborted} of {len(case['runs'])} "
                "runs, after rank 0 wrote the result (`terminate called without an active exception`: gloo's "
                "threads still running at the interpreter's teardown, as in any script that ends by returning "
                "from its workers); those runs count. The project's workers end with `os._exit` once "
                "their outputs are closed.",
                "",
            ]
    return lines


def _startup_table(cases: list[dict[str, Any]], floors: list[dict[str, Any]]) -> str:
    headers = [
        "configuration",
        "workers ready (s)",
        "then to the first step (s)",
        "first step (s)",
        "first step Δ (s)",
    ]
    reference = cases[0]["median"]["time_to_first_step_s"]
    rows = []
    for case in cases:
        m = case["median"]
        rows.append(
            [
                case["label"],
                f"{m['time_to_workers_ready_s']:.2f}",
                f"{m['time_to_first_step_s'] - m['time_to_workers_ready_s']:.2f}",
                f"{m['time_to_first_step_s']:.2f}{_spread([run['time_to_first_step_s'] for run in case['runs']], 2)}",
                "reference"
                if case is cases[0]
                else f"{m['time_to_first_step_s'] - reference:+.2f}",
            ]
        )
    for floor in floors:
        rows.append(
            [
                f"floor: `{floor['command']}`",
                "",
                "",
                f"{floor['median']:.2f}{_spread(floor['runs'], 2)}",
                f"{floor['median'] - reference:+.2f}",
            ]
        )
    return _markdown_table(headers, rows)


def _spread(values: list[float], decimals: int) -> str:
    """(min–max) over the repetitions, after a median; nothing for a single run."""
    return f" ({min(values):.{decimals}f}–{max(values):.{decimals}f})" if len(values) > 1 else ""


def _has_floors(cases: list[dict[str, Any]]) -> bool:
    """Whether the default section's runs each carry a floor timed just before (none up to a0006bf)."""
    return all("floor_s" in case["median"] for case in cases)


def _default_table(cases: list[dict[str, Any]]) -> str:
    floors = _has_floors(cases)
    headers = [
        "configuration",
        "wall (s)",
        "training (s)",
        "beyond training (s)",
        "first step (s)",
        "evaluation (s)",
        "checkpoints",
        "checkpoint stalls (s)",
    ]
    if floors:
        headers += ["floor (s)", "beyond training − floor (s)"]
    rows = []
    for case in cases:
        m = case["median"]
        spread = _spread([run["wall_time_s"] for run in case["runs"]], 2)
        rows.append(
            [
                case["label"],
                f"{m['wall_time_s']:.2f}{spread}",
                f"{m['train_time_s']:.2f}",
                f"{m['beyond_training_s']:+.2f}",
                f"{m['time_to_first_step_s']:.2f}",
                _seconds(m["eval_time_s"]),
                "" if case["checkpoints"] is None else str(case["checkpoints"]),
                _seconds(m["checkpoint_time_s"]),
            ]
        )
        if floors:
            rows[-1] += [
                f"{m['floor_s']:.2f}{_spread([run['floor_s'] for run in case['runs']], 2)}",
                f"{m['beyond_floor_s']:+.2f}",
            ]
    return _markdown_table(headers, rows)


def _seconds(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def _table(cases: list[dict[str, Any]], stalls: bool = False) -> str:
    headers = [
        "configuration",
        "samples/s",
        "step (ms)",
        "first step (s)",
        "peak RSS (MB)",
        "samples/s ×",
        "step ×",
        "first step Δ (s)",
        "RSS ×",
    ]
    sent = any(case.get("allreduce_bytes_per_step") for case in cases) and all(
        c["side"] == "project" for c in cases
    )
    if sent:
        headers.append("all-reduce / step (KB)")
    state = (
        all(case.get("model_state_bytes") for case in cases)
        and len({c["model_state_bytes"] for c in cases}) > 1
    )
    if state:
        headers.append("model state / rank (MB)")
    if stalls:
        headers += ["checkpoints", "stall / save (ms)", "stall / step"]
    rows = []
    for case in cases:
        m, vs = case["median"], case["vs_reference"]
        spread = _spread([run["steady_samples_per_sec"] for run in case["runs"]], 0)
        compared = (
            ["reference", "", "", ""]
            if vs is None
            else [
                f"{vs['throughput_ratio']:.2f}",
                f"{vs['step_time_ratio']:.2f}",
                f"{vs['startup_difference_s']:+.2f}",
                f"{vs['rss_ratio']:.2f}",
            ]
        )
        rows.append(
            [
                case["label"],
                f"{m['steady_samples_per_sec']:.0f}{spread}",
                f"{m['median_step_time_s'] * 1000:.1f}",
                f"{m['time_to_first_step_s']:.2f}",
                f"{m['peak_rss_mb']:.0f}",
                *compared,
            ]
        )
        if sent:
            rows[-1].append(
                f"{case['allreduce_bytes_per_step'] / 1024:.0f}"
                if case.get("allreduce_bytes_per_step")
                else ""
            )
        if state:
            rows[-1].append(f"{case['model_state_bytes'] / 2**20:.2f}")
        if stalls:
            stall = case["checkpoint_stall_s"]
            rows[-1] += [
                str(case["checkpoints"]),
                f"{stall * 1000:.1f}",
                f"{stall / m['median_step_time_s']:.2f}",
            ]
    return _markdown_table(headers, rows)


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the figures right-aligned."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i else (":" + "-" * (w + 1)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
