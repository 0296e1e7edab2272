"""Image classification from JPEG files on a volume, trained on Ray Train with everything ray_resilient offers.

Async sharded checkpoints reported to Ray, automatic resume (from the newest complete checkpoint,
data position and RNG included), elastic workers, a streaming and caching volume dataset, MLflow
metrics (loss, accuracy, fetch_seconds, goodput), a validation pass per epoch, and the final model
exported in a form plain PyTorch loads. With --survivors, survivor mode: a lost worker costs the
others about a step (``ray_resilient.survivors``), the same model, data, checkpoints and reports.

    python jobs/train_images.py                          # the embedded default, on a local Ray
    python jobs/train_images.py --survivors              # the same in survivor mode
    ray job submit --working-dir . -- python jobs/train_images.py \\
        --volume s3://bucket/shapes --storage-path s3://bucket/runs --min-workers 2 --max-workers 8

Without --volume it generates a small, learnable dataset (coloured shapes in the ImageFolder
layout, ``train/`` and ``val/``) into ./data/shapes and trains on CPU in a few minutes. A volume
given with --volume must have ``train/<class>/*.jpg`` and ``val/<class>/*.jpg``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.train
import torch
import torchvision
from ray.train.torch import TorchTrainer, get_device, prepare_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from ray_resilient import CheckpointConfig, Checkpointer, connect_ray, recommended_ray_config
from ray_resilient.data import (
    StreamingConfig,
    Volume,
    VolumeDataLoader,
    VolumeImageDataset,
    default_transform,
    eval_transform,
)
from ray_resilient.goodput import parse_duration
from ray_resilient.storage import RunStorage
from ray_resilient.survivors import SurvivingReplicas
from ray_resilient.tracking import (BackgroundMetrics, MlflowMetrics, current_run_name, default_tracking_uri,
                                    log_artifact)

MODEL_FILE = "final_model.pt"


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    """A torchvision classification model (e.g. resnet18, mobilenet_v3_small) with ``num_classes`` outputs."""
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def parallelize(model: torch.nn.Module, parallelism: str) -> torch.nn.Module:
    """``"ddp"``: Ray's ``prepare_model`` (DistributedDataParallel). ``"fsdp"``: FSDP2, each
    top-level child with parameters (a ResNet's stem, stages and head) and the root ``fully_shard``-ed."""
    if parallelism == "ddp":
        return prepare_model(model)
    model.to(get_device())
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def evaluate(model: torch.nn.Module, volume: Volume, image_size: int, batch: int,
             progress: Callable[[str], None]) -> float:
    """Top-1 accuracy over every image of ``volume`` (on rank 0 alone with DDP, on every rank with
    FSDP2, on the lead replica in survivor mode), calling ``progress`` at every batch (a
    ``Checkpointer``'s: its hang watchdog then knows this rank is getting on)."""
    dataset = VolumeImageDataset(volume, global_batch=batch, drop_last=False, seed=0,
                                 transform=eval_transform(image_size))
    loader = VolumeDataLoader(dataset, num_workers=0, metrics_logger=None)
    correct, seen = 0, set()
    model.eval()
    with torch.no_grad():
        for item in loader:
            progress("validation")
            predicted = model(item.images.to(get_device())).argmax(1).cpu()
            for sample, right in zip(item.sample_ids.tolist(), (predicted == item.labels).tolist()):
                if sample not in seen:  # the last batch is padded with repeats
                    seen.add(sample)
                    correct += right
    model.train()
    return correct / len(seen)


def export_model(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> str:
    """Write the trained weights and what is needed to rebuild the model next to the run's checkpoints."""
    storage = RunStorage.from_ray_context()
    path = f"{storage.experiment_path}/{MODEL_FILE}"
    buffer = io.BytesIO()
    torch.save({"model": config["model"], "classes": config["class_names"], "image_size": config["image_size"],
                "state_dict": state_dict}, buffer)
    with storage.filesystem.open_output_stream(path) as out:
        out.write(buffer.getvalue())
    with tempfile.TemporaryDirectory() as local:  # and as an MLflow artifact of the run
        with open(os.path.join(local, MODEL_FILE), "wb") as out:
            out.write(buffer.getvalue())
        log_artifact(current_run_name(), os.path.join(local, MODEL_FILE))
    return path


def train_loader(config: dict[str, Any]) -> VolumeDataLoader:
    """This worker's loader of the training split (its rank's share, or in survivor mode its micro-batches)."""
    context = ray.train.get_context()
    dataset = VolumeImageDataset(Volume(f"{config['volume']}/train"), global_batch=config["global_batch"],
                                 rank=context.get_world_rank(), world_size=context.get_world_size(),
                                 seed=config["seed"], transform=default_transform(config["image_size"]),
                                 streaming=StreamingConfig(config["cache_dir"], config["cache_limit"]))
    return VolumeDataLoader(dataset, num_workers=config["loader_workers"], log_every=config["log_every"])


def optimizer_and_schedule(model: torch.nn.Module, config: dict[str, Any], total_steps: int) -> tuple[Any, Any]:
    """SGD with momentum and weight decay, on a one-cycle schedule over ``total_steps``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9, weight_decay=5e-4)
    return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config["lr"], total_steps=total_steps)


def checkpoint_config(config: dict[str, Any]) -> CheckpointConfig:
    """The job's checkpoints, in either mode."""
    return CheckpointConfig(interval_steps=config["interval"], mtbf_s=config["mtbf_s"], seed=config["seed"],
                            faults=config["faults"], goodput_log_every=config["log_every"])


def job_metrics() -> BackgroundMetrics:
    """The job's MLflow metrics, from a background thread: an MLflow outage never blocks or fails the
    loop (ray_resilient.tracking)."""
    run_name = current_run_name()
    return BackgroundMetrics(lambda: MlflowMetrics(run_name), "job")


def train_fn(config: dict[str, Any]) -> None:
    if config["survivors"]:
        train_survivors(config)
        return
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    val_volume = Volume(f"{config['volume']}/val")
    loader = train_loader(config)
    dataset = loader.volume_dataset
    torch.manual_seed(config["seed"])
    model = parallelize(build_model(config["model"], len(config["class_names"])), config["parallelism"])
    device = get_device()
    total_steps = config["epochs"] * dataset.batches_per_epoch(0)
    optimizer, scheduler = optimizer_and_schedule(model, config, total_steps)
    metrics_log = job_metrics() if rank == 0 else None
    metrics: dict[str, float] = {}
    with Checkpointer(model, optimizer, lr_scheduler=scheduler, data=loader, config=checkpoint_config(config)) as ckpt:
        state = ckpt.restore()
        restarts = ckpt.status.restarts
        if rank == 0:
            print(f"[attempt {restarts + 1}] {world} workers (per rank: torch threads {torch.get_num_threads()}, "
                  f"loader workers {loader.num_workers}), starting at step {state.step} of {total_steps} "
                  f"(epoch {state.epoch}); restarts so far: {restarts}", flush=True)
        while loader.epoch < config["epochs"]:
            epoch, started, seen, correct = loader.epoch, time.monotonic(), 0, 0
            for batch in loader:
                images, labels = batch.images.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
                logits = model(images)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                seen += len(labels)
                correct += int((logits.argmax(1) == labels).sum())
                metrics = {"loss": loss.item(), "train_accuracy": correct / seen}
                ckpt.step_completed(loader.epoch, metrics)
                step = ckpt.train_state.step
                if metrics_log is not None and step % config["log_every"] == 0:
                    throughput = seen * world / (time.monotonic() - started)
                    metrics_log({**metrics, "samples_per_second": throughput}, step)
                    print(f"step {step}/{total_steps} epoch {epoch} | {throughput:.0f} samples/s | loss "
                          f"{metrics['loss']:.3f} | train acc {metrics['train_accuracy']:.3f} | checkpoints "
                          f"committed {ckpt.status.committed} | failed saves {ckpt.status.failed} | "
                          f"restarts {restarts}", flush=True)
            if seen and (rank == 0 or config["parallelism"] == "fsdp"):  # FSDP2: every rank takes part
                metrics["val_accuracy"] = evaluate(model.module if hasattr(model, "module") else model, val_volume,
                                                   config["image_size"], config["global_batch"], ckpt.progress)
                if metrics_log is not None:
                    metrics_log({"val_accuracy": metrics["val_accuracy"]}, ckpt.train_state.step)
                    print(f"epoch {epoch} done: val accuracy {metrics['val_accuracy']:.3f}", flush=True)
        ckpt.finish(metrics)
    if metrics_log is not None:
        metrics_log.flush(timeout=10)
    # The whole model on rank 0 (FSDP2 gathers its shards: every rank calls this).
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        print(f"exported the final model to {export_model(weights, config)}", flush=True)


def train_survivors(config: dict[str, Any]) -> None:
    """Survivor mode: every worker a whole replica (not wrapped in DDP), each global batch cut into
    ``micro_batches`` read from the volume by whichever replicas the membership gives them; the
    lead saves the checkpoints, validates after each epoch and exports the final model."""
    context = ray.train.get_context()
    world = context.get_world_size()
    val_volume = Volume(f"{config['volume']}/val")
    loader = train_loader(config)
    torch.manual_seed(config["seed"])
    device = get_device()
    model = build_model(config["model"], len(config["class_names"])).to(device)
    per_epoch = loader.volume_dataset.batches_per_epoch(0)
    total_steps = config["epochs"] * per_epoch
    optimizer, scheduler = optimizer_and_schedule(model, config, total_steps)
    metrics_log = job_metrics()

    def loss_of(step: int, part: int) -> torch.Tensor:
        batch = loader.micro_batch(step, part)
        logits = model(batch.images.to(device, non_blocking=True))
        return torch.nn.functional.cross_entropy(logits, batch.labels.to(device, non_blocking=True))

    with SurvivingReplicas(model, optimizer, lr_scheduler=scheduler, data=loader, micro_batches=config["micro_batches"],
                           config=checkpoint_config(config)) as replicas:
        if replicas.is_lead:
            print(f"[survivors] {replicas.world_size} of {world} replicas, {config['micro_batches']} micro-batches a "
                  f"step, starting at step {replicas.step} of {total_steps}", flush=True)
        started, first = time.monotonic(), replicas.step
        while replicas.step < total_steps:
            loss = replicas.train_step(loss_of)
            step = replicas.step
            replicas.result_metrics["loss"] = loss
            if replicas.is_lead and step % config["log_every"] == 0:
                throughput = (step - first) * config["global_batch"] / (time.monotonic() - started)
                metrics_log({"loss": loss, "samples_per_second": throughput}, step)
                print(f"step {step}/{total_steps} epoch {(step - 1) // per_epoch} | {throughput:.0f} samples/s | "
                      f"loss {loss:.3f} | replicas {replicas.world_size}", flush=True)
            if replicas.is_lead and step % per_epoch == 0:
                accuracy = evaluate(model, val_volume, config["image_size"], config["global_batch"], lambda _: None)
                replicas.result_metrics["val_accuracy"] = accuracy
                metrics_log({"val_accuracy": accuracy}, step)
                print(f"epoch {step // per_epoch - 1} done: val accuracy {accuracy:.3f}", flush=True)
        lead = replicas.is_lead
    metrics_log.flush(timeout=10)
    if lead:
        weights = {key: value.detach().cpu() for key, value in model.state_dict().items()}
        print(f"exported the final model to {export_model(weights, config)}", flush=True)


def generate_default_volume(root: str, per_class: int, classes: int, image_size: int, seed: int) -> str:
    """The embedded default dataset under ``root`` (train/ and val/), generated once."""
    from ray_resilient.testing import make_image_volume

    fs = pafs.LocalFileSystem()
    for split, count, split_seed in (("train", per_class, seed), ("val", max(per_class // 4, 10), seed + 1)):
        done = f"{root}/{split}/.complete"
        if os.path.exists(done):
            continue
        print(f"Generating the {split} split of the default dataset in {root}/{split}", file=sys.stderr)
        make_image_volume(fs, f"{root}/{split}", classes=classes, per_class=count, size=image_size, seed=split_seed,
                          progress=True)
        open(done, "w").close()
    return root


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--volume", help="dataset root with train/ and val/ in ImageFolder layout: a path, a mount "
                                       "or s3://bucket/prefix (default: generate ./data/shapes)")
    data.add_argument("--per-class", type=int, default=300, help="generated train images per class (default: 300)")
    data.add_argument("--classes", type=int, default=4, help="generated classes (default: 4)")
    data.add_argument("--image-size", type=int, default=32, help="training image side in pixels (default: 32)")
    data.add_argument("--cache-dir", default=None,
                      help="node-local cache of the volume's files (default: $TMPDIR/ray-resilient/cache/...)")
    data.add_argument("--cache-limit", type=int, default=None, help="cache bound in bytes (default: unbounded)")
    data.add_argument("--loader-workers", type=int, default=None,
                      help="DataLoader worker processes per rank (default: from the CPU count)")
    run = parser.add_argument_group("run")
    run.add_argument("--storage-path", default=os.path.abspath("runs"),
                     help="where checkpoints, the goodput ledger and the model go: a path, a shared mount or "
                          "s3://bucket/prefix (default: ./runs)")
    run.add_argument("--name", default="train_images", help="run name; running again resumes it (default: train_images)")
    run.add_argument("--min-workers", type=int, default=1, help="fewest Ray Train workers to run on (default: 1)")
    run.add_argument("--max-workers", type=int, default=2, help="most Ray Train workers (default: 2)")
    run.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    run.add_argument("--parallelism", choices=("ddp", "fsdp"), default="ddp",
                     help="ddp: replicated model (DistributedDataParallel); fsdp: sharded model and optimizer "
                          "(FSDP2 fully_shard), each rank checkpoints only its shards (default: ddp)")
    run.add_argument("--survivors", action="store_true",
                     help="survivor mode: a lost worker costs the others about a step, not a restart; "
                          "--max-workers replicas (DDP-style, no elastic sizes yet)")
    run.add_argument("--micro-batches", type=int, default=None,
                     help="survivor mode: micro-batches per global batch (default: --max-workers)")
    run.add_argument("--max-failures", type=int, default=3, help="worker-group restarts allowed (default: 3)")
    run.add_argument("--interval", default="20",
                     help='checkpoint every N steps, or "auto" for the optimum given --mtbf (default: 20)')
    run.add_argument("--mtbf", default="1h", help='the job\'s mean time between failures, for --interval auto '
                                                  '(e.g. 30m, 6h; default: 1h)')
    run.add_argument("--num-to-keep", type=int, default=3, help="complete checkpoints kept (default: 3)")
    run.add_argument("--ray-address", default=None,
                     help='Ray cluster: "local" starts a new one (default: RAY_ADDRESS, else a new local one)')
    run.add_argument("--tracking-uri", default=None,
                     help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ~/.ray_resilient/mlflow.db)")
    run.add_argument("--faults", default="",
                     help='fault plan for demos, e.g. "kill:step=30:rank=1" (see ray_resilient.faults; default: none)')
    run.add_argument("--verbose", action="store_true",
                     help="echo all of Ray's output (a line per report, the controller's error blocks), not only "
                          "the run's story (default: off; Ray's log files keep it all)")
    train = parser.add_argument_group("training")
    train.add_argument("--model", default="resnet18", help="torchvision model name (default: resnet18)")
    train.add_argument("--epochs", type=int, default=5, help="epochs (default: 5)")
    train.add_argument("--global-batch", type=int, default=64, help="global batch size (default: 64)")
    train.add_argument("--lr", type=float, default=0.02, help="peak learning rate, one-cycle (default: 0.02)")
    train.add_argument("--seed", type=int, default=0, help="seed of the order, augmentation and init (default: 0)")
    train.add_argument("--log-every", type=int, default=5, help="steps between progress lines (default: 5)")
    args = parser.parse_args(argv)
    if args.interval != "auto" and not args.interval.isdigit():
        parser.error(f'--interval must be a number of steps or "auto", got {args.interval!r}')
    if not 1 <= args.min_workers <= args.max_workers:
        parser.error(f"need 1 <= --min-workers <= --max-workers, got {args.min_workers} and {args.max_workers}")
    if args.survivors and args.parallelism != "ddp":
        parser.error("--survivors trains full replicas: it does not combine with --parallelism fsdp")
    if args.micro_batches is not None and not args.survivors:
        parser.error("--micro-batches is survivor mode's: add --survivors")
    if args.survivors:
        args.micro_batches = args.micro_batches or args.max_workers
        if args.micro_batches < args.max_workers or args.global_batch % args.micro_batches:
            parser.error(f"--micro-batches must be at least --max-workers ({args.max_workers}) and divide "
                         f"--global-batch ({args.global_batch}), got {args.micro_batches}")
    return args


def print_summary(result: ray.train.Result, config: dict[str, Any], run_dir: str, tracking_uri: str) -> None:
    """The end of the job: goodput report and timeline (next to the run, and in MLflow), where everything is."""
    from ray_resilient.goodput import render_report
    from ray_resilient.storage import open_filesystem

    metrics = result.metrics or {}
    with tempfile.TemporaryDirectory() as local:
        png = os.path.join(local, "goodput_timeline.png")
        print("\n" + render_report(run_dir, png))
        filesystem, path = open_filesystem(run_dir)
        with open(png, "rb") as source, filesystem.open_output_stream(f"{path}/goodput_timeline.png") as out:
            out.write(source.read())
        in_mlflow = log_artifact(os.path.basename(run_dir.rstrip("/")), png)
    ui = tracking_uri if tracking_uri.startswith("http") else f"mlflow ui --backend-store-uri {tracking_uri}"
    print(f"goodput timeline:  {run_dir}/goodput_timeline.png{' (and in the MLflow run)' if in_mlflow else ''}")
    print(f"val accuracy:      {metrics.get('val_accuracy', float('nan')):.3f}")
    print(f"checkpoints:       {run_dir} (final: {result.checkpoint.path if result.checkpoint else None})")
    print(f"exported model:    {run_dir}/{MODEL_FILE} (torch.load it; rebuild with "
          f"torchvision.models.get_model({config['model']!r}, num_classes=len(saved['classes'])))")
    print(f"MLflow:            experiment ray_resilient, run {os.path.basename(run_dir)!r}: {ui}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
    tracking_uri = default_tracking_uri()
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri  # the workers log to the same store
    # First, so that a cluster that is gone fails in seconds, before any work.
    connect_ray(args.ray_address, runtime_env={"env_vars": {"MLFLOW_TRACKING_URI": tracking_uri}})
    volume = args.volume or generate_default_volume(os.path.abspath("data/shapes"), args.per_class, args.classes,
                                                    args.image_size, args.seed)
    workers = args.max_workers if args.survivors else (args.min_workers, args.max_workers)
    ray_config = recommended_ray_config(args.name, args.storage_path, workers=workers, use_gpu=args.use_gpu,
                                        max_failures=args.max_failures, num_to_keep=args.num_to_keep,
                                        survivors=args.survivors, verbose=args.verbose)
    # Class names from the driver: a ``.classes`` attribute inside a train function defined in
    # __main__ makes cloudpickle try to pickle the torch.classes module.
    config = {"volume": volume, "class_names": Volume(f"{volume}/train").classes, "cache_dir": args.cache_dir, "cache_limit": args.cache_limit,
              "loader_workers": args.loader_workers, "image_size": args.image_size, "model": args.model,
              "parallelism": args.parallelism, "survivors": args.survivors, "micro_batches": args.micro_batches,
              "epochs": args.epochs, "global_batch": args.global_batch, "lr": args.lr, "seed": args.seed,
              "interval": "auto" if args.interval == "auto" else int(args.interval),
              "mtbf_s": parse_duration(args.mtbf), "faults": args.faults, "log_every": args.log_every}
    sizes = f"{args.max_workers} survivor-mode" if args.survivors else f"{args.min_workers}-{args.max_workers}"
    print(f"Training {args.model} on {volume} with {sizes} workers; run {args.name!r} in {args.storage_path}",
          flush=True)
    result = ray_config.fit(TorchTrainer(train_fn, train_loop_config=config, **ray_config.trainer_kwargs()))
    print_summary(result, config, f"{args.storage_path.rstrip('/')}/{args.name}", tracking_uri)
    metrics = result.metrics or {}
    print("RESULT " + json.dumps({key: metrics.get(key) for key in ("val_accuracy", "goodput", "step")}))


if __name__ == "__main__":
    main()
