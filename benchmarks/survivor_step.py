"""Survivor mode's step against DDP's, no failures: step time and bytes each replica sends.

Setup
    One local Ray instance; for each model and replica count, two runs of the same steps of the
    same global batch, one after the other:

    ddp        ``TorchTrainer`` with Ray's default ``TorchConfig`` (gloo), the model in
               ``DistributedDataParallel`` (default buckets); rank r trains rows
               ``[r B / n, (r + 1) B / n)`` of each global batch of ``B``.
    survivors  ``TorchTrainer(torch_config=SurvivorConfig())``, the model in ``SurvivingReplicas``
               with ``n`` micro-batches (one per replica; micro-batch k is the same rows as DDP's
               rank k), no checkpoints during the run.

    Models (``--models``):
    wide       an MLP of 4 layers 1024 wide (5.3 M parameters, 21 MB of gradient) on a global batch
               of 32 images of 32x32: a step dominated by moving and adding gradients
               (communication and memory traffic).
    conv       a 4-layer CNN of 62 K parameters on 64 images of 32x32 a step: a step dominated by
               compute.

    At 2 and at 4 replicas (``--replicas``): processes on this machine's cores, so at 4 on 2
    cores every step also waits for a core.

Measurement
    step      the median, over the steps after ``--warmup``, of each step's wall time on rank 0
              (DDP: forward, backward with its all-reduce, optimizer step; survivor mode:
              ``train_step``, its exchange included).
    bytes     per replica and step: survivor mode counts what its exchange sends
              (``SurvivingReplicas.sent_bytes``); DDP's ring all-reduce sends
              ``2 (n - 1) / n`` times the gradient's bytes.
    Ratios are survivor mode over DDP, per model and replica count.

The last line (the ``wide`` model, where the exchange's cost shows)::

    step_vs_ddp_2=<ratio> step_vs_ddp_4=<ratio> bytes_vs_ddp_4=<ratio>

Results: ``docs/benchmarks.md``. Run: ``python benchmarks/survivor_step.py`` (about 5 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

from ray_resilient import CheckpointConfig
from ray_resilient.survivors import SurvivingReplicas, SurvivorConfig
from ray_resilient.testing.kit import experiment_dir, start_local_ray

MODELS = {"wide": 32, "conv": 64}  # model -> global batch


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "wide":
        layers: list[torch.nn.Module] = [torch.nn.Flatten()]
        for width_in in (3 * 32 * 32, 1024, 1024):
            layers += [torch.nn.Linear(width_in, 1024), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 10, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


def batch(step: int, rows: slice, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of global batch ``step``: the same samples whichever mode trains them."""
    generator = torch.Generator().manual_seed(step)
    images = torch.randn(global_batch, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (global_batch,), generator=generator)
    return images[rows], labels[rows]


def train_ddp(config: dict[str, Any]) -> None:
    context = ray.train.get_context()
    rank, world, global_batch = context.get_world_rank(), context.get_world_size(), config["global_batch"]
    model = prepare_model(build(config["model"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    size = global_batch // world
    times = []
    for step in range(config["steps"]):
        images, labels = batch(step, slice(rank * size, (rank + 1) * size), global_batch)
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as empty:  # Result.metrics are those reported with a checkpoint
        ray.train.report({"step_seconds": statistics.median(times[config["warmup"]:]),
                          "sent_bytes": 2 * (world - 1) / world * gradient_bytes},
                         checkpoint=ray.train.Checkpoint.from_directory(empty) if rank == 0 else None)


def train_survivors(config: dict[str, Any]) -> None:
    world, global_batch = ray.train.get_context().get_world_size(), config["global_batch"]
    model = build(config["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    size = global_batch // world

    def loss_of(step: int, part: int) -> torch.Tensor:
        images, labels = batch(step, slice(part * size, (part + 1) * size), global_batch)
        return torch.nn.functional.cross_entropy(model(images), labels)

    times = []
    checkpoints = CheckpointConfig(interval_steps=None, goodput_logger=None)  # the final save alone
    with SurvivingReplicas(model, optimizer, micro_batches=world, config=checkpoints) as replicas:
        while replicas.step < config["steps"]:
            started = time.perf_counter()
            replicas.train_step(loss_of)
            times.append(time.perf_counter() - started)
        replicas.result_metrics = {"step_seconds": statistics.median(times[config["warmup"]:]),
                                   "sent_bytes": replicas.sent_bytes / len(times)}


def measure(mode: str, model: str, replicas: int, args: argparse.Namespace, storage: str) -> dict[str, float]:
    config = {"model": model, "global_batch": MODELS[model], "steps": args.steps, "warmup": args.warmup}
    survivors = mode == "survivors"
    trainer = TorchTrainer(train_survivors if survivors else train_ddp, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=replicas),
                           run_config=RunConfig(name=f"{mode}-{model}-{replicas}", storage_path=storage),
                           **({"torch_config": SurvivorConfig()} if survivors else {}))
    return trainer.fit().metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    ratios: dict[tuple[str, int], tuple[float, float]] = {}
    with experiment_dir("survivor-step-") as root:
        start_local_ray(num_cpus=max(args.replicas))
        try:
            for model in args.models:
                for replicas in args.replicas:
                    ddp, survivors = (measure(mode, model, replicas, args, str(root)) for mode in ("ddp", "survivors"))
                    ratios[model, replicas] = (survivors["step_seconds"] / ddp["step_seconds"],
                                               survivors["sent_bytes"] / ddp["sent_bytes"])
                    print(f"{model} x{replicas}: step ddp {ddp['step_seconds'] * 1000:.1f} ms, survivors "
                          f"{survivors['step_seconds'] * 1000:.1f} ms ({ratios[model, replicas][0]:.2f}x); "
                          f"bytes/replica/step ddp {ddp['sent_bytes'] / 1e6:.2f} MB, survivors "
                          f"{survivors['sent_bytes'] / 1e6:.2f} MB ({ratios[model, replicas][1]:.2f}x)", flush=True)
        finally:
            ray.shutdown()
    wide = {replicas: ratios.get(("wide", replicas), (float("nan"),) * 2) for replicas in (2, 4)}
    print(f"step_vs_ddp_2={wide[2][0]:.3f} step_vs_ddp_4={wide[4][0]:.3f} bytes_vs_ddp_4={wide[4][1]:.3f}")


if __name__ == "__main__":
    main()
