"""A small DDP classification job on Ray Train that checkpoints with ray_resilient and survives worker kills.

Runs on CPU workers (gloo) on a local Ray cluster by default, or on the cluster in
``RAY_ADDRESS`` (e.g. under ``ray job submit``). Try a kill::

    python jobs/train_ddp.py --faults "kill:step=30:rank=1"

The job restarts the worker group (``FailureConfig``), resumes from the newest complete
checkpoint, and finishes with exactly the weights an uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model

from ray_resilient import CheckpointConfig, Checkpointer, connect_ray, recommended_ray_config
from ray_resilient.testing import CLASSES, FEATURES, SyntheticBatches

def train_fn(config: dict[str, Any]) -> None:
    """The train function: restore, train with periodic async checkpoints, final checkpoint."""
    torch.use_deterministic_algorithms(True)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"])
    model = prepare_model(torch.nn.Sequential(
        torch.nn.Linear(FEATURES, config["hidden"]), torch.nn.ReLU(), torch.nn.Linear(config["hidden"], CLASSES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["epochs"])
    data = SyntheticBatches(config["samples"], config["global_batch"], config["seed"], rank, world)

    checkpoints = CheckpointConfig(interval_steps=config["interval"], seed=config["seed"], faults=config["faults"])
    with Checkpointer(model, optimizer, lr_scheduler=scheduler, data=data, config=checkpoints) as ckpt:
        state = ckpt.restore()
        if rank == 0:
            print(f"[rank 0] {world} workers, starting at step {state.step} (epoch {state.epoch})", flush=True)
        metrics: dict[str, float] = {}
        for epoch in range(state.epoch, config["epochs"]):
            correct = seen = 0
            started = time.monotonic()
            for _ids, x, y in data:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
                metrics = {"loss": loss.item(), "train_accuracy": correct / seen}
                ckpt.step_completed(epoch, metrics)
            scheduler.step()
            if rank == 0 and seen:
                print(f"[rank 0] epoch {epoch}: step {ckpt.status.step}, loss {metrics['loss']:.4f}, "
                      f"accuracy {metrics['train_accuracy']:.3f}, {seen * world / (time.monotonic() - started):.0f} "
                      f"samples/s, last checkpoint stall {ckpt.status.last_stall_seconds * 1000:.1f} ms", flush=True)
        ckpt.finish(metrics)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument("--storage-path", default=os.path.abspath("runs"),
                        help="run storage: a local path, a shared mount or s3://bucket/prefix (default: ./runs)")
    parser.add_argument("--name", default="train_ddp", help="run name; re-running it resumes the run (default: train_ddp)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs (default: 8)")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic samples (default: 4096)")
    parser.add_argument("--global-batch", type=int, default=64, help="global batch size (default: 64)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden units (default: 256)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--max-failures", type=int, default=3, help="worker-group restarts allowed (default: 3)")
    parser.add_argument("--num-to-keep", type=int, default=3, help="complete checkpoints kept (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and order (default: 0)")
    parser.add_argument("--ray-address", default=None,
                        help='Ray cluster to use: "local" starts a new one (default: RAY_ADDRESS, else local)')
    parser.add_argument("--faults", default="",
                        help='fault plan, e.g. "kill:step=30:rank=1" (see ray_resilient.faults; default: none)')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    connect_ray(args.ray_address)
    ray_config = recommended_ray_config(args.name, args.storage_path, workers=args.workers,
                                        max_failures=args.max_failures, num_to_keep=args.num_to_keep)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={key: getattr(args, key) for key in (
            "epochs", "samples", "global_batch", "hidden", "lr", "interval", "seed", "faults")},
        **ray_config.trainer_kwargs(),
    )
    result = ray_config.fit(trainer)
    metrics = result.metrics or {}
    print(f"\nDone: step {metrics.get('step')}, loss {metrics.get('loss', float('nan')):.4f}, "
          f"train accuracy {metrics.get('train_accuracy', float('nan')):.3f}")
    print(f"Final checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    print(f"Failed checkpoint saves: {metrics.get('checkpoint_failed_saves')}")


if __name__ == "__main__":
    main()
