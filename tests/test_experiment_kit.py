"""The experiment kit's job on an image volume (the main job's model and data, as the chaos
benchmarks train it): what it plans is what its loaders serve, to the whole group and to survivor
mode's replicas."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pyarrow.fs as pafs
import torch

from ray_resilient.testing import CLASSES, make_image_volume
from ray_resilient.testing.kit import ChaosJob, job_model, planned_samples
from ray_resilient.testing.kit.chaos_job import volume_loader


def test_the_image_job_plans_exactly_the_samples_its_loaders_serve_to_ranks_and_to_replicas(tmp_path):
    samples = make_image_volume(pafs.LocalFileSystem(), str(tmp_path / "volume"), classes=CLASSES, per_class=12,
                                size=8, seed=3)
    # 48 images, 6 global batches of 8 an epoch: 9 steps cross into the second epoch.
    job = ChaosJob(seed=3, samples=samples, global_batch=8, max_steps=9, step_seconds=0.0, model="resnet18",
                   volume=str(tmp_path / "volume"), image_size=8, loader_workers=0)
    planned = planned_samples(job)
    assert sum(planned.values()) == 9 * 8 and max(planned.values()) == 1
    assert {epoch for epoch, _ in planned} == {0, 1}

    served: Counter = Counter()  # DDP: each of 2 ranks its slice of every global batch
    for rank in (0, 1):
        loader, step = volume_loader(job, rank, 2), 0
        while step < job.max_steps:
            for batch in loader:
                served.update((step // 6, int(i)) for i in batch.sample_ids)
                step += 1
                if step == job.max_steps:
                    break
    assert served == planned

    replicas: Counter = Counter()  # survivor mode: 2 micro-batches a step; replica 1 is lost at step 4
    loaders = [volume_loader(job, rank, 2) for rank in (0, 1)]
    for step in range(job.max_steps):
        members = 2 if step < 4 else 1
        for rank in range(members):
            loaders[rank].assign_micro_batches(step, rank, members, 2)
            for part in range(rank, 2, members):
                replicas.update((step // 6, int(i)) for i in loaders[rank].micro_batch(step, part).sample_ids)
    assert replicas == planned

    model = job_model(job)  # the main job's ResNet-18, with BatchNorm, for the kit's classes
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, CLASSES)
    assert job_model(replace(job, model="mlp", width=16))(torch.zeros(2, 3, 8, 8)).shape == (2, CLASSES)
