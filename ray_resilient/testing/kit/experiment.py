"""The experiment kit: what the chaos benchmarks (and the survivor tests) share, as the tests share the rig.

An experiment runs a job's ``fit()`` in a driver process on a :class:`LocalRayCluster`, kills
workers by a seeded plan, and reads afterwards what every process did (:mod:`.records`). The kit:

- the job and its train loops, in Ray's workers (:mod:`.chaos_job`): whole-group restart with a
  ``Checkpointer``, survivor mode, and the parts a benchmark's own baseline builds on;
- kill plans, seeded: in wall-clock time (:func:`timed_kill_schedule`, fired by the job's
  ``TimedKills``), or in steps (:func:`spaced_kill_plan`, ``ray_resilient.random_kill_plan``:
  fired by the ``Checkpointer`` or the replicas);
- the driver: :func:`fit_on` runs one ``fit()`` in a driver process (:func:`fit_in_driver`) on a
  :func:`chaos_cluster`, in an :func:`experiment_dir`;
- the analyses of the records: :func:`kept_samples` (:func:`committed_micro_batches`) against
  :func:`planned_samples`,
  :func:`survivor_pauses`, :func:`recovery_phases`, :func:`discarded_steps`, all from the
  :func:`kill_moments`.

A benchmark is then its measurement and its last line. Everything here assumes one machine: the
record directory and the run storage are local paths every process can reach.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ray_resilient._ray_internals import NO_API_SERVER, ControllerRestart, controller_restart
from ray_resilient.faults import parse_faults
from ray_resilient.testing.driver import run_driver
from ray_resilient.testing.kit.chaos_job import SYNTHETIC_DATA, ChaosJob
from ray_resilient.testing.kit.records import RecordKind, of_kind, read_records
from ray_resilient.testing.local_cluster import LocalRayCluster

KERNEL_THREADS = 2  # kthreadd, the parent of every kernel thread (their CPU counts for nobody)


# --- kill plans --------------------------------------------------------------------------------------


def timed_kill_schedule(seed: int, mtbf_s: float, kills: int, world_size: int) -> list[list[float]]:
    """``kills`` seeded kills about one every ``mtbf_s`` of wall clock: gaps uniform in
    [0.75, 1.25] x ``mtbf_s``, each of a random rank, as [seconds after fit() was called, rank]."""
    rng = random.Random(seed)
    schedule, at = [], 0.0
    for _ in range(kills):
        at += rng.uniform(0.75 * mtbf_s, 1.25 * mtbf_s)
        schedule.append([round(at, 1), rng.randrange(world_size)])
    return schedule


def spaced_kill_plan(seed: int, kills: int, steps: int, world_size: int) -> str:
    """A fault plan of kills right after steps: kill ``i`` within a quarter gap of step
    ``i x steps / (kills + 1)``, each of a random rank, so that a replacement has joined before
    the next kill and every kill finds its replica."""
    rng, gap = random.Random(seed), steps // (kills + 1)
    return ";".join(f"kill:step={i * gap + rng.randrange(-(gap // 4), gap // 4 + 1)}:rank={rng.randrange(world_size)}"
                    for i in range(1, kills + 1))


# --- the driver ------------------------------------------------------------------------------------


@contextmanager
def experiment_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temp dir for an experiment's cluster, drivers, records and run storage; removed afterwards
    unless ``keep``, or the experiment failed (its logs say why)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
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


@contextmanager
def chaos_cluster(root: Path, node_cpus: int, import_dirs: Sequence[Path] = ()) -> Iterator[LocalRayCluster]:
    """A :class:`LocalRayCluster` in ``root/ray``: a head with no CPUs (no worker lands on it) plus
    one node of ``node_cpus``. ``import_dirs`` go on the ``PYTHONPATH`` of its nodes and drivers:
    the folders of train functions outside the package (a benchmark's own)."""
    pythonpath = os.pathsep.join(filter(None, [*map(str, import_dirs), os.environ.get("PYTHONPATH")]))
    with LocalRayCluster(root / "ray", env={**os.environ, "PYTHONPATH": pythonpath}) as cluster:
        cluster.add_node(cpus=node_cpus)
        yield cluster


@dataclass(frozen=True)
class Fit:
    """One ``fit()`` that ended without error: when it started and ended, and where it left things."""

    name: str
    fit_start: float
    fit_end: float
    record_dir: Path
    run_dir: Path  # checkpoints and the goodput ledger
    ray_dir: Path  # the cluster's temp dir (Ray's logs)
    registered: tuple[str, ...] = ()  # the checkpoints Ray kept registered (``Result.best_checkpoints``), oldest first

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.record_dir)


def fit_on(cluster: LocalRayCluster, root: Path, name: str, train_fn: Callable[[dict[str, Any]], None],
           job: ChaosJob, *, workers: int, max_failures: int, timeout: float, spare_workers: bool = True,
           survivors: bool = False) -> Fit:
    """One ``fit()`` of ``train_fn`` (:func:`train_restarting`, :func:`train_survivors` or a
    benchmark's own) on ``job`` in a driver process (:func:`fit_in_driver`) on ``cluster``: the
    run ``root/storage/<name>``, its records in ``root/record/<name>``, the driver's log in
    ``root/driver-<name>.log``. RuntimeError naming that log when the fit failed.

    The driver and the workers import ``train_fn`` by name; one of the script being run is found
    by the script's name (its folder must be among :func:`chaos_cluster`'s ``import_dirs``).
    """
    module = train_fn.__module__
    if module == "__main__":
        module = Path(sys.modules["__main__"].__file__).stem
    record_dir = root / "record" / name
    record_dir.mkdir(parents=True)
    config = {"address": cluster.address, "storage": str(root / "storage"), "name": name,
              "train_fn": f"{module}:{train_fn.__qualname__}",
              "workers": workers, "max_failures": max_failures, "spare_workers": spare_workers,
              "survivors": survivors, "loop": asdict(replace(job, record_dir=str(record_dir)))}
    outcome = run_driver(f"{__name__}:fit_in_driver", config, env=cluster.env, workdir=root, timeout=timeout,
                         name=f"driver-{name}")
    if outcome["error"]:
        raise RuntimeError(f"the {name} run failed: {outcome['error']}; see {root / f'driver-{name}.log'}")
    return Fit(name, outcome["fit_start"], outcome["fit_end"], record_dir, root / "storage" / name, cluster.temp_dir,
               tuple(outcome["registered"]))


def fit_in_driver(config: dict[str, Any]) -> dict[str, Any]:
    """The driver process of :func:`fit_on`: one ``fit()`` through ``recommended_ray_config`` (its
    workers preload the train function's module); when it started and ended, its error, and the
    checkpoints Ray kept registered."""
    import ray
    from ray.train.torch import TorchTrainer

    from ray_resilient.ray_config import recommended_ray_config
    from ray_resilient.spare_workers import DEFAULT_PRELOAD_MODULES

    module, _, function = config["train_fn"].partition(":")
    train_fn = getattr(importlib.import_module(module), function)
    ray.init(address=config["address"])
    preload = tuple(dict.fromkeys((*DEFAULT_PRELOAD_MODULES, SYNTHETIC_DATA, module)))
    ray_config = recommended_ray_config(config["name"], config["storage"], workers=config["workers"],
                                        max_failures=config["max_failures"], spare_workers=config["spare_workers"],
                                        preload=preload, survivors=config["survivors"])
    loop = {**config["loop"], "t0": time.time()}
    trainer = TorchTrainer(train_fn, train_loop_config=loop, **ray_config.trainer_kwargs())
    outcome: dict[str, Any] = {"fit_start": loop["t0"], "error": None, "registered": []}
    try:
        result = ray_config.fit(trainer)
        outcome["error"] = repr(result.error) if result.error else None
        outcome["registered"] = [checkpoint.path for checkpoint, _ in result.best_checkpoints]
    except Exception as err:  # noqa: BLE001 - reported by the parent process
        outcome["error"] = repr(err)
    outcome["fit_end"] = time.time()
    ray.shutdown()
    return outcome


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init`` of a new local Ray in this process, without a dashboard, for a benchmark whose
    trainers run in-process. Without a dashboard there is no state API server, so Ray Train's
    ``PlacementGroupCleaner`` would ask whichever dashboard listens on 127.0.0.1:8265 (another
    local cluster's), not find this run's controller there, and remove the run's placement group
    mid-run; the state API is pointed nowhere instead, as :class:`LocalRayCluster` does."""
    import ray

    os.environ.update(NO_API_SERVER)
    ray.init(address="local", include_dashboard=False, **init_kwargs)


@contextmanager
def foreign_cpu(every_s: float = 2.0) -> Iterator[list[float]]:
    """Samples, every ``every_s`` while inside, the cores' worth of CPU used by processes that are
    not this one's descendants (its clusters, drivers and workers) nor kernel threads; yields the
    list the samples go to. Other users' work on a shared machine slows start-ups and steps alike:
    this says how much of it a run met (a process that lived between two samples is missed)."""
    samples: list[float] = []
    done = threading.Event()
    sampler = threading.Thread(target=_sample_foreign_cpu, args=(samples, done, every_s), daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        done.set()
        sampler.join()


def _sample_foreign_cpu(samples: list[float], done: threading.Event, every_s: float) -> None:
    before = _process_cpu()
    while not done.wait(every_s):
        now = _process_cpu()
        mine, changed = {os.getpid(), KERNEL_THREADS}, True
        while changed:
            found = {pid for pid, (parent, _) in now.items() if parent in mine} - mine
            mine, changed = mine | found, bool(found)
        used = sum(cpu - before.get(pid, (0, 0.0))[1] for pid, (_, cpu) in now.items() if pid not in mine)
        samples.append(max(0.0, used) / every_s)
        before = now


def _process_cpu() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far) of every process on the machine (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        found[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    return found


# --- analyses --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """A kill as it happened: the killed process, its rank, the last step it committed, and when."""

    step: int
    rank: int
    t: float
    pid: int


def kill_moments(records: Sequence[dict[str, Any]], plan: str = "", action: str = "kill") -> list[Kill]:
    """Every kill of a run, in time order: the KILL records of timed kills, and each
    ``kill:step=N:rank=R`` of ``plan`` at the first commit of step N by rank R (it fires then,
    once per run). RuntimeError when a planned kill never fired. ``action="stop"``: the planned
    SIGSTOPs (``stop:step=N:rank=R``) instead, and no timed kills."""
    timed = of_kind(records, RecordKind.KILL) if action == "kill" else []
    kills = [Kill(r["step"], r["rank"], r["t"], r["pid"]) for r in timed]
    steps = of_kind(records, RecordKind.STEP)
    for fault in parse_faults(plan):
        if (fault.action, fault.point) != (action, "step"):
            continue
        killed = next((r for r in steps if r["step"] == fault.step and r["rank"] == fault.rank), None)
        if killed is None:
            raise RuntimeError(f"rank {fault.rank} never committed step {fault.step}: its kill never fired "
                               "(was its replica back? give the run more steps)")
        kills.append(Kill(fault.step, fault.rank, killed["t"], killed["pid"]))
    return sorted(kills, key=lambda k: k.t)


def kept_samples(records: Sequence[dict[str, Any]]) -> Counter:
    """(epoch, sample id) of every sample the final model was trained on, as often as it was.

    A step counts with the micro-batches of the membership that went on from it: its records
    count when a process of the same membership (survivor mode: the same ``members``; otherwise
    any) committed a later step or finished, or a later attempt restored a checkpoint of that
    step or newer; and no process started later from an older step (a restore, or a whole job
    starting over from its checkpoint), which trains it again or never.
    """
    last: dict[int, float] = defaultdict(float)  # pid -> the step it went on to (inf: it finished)
    for r in records:
        if r["kind"] in (RecordKind.STEP, RecordKind.FINISHED):
            last[r["pid"]] = math.inf if r["kind"] == RecordKind.FINISHED else max(last[r["pid"]], r["step"])
    steps = of_kind(records, RecordKind.STEP)
    went_on = {(r["step"], _membership(r)) for r in steps if last[r["pid"]] > r["step"]}
    restored = [(r["t"], r["step"]) for r in of_kind(records, RecordKind.RESTORED)]
    starts = restored + [(r["t"], r["step"]) for r in of_kind(records, RecordKind.JOINED)]
    seen: Counter = Counter()
    counted = set()  # survivor mode: (step, members) whose micro-batches are counted
    for r in steps:
        if any(t > r["t"] and step < r["step"] for t, step in starts):
            continue
        key = (r["step"], _membership(r))
        if key in went_on or any(t > r["t"] and step >= r["step"] for t, step in restored):
            if key[1] is None:
                seen.update((r["epoch"], i) for ids in r["parts"].values() for i in ids)
            elif key not in counted:
                counted.add(key)
                seen.update((r["epoch"], i) for ids in committed_micro_batches(records, r).values() for i in ids)
    return seen


def committed_micro_batches(records: Sequence[dict[str, Any]], step: dict[str, Any]) -> dict[int, list[int]]:
    """Survivor mode: {part: sample ids} of the micro-batches the committed ``step`` (a STEP record)
    trained: for each part, the last one computed for it in the step's membership before the commit.

    Read from the COMPUTED records rather than the members' STEP records: a replica killed just
    after the step's exchange gave its micro-batches to the step but never recorded it.
    """
    parts = {}
    for r in of_kind(records, RecordKind.COMPUTED):
        if r["t"] < step["t"] and r["step"] == step["step"] and r["members"] == step["members"]:
            parts[r["part"]] = r["ids"]
    return parts


def _membership(record: dict[str, Any]) -> tuple[int, ...] | None:
    members = record.get("members")
    return None if members is None else tuple(members)


def planned_samples(job: ChaosJob) -> Counter:
    """(epoch, sample id) of the ``job.max_steps`` global batches of an uninterrupted run."""
    planned: Counter = Counter()
    if job.volume:
        from ray_resilient.data import SamplePlan

        plan = SamplePlan(job.samples, job.global_batch, 1, job.seed)
        for step in range(job.max_steps):
            epoch, batch = divmod(step, plan.batches_per_epoch)
            planned.update((epoch, int(i)) for i in plan.global_batch_indices(epoch, batch))
        return planned
    from ray_resilient.testing.synthetic_data import SyntheticBatches

    data = SyntheticBatches(job.samples, job.global_batch, job.seed, 0, 1)
    for step in range(job.max_steps):
        planned.update((step // data.batches_per_epoch, i) for i in data.micro_batch(step, 0, 1)[0].tolist())
    return planned


def sample_errors(kept: Counter, planned: Counter) -> tuple[int, int]:
    """(samples trained more often than planned, samples of the plan never trained)."""
    return sum((kept - planned).values()), sum((planned - kept).values())


def median_step_seconds(records: Sequence[dict[str, Any]]) -> float:
    """The median time between two consecutive commits of one process."""
    committed = _committed(records)
    gaps = [steps[s] - steps[s - 1] for steps in committed.values() for s in steps if s - 1 in steps]
    return statistics.median(gaps) if gaps else math.nan


def _committed(records: Sequence[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """pid -> step -> when that process committed it."""
    committed: dict[int, dict[int, float]] = defaultdict(dict)
    for r in of_kind(records, RecordKind.STEP):
        committed[r["pid"]][r["step"]] = r["t"]
    return committed


@dataclass(frozen=True)
class Pause:
    """What a kill cost survivor mode's survivors, in seconds beyond a median step (see :func:`survivor_pauses`)."""

    kill: Kill
    survivors: int
    pause: float
    joined_at: int  # the step at which the replacement joined (-1: it never did)
    join: float  # NaN when it never joined


def survivor_pauses(records: Sequence[dict[str, Any]], kills: Sequence[Kill]) -> list[Pause]:
    """Per kill in survivor mode: ``pause``, on the slowest survivor, from its commit of the killed
    replica's last step to its commit of the next, less the median step; ``join``, the same for
    the step at which the replacement was taken in."""
    committed, usual = _committed(records), median_step_seconds(records)
    joins = of_kind(records, RecordKind.JOINED)

    def slowest(step: int, pids: list[int]) -> float:
        gaps = [committed[p][step + 1] - committed[p][step] for p in pids if {step, step + 1} <= committed[p].keys()]
        return max(gaps) - usual if gaps else math.nan

    pauses = []
    for kill in kills:
        survivors = [p for p, steps in committed.items()
                     if p != kill.pid and {kill.step, kill.step + 1} <= steps.keys()]
        replacement = next((r for r in joins if r["rank"] == kill.rank and r["t"] > kill.t), None)
        joined_at = replacement["step"] if replacement else -1
        pauses.append(Pause(kill, len(survivors), slowest(kill.step, survivors), joined_at,
                            slowest(joined_at, survivors) if joined_at > 0 else math.nan))
    return pauses


def discarded_steps(run_dir: Path) -> int:
    """Steps survivor mode dropped and trained again (the ledger's ``step_discarded``, once per membership)."""
    from ray_resilient.goodput.events import EventKind
    from ray_resilient.goodput.ledger import load_events

    return len({(e["step"], e.get("world_size")) for e in load_events(str(run_dir))
                if e["kind"] == EventKind.STEP_DISCARDED})


# The phases of a whole-group recovery, from the kill to the first step after the restore, each ended
# by the last rank's record of that kind (the ranks wait for each other at the next collective).
RECOVERY_MARKS = {"restart": RecordKind.START, "setup": RecordKind.RESTORE_START, "restore": RecordKind.RESTORED,
                  "ffwd": RecordKind.FIRST_BATCH, "first_step": RecordKind.STEP}
PHASES = ("detect", *RECOVERY_MARKS)
# Sub-phases of `restart`, ended by records of the controller's log (`launch`: the train function ran),
# and of `setup`, ended by the train function's own records.
RESTART_DETAIL = (*ControllerRestart.PHASES, "launch")
SETUP_MARKS = {"imports": RecordKind.IMPORTED, "model": RecordKind.MODEL_READY, "manager": RecordKind.RESTORE_START}


def recovery_phases(records: Sequence[dict[str, Any]], kills: Sequence[Kill], ray_dir: Path) -> list[dict[str, Any]]:
    """One row per kill of a whole-group restart run: how long each phase of its recovery took (s).

    ``detect``: kill -> the controller's decision to retry (``ray_dir``'s controller log);
    ``restart`` -> the train function started on every rank of the new group (split into
    RESTART_DETAIL); ``setup`` -> ``restore()`` called (split into SETUP_MARKS); ``restore`` ->
    it returned; ``ffwd`` -> the first batch in hand; ``first_step`` -> the first step committed.
    ``recovery`` is their sum, ``recomputed`` the killed step less the restored one.
    """
    ranks = sorted({r["rank"] for r in records})
    rows = []
    for kill in kills:
        attempt = _attempt_after(records, ranks, kill)

        def last_rank_at(kind: RecordKind) -> float:
            """When the last rank got to ``kind`` in this attempt (NaN if a rank never recorded it)."""
            times = [next((r["t"] for r in attempt[rank] if r["kind"] == kind), math.nan) for rank in ranks]
            return math.nan if any(math.isnan(t) for t in times) else max(times)

        t_start = last_rank_at(RecordKind.START)
        restart = controller_restart(ray_dir, after=kill.t, before=t_start)
        restored = next(r["step"] for r in attempt[ranks[0]] if r["kind"] == RecordKind.RESTORED)
        row: dict[str, Any] = {"kill_step": kill.step, "rank": kill.rank, "restored_step": restored,
                               "preloaded": attempt[ranks[0]][0].get("preloaded", [])}
        row.update(_phase_lengths(kill.t, {"detect": restart.retry, **{name: last_rank_at(kind)
                                                                        for name, kind in RECOVERY_MARKS.items()}}))
        row.update(_phase_lengths(restart.retry, {**restart.phases, "launch": t_start}))
        row.update(_phase_lengths(t_start, {name: last_rank_at(kind) for name, kind in SETUP_MARKS.items()}))
        row["recovery"] = last_rank_at(RecordKind.STEP) - kill.t
        row["recomputed"] = kill.step - restored
        rows.append(row)
    return rows


def _attempt_after(records: Sequence[dict[str, Any]], ranks: list[int], kill: Kill) -> dict[int, list[dict]]:
    """rank -> the records of its first process that started after ``kill`` (the restarted attempt)."""
    attempt = {}
    for rank in ranks:
        start = next((r for r in of_kind(records, RecordKind.START) if r["rank"] == rank and r["t"] > kill.t), None)
        if start is None:
            raise RuntimeError(f"rank {rank} never started again after the kill at step {kill.step}")
        attempt[rank] = [r for r in records if r["pid"] == start["pid"] and r["rank"] == rank]
    return attempt


def _phase_lengths(start: float, marks: dict[str, float]) -> dict[str, float]:
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


def finite_median(values: Sequence[float]) -> float:
    """The median of the values that are not NaN (NaN when none is): a kill without a pause, a phase a run skipped."""
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan
