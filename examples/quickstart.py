"""Resilient training in a few lines: python examples/quickstart.py VOLUME STORAGE_PATH [EPOCHS]."""
import sys

import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model

from ray_resilient import CheckpointConfig, Checkpointer, recommended_ray_config
from ray_resilient.data import Volume, VolumeDataLoader, VolumeImageDataset, default_transform


def train_fn(config):
    context = ray.train.get_context()
    dataset = VolumeImageDataset(Volume(config["volume"]), global_batch=32, seed=0,
                                 rank=context.get_world_rank(), world_size=context.get_world_size(),
                                 transform=default_transform(32))
    loader = VolumeDataLoader(dataset)  # resumable: its position is part of every checkpoint
    classes = dataset.volume.num_classes
    model = prepare_model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Checkpointer(model, optimizer, data=loader, config=CheckpointConfig(interval_steps=10)) as ckpt:
        ckpt.restore()  # the newest complete checkpoint of the run, or a fresh start
        while loader.epoch < config["epochs"]:
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(batch.images), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                ckpt.step_completed(loader.epoch, {"loss": loss.item()})  # async save every 10 steps
        ckpt.finish()  # the final checkpoint, durable and registered with Ray


if __name__ == "__main__":
    volume, storage_path = sys.argv[1], sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    config = recommended_ray_config("quickstart", storage_path, workers=(1, 2))
    trainer = TorchTrainer(train_fn, train_loop_config={"volume": volume, "epochs": epochs},
                           **config.trainer_kwargs())
    result = config.fit(trainer)  # trainer.fit(), with a clear error if max_failures is used up
    print(f"loss {result.metrics['loss']:.3f}, final checkpoint {result.checkpoint.path}")
