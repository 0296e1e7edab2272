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


def test_a_global_batch_in_no_micro_batches_is_refused():
    from ray_resilient.survivors import SurvivingReplicas

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
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


def test_the_next_membership_copies_from_a_replica_holding_state_or_restores_from_storage():
    from ray_resilient.survivors.coordinator import Membership, Report, next_membership

    first = next_membership(None, {}, (2, 0, 1))  # a worker group starting: one read, the others copy
    assert (first.epoch, first.members, first.source, first.lead, first.behind, first.from_storage) == (
        0, (0, 1, 2), 0, 0, (1, 2), True)
    old = Membership(3, (0, 1, 2), 40, 0, 0, ())
    # Replica 1 died; 0 and 2 applied 41 and 40 steps; replacement 1 waits.
    after = next_membership(old, {0: Report(41, True), 2: Report(40, True)}, (1,))
    assert (after.members, after.step, after.source, after.lead, after.behind, after.from_storage) == (
        (0, 1, 2), 41, 0, 0, (1, 2), False)
    # The lead died; the replacement 0 whose copy broke off says it has no state: it is never the
    # source nor the lead, whatever step it reports.
    old = Membership(5, (0, 1), 41, 0, 0, (1,))
    after = next_membership(old, {0: Report(0, False), 1: Report(41, True)}, ())
    assert (after.source, after.lead, after.step, after.behind) == (1, 1, 41, (0,))
    # The only replica holding state died while copying: the others restore from storage.
    after = next_membership(Membership(6, (0, 1), 41, 0, 0, (1,)), {1: Report(0, False)}, (0,))
    assert (after.epoch, after.members, after.source, after.lead, after.behind, after.from_storage) == (
        7, (0, 1), 0, 0, (1,), True)
    assert next_membership(old, {}, ()) is None


def test_a_state_copy_carries_every_leaf_into_the_receivers_own_tensors():
    """Over a real gloo group (two ranks in threads): the receiver's model takes the tensors in
    place; its optimizer, which never stepped, gets new ones."""
    import datetime
    import threading

    import torch.distributed as dist

    from ray_resilient._torch_internals import gloo_group
    from ray_resilient.survivors.state_copy import receive_state, send_state

    def replica(seed: int, stepped: bool):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
        if stepped:
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
        return model, optimizer, scheduler

    def state(model, optimizer, scheduler):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": 41, "path": ("a", 1.5, None)}

    source, receiver = replica(1, True), replica(2, False)
    store = dist.HashStore()
    groups = [None] * 2
    results: dict = {}

    def run(rank: int) -> None:
        group = groups[rank] = gloo_group(dist.PrefixStore("copy/", store), rank, 2, datetime.timedelta(seconds=30),
                                          "127.0.0.1")
        wait = lambda work: work.wait()  # noqa: E731
        if rank == 0:
            results["sent"] = send_state(group, state(*source), wait)
        else:
            results["received"] = receive_state(group, {"model": receiver[0].state_dict()}, wait)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    received, expected = results["received"], state(*source)
    assert received["step"] == 41 and received["path"] == ("a", 1.5, None)
    assert received["scheduler"] == expected["scheduler"]
    assert received["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for key, value in expected["model"].items():  # in place: the receiver's own parameters
        assert torch.equal(receiver[0].state_dict()[key], value)
        assert received["model"][key].data_ptr() == receiver[0].state_dict()[key].data_ptr()
    for index, buffers in expected["optimizer"]["state"].items():  # int keys stay ints
        assert torch.equal(received["optimizer"]["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    tensor_bytes = sum(v.numel() * v.element_size() for v in expected["model"].values()) + sum(
        b["momentum_buffer"].numel() * 4 for b in expected["optimizer"]["state"].values())
    assert tensor_bytes < results["sent"] < tensor_bytes + 4096  # the tensors and a small JSON layout


def test_a_state_layout_carries_no_code_and_names_what_it_cannot_carry():
    from ray_resilient.survivors.state_copy import StateLayoutError, describe, placeholders

    with pytest.raises(StateLayoutError, match=r"state\['hook'\] is a function"):
        describe({"hook": lambda: None}, [])
    for bad in ({"tensor": ["system", [2]]}, {"tensor": ["float32", [-1]]}, {"pickle": "cos\nsystem"},
                {"dict": [[["type", "os"], {"value": 1}]]}):
        with pytest.raises(StateLayoutError):
            placeholders(bad, None, [])


def test_a_replica_that_stops_without_dying_is_dropped_once_silent_and_a_killed_one_at_once():
    """Real processes holding a :class:`LivenessLink`, each with a forked child (a DataLoader
    worker's place): one SIGSTOPped (its sockets stay open, no FIN comes) is dropped after 2 s of
    silence (the coordinator's rule, heartbeats on time), one SIGKILLed at once (its child holds no
    copy of the link), and one alive keeps its link."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys
    import time

    from ray_resilient.survivors.liveness import HEARTBEAT_S, watch_heartbeats
    from ray_resilient.watchdog.silence import SilenceRule

    silence = SilenceRule()

    async def scenario() -> dict[str, tuple[str, float]]:
        """How and when (seconds after its SIGSTOP or SIGKILL) each link ended, once the stopped one did."""
        ended: dict[str, tuple[str, float]] = {}

        async def watch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            name, _ = (await reader.readline()).decode().split()
            ended[name] = (await watch_heartbeats(reader, silence), time.monotonic())
            writer.close()

        server = await asyncio.start_server(watch, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        # Each holds its link, and its forked child lives on, until stdin closes (the test's end).
        holders = {name: subprocess.Popen([sys.executable, "-c", (
            "import os, sys\nfrom ray_resilient.survivors.liveness import LivenessLink\n"
            f"link = LivenessLink('127.0.0.1', {port}, '{name}', 'token')\n"
            "if os.fork() == 0:\n    sys.stdin.read()\n    os._exit(0)\n"
            "print('up', flush=True)\nsys.stdin.read()")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for name in ("stopped", "killed", "alive")}
        try:
            for holder in holders.values():
                assert await asyncio.to_thread(holder.stdout.readline) == "up\n"
            os.kill(holders["stopped"].pid, signal.SIGSTOP)
            holders["killed"].kill()
            signalled = time.monotonic()
            while "stopped" not in ended and time.monotonic() < signalled + 60:
                await asyncio.sleep(0.05)
            return {name: (how, at - signalled) for name, (how, at) in ended.items()}
        finally:
            for holder in holders.values():
                holder.kill()  # SIGKILL ends a stopped process too
                holder.wait()
            server.close()

    ended = asyncio.run(scenario())
    assert "alive" not in ended
    assert ended["killed"][0] == "closed its connection" and ended["killed"][1] < 1.0
    how, after = ended["stopped"]
    assert how.startswith("sent no heartbeat") and 2.0 - HEARTBEAT_S <= after <= 3.0, (how, after)


def test_silence_is_a_stop_beyond_the_floor_or_four_times_the_p99_of_the_heartbeat_gaps_heard():
    from ray_resilient.watchdog.silence import SilenceRule

    silence = SilenceRule(2.0)
    assert silence.threshold_s == 2.0  # nothing heard yet: the floor
    for _ in range(199):
        silence.heard(0.25)
    silence.heard(1.43)  # one gap in 200 of a starved but live process: beyond the p99, ignored
    assert silence.threshold_s == 2.0
    for _ in range(3):
        silence.heard(1.43)  # 2% of the gaps: the machine is loaded
    assert silence.threshold_s == pytest.approx(4 * 1.43)
    with pytest.raises(ValueError, match="must be > 0"):
        SilenceRule(0)


def test_a_step_keeps_the_micro_batches_of_a_replica_killed_after_its_exchange_and_not_of_a_dropped_attempt(
        tmp_path):
    from ray_resilient.testing import RecordKind, Recorder, committed_micro_batches, kept_samples, read_records

    recorders = {}
    for replica in range(3):
        recorders[replica] = Recorder(tmp_path, replica)
        recorders[replica].pid = 100 + replica  # three processes
    t = iter(range(1, 100))

    def computed(replica: int, step: int, members: list[int], part: int) -> None:
        ids = [6 * (step - 1) + 2 * part, 6 * (step - 1) + 2 * part + 1]
        recorders[replica](RecordKind.COMPUTED, t=next(t), step=step, epoch=0, members=members, part=part, ids=ids)

    def committed(replica: int, step: int, members: list[int]) -> None:
        recorders[replica](RecordKind.STEP, t=next(t), step=step, epoch=0, members=members, loss=1.0)

    # Step 1 on three replicas; replica 1 is killed after the exchange, before it records the commit.
    for replica in range(3):
        computed(replica, 1, [0, 1, 2], replica)
    committed(0, 1, [0, 1, 2])
    committed(2, 1, [0, 1, 2])
    # Step 2: the attempt with replica 1 is dropped; the two survivors train it again, two parts for replica 0.
    computed(0, 2, [0, 1, 2], 0)
    computed(2, 2, [0, 1, 2], 2)
    computed(0, 2, [0, 2], 0)
    computed(2, 2, [0, 2], 1)
    computed(0, 2, [0, 2], 2)
    committed(0, 2, [0, 2])
    committed(2, 2, [0, 2])
    for replica in (0, 2):
        recorders[replica](RecordKind.FINISHED, t=next(t), step=2)

    records = read_records(tmp_path)
    step_1 = next(r for r in records if r["kind"] == "step" and r["step"] == 1)
    assert committed_micro_batches(records, step_1) == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    assert kept_samples(records) == {(0, i): 1 for i in range(12)}


ROW, MICRO_BATCHES = 1001, 4


def micro_batch_row(k: int) -> torch.Tensor:
    """Micro-batch k's row: values of very different magnitudes (so the order of a sum shows in
    its bits), the last 3 elements an integer buffer's change."""
    generator = torch.Generator().manual_seed(k)
    row = torch.randn(ROW, generator=generator) * 10.0 ** torch.randint(-6, 7, (ROW,), generator=generator)
    row[-3:] = k + 1
    return row


def exchange_rank(rank: int, size: int, root: str) -> None:
    import datetime

    import torch.distributed as dist

    from ray_resilient._torch_internals import gloo_group
    from ray_resilient.survivors.exchange import MicroBatchExchange

    store = dist.FileStore(f"{root}/store-{size}", size)
    group = gloo_group(store, rank, size, datetime.timedelta(seconds=60), "127.0.0.1")
    exact = torch.zeros(ROW, dtype=torch.bool)
    exact[-3:] = True
    exchange = MicroBatchExchange(ROW, MICRO_BATCHES, exact, replicas=size, dtype=torch.float32)
    results = []
    for step in range(2):  # the buffers are reused: the second step must not see the first's
        rows = exchange.rows(size)
        for slot, k in enumerate(range(rank, MICRO_BATCHES, size)):
            rows[slot] = micro_batch_row(k) * (step + 1)
        reduced, controls = exchange.reduce(group, rank, torch.tensor([rank * 10, step]), lambda work: work.wait())
        results.append((reduced.clone(), controls.clone()))
    torch.save({"results": results, "sent_bytes": exchange.sent_bytes}, f"{root}/{size}-{rank}.pt")


def test_the_exchange_sums_micro_batches_in_their_order_to_the_same_bits_at_any_membership_and_moves_what_ddp_does(
        tmp_path):
    """Micro-batch rows reduced by 1, 2, 3 and 4 members (each member its micro-batches ``k % n``):
    every member of every membership gets the same bits, the sequential sum in micro-batch order
    divided by their count (integer elements: micro-batch 0's), and every member's controls. Each
    member sends, per step, with one micro-batch each, what DDP's ring all-reduce sends (2 (n - 1) / n
    rows: the data and the controls' ``MICRO_BATCHES x CONTROLS x DIGITS`` digits, padding aside)."""
    import torch.multiprocessing as mp

    from ray_resilient.survivors.exchange import CONTROLS, DIGITS

    for size in (1, 2, 3, 4):
        mp.start_processes(exchange_rank, args=(size, str(tmp_path)), nprocs=size, start_method="fork")
    for step in range(2):
        expected = micro_batch_row(0) * (step + 1)
        for k in range(1, MICRO_BATCHES):
            expected += micro_batch_row(k) * (step + 1)
        expected /= MICRO_BATCHES
        expected[-3:] = micro_batch_row(0)[-3:] * (step + 1)
        sequential_bits = expected.view(torch.int32)
        reordered = (sum(micro_batch_row(k) * (step + 1) for k in reversed(range(MICRO_BATCHES))) / MICRO_BATCHES)
        assert not torch.equal(reordered[:-3].view(torch.int32), sequential_bits[:-3])  # the order shows
        for size in (1, 2, 3, 4):
            for rank in range(size):
                reduced, controls = torch.load(tmp_path / f"{size}-{rank}.pt")["results"][step]
                assert torch.equal(reduced.view(torch.int32), sequential_bits), (size, rank, step)
                assert controls.tolist() == [[r * 10, step] for r in range(size)]
    for size in (2, 4):
        sent = torch.load(tmp_path / f"{size}-0.pt")["sent_bytes"] / 2  # per step
        ring = 2 * (size - 1) / size * (ROW + MICRO_BATCHES * CONTROLS * DIGITS) * 4
        slots = -(-MICRO_BATCHES // size)
        assert sent <= ring * slots * 1.02 and (slots > 1 or sent >= ring * 0.98), (size, sent, ring)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_exchange_carries_integer_controls_exactly_in_rows_of_the_gradients_dtype_under_a_bf16_default(dtype):
    """Two members of a real gloo group (threads) under ``torch.set_default_dtype(torch.bfloat16)``:
    the controls of steps 2**24 + 2 and 300 (where float32 and bfloat16 round the offered step + 1)
    and of one past 2**60 come back exact, and the rows keep the gradients' dtype (float32 ones
    are not rounded to the default's bfloat16)."""
    import datetime
    import threading

    import torch.distributed as dist

    from ray_resilient._torch_internals import gloo_group
    from ray_resilient.survivors.exchange import MicroBatchExchange

    value = torch.tensor(1 + 2 ** -12, dtype=dtype)  # bfloat16 holds 1 + 2**-7 at best
    steps = [2 ** 24 + 2, 300, 2 ** 60 + 1]
    store, results = dist.HashStore(), {}

    def member(rank: int) -> None:
        group = gloo_group(dist.PrefixStore("exchange/", store), rank, 2, datetime.timedelta(seconds=30), "127.0.0.1")
        exchange = MicroBatchExchange(3, 2, torch.zeros(3, dtype=torch.bool), replicas=2, dtype=dtype)
        for step in steps:
            exchange.rows(2)[0] = value * (rank + 1)
            controls = torch.tensor([1 + step + rank, rank], dtype=torch.int64)
            reduced, received = exchange.reduce(group, rank, controls, lambda work: work.wait())
            results[rank, step] = reduced.clone(), received.clone()

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        torch.set_default_dtype(default)
    mean = (value + value * 2) / 2
    assert sorted(results) == [(rank, step) for rank in range(2) for step in sorted(steps)]
    for (rank, step), (reduced, received) in results.items():
        assert reduced.dtype == dtype and torch.equal(reduced, mean.expand(3)), (rank, step, reduced)
        assert received.dtype == torch.int64 and received.tolist() == [[1 + step, 0], [2 + step, 1]], (rank, step)


def test_fewer_micro_batches_than_replicas_are_refused():
    """A member of rank >= micro_batches would compute no micro-batch, and its controls (the lead's
    offered registration, a replacement waiting) travel in its first row: never summed."""
    from ray_resilient.survivors.exchange import MicroBatchExchange

    exact = torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"micro_batches \(2\) must be at least the replicas \(3\)"):
        MicroBatchExchange(4, 2, exact, replicas=3, dtype=torch.float32)
    assert MicroBatchExchange(4, 3, exact, replicas=3, dtype=torch.float32).rows(3).shape == (1, 4)
