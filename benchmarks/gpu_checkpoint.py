"""Checkpoint stall on a GPU: ray_resilient against torch.save, Ray's uploads and the copy floor.

Setup
    One Ray ``TorchTrainer`` worker (``use_gpu=True`` when a GPU is there, otherwise on CPU, so
    the script cannot rot on machines without one), the recommended Ray configuration. The state
    is an MLP of square fp32 ``Linear`` layers plus Adam's two moments: ``--state-gib`` GiB on the
    device (default 4). A training step is ``--step-seconds`` of compute (matmuls on the GPU; a
    sleep on CPU), then a real forward/backward/``optimizer.step()`` on a small batch.

Methods (each saves ``--saves`` times, one save every ``--steps-between`` steps)
    copy_floor         every state tensor ``copy_``-ed into preallocated pinned host buffers
                       (non-blocking, one synchronize): the least a consistent snapshot can stall.
    torch_save+SYNC    ``torch.save`` of model+optimizer state into a temp dir, then
                       ``ray.train.report(checkpoint=...)`` with Ray's default SYNC upload.
    torch_save+ASYNC   the same ``torch.save``, reported with ``CheckpointUploadMode.ASYNC``.
    ray_resilient      ``Checkpointer.step_completed`` on the save step, at an interval
                       longer than a save's time to durable (steady state), then at one
                       shorter (saves overlap writes; a save due while both staging buffer
                       sets are written is deferred, not waited for).

Then a second ``fit()`` with the same run name restores the newest checkpoint and compares the
model and optimizer state with the first run's final state, bitwise.

Reported: each method's median stall, ray_resilient's time to durable and write bandwidth (state
bytes over the time from staged to durable), and its stall and deferred saves at both intervals.
The last line::

    gpu_stall_over_floor=<ray_resilient steady stall / floor> gpu_stall_vs_torch_save=<torch.save+SYNC / ray_resilient> gpu_durable_seconds=<median> gpu_resume_bitwise=<True|False>

Run: ``python benchmarks/gpu_checkpoint.py`` on a GPU machine; ``--state-gib 0.25`` on CPU.
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
from typing import Any

import ray
import ray.train
import torch
from ray.train import Checkpoint, CheckpointUploadMode
from ray.train.torch import TorchTrainer, get_device
from torch.distributed.checkpoint.state_dict import get_state_dict

from ray_resilient import CheckpointConfig, Checkpointer, recommended_ray_config
from ray_resilient.testing.kit import start_local_ray

LAYERS = 8
BATCH = 8
FLOOR, TORCH_SYNC, TORCH_ASYNC, LONG, SHORT = (
    "copy_floor", "torch_save+SYNC", "torch_save+ASYNC", "ray_resilient", "ray_resilient (short interval)")


class Job:
    """Model, Adam and the emulated step of the one worker."""

    def __init__(self, state_gib: float, step_seconds: float):
        self.device = get_device()
        params = state_gib * 2**30 / 12  # fp32 parameters + Adam's exp_avg and exp_avg_sq
        width = max(8, round(math.sqrt(params / LAYERS)))
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)]
        self.model = torch.nn.Sequential(*layers).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-6)
        self.width, self.step_seconds = width, step_seconds
        self.cuda = self.device.type == "cuda"
        self.work = torch.randn(4096, 4096, device=self.device) if self.cuda else None

    def step(self) -> None:
        if self.cuda:  # real GPU compute for step_seconds
            started = time.monotonic()
            while time.monotonic() - started < self.step_seconds:
                for _ in range(20):
                    self.work = torch.tanh(self.work @ self.work)
                torch.cuda.synchronize()
        else:
            time.sleep(self.step_seconds)
        loss = self.model(torch.randn(BATCH, self.width, device=self.device)).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.model.state_dict().values()] + [
            v for state in self.optimizer.state.values() for v in state.values() if v.dim() > 0]

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def timed(job: Job, fn) -> float:
    started = time.monotonic()
    fn()
    job.sync()
    return time.monotonic() - started


def floor_stalls(job: Job, saves: int, steps_between: int) -> list[float]:
    sources = job.tensors()
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=job.cuda) for t in sources]

    def copy() -> None:
        for buffer, source in zip(buffers, sources):
            buffer.copy_(source, non_blocking=job.cuda)

    stalls = []
    for _ in range(saves):
        for _ in range(steps_between):
            job.step()
        stalls.append(timed(job, copy))
    return stalls


def torch_save_stalls(job: Job, saves: int, steps_between: int, mode: CheckpointUploadMode, tag: str) -> list[float]:
    def save(index: int) -> None:
        directory = tempfile.mkdtemp(prefix=f"{tag}_")
        torch.save({"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict()},
                   os.path.join(directory, "state.pt"))
        ray.train.report({"index": index}, checkpoint=Checkpoint.from_directory(directory),
                         checkpoint_dir_name=f"{tag}_{index:03d}", checkpoint_upload_mode=mode)
        if mode == CheckpointUploadMode.SYNC:
            shutil.rmtree(directory)

    stalls = []
    for index in range(saves):
        for _ in range(steps_between):
            job.step()
        stalls.append(timed(job, lambda: save(index)))
    return stalls


def resilient_phase(job: Job, saves: int, steps_between: int, write_threads: int) -> dict[str, Any]:
    """Train until ``saves`` saves started at an interval of ``steps_between`` steps (a Checkpointer
    of its own, resuming the run): the stall of each step that started one, the saves deferred, and
    every save made durable meanwhile."""
    config = CheckpointConfig(interval_steps=steps_between, goodput_logger=None, write_threads=write_threads)
    stalls: list[float] = []
    durable: dict[int, tuple[float, float]] = {}
    with Checkpointer(job.model, job.optimizer, config=config) as ckpt:
        ckpt.restore()  # the previous phase's final checkpoint (the first: finds nothing, takes the run's lease)
        while ckpt.status.saves_started < saves:
            job.step()
            started = ckpt.status.saves_started
            stall = timed(job, lambda: ckpt.step_completed(0))
            status = ckpt.status
            if status.saves_started > started:
                stalls.append(stall)
            if status.last_save is not None:
                durable[status.last_save.step] = (status.last_save.stage_seconds, status.last_save.durable_seconds)
        deferred = ckpt.status.deferred
        ckpt.finish()
        step = ckpt.status.step
    return {"stalls": stalls, "deferred": deferred, "durable": durable, "steps_between": steps_between,
            "step": step}


def measure_fn(config: dict[str, Any]) -> None:
    job = Job(config["state_gib"], config["step_seconds"])
    job.step()  # creates Adam's state
    saves, between = config["saves"], config["steps_between"]
    results: dict[str, Any] = {"state_bytes": job.state_bytes(), "device": str(job.device)}
    results[FLOOR] = floor_stalls(job, saves, between)
    results[TORCH_SYNC] = torch_save_stalls(job, saves, between, CheckpointUploadMode.SYNC, "torch_sync")
    results[TORCH_ASYNC] = torch_save_stalls(job, saves, between, CheckpointUploadMode.ASYNC, "torch_async")
    step_seconds = config["step_seconds"]
    threads = config["write_threads"]
    # The given interval first; if a save took longer than it to become durable, again at 1.5 times
    # the time to durable (steady state); then at half of it. Each phase ends with its final save.
    probe = resilient_phase(job, saves + 1, between, threads)
    durable = statistics.median(d for _, d in probe["durable"].values())
    longer = max(between, math.ceil(1.5 * durable / step_seconds))
    results[LONG] = probe if longer == between else resilient_phase(job, saves, longer, threads)
    results[SHORT] = resilient_phase(job, 2 * saves, max(1, math.floor(0.5 * durable / step_seconds)), threads)
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    torch.save({"model": model_sd, "optimizer": optim_sd, "step": results[SHORT]["step"]}, config["final"])
    with open(config["results"], "w") as f:
        json.dump(results, f, default=str)


def resume_fn(config: dict[str, Any]) -> None:
    job = Job(config["state_gib"], config["step_seconds"])
    with Checkpointer(job.model, job.optimizer, config=CheckpointConfig(goodput_logger=None)) as ckpt:
        state = ckpt.restore()
        final = torch.load(config["final"], map_location=job.device)
        model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
        same = state.step == final["step"] and equal(model_sd, final["model"]) and equal(optim_sd, final["optimizer"])
    with open(config["resume"], "w") as f:
        json.dump({"bitwise": same, "step": state.step}, f)


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b.to(a.device))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def fit(fn, config: dict[str, Any], storage: str, use_gpu: bool) -> None:
    ray_config = recommended_ray_config("gpu_checkpoint", storage, workers=1, use_gpu=use_gpu, max_failures=0,
                                        num_to_keep=2, spare_workers=False)
    result = TorchTrainer(fn, train_loop_config=config, **ray_config.trainer_kwargs()).fit()
    if result.error is not None:
        raise result.error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gib", type=float, default=4.0, help="model + Adam state in GiB (default 4)")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="compute per step (default 1.0)")
    parser.add_argument("--steps-between", type=int, default=3, help="steps between saves (default 3)")
    parser.add_argument("--saves", type=int, default=4, help="saves per method (default 4)")
    parser.add_argument("--write-threads", type=int, default=4, help="ray_resilient's write_threads (default 4)")
    parser.add_argument("--storage", default=None, help="run storage (default: a temporary directory)")
    args = parser.parse_args()
    use_gpu = torch.cuda.is_available()
    storage = args.storage or tempfile.mkdtemp(prefix="gpu_checkpoint_")
    files = {name: os.path.join(storage, f"{name}.json") for name in ("results", "resume")}
    config = {**vars(args), **files, "final": os.path.join(storage, "final_state.pt")}
    start_local_ray(log_to_driver=False)
    try:
        fit(measure_fn, config, storage, use_gpu)
        fit(resume_fn, config, storage, use_gpu)
    finally:
        ray.shutdown()
    with open(files["results"]) as f:
        results = json.load(f)
    with open(files["resume"]) as f:
        resume = json.load(f)
    print_report(results, resume, args)


def print_report(results: dict[str, Any], resume: dict[str, Any], args: argparse.Namespace) -> None:
    gib = results["state_bytes"] / 2**30
    median = {m: statistics.median(results[m] if isinstance(results[m], list) else results[m]["stalls"])
              for m in (FLOOR, TORCH_SYNC, TORCH_ASYNC, LONG, SHORT)}
    print(f"\n{gib:.2f} GiB of model + Adam state on {results['device']}, a save every {args.steps_between} steps of "
          f"{args.step_seconds:.2f} s, median stall over {args.saves} saves")
    print(f"{'method':<32} {'stall_s':>8} {'x ray_resilient':>16}")
    for method, stall in median.items():
        print(f"{method:<32} {stall:8.3f} {stall / median[LONG]:16.2f}")
    durable = [d for _, d in results[LONG]["durable"].values()]
    written = [d - s for s, d in results[LONG]["durable"].values()]
    print(f"ray_resilient time to durable: median {statistics.median(durable):.3f} s; write bandwidth per rank "
          f"{results['state_bytes'] / statistics.median(written) / 1e9:.2f} GB/s (state bytes / staged-to-durable)")
    for method in (LONG, SHORT):
        phase = results[method]
        print(f"{method}: a save due every {phase['steps_between']} steps ({phase['steps_between'] * args.step_seconds:.2f} s"
              f" against {statistics.median(durable):.2f} s to durable): stall {median[method]:.3f} s, "
              f"{phase['deferred']} of {len(phase['stalls'])} saves deferred")
    print(f"resume: step {resume['step']}, bitwise {resume['bitwise']}")
    print(f"gpu_stall_over_floor={median[LONG] / median[FLOOR]:.2f} "
          f"gpu_stall_vs_torch_save={median[TORCH_SYNC] / median[LONG]:.2f} "
          f"gpu_durable_seconds={statistics.median(durable):.3f} gpu_resume_bitwise={resume['bitwise']}")


if __name__ == "__main__":
    main()
