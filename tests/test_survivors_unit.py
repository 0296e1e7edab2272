"""Survivor mode's parts that need no cluster: the configuration, the refusals, the sample plan."""

from __future__ import annotations

import pytest
import torch

from ray_resilient import recommended_ray_config
from ray_resilient.testing.synthetic_data import SyntheticBatches


def test_survivors_true_gives_the_trainer_the_survivor_backend_and_needs_a_fixed_worker_count(tmp_path):
    from ray_resilient.survivors import SurvivorConfig

    kwargs = recommended_ray_config("r", str(tmp_path), workers=3, survivors=True).trainer_kwargs()
    assert isinstance(kwargs["torch_config"], SurvivorConfig)
    assert "torch_config" not in recommended_ray_config("r", str(tmp_path), workers=3).trainer_kwargs()
    with pytest.raises(ValueError, match="fixed number of workers"):
        recommended_ray_config("r", str(tmp_path), workers=(2, 3), survivors=True)


def test_a_model_whose_forward_pass_changes_buffers_is_refused_naming_the_layer():
    from ray_resilient.survivors import SurvivingReplicas

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="'1' is a BatchNorm .* GroupNorm or LayerNorm"):
        SurvivingReplicas(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        SurvivingReplicas(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=0)


def test_the_micro_batches_of_a_step_are_its_global_batch_of_the_plan_in_order():
    data = SyntheticBatches(100, 12, seed=5, rank=0, world_size=1)  # 8 global batches an epoch
    served = [ids for epoch in range(2) for ids, _, _ in data]
    for step, ids in enumerate(served):
        parts = [data.micro_batch(step, k, 3) for k in range(3)]
        assert torch.equal(torch.cat([p[0] for p in parts]), ids)
        ids_1, features_1, labels_1 = parts[1]
        assert torch.equal(features_1, data.features[ids_1]) and torch.equal(labels_1, data.labels[ids_1])
    with pytest.raises(ValueError, match="not divisible into 5"):
        data.micro_batch(0, 0, 5)
