"""Training-loop stall per checkpoint: ray_resilient's async sharded save vs. the usual alternatives.

Setup
    One local Ray cluster, two ``TorchTrainer.fit()`` runs on CPU (gloo), one after the other:

    1. 2 workers measure every method below, in sequence, in one run, on the same model;
    2. 1 worker measures ray_resilient alone, for time-to-durable with 1 vs 2 workers.

    The training state is an MLP of ``LAYERS`` square ``Linear`` layers sized so that its fp32
    parameters plus SGD momentum take ``--state-mb`` MiB (default 256: 33.6M parameters), wrapped
    in DDP by ``ray.train.torch.prepare_model`` (left unwrapped with 1 worker). A training step is
    ``--step-seconds`` of ``time.sleep`` emulating accelerator compute, then one real
    forward/backward/``optimizer.step()`` on a small random batch (with 2 workers, DDP all-reduces
    128 MiB of gradients over gloo, keeping both cores busy for 0.1-0.4 s). A save follows the
    real step, so a background write overlaps emulated compute, as it would overlap GPU compute;
    ``--cpu-step-first`` swaps the order to show what the CPU all-reduce does to it. One step
    before any measurement creates the momentum buffers. Runs keep ``--keep`` checkpoints (Ray's
    ``CheckpointConfig(num_to_keep)``), as real runs do.

Methods (each saves ``--checkpoints`` times, ``--steps-between`` steps apart: long enough for an
asynchronous save to finish before the next one starts, i.e. steady state, and for Ray's
controller, which polls every 2 s, to take the previous report off a worker's size-1 result queue;
closer saves make SYNC and NO_UPLOAD reports wait for it)
    copy_floor         every state tensor (parameters + momentum) copied into preallocated
                       buffers: the least any consistent snapshot of the state can stall.
    torch_save+SYNC    rank 0 ``torch.save`` of model+optimizer ``state_dict()`` into a temp dir,
                       ``ray.train.report(checkpoint=Checkpoint.from_directory(dir))`` with the
                       default SYNC upload (other ranks report None), then the temp dir removed.
    torch_save+ASYNC   the same ``torch.save`` into a local temp dir, reported with
                       ``checkpoint_upload_mode=CheckpointUploadMode.ASYNC`` (Ray copies it into
                       the run storage and deletes it on its upload thread).
    dcp.save           synchronous ``torch.distributed.checkpoint.save`` of ``get_state_dict``
                       (model+optimizer) into a directory under the run storage (each rank writes
                       its half, fsynced), then registered with ``ray.train.report`` (NO_UPLOAD).
    ray_resilient      ``Checkpointer.step_completed`` on the checkpoint step: registers the
                       saves that finished with Ray, builds the state dict and stages it into a
                       free set of reused buffers; the write (sharded DCP, fsynced) runs on a
                       background thread.

Timing
    A stall is ``time.monotonic()`` around exactly the call the training loop blocks on, on rank 0;
    for ray_resilient that is ``step_completed()`` (the checkpointer's own ``last_stall_seconds``, over
    the same calls, is printed alongside). Phases inside a stall are timed the same way (for
    ray_resilient by the checkpointer itself: ``SaveResult.stall_phases``). The table shows
    medians over the saves of each method; the first save of a method includes one-time costs
    (allocating staging buffers). Between methods every rank stops and rank 0 runs ``os.sync()``,
    so one method's dirty page cache is not written back during the next one.
    Time-to-durable is ``SaveResult.durable_seconds`` (also reported to Ray as
    ``checkpoint_durable_seconds``): from the start of a save, staging included, until every rank's
    files and ``.metadata`` are fsynced; median over the saves, with 1 and with 2 workers.

Machine
    Measured on a 2-core AMD EPYC Firecracker VM, 24 GiB RAM, torch CPU, Ray 2.60; the workers,
    their background writers and Ray's processes share the 2 cores, and other users' jobs ran at
    the same time (medians moved by up to 2x between runs). The virtio disk takes fsynced writes
    at ~1.7 GB/s, but writing into guest memory not touched recently (a growing page cache, fresh
    buffers) runs at only ~0.4 GB/s: the host backs guest RAM lazily and DAMON pages cold memory
    out. That, not serialization (``torch.save`` of 256 MiB to /dev/null takes 0.06 s) nor fsync,
    sets the cost of every file write here, so it varies with the state of the page cache;
    keeping only ``--keep`` checkpoints lets writes reuse the page cache of deleted ones.

The last line printed is the summary the issue asks for::

    stall_vs_torch_save=<a/d> stall_vs_ray_async=<b/d> stall_over_copy_floor=<d/floor> durable_2w_over_1w=<t2/t1>

Run: ``python benchmarks/checkpoint_stall.py`` (about 4 minutes; ``--state-mb 16 --checkpoints 3``
for a quick try).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint, CheckpointUploadMode, RunConfig, ScalingConfig
from ray.train import CheckpointConfig as RayCheckpointConfig
from ray.train.torch import TorchTrainer, prepare_model
from torch.distributed.checkpoint.state_dict import get_state_dict

from ray_resilient import CheckpointConfig, Checkpointer
from ray_resilient.storage import RunStorage
from ray_resilient.testing.kit import start_local_ray

LAYERS = 8
BATCH = 8
FLOOR, TORCH_SYNC, TORCH_ASYNC, DCP_SYNC, RESILIENT = (
    "copy_floor", "torch_save+SYNC", "torch_save+ASYNC", "dcp.save", "ray_resilient")
METHODS = (FLOOR, TORCH_SYNC, TORCH_ASYNC, DCP_SYNC, RESILIENT)
TOTAL = "stall"
LAST_STALL = "last_stall_seconds"


# --- inside the Ray workers ------------------------------------------------------------------


def build_model(state_mb: float) -> torch.nn.Module:
    """An MLP whose fp32 parameters plus SGD momentum take about ``state_mb`` MiB."""
    params = state_mb * 2**20 / 8
    width = max(8, round(math.sqrt(params / LAYERS)))
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


class PhaseClock:
    """Wall time of named phases inside the stall being measured (this rank only)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            if self.phases is not None:
                self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - start

    def measure(self, blocking: Callable[[], None]) -> dict[str, float]:
        """Run ``blocking``; return its wall time (key ``stall``) and the phases inside it."""
        self.phases = {}
        start = time.monotonic()
        blocking()
        stall = time.monotonic() - start
        phases, self.phases = self.phases, None
        return {TOTAL: stall, **phases}


class Job:
    """The model, optimizer and loop of one worker."""

    def __init__(self, state_mb: float, steps_between: int, step_seconds: float, cpu_step_first: bool,
                 write_threads: int):
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.experiment_path = RunStorage.from_ray_context().experiment_path
        torch.manual_seed(0)
        self.model = prepare_model(build_model(state_mb))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.width = unwrap(self.model)[0].in_features
        self.steps_between = steps_between
        self.step_seconds = step_seconds
        self.cpu_step_first = cpu_step_first
        self.write_threads = write_threads
        self.clock = PhaseClock()

    def train_step(self) -> None:
        """The emulated accelerator compute and one real optimizer step (order: see --cpu-step-first)."""
        if not self.cpu_step_first:
            time.sleep(self.step_seconds)
        loss = self.model(torch.randn(BATCH, self.width)).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.cpu_step_first:
            time.sleep(self.step_seconds)

    def state_tensors(self) -> list[torch.Tensor]:
        momentum = [state["momentum_buffer"] for state in self.optimizer.state.values()]
        return list(unwrap(self.model).state_dict().values()) + momentum

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def torch_save(self, directory: str) -> Checkpoint:
        with self.clock.phase("torch.save"):
            state = {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, os.path.join(directory, "state.pt"))
        return Checkpoint.from_directory(directory)

    def settle(self) -> None:
        """All ranks stop; rank 0 writes back dirty pages so the next method starts clean."""
        dist.barrier()
        if self.rank == 0:
            os.sync()
        dist.barrier()


class Saver:
    """One checkpointing method. ``save`` is exactly what the training loop blocks on."""

    def __init__(self, job: Job):
        self.job = job

    def step_completed(self) -> None:
        """A training step finished that is not a checkpoint step."""

    def save(self, index: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Finish outstanding work (not part of any stall)."""


class CopyFloor(Saver):
    def __init__(self, job: Job):
        super().__init__(job)
        self.sources = job.state_tensors()
        self.buffers = [torch.empty_like(t) for t in self.sources]

    def save(self, index: int) -> None:
        for buffer, source in zip(self.buffers, self.sources):
            buffer.copy_(source)


class TorchSaveSync(Saver):
    def save(self, index: int) -> None:
        directory = tempfile.mkdtemp(prefix="torch_save_sync_")
        checkpoint = self.job.torch_save(directory) if self.job.rank == 0 else None
        with self.job.clock.phase("report (SYNC upload)"):
            ray.train.report({"index": index}, checkpoint=checkpoint, checkpoint_dir_name=f"torch_sync_{index:03d}")
        with self.job.clock.phase("remove temp dir"):
            shutil.rmtree(directory)


class TorchSaveAsync(Saver):
    def save(self, index: int) -> None:
        checkpoint = None
        if self.job.rank == 0:
            checkpoint = self.job.torch_save(tempfile.mkdtemp(prefix="torch_save_async_"))
        with self.job.clock.phase("report (ASYNC)"):
            ray.train.report({"index": index}, checkpoint=checkpoint, checkpoint_dir_name=f"torch_async_{index:03d}",
                             checkpoint_upload_mode=CheckpointUploadMode.ASYNC)


class DcpSync(Saver):
    def save(self, index: int) -> None:
        clock = self.job.clock
        with clock.phase("get_state_dict"):
            model_state, optimizer_state = get_state_dict(self.job.model, self.job.optimizer)
        name = f"dcp_sync_{index:03d}"
        path = f"{self.job.experiment_path}/{name}"
        with clock.phase("dcp.save (own half, fsync)"):
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        with clock.phase("report (NO_UPLOAD)"):
            ray.train.report({"index": index}, checkpoint=Checkpoint(path), checkpoint_dir_name=name,
                             checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


class Resilient(Saver):
    def __init__(self, job: Job):
        super().__init__(job)
        self.ckpt = Checkpointer(job.model, job.optimizer, config=CheckpointConfig(
            interval_steps=job.steps_between, write_threads=job.write_threads))
        self.ckpt.restore()  # a fresh run: finds nothing; takes the run's lease

    def step_completed(self) -> None:
        self.ckpt.step_completed(0)

    def save(self, index: int) -> None:
        self.ckpt.step_completed(0, {"index": index})

    def close(self) -> None:
        self.ckpt.finish()
        self.ckpt.close()


SAVERS: dict[str, type[Saver]] = {
    FLOOR: CopyFloor, TORCH_SYNC: TorchSaveSync, TORCH_ASYNC: TorchSaveAsync, DCP_SYNC: DcpSync, RESILIENT: Resilient,
}


def measure_method(job: Job, method: str, checkpoints: int) -> dict[str, list]:
    """Train, saving every ``job.steps_between`` steps with ``method``: the stall of each save
    (and for ray_resilient each save's time to durable)."""
    saver = SAVERS[method](job)
    records = []
    for index in range(checkpoints):
        for _ in range(job.steps_between - 1):
            job.train_step()
            saver.step_completed()
        job.train_step()
        records.append(job.clock.measure(lambda: saver.save(index)))
    saver.close()
    measured: dict[str, list] = {"stalls": records}
    if isinstance(saver, Resilient):  # the phases of its stall, as the Checkpointer timed them
        saves = list(saver.ckpt.status.recent_saves)
        if len(saves) != len(records) or not all(save.ok for save in saves):
            raise RuntimeError(f"expected {len(records)} ray_resilient saves, all durable: {saves}")
        for record, save in zip(records, saves):
            record.update(save.stall_phases, **{LAST_STALL: save.stall_seconds})
        measured["durable"] = [save.durable_seconds for save in saves]
        measured["stage"] = [save.stage_seconds for save in saves]
    for _ in range(job.steps_between):  # let the last asynchronous save finish before the next method
        job.train_step()
    job.settle()
    return measured


def train_fn(config: dict[str, Any]) -> None:
    """Measure each method in turn; rank 0 writes the stalls to ``config['results']`` (JSON)."""
    job = Job(config["state_mb"], config["steps_between"], config["step_seconds"], config["cpu_step_first"],
              config["write_threads"])
    job.train_step()
    results: dict[str, Any] = {"state_bytes": job.state_bytes()}
    for method in config["methods"]:
        results[method] = measure_method(job, method, config["checkpoints"])
    if job.rank == 0:
        with open(config["results"], "w") as f:
            json.dump(results, f)


# --- driver ------------------------------------------------------------------------------


def run_trainer(workers: int, methods: tuple[str, ...], args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """One ``TorchTrainer.fit()`` measuring ``methods`` in turn: rank 0's measurements."""
    results = os.path.join(storage, f"results_{workers}w.json")
    config = {"state_mb": args.state_mb, "step_seconds": args.step_seconds, "checkpoints": args.checkpoints,
              "steps_between": args.steps_between, "cpu_step_first": args.cpu_step_first,
              "write_threads": args.write_threads, "methods": list(methods), "results": results}
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=storage, name=f"checkpoint_stall_{workers}w",
                             checkpoint_config=RayCheckpointConfig(num_to_keep=args.keep)),
    )
    trainer.fit()
    with open(results) as f:
        return json.load(f)


def median(records: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records if key in r)


def print_table(two: dict[str, Any], one: dict[str, Any], args: argparse.Namespace) -> None:
    d = median(two[RESILIENT]["stalls"], TOTAL)
    order = "real CPU step, then sleep" if args.cpu_step_first else "sleep, then real CPU step"
    print(f"\nTraining-loop stall per checkpoint, rank 0, median of {args.checkpoints} saves: "
          f"{two['state_bytes'] / 2**20:.1f} MiB of state (params + momentum), 2 workers, "
          f"{args.steps_between} steps ({order} {args.step_seconds:.2f}s) between saves")
    print(f"{'method':<18} {'stall_s':>8} {'x ray_resilient':>16}   phases (median s)")
    for method in METHODS:
        records = two[method]["stalls"]
        stall = median(records, TOTAL)
        names = dict.fromkeys(k for r in records for k in r if k not in (TOTAL, LAST_STALL))
        phases = ", ".join(f"{name} {median(records, name):.3f}" for name in names)
        print(f"{method:<18} {stall:8.3f} {stall / d:16.2f}   {phases}")
    print(f"ray_resilient's own last_stall_seconds: median {median(two[RESILIENT]['stalls'], LAST_STALL):.3f}")
    print("every stall, in order (s):")
    for method in METHODS:
        print(f"  {method:<18} {' '.join(f'{r[TOTAL]:.3f}' for r in two[method]['stalls'])}")
    print("\nTime to durable of ray_resilient's saves (SaveResult.durable_seconds, staging included):")
    for label, run in (("1 worker ", one), ("2 workers", two)):
        durable = run[RESILIENT]["durable"]
        print(f"  {label} median {statistics.median(durable):.3f}s (every save: "
              f"{' '.join(f'{t:.3f}' for t in durable)}; staging median {statistics.median(run[RESILIENT]['stage']):.3f}s)")


def summary_line(two: dict[str, Any], one: dict[str, Any]) -> str:
    def stall(method: str) -> float:
        return median(two[method]["stalls"], TOTAL)

    d = stall(RESILIENT)
    ratios = {
        "stall_vs_torch_save": stall(TORCH_SYNC) / d,
        "stall_vs_ray_async": stall(TORCH_ASYNC) / d,
        "stall_over_copy_floor": d / stall(FLOOR),
        "durable_2w_over_1w": statistics.median(two[RESILIENT]["durable"]) / statistics.median(one[RESILIENT]["durable"]),
    }
    return " ".join(f"{name}={value:.2f}" for name, value in ratios.items())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=float, default=256, help="params + momentum, MiB (default 256)")
    parser.add_argument("--checkpoints", type=int, default=7, help="saves per method (default 7)")
    parser.add_argument("--steps-between", type=int, default=3, help="training steps between saves (default 3)")
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="emulated accelerator compute per step, besides the real CPU step (default 1.0)")
    parser.add_argument("--cpu-step-first", action="store_true",
                        help="run each step's real CPU work before its emulated compute, so that a background "
                             "write overlaps the CPU DDP step (as in CPU-only training)")
    parser.add_argument("--keep", type=int, default=2, help="CheckpointConfig(num_to_keep) (default 2)")
    parser.add_argument("--write-threads", type=int, default=4, help="ray_resilient's write_threads (default 4)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    storage = tempfile.mkdtemp(prefix="checkpoint_stall_")
    start_local_ray(num_cpus=4)
    try:
        two = run_trainer(2, METHODS, args, storage)
        one = run_trainer(1, (RESILIENT,), args, storage)
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    print_table(two, one, args)
    print(summary_line(two, one))


if __name__ == "__main__":
    main()
