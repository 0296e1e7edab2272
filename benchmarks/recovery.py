"""Recovery from a worker kill: time from the kill to the first step completed after the restore.

Setup
    A local multi-node Ray cluster (:class:`ray_resilient.testing.LocalRayCluster`): a head
    node with 0 CPUs (no worker lands on it) plus one worker node with ``--node-cpus`` CPUs
    (default 2). A driver subprocess runs one ``TorchTrainer`` through the configuration
    :func:`ray_resilient.recommended_ray_config` recommends (``--workers`` CPU workers on gloo,
    ``max_failures`` = the number of kills, the Ray Train environment it exports: health check
    every 0.5 s, worker-group start timeout 10 s), with ``ResilientRayConfig.fit``.

    The train function (:func:`train_fn`, imported by the workers from this module) trains a small
    MLP (32 -> 512 -> 512 -> 512 -> 4, fp32, SGD with momentum: 2.2 MB of parameters, 4.4 MB of
    state), wrapped in DDP by ``prepare_model``, on ``SyntheticBatches`` (``ray_resilient.testing``)
    (resumable in-memory data). A step is ``--step-seconds`` of ``time.sleep`` emulating
    accelerator compute, then one real forward/backward/``optimizer.step()`` on the rank's slice
    of a ``--global-batch`` (64) sample global batch. ``Checkpointer`` checkpoints every ``--interval`` steps
    (sharded async DCP) and restores the newest complete checkpoint, data position included.

    ``--kills`` SIGKILLs of one worker process at seeded random steps come from
    ``random_kill_plan(seed, kills=K, steps=S, interval=I, world_size=W, upload_kills=0)``: the
    ``kill:step=N:rank=R`` fault fires inside ``step_completed`` right after step N, once per run.
    Every kill makes Ray Train restart the whole worker group, and gives one recovery sample.
    The same plan runs twice, each on a fresh cluster: without and with spare workers.

Timing
    Every rank appends timestamped events (``time.time()``, one JSON object a line) to a file:
    train function entered, ``restore()`` started and returned (with the restored step), first
    batch in hand after the restore, and the end of every step (written just before
    ``step_completed``, so the "step N" event of the killed rank is the moment of the kill, to a
    few hundred microseconds). The controller's decision to restart is the ``[FailurePolicy]
    RETRY`` record of Ray Train's controller log (``ray-train-sys-controller-*.log``, else
    ``ray-train-app-controller-*.log``, under the cluster's temp dir; its ``timestamp_ns``). A
    point of the restarted attempt counts when the last rank has passed it (the ranks wait for
    each other at the next collective anyway). Columns of the table, one row per kill (all in
    seconds, they add up to ``recovery``):

    detect       kill -> the controller's RETRY decision. The controller polls the workers every
                 ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (0.5 s) and sees the dead actor.
    restart      RETRY -> the train function entered on every rank of the new worker group: the old
                 group (the surviving rank, stuck in an all-reduce) is killed, a new placement group
                 and new worker actors are started (new processes: ``import torch``, Ray Train),
                 the torch process group is set up.
    setup        train function entered -> ``restore()`` called: model, ``prepare_model`` (DDP
                 broadcasts the parameters), optimizer, data, ``Checkpointer`` (its gloo group).
    restore      ``Checkpointer.restore()``: find the newest complete checkpoint, load it (DCP).
    ffwd         ``restore()`` returned -> the first batch at the restored data position in hand
                 (data fast-forward; ``SyntheticBatches`` seeks by index, so this is tiny here).
    first_step   that batch -> the first step completed after the restore (one step: sleep,
                 forward/backward/all-reduce, plus first-iteration costs).
    recovery     kill -> the first step completed after the restore (the sum of the above).
    recomputed   the killed step minus the restored step: steps trained again.

    A second table splits two phases further (seconds):

    stop+pg      RETRY -> the new placement group is ready (old group shut down, resources freed);
                 controller log "Placement group ready".
    actors       -> the new worker actors exist (new Ray worker processes); "worker actors created".
    context      -> Ray Train's context initialized on the workers (in a fresh process this imports
                 torch: it is already in ``sys.modules`` when the train function starts);
                 "Train context initialized".
    launch       -> the train function entered on every rank (torch process group set up, launch).
    imports      train function entered -> its imports done (``ray.train.torch``, ``synthetic_data``,
                 ``ray_resilient``).
    model        -> model, DDP, optimizer and data built.
    manager      -> ``Checkpointer`` constructed (``restore()`` is called next).

    The last line printed is the summary the issue asks for (medians over the kills, with spares)::

        recovery_seconds=<median> recomputed_steps=<median> restore_seconds=<median>

Machine
    A 2-core AMD EPYC Firecracker VM, 24 GiB RAM, torch CPU, Ray 2.60 (Train V2), shared with other
    users' jobs: the two workers, Ray's processes (GCS, two raylets, the controller) and the driver
    share the 2 cores. The last line is about the run with spares (summary: medians over the kills).

Result and what dominates (defaults, ``--seed 0``: 5 kills, all of rank 1, in 300 steps)
    Each invocation runs the same kill plan twice on fresh clusters: without spare workers
    (``recommended_ray_config(spare_workers=False)``) and with them, the default (see
    :mod:`ray_resilient.spare_workers`; ``preload`` adds the synthetic data's module and this one). On an
    otherwise quiet machine (2026-11-29)::

                          without spares   with spares (default)
        recovery (median)     8.52 s          4.52 s    (ratio 0.53)
        detect                0.16            0.22
        restart               5.44            1.24      actors 2.35 -> 0.15, context 2.66 -> 0.08
        setup                 2.43            2.77      imports 1.65 -> 0.00, model 0.86 -> 2.76
        restore               0.056           0.075
        first step            0.059           0.061
        recomputed steps      13              13        (at most 18, under the 20-step interval)

    (An earlier run the same day, before the spares' ``OMP_NUM_THREADS`` fix: 8.01 s and 4.14 s.)

    Without spares, Ray Train restarting the whole worker group as new processes dominates:
    ``actors`` (a new Ray worker process per rank) and ``context`` (it imports torch and Ray
    Train), then the train function's own imports. With spares, the new actors land on idle
    processes that already imported all of that: ``restart`` is mostly stopping the old group and
    the new placement group (``stop+pg`` 0.5 s). What is left is ``model`` (2.8 s): building the
    model, ``prepare_model`` (DDP's first broadcast over a new gloo group) and lazily imported
    torch parts, on cores shared with the spares' replacements starting; then ``stop+pg``.
    Detection is bounded by the health check (0.5 s); restoring 4.4 MB (0.1 s) and the data
    fast-forward (``SyntheticBatches`` seeks by index) are small. Earlier runs on busier cores
    (other users' test suites, load average 3-5) gave a median of 14.5-19.0 s without spares:
    the new processes' start-up is what shared cores slow most, and what spares take out of the
    recovery. Not measured here: the loss of a whole node adds the GCS's node-death detection,
    about 3 s with ``FAST_NODE_FAILURE_DETECTION`` (15 s with Ray's defaults), and the spares of
    the lost node are lost with it (the restart on the remaining nodes uses theirs).

Run: ``python benchmarks/recovery.py`` (about 4 minutes; ``--kills 2 --steps 120`` for a quick try).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ray_resilient._ray_internals import CONTROLLER_RESTART_MARKS, CONTROLLER_RETRY, controller_log

BENCHMARKS = Path(__file__).resolve().parent

HIDDEN = 512
DATA_MODULE = "ray_resilient.testing.synthetic_data"
# Modules whose presence at the train function's entry says what the worker imported before it.
PRELOAD_PROBES = ("torch", "torch.distributed.checkpoint", "ray_resilient", DATA_MODULE, "recovery")
PHASES = ("detect", "restart", "setup", "restore", "ffwd", "first_step")


# --- the train function (runs in the Ray workers, which import this module as `recovery`) ------


class EventLog:
    """Appends ``{"t": time.time(), "event": ..., "rank": ..., "pid": ...}`` lines to this rank's file.

    Each line is written with one ``write`` and the file closed at once, so a SIGKILL loses nothing
    already logged.
    """

    def __init__(self, record_dir: str, rank: int):
        self.path = Path(record_dir) / f"events-rank{rank}.jsonl"
        self.rank, self.pid = rank, os.getpid()

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        line = json.dumps({"t": time.time() if t is None else t, "event": event, "rank": self.rank,
                           "pid": self.pid, **fields})
        with open(self.path, "a") as out:
            out.write(line + "\n")


def train_fn(config: dict[str, Any]) -> None:
    """Restore, then train ``max_steps`` steps with periodic checkpoints, logging timed events."""
    entered = time.time()
    preloaded = [m for m in PRELOAD_PROBES if m in sys.modules]  # imported before the train function ran
    import ray.train
    import torch
    from ray.train.torch import prepare_model
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES, SyntheticBatches

    from ray_resilient import Checkpointer

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = EventLog(config["record_dir"], rank)
    log("attempt_start", t=entered, world=world, preloaded=preloaded)
    log("imported")

    torch.manual_seed(config["seed"])
    model = prepare_model(torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = SyntheticBatches(config["samples"], config["global_batch"], config["seed"], rank, world)
    max_steps = config["max_steps"]
    epochs = math.ceil(max_steps / data.batches_per_epoch) + 1
    log("model_ready")

    with Checkpointer(model, optimizer, data=data, interval_steps=config["interval"], seed=config["seed"],
                      faults=config["faults"]) as ckpt:
        log("restore_start")
        state = ckpt.restore()
        log("restore_end", step=state.step)
        step, first = state.step, True
        for epoch in range(state.epoch, epochs):
            for _ids, x, y in data:
                if first:
                    log("first_batch", step=step)
                    first = False
                time.sleep(config["step_seconds"])  # the accelerator's compute
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                log("step", step=step)  # before step_completed: a planned kill fires inside it
                ckpt.step_completed(epoch, {"loss": loss.item()})
                if step >= max_steps:
                    break
            if step >= max_steps:
                break
        ckpt.finish()
    log("finished", step=step)


def drive(config: dict[str, Any]) -> dict[str, Any]:
    """The driver (:func:`ray_resilient.testing.run_driver`, which imports this module as ``recovery``,
    so the workers import the train function too): one ``fit()``; its times and error."""
    import ray
    from ray.train.torch import TorchTrainer

    from ray_resilient import recommended_ray_config
    from ray_resilient.spare_workers import DEFAULT_PRELOAD_MODULES

    ray.init(address=config["address"])
    ray_config = recommended_ray_config("recovery", config["storage"], workers=config["workers"],
                                        max_failures=config["max_failures"], spare_workers=config["spares"],
                                        preload=(*DEFAULT_PRELOAD_MODULES, DATA_MODULE, "recovery"))
    trainer = TorchTrainer(train_fn, train_loop_config=config["loop"], **ray_config.trainer_kwargs())
    started = time.time()
    outcome: dict[str, Any] = {"fit_start": started}
    try:
        result = ray_config.fit(trainer)
        outcome.update(error=repr(result.error) if result.error else None, metrics=result.metrics)
    except Exception as err:  # noqa: BLE001 - reported by the parent process
        outcome.update(error=repr(err))
    outcome["fit_end"] = time.time()
    ray.shutdown()
    return outcome


# --- analysis -------------------------------------------------------------------------------------


def read_events(record_dir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(record_dir.glob("events-rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])


# Sub-phases of `restart`: the controller's log records that end them (the last one before the
# restarted train function ran; `launch` ends when it ran on every rank).
RESTART_DETAIL = (*CONTROLLER_RESTART_MARKS, "launch")
# Sub-phases of `setup`, ended by the train function's own events.
SETUP_MARKS = {"imports": "imported", "model": "model_ready", "manager": "restore_start"}
SETUP_DETAIL = tuple(SETUP_MARKS)


def recoveries(events: list[dict[str, Any]], plan: str, controller: list[tuple[float, str]]) -> list[dict[str, float]]:
    """One row per planned kill: the phases of the recovery it caused (see the module docstring)."""
    from ray_resilient.faults import parse_faults

    rows = []
    ranks = sorted({e["rank"] for e in events})
    retries = [t for t, message in controller if message.startswith(CONTROLLER_RETRY)]
    for fault in parse_faults(plan):
        killed = [e for e in events if e["event"] == "step" and e["step"] == fault.step and e["rank"] == fault.rank]
        if not killed:
            raise RuntimeError(f"no 'step {fault.step}' event of rank {fault.rank}: did the kill not fire?")
        t_kill = killed[0]["t"]  # the first time that step was done: the fault fires then, once
        # The attempt after the kill: each rank's first train-function entry after it (its process id
        # tells its later events from those of the old attempt's surviving rank).
        attempt = {}
        for rank in ranks:
            start = next((e for e in events if e["event"] == "attempt_start" and e["rank"] == rank
                          and e["t"] > t_kill), None)
            if start is None:
                raise RuntimeError(f"rank {rank} never started again after the kill at step {fault.step}")
            attempt[rank] = [e for e in events if e["pid"] == start["pid"] and e["rank"] == rank]

        def last_rank_at(event: str) -> float:
            """When the last rank got to ``event`` in this attempt (NaN if a rank never logged it)."""
            times = [next((e["t"] for e in attempt[rank] if e["event"] == event), math.nan) for rank in ranks]
            return math.nan if any(math.isnan(t) for t in times) else max(times)

        t_start = last_rank_at("attempt_start")
        t_retry = next((t for t in retries if t_kill < t < t_start), math.nan)
        t_first_step = last_rank_at("step")
        restored = next(e["step"] for e in attempt[ranks[0]] if e["event"] == "restore_end")
        row: dict[str, Any] = {"kill_step": fault.step, "rank": fault.rank, "restored_step": restored,
                               "preloaded": attempt[ranks[0]][0].get("preloaded", [])}
        marks = {
            "detect": t_retry, "restart": t_start, "setup": last_rank_at("restore_start"),
            "restore": last_rank_at("restore_end"), "ffwd": last_rank_at("first_batch"), "first_step": t_first_step,
        }
        row.update(phase_lengths(t_kill, marks))
        restart = {name: max((t for t, message in controller if t_retry < t < t_start and needle in message),
                             default=math.nan) for name, needle in CONTROLLER_RESTART_MARKS.items()}
        row.update(phase_lengths(t_retry, {**restart, "launch": t_start}))
        row.update(phase_lengths(t_start, {name: last_rank_at(event) for name, event in SETUP_MARKS.items()}))
        row["recovery"] = t_first_step - t_kill
        row["recomputed"] = fault.step - restored
        rows.append(row)
    return rows


def phase_lengths(start: float, marks: dict[str, float]) -> dict[str, float]:
    """Lengths of consecutive phases from ``start`` to each mark in turn (a missing mark, NaN, is
    counted in the next phase)."""
    lengths, previous = {}, start
    for name, t in marks.items():
        if math.isnan(t):
            lengths[name] = math.nan
            continue
        lengths[name] = t - previous if not math.isnan(previous) else math.nan
        previous = t
    return lengths


def step_seconds(events: list[dict[str, Any]]) -> float:
    """Median time between consecutive steps of rank 0 within an attempt (steady state)."""
    gaps, last = [], {}
    for e in events:
        if e["rank"] == 0 and e["event"] == "step":
            if e["pid"] in last:
                gaps.append(e["t"] - last[e["pid"]])
            last[e["pid"]] = e["t"]
    return statistics.median(gaps) if gaps else math.nan


def median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def print_table(rows: list[dict[str, Any]], columns: tuple[str, ...], ints: tuple[str, ...] = ()) -> dict[str, float]:
    """One line per row and a median line; returns the medians."""
    keys = ("kill_step", "rank") + tuple(c for c in columns if c not in ("kill_step", "rank"))
    print(" ".join(f"{c:>13}" for c in keys))
    for row in rows:
        print(" ".join(f"{row[c]:>13d}" if c in ("kill_step", "rank", *ints) else f"{row[c]:>13.4f}" for c in keys))
    med = {c: median([r[c] for r in rows]) for c in keys}
    print(" ".join(f"{'median':>13}" if c == "kill_step" else f"{'':>13}" if c in ("rank", "restored_step")
                   else f"{med[c]:>13.4f}" for c in keys))
    return med


def print_report(rows: list[dict[str, Any]], events: list[dict[str, Any]], outcome: dict[str, Any],
                 args: argparse.Namespace, plan: str) -> dict[str, float]:
    """The tables of one run; returns the medians."""
    print(f"\nRecovery from a SIGKILL of one of {args.workers} workers (checkpoint every {args.interval} steps, "
          f"{args.step_seconds}s of emulated compute a step), seconds per phase:")
    print(f"plan: {plan}")
    med = print_table(rows, ("restored_step", *PHASES, "recovery", "recomputed"), ints=("restored_step", "recomputed"))
    print("\nrestart and setup in detail (seconds; restart = stop+pg + actors + context + launch, "
          "setup = imports + model + manager):")
    detail = print_table(rows, (*RESTART_DETAIL, *SETUP_DETAIL))
    phases = {p: med[p] for p in PHASES if not math.isnan(med[p])}
    top = max(phases, key=phases.get)
    share = {p: 100 * v / med["recovery"] for p, v in phases.items()}
    print(f"\n'{top}' dominates: {phases[top]:.2f}s of the median {med['recovery']:.2f}s recovery "
          f"({share[top]:.0f}%); then " + ", ".join(
              f"{p} {phases[p]:.3f}s ({share[p]:.0f}%)" for p in sorted(phases, key=phases.get, reverse=True)
              if p != top) + ".")
    parts = {p: detail[p] for p in (*RESTART_DETAIL, *SETUP_DETAIL) if not math.isnan(detail[p])}
    if parts:
        largest = sorted(parts.items(), key=lambda kv: -kv[1])[:4]
        print("largest parts: " + ", ".join(f"{p} {v:.2f}s" for p, v in largest)
              + f"; modules already imported when the train function started: {rows[0]['preloaded'] or 'none'}")
    starts = [e["t"] for e in events if e["event"] == "attempt_start"]
    first_step = min(e["t"] for e in events if e["event"] == "step")
    print(f"steady step time {step_seconds(events):.3f}s; first start (fit() called -> first step): "
          f"{first_step - outcome['fit_start']:.2f}s; train function entries: {len(starts)} "
          f"({len(rows) + 1} attempts x {args.workers} ranks expected); fit() took "
          f"{outcome['fit_end'] - outcome['fit_start']:.1f}s, error: {outcome.get('error')}")
    return med


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5, help="worker kills, one recovery each (default: 5)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the run (default: 300)")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--step-seconds", type=float, default=0.05,
                        help="emulated accelerator compute per step (default: 0.05)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per global batch (default: 64)")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs of the worker node (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the data (default: 0)")
    parser.add_argument("--timeout", type=float, default=600, help="give up on the run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (Ray logs, events, checkpoints)")
    return parser.parse_args(argv)


@contextmanager
def run_dir(prefix: str, keep: bool) -> Iterator[Path]:
    """A temp dir for one run, with ``ray/`` (the cluster) and ``record/`` (the events); removed
    afterwards unless ``keep``, or the run failed (its logs say why)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    (root / "ray").mkdir()
    (root / "record").mkdir()
    try:
        yield root
    except BaseException:
        keep = True
        raise
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        elif root.exists():
            print(f"temp dir kept: {root}", file=sys.stderr)


def drive_on_fresh_cluster(root: Path, function: str, config: dict[str, Any], node_cpus: int,
                           timeout: float) -> dict[str, Any]:
    """``function`` (``"module:name"`` of this folder) in a driver process, on a fresh local cluster
    in ``root/ray`` (a CPU-less head plus a node of ``node_cpus``); the driver's outcome."""
    from ray_resilient.testing import LocalRayCluster, run_driver

    # The driver and the workers import the benchmark's module (drive, train_fn) through PYTHONPATH.
    pythonpath = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    with LocalRayCluster(root / "ray", env={**os.environ, "PYTHONPATH": pythonpath}) as cluster:
        cluster.add_node(cpus=node_cpus)
        return run_driver(function, {**config, "address": cluster.address}, env=cluster.env, workdir=root,
                          timeout=timeout)


def run(args: argparse.Namespace, plan: str, spares: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict]:
    """One run on a fresh local cluster: (recovery rows, events, the driver's outcome)."""
    with run_dir("recovery-", args.keep) as root:
        config = {
            "storage": str(root / "storage"), "workers": args.workers, "max_failures": args.kills, "spares": spares,
            "loop": {"record_dir": str(root / "record"), "faults": plan, "seed": args.seed, "interval": args.interval,
                     "max_steps": args.steps, "step_seconds": args.step_seconds, "samples": 4096,
                     "global_batch": args.global_batch},
        }
        outcome = drive_on_fresh_cluster(root, "recovery:drive", config, args.node_cpus, args.timeout)
        events = read_events(root / "record")
        return recoveries(events, plan, controller_log(root / "ray")), events, outcome


def main() -> None:
    args = parse_args()
    from ray_resilient.faults import random_kill_plan

    plan = random_kill_plan(args.seed, kills=args.kills, steps=args.steps, interval=args.interval,
                            world_size=args.workers, upload_kills=0)
    results = {}
    for spares in (False, True):  # the product's default (spares) last: its summary is the last line
        name = "with spare workers (the default)" if spares else "without spare workers (spare_workers=False)"
        print(f"\n=== {name} ===")
        rows, events, outcome = run(args, plan, spares)
        results[spares] = print_report(rows, events, outcome, args, plan)
    off, on = results[False], results[True]
    print(f"\nspare workers: median recovery {on['recovery']:.2f}s vs {off['recovery']:.2f}s without "
          f"(ratio {on['recovery'] / off['recovery']:.2f}); restart {on['restart']:.2f}s vs {off['restart']:.2f}s, "
          f"setup {on['setup']:.2f}s vs {off['setup']:.2f}s")
    print(f"recovery_seconds={on['recovery']:.3f} recomputed_steps={on['recomputed']:g} "
          f"restore_seconds={on['restore']:.4f}")


if __name__ == "__main__":
    main()
