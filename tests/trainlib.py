"""Train functions for the tests, instrumented to record what each attempt restored and consumed.

Lives in its own module so Ray workers import it (conftest puts tests/ on their PYTHONPATH); the
data is the rig's resumable in-memory dataset (:class:`ray_resilient.testing.SyntheticBatches`).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from typing import Any

import numpy as np
import psutil
import ray.train
import torch
from ray.train.torch import prepare_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard

from ray_resilient import Attempt, CheckpointConfig, Checkpointer, LifecycleHook, spare_workers
from ray_resilient._ray_internals import without_unused_dataset_manager
from ray_resilient.checkpoint.lease import TTL_S
from ray_resilient.testing import wait_until
from ray_resilient.testing.kit import RecordKind, Recorder, train_replica
from ray_resilient.testing.synthetic_data import CLASSES, FEATURES, SyntheticBatches
from ray_resilient.watchdog import HangWatchdogConfig


JOB = {"seed": 7, "samples": 384, "global_batch": 32, "epochs": 2, "interval": 5}  # train_fn: 24 steps


# The lease TTL of runs whose driver a test kills and starts again: the new driver waits this long
# for the dead one's lease (the default 30 s is for real storage and loaded drivers).
RESTARTED_DRIVER_LEASE_TTL_S = 8.0


def job_config(record_dir, faults: str = "", **overrides: Any) -> dict[str, Any]:
    """``train_fn``'s config recording into ``record_dir``."""
    os.makedirs(record_dir, exist_ok=True)
    return {**JOB, "record_dir": str(record_dir), "faults": faults, **overrides}


def final_weights(record_dir) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(record_dir, "final_weights.pt"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


class AttemptRecorder:
    """What one attempt of a run restored and trained on, per rank, in files a test reads afterwards.

    The ranks of an attempt share an id (rank 0's clock, broadcast), which orders the attempts.
    """

    def __init__(self, record_dir: str, restored_step: int, registered) -> None:
        ctx = ray.train.get_context()
        self.rank, world = ctx.get_world_rank(), ctx.get_world_size()
        attempt = [time.time_ns()]
        torch.distributed.broadcast_object_list(attempt, src=0)
        self.attempt = attempt[0]
        with open(os.path.join(record_dir, f"attempt-rank{self.rank}-{self.attempt}.json"), "w") as out:
            json.dump({"attempt": self.attempt, "restored_step": restored_step, "world_size": world,
                       "registered": registered.path if registered else None, "pid": os.getpid(),
                       "node_id": ray.get_runtime_context().get_node_id(),
                       "process_started": psutil.Process().create_time(), "preloaded": spare_workers.preloaded}, out)
        self._log = open(os.path.join(record_dir, f"samples-rank{self.rank}-{self.attempt}.jsonl"), "w")

    def step(self, step: int, ids: torch.Tensor, loss: torch.Tensor) -> None:
        self._log.write(json.dumps({"step": step, "ids": ids.tolist(), "loss": loss.item(), "time": time.time()}) + "\n")
        self._log.flush()


class LifecycleRecorder(LifecycleHook):
    """A user's lifecycle hook: every point the checkpoint loop fires, one JSON line each, in
    ``record_dir/lifecycle-rank<r>-<pid>.jsonl``."""

    def __init__(self, record_dir: str) -> None:
        self._dir = record_dir
        self._log: Any = None

    def _write(self, point: str, **fields: Any) -> None:
        self._log.write(json.dumps({"point": point, **fields}) + "\n")
        self._log.flush()

    def attempt_started(self, attempt: Attempt) -> None:
        self._log = open(os.path.join(self._dir, f"lifecycle-rank{attempt.rank}-{os.getpid()}.jsonl"), "w")
        self._write("attempt_started", rank=attempt.rank, world_size=attempt.world_size,
                    pids=[identity["pid"] for identity in attempt.identities])

    def phase(self, name: str, allowance: float | str | None = None) -> None:
        self._write("phase", name=name, allowance=allowance)

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        self._write("saving", name=name)

    def step_finished(self, step: int) -> None:
        self._write("step_finished", step=step)

    def attempt_ended(self, failed: bool) -> None:
        self._write("attempt_ended", failed=failed)
        self._log.close()


def assert_auto_intervals(events: list[dict[str, Any]], mtbf_s: float) -> None:
    """Each interval the ``"auto"`` policy chose between two saves of rank 0's ``events`` (the last,
    the final save, aside) is Daly's for ``mtbf_s``, within a step: a save costs its stall plus the
    interference of the previous save's write (what the steps beside it, their span overlapping
    it, took beyond the median of the last 50 steps without a write); the interval is never
    shorter than the newest save durable by then (as the save began, or as its stall ended: which
    the policy had collected is not in the events). The loop sees a write end when rank 0's part
    of it ends, a moment before its durable event: the step at the window's end may count or not."""
    from statistics import median

    from ray_resilient.goodput import interval_steps_for

    saves = [e for e in events if e["kind"] == "save"]
    step_spans = {e["step"]: (e["t_start"], e["t"]) for e in events if e["kind"] == "step"}
    step_seconds = {step: t1 - t0 for step, (t0, t1) in step_spans.items()}
    durable_at = {e["step"]: e["t"] for e in events if e["kind"] == "durable"}
    started_at = {e["step"]: e["t_start"] for e in saves}
    writes = [(e["t"], durable_at[e["step"]]) for e in saves if e["step"] in durable_at]
    beside = {step for step, (t0, t1) in step_spans.items() if any(t1 > a and t0 < b for a, b in writes)}

    def durable_seconds(before: float) -> float:
        newest = max((step for step, t in durable_at.items() if t <= before), default=None)
        return durable_at[newest] - started_at[newest] if newest is not None else 0.0

    for previous, save, following in zip([None, *saves], saves, saves[1:-1]):
        steady = [step_seconds[s] for s in range(1, save["step"] + 1) if s not in beside][-50:]
        since = [s for s in range(previous["step"] + 1 if previous else 1, save["step"] + 1) if s in beside]
        expected = set()
        for counted in (since, since[:-1]):
            interference = max(0.0, sum(step_seconds[s] for s in counted) - len(counted) * median(steady))
            expected |= {interval_steps_for(mtbf_s, save["t"] - save["t_start"] + interference, median(steady),
                                            durable_seconds(before)) for before in (save["t_start"], save["t"])}
        chosen = following["step"] - save["step"]
        assert any(abs(chosen - e) <= 1 for e in expected), (save, following, expected)


def read_lifecycle(record_dir: str, rank: int) -> list[list[dict[str, Any]]]:
    """The lifecycle points of each process of ``rank``, in the order its processes started."""
    names = [n for n in os.listdir(record_dir) if n.startswith(f"lifecycle-rank{rank}-")]
    logs = []
    for name in names:
        with open(os.path.join(record_dir, name)) as f:
            logs.append((os.path.getctime(os.path.join(record_dir, name)), [json.loads(line) for line in f]))
    return [points for _, points in sorted(logs, key=lambda entry: entry[0])]


def _attempt_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1].split(".")[0])


def read_attempts(record_dir: str, rank: int = 0) -> list[dict[str, Any]]:
    """Every attempt's record for ``rank``, in start order."""
    names = sorted((n for n in os.listdir(record_dir) if n.startswith(f"attempt-rank{rank}-")), key=_attempt_of)
    records = []
    for name in names:
        with open(os.path.join(record_dir, name)) as f:
            records.append(json.load(f))
    return records


def _steps(record_dir: str, rank: int) -> dict[int, tuple[int, dict[str, Any]]]:
    """Step -> (attempt, record) of what ``rank`` trained on, as kept: a recomputed step's last attempt wins."""
    names = sorted((n for n in os.listdir(record_dir) if n.startswith(f"samples-rank{rank}-")), key=_attempt_of)
    steps: dict[int, tuple[int, dict[str, Any]]] = {}
    for name in names:
        with open(os.path.join(record_dir, name)) as f:
            for line in f:
                record = json.loads(line)
                steps[record["step"]] = (_attempt_of(name), record)
    return steps


def consumed_samples(record_dir: str, rank: int) -> dict[int, list[int]]:
    """Step -> sample ids this rank trained on, as kept."""
    return {step: record["ids"] for step, (_, record) in _steps(record_dir, rank).items()}


def kept_global_batches(record_dir: str) -> dict[int, list[int]]:
    """Step -> the global batch trained on (every rank's ids, in rank order), as kept.

    Ranks can change between attempts (an elastic resize): a step's batch is taken from the
    last attempt that trained it, on all of that attempt's ranks.
    """
    world = max(a["world_size"] for a in read_attempts(record_dir))
    per_rank = [_steps(record_dir, rank) for rank in range(world)]
    batches = {}
    for step, (attempt, _) in per_rank[0].items():
        batches[step] = [i for steps in per_rank if step in steps and steps[step][0] == attempt
                         for i in steps[step][1]["ids"]]
    return batches


def kept_losses(record_dir: str) -> dict[int, float]:
    """Step -> rank 0's loss, as kept."""
    return {step: record["loss"] for step, (_, record) in _steps(record_dir, 0).items()}


def build_model(seed: int, features: int = FEATURES) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, CLASSES))


def parallelize(model: torch.nn.Module, parallelism: str) -> torch.nn.Module:
    """``"ddp"``: Ray's ``prepare_model``; ``"fsdp"``: FSDP2, each Linear and the root ``fully_shard``-ed."""
    if parallelism == "ddp":
        return prepare_model(model)
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def save_final_weights(model: torch.nn.Module, record_dir: str) -> None:
    """The full, unsharded model state (a collective: every rank calls it), written by rank 0."""
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ray.train.get_context().get_world_rank() == 0:
        torch.save({k: v.clone() for k, v in weights.items()}, os.path.join(record_dir, "final_weights.pt"))


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def hold(holds: list[dict[str, Any]], world: int, restored_step: int, step: int, ckpt: Checkpointer) -> None:
    """Wait where a test asked, so that it acts on the run at a point it chose, not a race.

    Each hold is ``{"world_size": W, "at_step": S, "until": "replaced" | FILE}``: an attempt of W
    workers that started before step S stops once it trained step S, until Ray replaces its
    worker group ("replaced": it never goes on) or until FILE exists. A held rank tells the hang
    watchdog it is busy, as a long evaluation pass would.
    """
    def held() -> bool:
        ckpt.progress("held by the test")
        return rule["until"] != "replaced" and os.path.exists(rule["until"])

    for rule in holds:
        if rule["world_size"] == world and restored_step < rule["at_step"] == step:
            wait_until(held, timeout=3600, what=f"{rule['until']} to exist")  # "replaced": until Ray stops it


def train_fn(config: dict[str, Any]) -> None:
    """Train with SGD+momentum and a step LR schedule; checkpoint every ``interval`` steps.
    ``parallelism``: ``"ddp"`` (default) or ``"fsdp"`` (FSDP2); ``holds``: see :func:`hold`;
    ``goodput_logger``: ``"mlflow"`` for a test that reads the live goodput (default: none, so
    the workers neither import MLflow nor open its store).

    Records, per attempt, the sample ids each rank consumed (``record_dir``) and finally the
    model weights (rank 0), so tests can compare runs bitwise.
    """
    torch.use_deterministic_algorithms(True)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    seed = config["seed"]
    model = parallelize(build_model(seed), config.get("parallelism", "ddp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)
    data = SyntheticBatches(config["samples"], config["global_batch"], seed, rank, world)
    loss = torch.zeros(())
    checkpoints = CheckpointConfig(interval_steps=config["interval"], mtbf_s=config.get("mtbf_s"), seed=seed,
                                   faults=config.get("faults", ""), goodput_logger=config.get("goodput_logger"),
                                   goodput_log_every=config.get("goodput_log_every", 50),
                                   lease_ttl_s=config.get("lease_ttl_s", TTL_S),
                                   hang_watchdog=HangWatchdogConfig(**config.get("watchdog", {})))
    with Checkpointer(model, optimizer, lr_scheduler=scheduler, data=data, config=checkpoints,
                      hooks=[LifecycleRecorder(config["record_dir"])]) as ckpt:
        registered = ray.train.get_checkpoint()
        state = ckpt.restore()  # the live train state: its step counts on
        restored_step = state.step
        recorder = AttemptRecorder(config["record_dir"], restored_step, registered)
        for epoch in range(state.epoch, config["epochs"]):
            for ids, x, y in data:
                # Dropout-like randomness from the restored RNG: a resume that lost RNG state diverges.
                x = x + 0.01 * torch.randn_like(x)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                recorder.step(ckpt.train_state.step + 1, ids, loss)
                time.sleep(config.get("step_seconds", 0.0))  # emulated accelerator compute
                ckpt.step_completed(data.epoch, {"loss": loss.item()})
                hold(config.get("holds", ()), world, restored_step, ckpt.train_state.step, ckpt)
        ckpt.finish({"loss": loss.item()})
    save_final_weights(model, config["record_dir"])


class Counter:
    """A user Stateful extra (identical on every rank)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def snapshot(model, optimizer, scheduler, scaler, counter: Counter) -> dict[str, Any]:
    """Deep copies of everything a checkpoint must carry, comparable across world sizes."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return copy.deepcopy({
        "model": model_sd,
        "optimizer": optim_sd,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "counter": counter.value,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    })


def roundtrip_fn(config: dict[str, Any]) -> None:
    """Phase "save": train a few steps with Adam, a scheduler, a grad scaler, an extra, then the
    final checkpoint; phase "restore": fresh objects (other init), restore. Both snapshot the state."""
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    saving = config["phase"] == "save"
    seed = config["seed"] if saving else config["seed"] + 99
    model = prepare_model(build_model(seed))
    random.seed(seed + rank)  # per-rank streams, so a restore that mixes ranks up is caught
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    counter = Counter()
    with Checkpointer(model, optimizer, lr_scheduler=scheduler, grad_scaler=scaler, extras={"counter": counter},
                      config=CheckpointConfig(interval_steps=3, seed=config["seed"], goodput_logger=None)) as ckpt:
        ckpt.restore()  # saving: finds nothing, starts fresh
        if saving:
            for _ in range(config["steps"]):
                x, y = torch.randn(8, FEATURES), torch.randint(0, CLASSES, (8,))
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                counter.value += 1 + counter.value % 3
                ckpt.step_completed(0)
            ckpt.finish()
        torch.save(snapshot(model, optimizer, scheduler, scaler, counter),
                   os.path.join(config["record_dir"], f"snapshot-{config['phase']}-rank{rank}.pt"))


# Spare workers preloading what these train functions import: the defaults but MLflow (they log
# no metrics unless a test asks), and this module. The marker variable gives run_job's workers a
# runtime environment of their own: a test of the recommended config's spares (test_chaos) checks
# when its spares were started, so they must never be run_job's leftovers.
RUN_JOB_PRELOAD = (*(name for name in spare_workers.DEFAULT_PRELOAD_MODULES if name != "mlflow"), "trainlib")
RUN_JOB_WORKER_ENV = {**spare_workers.worker_env(RUN_JOB_PRELOAD), "RAY_RESILIENT_TEST_RUN_JOB": "1"}


def run_job(
    train_fn,
    config: dict[str, Any],
    storage_path: str,
    name: str,
    workers: int = 2,
    max_failures: int = 3,
    num_to_keep: int | None = 2,
    storage_filesystem=None,
):
    """One ``TorchTrainer.fit()`` on the session's local Ray cluster.

    Its workers run with spare workers on (:data:`RUN_JOB_WORKER_ENV`): each attempt leaves warm
    processes behind, which the next attempt, or the next test's run, starts on in a fraction
    of a second instead of the 4-5 s a new process takes to import torch and set up Ray Train.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
            worker_runtime_env={"env_vars": RUN_JOB_WORKER_ENV},
        ),
    )
    return without_unused_dataset_manager(trainer).fit()  # as ResilientRayConfig.fit does


EMULATED_STEP_SECONDS = 0.02


def no_restore_fn(config: dict[str, Any]) -> None:
    """A train function that forgets ``restore()`` and saves at every step."""
    model = prepare_model(build_model(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Checkpointer(model, optimizer, config=CheckpointConfig(interval_steps=1, goodput_logger=None)) as ckpt:
        ckpt.step_completed(0)


def preemption_fn(config: dict[str, Any]) -> None:
    """Train (with emulated compute time) until a just-in-time checkpoint was taken, then a few
    more steps. Rank 0 writes its node id and step to ``progress`` so the test can drain the node.
    ``faults``: a fault plan; the hang watchdog allows ranks that answer 5 s without progress."""
    ctx = ray.train.get_context()
    model = prepare_model(build_model(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoints = CheckpointConfig(interval_steps=None, preemption_check_steps=5, goodput_logger=None,
                                   faults=config.get("faults"), hang_watchdog=HangWatchdogConfig(floor_s=5.0))
    with Checkpointer(model, optimizer, config=checkpoints) as ckpt:
        ckpt.restore()
        steps_after = None
        for step in range(config["max_steps"]):
            loss = model(torch.randn(4, FEATURES)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(EMULATED_STEP_SECONDS)  # accelerator compute; keeps the loop running while the drain lands
            ckpt.step_completed(0)
            if ctx.get_world_rank() == 0:
                with open(config["progress"], "w") as out:
                    json.dump({"node_id": ray.get_runtime_context().get_node_id(), "step": step}, out)
            if ckpt.status.preemption_saves:
                steps_after = 0 if steps_after is None else steps_after + 1
                if steps_after == 5:
                    break
        ckpt.finish()


def image_train_fn(config: dict[str, Any]) -> None:
    """Train a linear classifier on the volume's JPEGs through VolumeDataLoader; the loader's
    position is the checkpoint's data slot. Records consumed sample ids like ``train_fn``."""
    from ray_resilient.data import StreamingConfig, Volume, VolumeDataLoader, VolumeImageDataset, default_transform

    torch.use_deterministic_algorithms(True)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    dataset = VolumeImageDataset(Volume(config["volume"]), global_batch=config["global_batch"], rank=rank,
                                 world_size=world, seed=config["seed"], transform=default_transform(12),
                                 streaming=StreamingConfig(config["cache_dir"]))
    loader = VolumeDataLoader(dataset, num_workers=config["workers"], metrics_logger=None)
    torch.manual_seed(config["seed"])
    model = prepare_model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 12 * 12, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoints = CheckpointConfig(interval_steps=config["interval"], seed=config["seed"], faults=config["faults"],
                                   goodput_logger=None)
    with Checkpointer(model, optimizer, data=loader, config=checkpoints) as ckpt:
        state = ckpt.restore()
        recorder = AttemptRecorder(config["record_dir"], state.step, None)
        while loader.epoch < config["epochs"]:
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(batch.images), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                recorder.step(ckpt.train_state.step + 1, batch.sample_ids, loss)
                ckpt.step_completed(loader.epoch, {"loss": loss.item()})
        ckpt.finish()
    if rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save({k: v.clone() for k, v in module.state_dict().items()},
                   os.path.join(config["record_dir"], "final_weights.pt"))


SURVIVOR_IMAGE_SIDE = 4  # survivor_fn's images, flattened: 3 x 4 x 4 features


def survivor_volume_loader(config: dict[str, Any]) -> Any:
    """The loader of ``config["volume"]`` (an S3 volume: uri, endpoint, access_key, secret_key,
    and optionally cache_dir) for :func:`survivor_fn`: ``loader_workers`` DataLoader workers (0:
    in the replica's process), the training augmentation at :data:`SURVIVOR_IMAGE_SIDE` pixels,
    metrics to ``data_logger`` every 5 steps."""
    from ray_resilient.data import StreamingConfig, Volume, VolumeDataLoader, VolumeImageDataset, default_transform

    spec = config["volume"]
    volume = Volume(spec["uri"], endpoint=spec["endpoint"], access_key=spec["access_key"],
                    secret_key=spec["secret_key"])
    ctx = ray.train.get_context()
    dataset = VolumeImageDataset(volume, global_batch=config["global_batch"], rank=ctx.get_world_rank(),
                                 world_size=ctx.get_world_size(), seed=config["seed"],
                                 transform=default_transform(SURVIVOR_IMAGE_SIDE),
                                 streaming=StreamingConfig(spec.get("cache_dir")))
    return VolumeDataLoader(dataset, num_workers=config.get("loader_workers", 0),
                            metrics_logger=config.get("data_logger"), log_every=5)


def survivor_components_fn(config: dict[str, Any]) -> None:
    """Survivor mode given what the mainline's ``Checkpointer`` takes: a ``GradScaler`` (growing every
    2 steps), an extra ``Stateful`` (``Counter``), checkpoint storage of the job's own
    (``config["storage"]``, not Ray's run directory) and ``faults`` (a ``preempt`` one: a save
    answers it); each replica calls ``progress()`` between its steps. Each replica writes its final
    scale, counter and step to ``record_dir/replica<r>.json``."""
    from ray_resilient.checkpoint import CheckpointStorage
    from ray_resilient.survivors import SurvivingReplicas

    torch.use_deterministic_algorithms(True)
    replica = ray.train.get_context().get_world_rank()
    data = SyntheticBatches(config["samples"], config["global_batch"], config["seed"], 0, 1)
    model = build_model(config["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    counter = Counter()
    checkpoints = CheckpointConfig(interval_steps=None, seed=config["seed"], faults=config["faults"],
                                   storage=CheckpointStorage.from_uri(config["storage"]), goodput_logger=None)

    def loss_of(step: int, part: int) -> torch.Tensor:
        _, x, y = data.micro_batch(step, part, 2)
        return torch.nn.functional.cross_entropy(model(x), y)

    with SurvivingReplicas(model, optimizer, grad_scaler=scaler, extras={"counter": counter}, micro_batches=2,
                           config=checkpoints) as replicas:
        while replicas.step < config["steps"]:
            replicas.train_step(loss_of)
            counter.value += 1 + counter.value % 3
            replicas.progress("bookkeeping")
    with open(os.path.join(config["record_dir"], f"replica{replica}.json"), "w") as out:
        json.dump({"scale": scaler.get_scale(), "counter": counter.value, "step": replicas.step}, out)


def survivor_fn(config: dict[str, Any]) -> None:
    """Train in survivor mode (the experiment kit's loop, :func:`ray_resilient.testing.kit.train_replica`):
    ``micro_batches`` parts of each global batch of ``SyntheticBatches``, or with ``volume`` of the
    volume's images (:func:`survivor_volume_loader`), SGD with a scheduler.

    Each process records into ``record_dir`` (:func:`ray_resilient.testing.kit.read_records`): ``start``,
    ``joined`` (the step it joined at and the sha of its state then), each micro-batch it computed
    (the step, the membership, its part and sample ids), and every committed step (the membership,
    the loss, the sha). The lead
    writes the final weights. ``wait_at``: ``[{"step": S, "until": FILE}]``: every replica stops
    after step S until FILE exists (a test acts then); ``{"step": S, "lead_alone": SECONDS}``: the
    lead alone works that long after step S (an evaluation), the others go on to the next step.
    ``goodput_logger``: as :func:`train_fn`'s; ``timeout_s``: survivor mode's.
    """
    torch.use_deterministic_algorithms(True)
    record = Recorder(config["record_dir"], ray.train.get_context().get_world_rank())
    record(RecordKind.START)
    seed = config["seed"]
    if config.get("volume"):
        data = survivor_volume_loader(config)
        features, per_epoch = 3 * SURVIVOR_IMAGE_SIDE ** 2, data.volume_dataset.batches_per_epoch(0)
    else:
        data = SyntheticBatches(config["samples"], config["global_batch"], seed, 0, 1)
        features, per_epoch = FEATURES, data.batches_per_epoch
    model = build_model(seed, features)  # its BatchNorm's statistics: merged over each step's micro-batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)

    def wait(step: int, is_lead: bool) -> None:
        for rule in config.get("wait_at", ()):
            if step == rule["step"] and "until" in rule:
                wait_until(lambda: os.path.exists(rule["until"]), timeout=600, what=f"{rule['until']} to exist")
            elif step == rule["step"] and is_lead:
                time.sleep(rule["lead_alone"])  # the lead's work alone between two steps

    lead = train_replica(model, optimizer, data, record, max_steps=per_epoch * config["epochs"],
                         step_seconds=config.get("step_seconds", 0.0), digest=True, after_step=wait,
                         flatten_images=True,
                         lr_scheduler=scheduler, micro_batches=config["micro_batches"],
                         timeout_s=config.get("timeout_s", 30.0),
                         config=CheckpointConfig(interval_steps=config.get("interval"), mtbf_s=config.get("mtbf_s"),
                                                 seed=seed, goodput_logger=config.get("goodput_logger"),
                                                 goodput_log_every=config.get("goodput_log_every", 50),
                                                 faults=config.get("faults", ""),
                                                 lease_ttl_s=config.get("lease_ttl_s", TTL_S)))
    if lead:
        torch.save({k: v.clone() for k, v in model.state_dict().items()},
                   os.path.join(config["record_dir"], "final_weights.pt"))
