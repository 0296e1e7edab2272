"""Restore from S3 at read bandwidth: the node's copy against a bulk GET and the streaming restore.

Setup
    A real S3 server on loopback (SeaweedFS, as the tests start it) holds the run's storage. A Ray
    Train run of 2 workers (one node, gloo) saves a replicated (DDP-like) stack of ``LAYERS`` linear
    layers with Adam, ``--state-mb`` MiB of model and optimizer state in 128 parameters and their 384
    optimizer tensors (a real model's count: ResNet-18 has 62 parameters), through the
    ``Checkpointer`` (each rank its shards, 4 files a rank). A second run of 2 workers restores it
    once with ``Checkpointer.restore()`` (printed: lease, stages and all), then ``--repeats`` times
    each, alternating:

    restore     what a restore reads through: ``dcp.load`` of the model and optimizer with
                ``CheckpointStorage.reader`` on both ranks, the node's copy empty (a fresh
                ``local_dir`` each time): each shard file the ranks' load plans name is fetched once
                for the node in parallel ranged GETs, verified as it streams, read from local disk.
    bulk_get    the same shard files read whole into memory, all at once (one GET each, in
                parallel threads), by rank 0: the node's floor for fetching those bytes.
    streaming   the restore as it was before the node's copy: each rank streams its share of the
                files to check their SHA-256 against the manifests, then DCP reads each tensor's
                byte range from S3 (``reader(fetch=False)``: one ranged GET per item), every rank
                every tensor.

    Each time is measured on rank 0 between barriers. ``bytes_fetched_per_node_over_checkpoint`` is
    what the restores fetched on the node (both ranks, ``CheckpointStorage.fetched``) over the
    checkpoint's shard bytes.

Output
    One line per measurement, then ``restore_vs_bulk_get=.. restore_speedup_vs_streaming=..
    bytes_fetched_per_node_over_checkpoint=..`` (medians; targets at most 1.5, at least 5, at most 1.1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.distributed.checkpoint.state_dict import get_state_dict

from ray_resilient import CheckpointConfig, Checkpointer
from ray_resilient.checkpoint import CheckpointStorage, list_checkpoints
from ray_resilient.testing import S3Server, seaweedfs
from ray_resilient.testing.kit import start_local_ray

WORKERS = 2
LAYERS = 64
RUN = "restore-throughput"


def model_for(state_mb: int) -> torch.nn.Module:
    """``LAYERS`` square linear layers whose parameters plus Adam's two moments take about ``state_mb`` MiB."""
    width = int(((state_mb << 20) / 12 / LAYERS) ** 0.5)  # 12 bytes a parameter with Adam
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))


def save(config: dict) -> None:
    """One step, then the final checkpoint."""
    model = model_for(config["state_mb"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Checkpointer(model, optimizer, config=CheckpointConfig(goodput_logger=None, hang_watchdog=None)) as checkpointer:
        checkpointer.restore()
        model(torch.ones(4, model[0].in_features)).sum().backward()  # the same step on both replicas
        optimizer.step()
        checkpointer.step_completed(0)
        checkpointer.finish()


def bulk_get(fs: pafs.FileSystem, directory: str, names: list[str]) -> int:
    def get(name: str) -> int:
        with fs.open_input_stream(f"{directory}/{name}") as stream:
            return len(stream.read())
    with ThreadPoolExecutor(len(names)) as pool:
        return sum(pool.map(get, names))


def verify_share(fs: pafs.FileSystem, directory: str, rank: int) -> None:
    """What a restore did before the node's copy: this rank's share of the files, each streamed
    once through SHA-256 and checked against its manifest entry."""
    names = [info.base_name for info in fs.get_file_info(pafs.FileSelector(directory))]
    manifest: dict[str, dict] = {}
    for name in sorted(n for n in names if n.startswith("checksums_rank_")):
        with fs.open_input_stream(f"{directory}/{name}") as stream:
            manifest.update(json.loads(stream.read()))
    for name in sorted(manifest)[rank::WORKERS]:
        digest = hashlib.sha256()
        with fs.open_input_stream(f"{directory}/{name}") as stream:
            while chunk := stream.read(8 << 20):
                digest.update(chunk)
        assert digest.hexdigest() == manifest[name]["sha256"], name


def measure(config: dict) -> None:
    rank = ray.train.get_context().get_world_rank()
    server: S3Server = config["server"]
    fs, root = server.filesystem(), config["root"]
    run = f"{server.bucket}/{RUN}/{RUN}"
    model = model_for(config["state_mb"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(4, model[0].in_features)).sum().backward()
    optimizer.step()  # Adam's state exists, to be loaded into

    def node(local: str) -> CheckpointStorage:
        return CheckpointStorage(fs, run, f"{root}/{local}")

    started = time.monotonic()
    checkpoints = CheckpointConfig(storage=node("checkpointer"), goodput_logger=None, hang_watchdog=None)
    with Checkpointer(model, optimizer, config=checkpoints) as checkpointer:
        checkpointer.restore()
    checkpointer_seconds = time.monotonic() - started
    path = list_checkpoints(fs, run)[-1].path
    files = {info.base_name: info.size for info in fs.get_file_info(pafs.FileSelector(path))}
    shards = sorted(name for name in files if name.endswith(".distcp"))
    checkpoint_bytes = sum(files[name] for name in shards)
    timings: dict[str, list[float]] = {"restore": [], "bulk_get": [], "streaming": []}
    fetched: list[int] = []
    for repeat in range(config["repeats"]):
        for mode in timings:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
            dist.barrier()
            started = time.monotonic()
            if mode == "restore":
                storage = node(f"fresh-{repeat}")
                dcp.load(state, storage_reader=storage.reader(path))
            elif mode == "bulk_get" and rank == 0:
                assert bulk_get(fs, path, shards) == checkpoint_bytes
            elif mode == "streaming":
                verify_share(fs, path, rank)
                dist.barrier()
                dcp.load(state, storage_reader=node("streaming").reader(path, fetch=False))
            dist.barrier()
            timings[mode].append(time.monotonic() - started)
            if mode == "restore":
                per_rank = [0] * WORKERS
                dist.all_gather_object(per_rank, storage.fetched.bytes)
                fetched.append(sum(per_rank))
            if rank == 0:
                print(f"repeat {repeat} {mode:9s} {timings[mode][-1]:7.3f} s", flush=True)
    if rank == 0:
        with open(f"{root}/result.json", "w") as out:
            json.dump({"timings": timings, "fetched": fetched, "checkpoint_bytes": checkpoint_bytes,
                       "checkpointer_seconds": checkpointer_seconds}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=int, default=300, help="model plus Adam state, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restore-throughput-") as root:
        with seaweedfs(Path(root) / "seaweedfs") as server:
            start_local_ray(num_cpus=WORKERS)
            try:
                config = {"state_mb": args.state_mb, "repeats": args.repeats, "server": server, "root": root}
                for train_fn in (save, measure):
                    TorchTrainer(train_fn, train_loop_config=config, scaling_config=ScalingConfig(num_workers=WORKERS),
                                 run_config=RunConfig(name=RUN, storage_path=f"{server.bucket}/{RUN}",
                                                      storage_filesystem=server.filesystem())).fit()
            finally:
                ray.shutdown()
        with open(Path(root) / "result.json") as stream:
            result = json.load(stream)
    median = {mode: statistics.median(times) for mode, times in result["timings"].items()}
    size = result["checkpoint_bytes"]
    print(f"checkpoint: {size / 2**20:.0f} MiB of shards; Checkpointer.restore() "
          f"{result['checkpointer_seconds']:.3f} s (lease, stages, fetch); medians: " + ", ".join(
              f"{mode} {seconds:.3f} s ({size / seconds / 2**20:.0f} MiB/s)" for mode, seconds in median.items()))
    print(f"restore_vs_bulk_get={median['restore'] / median['bulk_get']:.2f} "
          f"restore_speedup_vs_streaming={median['streaming'] / median['restore']:.2f} "
          f"bytes_fetched_per_node_over_checkpoint={statistics.median(result['fetched']) / size:.2f}")


if __name__ == "__main__":
    main()
