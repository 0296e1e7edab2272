"""Ray 2.60's own torchft example as shipped, timed: the measurement behind survivor mode's choice.

Runs ``ray/train/v2/examples/pytorch/torchft_linear_example.py``'s ``train_func`` (2 workers, a
replica failure at step 20, ``TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo")``,
``FailureConfig(max_failures=3)``) on a new local Ray instance and prints how ``fit()`` ended and
after how long. torchft is not a dependency of this project; install it beside the venv::

    .venv/bin/pip install --target /tmp/tftlib --no-deps torchft==0.2.0
    .venv/bin/pip install --target /tmp/tftlib --no-deps opentelemetry-exporter-otlp-proto-http \\
        opentelemetry-exporter-otlp-proto-common
    PYTHONPATH=/tmp/tftlib .venv/bin/python benchmarks/torchft_example.py

Result: ``docs/benchmarks.md`` (it did not recover); why that decided survivor mode's design:
``ray_resilient/survivors/__init__.py``.
"""

from __future__ import annotations

import os
import tempfile
import time


def main() -> None:
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.examples.pytorch.torchft_linear_example import train_func
    from ray.train.v2.torch.torchft_config import TorchftConfig

    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    started = time.time()
    trainer = TorchTrainer(
        train_func, train_loop_config={"num_steps": 100, "error_step": 20, "num_replicas": 2},
        scaling_config=ScalingConfig(num_workers=2),
        torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo"),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), failure_config=FailureConfig(max_failures=3)))
    try:
        result = trainer.fit()
        outcome = f"error {result.error!r}" if result.error else f"finished: {result.metrics}"
    except Exception as err:  # noqa: BLE001 - what the measurement reports
        outcome = f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    print(f"torchft_example: {outcome} after {time.time() - started:.0f} s")
    ray.shutdown()


if __name__ == "__main__":
    main()
