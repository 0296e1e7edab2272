"""Survivor mode vs whole-group restart: what a worker's SIGKILL costs the workers that remain.

Setup
    The model, data and cluster of ``benchmarks/recovery.py``: a local multi-node Ray cluster
    (:class:`ray_resilient.testing.LocalRayCluster`, a head with 0 CPUs plus one worker node with
    ``--node-cpus`` CPUs, default 3), the MLP 32 -> 512 -> 512 -> 512 -> 4 (2.2 MB of parameters)
    with SGD and momentum, ``SyntheticBatches`` with a ``--global-batch`` of 96 samples, a step of
    ``--step-seconds`` (0.05) of ``time.sleep`` emulating accelerator compute per micro-batch plus
    the real forward/backward, 3 workers, a checkpoint every ``--interval`` (20) steps, and the
    same seeded plan of ``--kills`` (5) SIGKILLs of one worker right after a step
    (``kill:step=N:rank=R``): kill ``i`` falls within a quarter gap of step ``i x steps / (kills + 1)``,
    of a random rank, so that a replacement (10-20 s to start here) has joined before the next
    kill and every planned kill finds its replica. Both modes run in one invocation, each on a
    fresh cluster, through ``recommended_ray_config``:

    restart    ``recovery.py``'s run with spare workers (the default): every kill restarts the
               whole worker group, which restores the newest checkpoint. ``restart_seconds`` is
               its recovery per kill: kill -> the first step completed after the restore.
    survivors  ``recommended_ray_config(..., survivors=True)`` and
               :class:`~ray_resilient.survivors.SurvivingReplicas` with 3 micro-batches of 32 (one
               per replica; two on one replica while one is missing): the survivors drop the step
               in flight, re-form without the dead replica and train the same global batch again;
               Ray starts a replacement that copies its state from a live replica and joins.

Measurement (survivor mode)
    Every process logs each committed step (``time.time()``, the membership, the micro-batches it
    computed with their sample ids). ``pause`` per kill = on the slowest survivor, the time from
    its commit of the killed step N to its commit of step N+1, minus the median step (so a pause
    of 0 is a step that took no longer than usual). ``join`` = the same for the step at which the
    replacement was taken in. ``recomputed_steps`` = steps dropped (the ledger's
    ``step_discarded``, counted once per membership change). Samples: a step's kept micro-batches
    are those logged by the processes of the membership that committed it (the survivors, and the
    dead replica if it committed the step before dying); a (step, micro-batch) of the plan kept
    zero times is ``lost``, kept more than once ``repeated``, counted in samples.

The last line::

    survivor_pause_seconds=<median> restart_seconds=<median, whole-group mode> recomputed_steps=<survivor mode, total> lost_samples=<n> repeated_samples=<n>

Run: ``python benchmarks/survivor_recovery.py`` (about 8 minutes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import recovery

MICRO_BATCHES = 3


# --- the train function (runs in the Ray workers, which import this module as `survivor_recovery`)


def train_fn(config: dict[str, Any]) -> None:
    """Survivor mode: train ``max_steps`` steps, logging every committed step."""
    import ray.train
    import torch
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES, SyntheticBatches

    from ray_resilient.survivors import SurvivingReplicas

    replica = ray.train.get_context().get_world_rank()
    log = recovery.EventLog(config["record_dir"], replica)
    log("attempt_start")
    torch.manual_seed(config["seed"])
    hidden = recovery.HIDDEN
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = SyntheticBatches(config["samples"], config["global_batch"], config["seed"], 0, 1)
    computed: dict[int, list[int]] = {}

    def loss_of(step: int, part: int) -> torch.Tensor:
        ids, x, y = data.micro_batch(step, part, MICRO_BATCHES)
        computed[part] = ids.tolist()
        time.sleep(config["step_seconds"])  # the accelerator's compute
        return torch.nn.functional.cross_entropy(model(x), y)

    with SurvivingReplicas(model, optimizer, micro_batches=MICRO_BATCHES, seed=config["seed"],
                           checkpoint_interval=config["interval"], faults=config["faults"]) as replicas:
        log("joined", step=replicas.step)
        while replicas.step < config["max_steps"]:
            computed.clear()
            replicas.train_step(loss_of)
            log("step", step=replicas.step, members=list(replicas.members),
                parts={k: computed[k] for k in replicas.last_parts})
    log("finished", step=replicas.step)


def drive(config: dict[str, Any]) -> dict[str, Any]:
    """The driver process: one survivor-mode ``fit()``; its error, if any."""
    import ray
    from ray.train.torch import TorchTrainer

    from ray_resilient import recommended_ray_config

    ray.init(address=config["address"])
    ray_config = recommended_ray_config("survivors", config["storage"], workers=MICRO_BATCHES,
                                        max_failures=config["max_failures"], spare_workers=True,
                                        survivors=True)
    trainer = TorchTrainer(train_fn, train_loop_config=config["loop"], **ray_config.trainer_kwargs())
    try:
        result = ray_config.fit(trainer)
        outcome = {"error": repr(result.error) if result.error else None}
    except Exception as err:  # noqa: BLE001 - reported by the parent process
        outcome = {"error": repr(err)}
    ray.shutdown()
    return outcome


# --- analysis -------------------------------------------------------------------------------------


def spaced_kill_plan(seed: int, kills: int, steps: int, world_size: int) -> str:
    """Kill ``i`` within a quarter gap of step ``i x steps / (kills + 1)``, each of a random rank."""
    rng, gap = random.Random(seed), steps // (kills + 1)
    return ";".join(f"kill:step={i * gap + rng.randrange(-(gap // 4), gap // 4 + 1)}:rank={rng.randrange(world_size)}"
                    for i in range(1, kills + 1))


def committed_times(events: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """pid -> step -> when that process committed it."""
    times: dict[int, dict[int, float]] = defaultdict(dict)
    for e in events:
        if e["event"] == "step":
            times[e["pid"]][e["step"]] = e["t"]
    return times


def median_step(times: dict[int, dict[int, float]]) -> float:
    gaps = [steps[s] - steps[s - 1] for steps in times.values() for s in steps if s - 1 in steps]
    return statistics.median(gaps)


def pauses(events: list[dict[str, Any]], plan: str) -> tuple[list[dict[str, Any]], float]:
    """One row per planned kill: the survivors' pause, and the pause when the replacement joined."""
    from ray_resilient.faults import parse_faults

    times = committed_times(events)
    usual = median_step(times)
    rows = []
    for fault in parse_faults(plan):
        killed = next((e for e in events if e["event"] == "step" and e["step"] == fault.step
                       and e["rank"] == fault.rank), None)
        if killed is None:
            raise RuntimeError(f"replica {fault.rank} never committed step {fault.step}: it was not back when its "
                               "kill was due (give the run more --steps)")
        survivors = [pid for pid, steps in times.items() if pid != killed["pid"]
                     and fault.step in steps and fault.step + 1 in steps]
        pause = max(times[pid][fault.step + 1] - times[pid][fault.step] for pid in survivors) - usual
        replacement = next((e for e in events if e["event"] == "joined" and e["rank"] == fault.rank
                            and e["t"] > killed["t"]), None)
        join = float("nan")
        if replacement is not None and replacement["step"] > 0:
            s = replacement["step"]
            join = max((times[pid][s + 1] - times[pid][s] for pid in survivors if s in times[pid]
                        and s + 1 in times[pid]), default=float("nan")) - usual
        rows.append({"kill_step": fault.step, "rank": fault.rank, "survivors": len(survivors), "pause": pause,
                     "joined_at": replacement["step"] if replacement else -1, "join": join})
    return rows, usual


def kept_samples(events: list[dict[str, Any]], steps: int, global_batch: int) -> tuple[int, int]:
    """(lost, repeated) samples over the kept steps, against the plan (see the module docstring)."""
    last_step = defaultdict(int)
    for e in events:
        if e["event"] in ("step", "finished"):
            last_step[e["pid"]] = max(last_step[e["pid"]], e["step"])
    by_step = defaultdict(list)
    for e in events:
        if e["event"] == "step":
            by_step[e["step"]].append(e)
    size = global_batch // MICRO_BATCHES
    lost = repeated = 0
    for step in range(1, steps + 1):
        records = by_step.get(step, [])
        went_on = [r for r in records if last_step[r["pid"]] > step or step == steps]
        members = {tuple(r["members"]) for r in went_on}
        if len(members) != 1:
            lost += global_batch  # nobody carried this step on, or the carriers disagree
            continue
        kept = [r for r in records if tuple(r["members"]) in members]
        counts = Counter(int(k) for r in kept for k in r["parts"])
        for part in range(MICRO_BATCHES):
            lost += size * (counts[part] == 0)
            repeated += size * max(0, counts[part] - 1)
    return lost, repeated


def discarded_steps(storage: Path) -> int:
    from ray_resilient.goodput import load_events

    dropped = {(e["step"], e.get("world_size")) for e in load_events(str(storage / "survivors"))
               if e["kind"] == "step_discarded"}
    return len(dropped)


def run_survivors(args: argparse.Namespace, plan: str) -> tuple[list[dict[str, Any]], float, int, int, int]:
    """The survivor-mode run on a fresh local cluster: (pause rows, median step, steps dropped,
    lost samples, repeated samples)."""
    with recovery.run_dir("survivor-recovery-", args.keep) as root:
        config = {
            "storage": str(root / "storage"), "max_failures": args.kills,
            "loop": {"record_dir": str(root / "record"), "faults": plan, "seed": args.seed, "interval": args.interval,
                     "max_steps": args.steps, "step_seconds": args.step_seconds, "samples": 4096,
                     "global_batch": args.global_batch},
        }
        outcome = recovery.drive_on_fresh_cluster(root, "survivor_recovery:drive", config, args.node_cpus,
                                                  args.timeout)
        if outcome["error"]:
            raise RuntimeError(f"the survivor-mode run failed: {outcome['error']}")
        events = recovery.read_events(root / "record")
        rows, usual = pauses(events, plan)
        lost, repeated = kept_samples(events, args.steps, args.global_batch)
        return rows, usual, discarded_steps(root / "storage"), lost, repeated


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="worker kills (default: 5)")
    parser.add_argument("--steps", type=int, default=1200, help="training steps of the run (default: 1200)")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="emulated compute per micro-batch")
    parser.add_argument("--global-batch", type=int, default=96, help="samples per global batch (default: 96)")
    parser.add_argument("--node-cpus", type=int, default=3, help="CPUs of the worker node (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the data (default: 0)")
    parser.add_argument("--timeout", type=float, default=600, help="give up on a run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    plan = spaced_kill_plan(args.seed, args.kills, args.steps, MICRO_BATCHES)
    print(f"plan: {plan}")
    print("\n=== whole-group restart, with spare workers (recovery.py) ===")
    restart_args = recovery.parse_args([
        "--kills", str(args.kills), "--steps", str(args.steps), "--interval", str(args.interval),
        "--step-seconds", str(args.step_seconds), "--workers", str(MICRO_BATCHES),
        "--global-batch", str(args.global_batch), "--node-cpus", str(args.node_cpus), "--seed", str(args.seed),
        "--timeout", str(args.timeout), *(["--keep"] if args.keep else [])])
    restart_rows, events, outcome = recovery.run(restart_args, plan, spares=True)
    restart = recovery.print_report(restart_rows, events, outcome, restart_args, plan)

    print("\n=== survivor mode ===")
    started = time.time()
    rows, usual, recomputed, lost, repeated = run_survivors(args, plan)
    print(f"(run took {time.time() - started:.0f} s; median step {usual:.3f} s)")
    print(f"{'kill_step':>10} {'rank':>5} {'survivors':>10} {'pause':>8} {'joined_at':>10} {'join':>8}")
    for row in rows:
        print(f"{row['kill_step']:>10d} {row['rank']:>5d} {row['survivors']:>10d} {row['pause']:>8.3f} "
              f"{row['joined_at']:>10d} {row['join']:>8.3f}")
    pause = statistics.median(r["pause"] for r in rows)
    joins = [r["join"] for r in rows if r["join"] == r["join"]]
    print(f"median pause {pause:.3f} s vs median whole-group recovery {restart['recovery']:.3f} s "
          f"(ratio {pause / restart['recovery']:.3f}); median pause when a replacement joined "
          f"{statistics.median(joins) if joins else float('nan'):.3f} s; recomputed steps {recomputed} "
          f"(whole-group mode: {sum(r['recomputed'] for r in restart_rows)})")
    print(f"survivor_pause_seconds={pause:.3f} restart_seconds={restart['recovery']:.3f} "
          f"recomputed_steps={recomputed} lost_samples={lost} repeated_samples={repeated}")


if __name__ == "__main__":
    main()
