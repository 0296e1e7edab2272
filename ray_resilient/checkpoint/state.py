"""What a checkpoint contains, under named keys so that save and load cannot drift apart.

Layout of the DCP state dict (all plain DCP, loadable without this package)::

    model                 model state, DDP/FSDP prefixes stripped (get_state_dict)
    optimizer             optimizer state keyed by parameter name
    lr_scheduler          scheduler.state_dict()            (when given)
    grad_scaler           torch.amp.GradScaler.state_dict() (when given and enabled)
    extras.<name>         each user Stateful's state_dict()
    train_state           {"step", "epoch", "world_size", "seed", "interval_steps"}
    rank_state.rank_<r>   per rank: {"rng": ..., "data": ..., "buffers": ...}

Per-rank state lives under per-rank keys: under one shared key DCP would deduplicate it and only
one rank's RNG would survive. Model buffers (BatchNorm running statistics) are per-rank state:
each rank updates them from its own batches (DDP overwrites them with rank 0's at the next
forward, FSDP2 never does), so ``model`` holds rank 0's and each rank's own are restored from
its ``rank_state`` entry when the world size is unchanged.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.stateful import Stateful

from ray_resilient._torch_internals import without_compile_prefix

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
GRAD_SCALER = "grad_scaler"
EXTRAS = "extras"
TRAIN_STATE = "train_state"
RANK_STATE = "rank_state"
RNG = "rng"
DATA = "data"
BUFFERS = "buffers"


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


@dataclass
class TrainState:
    """Where training is: steps completed, current epoch, and the topology that wrote it."""

    step: int = 0
    epoch: int = 0
    world_size: int = 1
    seed: int = 0
    interval_steps: int = 0  # the save interval in effect ("auto" continues with it); 0: not recorded

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


@runtime_checkable
class ReshardableStateful(Protocol):
    """A per-rank Stateful (e.g. a data loader position) that can take over after a resize.

    ``load_resharded_state_dicts`` receives every old rank's state, in rank order, when the
    job restarts on a different number of workers.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def load_resharded_state_dicts(self, states: list[dict[str, Any]]) -> None: ...


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG streams: python ``random``, numpy, torch CPU and CUDA when present."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Fresh, deterministic RNG streams for ``rank`` after a resize (never another rank's)."""
    derived = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    random.seed(derived)
    np.random.seed(derived)
    torch.default_generator.manual_seed(derived)
    if torch.cuda.is_initialized():  # torch.manual_seed would queue it with a stack trace: 1 ms a call
        torch.cuda.manual_seed_all(derived)


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's live persistent buffers, by their key in the (wrapper-free) model state dict."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {
        without_compile_prefix(key): value
        for key, value in module.state_dict(keep_vars=True).items()
        if not isinstance(value, torch.nn.Parameter)
    }


def own_share(tree: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``tree`` without the tensors other ranks save: replicated tensors are dealt to ranks by
    size (largest first, to the rank with the fewest bytes so far), identically on every rank,
    so the ranks' shares are disjoint and together hold every tensor once."""
    sizes: dict[tuple[str, ...], int] = {}

    def collect(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                collect(value, (*path, str(key)))
            elif isinstance(value, torch.Tensor):
                sizes[(*path, str(key))] = value.numel() * value.element_size()

    collect(tree, ())
    loads = [0] * world_size
    mine = set()
    for path, nbytes in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += nbytes
        if owner == rank:
            mine.add(path)

    def prune(node: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        kept = {}
        for key, value in node.items():
            here = (*path, str(key))
            if isinstance(value, Mapping):
                kept[key] = prune(value, here)
            elif not isinstance(value, torch.Tensor) or here in mine:
                kept[key] = value
        return kept

    return prune(tree, ())


class TrainingComponents:
    """The live objects a checkpoint captures, and how each becomes (and comes back from) state."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        grad_scaler: Any | None = None,
        data: Stateful | None = None,
        extras: Mapping[str, Stateful] | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.data = data
        self.extras = dict(extras or {})
        for name, obj in {"data": data, **self.extras}.items():
            if obj is not None and not isinstance(obj, Stateful):
                raise TypeError(f"{name}={obj!r} must have state_dict() and load_state_dict()")

    def _model_and_optimizer(self) -> dict[str, Any]:
        optimizers = () if self.optimizer is None else (self.optimizer,)
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        state = {MODEL: model_sd}
        if self.optimizer is not None:
            state[OPTIMIZER] = optim_sd
        return state

    def shared_state(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler and extras: what every replica holds alike."""
        state = self._model_and_optimizer()
        if self.lr_scheduler is not None:
            state[LR_SCHEDULER] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            state[GRAD_SCALER] = self.grad_scaler.state_dict()
        if self.extras:
            state[EXTRAS] = {name: obj.state_dict() for name, obj in self.extras.items()}
        return state

    def state_to_save(self, train_state: TrainState, rank: int) -> dict[str, Any]:
        """The DCP state dict this rank saves (tensors still live; the stager copies them).

        With DDP every rank holds the same parameters and optimizer state, and DCP would write
        each once anyway: each rank hands over only its share (:func:`own_share`), so each
        stages half (with 2 ranks) of the replicated state. Buffers differ between ranks: the
        shared ``model`` entry takes rank 0's, and each rank saves its own in ``rank_state``.
        """
        buffers = model_buffers(self.model)
        rank_state: dict[str, Any] = {RNG: capture_rng_state(), BUFFERS: buffers}
        if self.data is not None:
            rank_state[DATA] = self.data.state_dict()
        state = self.shared_state()
        if train_state.world_size > 1:
            rank0_buffers = {key: state[MODEL].pop(key) for key in buffers if key in state[MODEL]}
            if isinstance(self.model, DistributedDataParallel):
                for key in (MODEL, OPTIMIZER):
                    if key in state:
                        state[key] = own_share(state[key], rank, train_state.world_size)
            if rank == 0:
                state[MODEL].update(rank0_buffers)
        state[TRAIN_STATE] = train_state.state_dict()
        state[RANK_STATE] = {rank_key(rank): rank_state}
        return state

    def state_to_load(self, saved: TrainState, rank: int, world_size: int) -> dict[str, Any]:
        """Placeholders for ``dcp.load``: the shared state plus the per-rank entries to read.

        Same world size: this rank's own entry. Different world size: every old rank's data
        entry (for a ReshardableStateful), and no RNG (it is re-derived, see ``apply_loaded``).
        """
        state = self.shared_state()
        if saved.world_size == world_size:
            state[RANK_STATE] = {rank_key(rank): self._rank_placeholder()}
        elif isinstance(self.data, ReshardableStateful):
            state[RANK_STATE] = {
                rank_key(r): {DATA: self.data.state_dict()} for r in range(saved.world_size)
            }
        return state

    def _rank_placeholder(self) -> dict[str, Any]:
        buffers = {key: value.detach().clone() for key, value in model_buffers(self.model).items()}
        placeholder: dict[str, Any] = {RNG: capture_rng_state(), BUFFERS: buffers}
        if self.data is not None:
            placeholder[DATA] = self.data.state_dict()
        return placeholder

    def apply_data_position(self, state: dict[str, Any], saved: TrainState, rank: int, world_size: int) -> list[str]:
        """Hand the loaded data position to ``data``, which refuses one of another dataset by
        raising. Returns warnings."""
        if self.data is None:
            return []
        if saved.world_size == world_size:
            self.data.load_state_dict(state[RANK_STATE][rank_key(rank)][DATA])
            return []
        if isinstance(self.data, ReshardableStateful):
            self.data.load_resharded_state_dicts([state[RANK_STATE][rank_key(r)][DATA] for r in range(saved.world_size)])
            return []
        return [
            f"world size changed from {saved.world_size} to {world_size} and "
            f"{type(self.data).__name__} cannot reshard its position: it starts from its "
            "initial state (implement load_resharded_state_dicts to continue exactly)"
        ]

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Push :meth:`shared_state`'s parts of ``state`` into the live objects."""
        optimizers = () if self.optimizer is None else (self.optimizer,)
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state[MODEL],
            optim_state_dict=state.get(OPTIMIZER, {}),
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state[LR_SCHEDULER])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state[GRAD_SCALER])
        for name, obj in self.extras.items():
            obj.load_state_dict(state[EXTRAS][name])

    def apply_loaded(self, state: dict[str, Any], saved: TrainState, rank: int, world_size: int) -> list[str]:
        """Push the loaded model, optimizer, scheduler, scaler, extras, buffers and RNG streams into
        the live objects (the data position is :meth:`apply_data_position`'s). Returns warnings."""
        self.load_shared_state(state)
        if saved.world_size == world_size:
            own = state[RANK_STATE][rank_key(rank)]
            live = model_buffers(self.model)
            with torch.no_grad():
                for key, value in own.get(BUFFERS, {}).items():
                    live[key].copy_(value)
            restore_rng_state(own[RNG])
            return []
        reseed_rng(saved.seed, saved.step, rank)
        return [
            f"world size changed from {saved.world_size} to {world_size}: RNG streams re-derived "
            f"from (seed={saved.seed}, step={saved.step}, rank={rank}) instead of restored, and model "
            "buffers (e.g. BatchNorm statistics) taken from old rank 0"
        ]
