"""The processes of a run: who this rank is, and the few collectives GRPOTrainer needs (FSDP2:
forge/parallel/sharding.py).

Only the trainer uses this module. With several processes (torchrun, `accelerate launch`, `forge train --nproc
N`), `DataParallel` sets up the process group from the launcher's environment and sums, gathers and broadcasts
what the trainer hands it; with one, `DataParallel()` is a `OneProcess`, whose calls return what they are given
(no torch.distributed at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from forge.parallel import sharding

if TYPE_CHECKING:
    from typing_extensions import Self

# Launch settings of accelerate for engines that shard the model in their own way; FSDP2 is Forge's
# (fsdp=True).
_OTHER_ENGINES = {"ACCELERATE_USE_DEEPSPEED": "DeepSpeed", "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM"}
_GRAD_BUCKET_ELEMENTS = 2**24  # gradients are all-reduced in flat buckets of at most this many elements


def _set(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() in ("1", "true", "yes")


def fsdp_requested(fsdp: bool) -> bool:
    """fsdp=True, or accelerate launched Forge with an FSDP2 config; refuses the engines Forge does not
    run."""
    for variable, engine in _OTHER_ENGINES.items():
        if _set(variable):
            raise ValueError(
                f"accelerate launched Forge with {engine} ({variable}={os.environ[variable]}), which Forge "
                f"does not support: Forge runs its own sampling, loss and AdamW, so {engine}'s engine would "
                f"not be used. To shard the weights, gradients and optimizer state over the processes, use "
                f"Forge's FSDP2: `forge train --nproc N --fsdp` (or GRPOConfig(fsdp=True), or accelerate "
                f"launch with examples/accelerate/fsdp.yaml). Without sharding: a DDP config "
                f"(examples/accelerate/ddp_gpu.yaml or ddp_cpu.yaml) or `forge train --nproc N`.")
    if _set("ACCELERATE_USE_FSDP"):
        if os.environ.get("FSDP_VERSION", "1") != "2":
            raise ValueError(
                f"accelerate launched Forge with FSDP version {os.environ.get('FSDP_VERSION', '1')}; Forge "
                f"shards with FSDP2 (torch's fully_shard) only. Set `fsdp_version: 2` in the accelerate "
                f"config (examples/accelerate/fsdp.yaml), or run `forge train --nproc N --fsdp`.")
        return True
    return fsdp


class DataParallel:
    """Process information and collectives of several processes; with one, `DataParallel()` is a `OneProcess`
    (as pathlib's `Path()` is a `PosixPath` or a `WindowsPath`), which needs none of torch.distributed.

    Data parallelism as DDP does it: every rank holds the whole model, works on its own share of the prompts,
    and gradients are summed across ranks before the optimizer step, so the weights stay identical. The
    process group is set up from the launcher's environment (torchrun, `accelerate launch`, `forge train
    --nproc`): gloo on CPU, NCCL for CUDA tensors plus gloo for CPU ones on GPUs.

    With `fsdp` (and several processes) the ranks still split the prompts the same way, but the model is
    sharded with FSDP2 (forge/parallel/sharding.py): `shard` wraps it, and FSDP2 reduces the gradients in
    backward.
    """

    def __new__(cls, fsdp: bool = False) -> Self:
        one_process = cls is DataParallel and int(os.environ.get("WORLD_SIZE", "1")) == 1
        return super().__new__(OneProcess if one_process else cls)

    def __init__(self, fsdp: bool = False) -> None:
        fsdp = fsdp_requested(fsdp)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.is_main = self.rank == 0
        self.device = None  # the rank's GPU when there are several processes and GPUs
        self.fsdp = fsdp and self.world_size > 1
        if fsdp and self.world_size == 1:
            warnings.warn("fsdp=True with one process: there is nothing to shard over, so the model trains "
                          "whole; start several processes (forge train --nproc N --fsdp) to shard it",
                          stacklevel=3)
        if self.world_size == 1:
            return
        if torch.cuda.is_available():
            local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local_rank >= gpus:
                raise ValueError(f"process {local_rank} of this machine has no GPU of its own ({gpus} "
                                 f"visible): start at most {gpus} processes per machine, or hide the GPUs "
                                 f"(CUDA_VISIBLE_DEVICES=) to train on CPU")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)  # "cuda" now means this rank's GPU, also in policy.load_model
        if not torch.distributed.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: shard the model over the ranks, its shards on this rank's GPU when there is one."""
        return sharding.shard(model, self.device)

    @property
    def main_pid(self) -> int:
        """Rank 0's process id: the name of the temporary directory every rank writes a sharded checkpoint
        to."""
        if not hasattr(self, "_main_pid"):
            self._main_pid = self.gather_objects(os.getpid())[0]
        return self._main_pid

    def sum_shards(self, values: list[float]) -> list[float]:
        """Totals of per-parameter values (e.g. squared norms): summed over the ranks' shards under FSDP2;
        with a whole model on every rank, the values themselves."""
        return self.sum(values) if self.fsdp else values

    def whole_weights(self, model: torch.nn.Module):
        """FSDP2: the whole weights of `model` on every rank inside the block (sharding.gathered)."""
        return sharding.gathered(model) if self.fsdp else contextlib.nullcontext()

    def kept_until_backward(self, model: torch.nn.Module):
        """FSDP2: in the loss pass, each unit gathered once per micro-batch, for its forward and its backward
        (sharding.kept_until_backward)."""
        return sharding.kept_until_backward(model) if self.fsdp else contextlib.nullcontext()

    def loss_indices(self, loss_mask: torch.Tensor) -> torch.Tensor | None:
        """(n,) the completions of a rollout's loss mask (N, T) with a loss token: the others (dropped groups,
        masked samples) need no forward. None (every completion) under FSDP2, whose forward and backward are
        collectives: every rank runs as many micro-batches."""
        return None if self.fsdp else loss_mask.any(dim=1).nonzero().squeeze(1)

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """FSDP2: this rank's shard of each sharded tensor; the tensors themselves with whole weights."""
        return [sharding.local(t) for t in tensors] if self.fsdp else list(tensors)

    def broadcast_from_main(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite these tensors on every rank with rank 0's values."""
        with torch.no_grad():
            for tensor in tensors:
                torch.distributed.broadcast(tensor.data, src=0)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (each rank's loss is its share of the global loss);
        under FSDP2 the backward pass has already reduced them (summed, into each rank's shard)."""
        if not self.fsdp:
            _sum_grads_over_ranks(params, self.sum)

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # on the GPU for an NCCL-only group
        torch.distributed.all_reduce(t)
        return t.tolist()

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0

    def my_share(self, values: Sequence, per_round: int, group: int = 1) -> Sequence:
        """This rank's whole groups of a round of `per_round` prompts: prompts r*share .. (r+1)*share, share =
        per_round // world_size, with `group` entries of `values` per prompt (rows: 1; completions: G)."""
        per_rank = per_round // self.world_size * group  # entries of `values`
        return values[self.rank * per_rank:(self.rank + 1) * per_rank]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor in rank order (rank r holds the prompts after ranks 0..r-1)."""
        return torch.cat(self.gather_objects(values.cpu()))

    def gather_objects(self, value: Any) -> list:
        """Every rank's picklable value, in rank order."""
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out

    def combined(self, stats: Any) -> Any:
        """A per-rank statistics dataclass combined over the ranks, each field as its metadata says
        (`over_ranks`): "cat" a list of tensors into one tensor in rank order, "sum" a number over the ranks,
        "max" the largest; a dict field combines each of its values so (forge/run/step_stats.py)."""
        values = {}
        for f in dataclasses.fields(stats):
            how, value = f.metadata.get("over_ranks"), getattr(stats, f.name)
            if how is not None:
                values[f.name] = ({key: self._combine(how, part) for key, part in value.items()}
                                  if isinstance(value, dict) else self._combine(how, value))
        return dataclasses.replace(stats, **values)

    def _combine(self, how: str, value: Any) -> Any:
        if how == "cat":
            return [self.gather(torch.cat(value))] if value else []
        if how == "sum":
            return self.sum([float(value)])[0]
        return self.max(value)

    def barrier(self) -> None:
        torch.distributed.barrier()


class OneProcess(DataParallel):
    """One process: the whole model and every prompt here, nothing to sum, gather or shard. Each collective of
    DataParallel is the value it was given (its docstring says what it does with several), so the trainer calls
    them alike for one process and for N, and a one-process step enters no process-group code."""

    def sum_shards(self, values: list[float]) -> list[float]:
        return values

    def whole_weights(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def kept_until_backward(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def broadcast_from_main(self, tensors: list[torch.Tensor]) -> None:
        pass

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, value: float) -> float:
        return value

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def my_share(self, values: Sequence, per_round: int, group: int = 1) -> Sequence:
        return values[:per_round * group]  # the whole round

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def gather_objects(self, value: Any) -> list:
        return [value]

    def combined(self, stats: Any) -> Any:
        return stats

    def barrier(self) -> None:
        pass


def _sum_grads_over_ranks(params: list[torch.nn.Parameter], sum_over_ranks) -> None:
    """The all-reduce of `DataParallel.all_reduce_grads`, in flat buckets of at most _GRAD_BUCKET_ELEMENTS.

    A parameter that has a gradient on some rank gets zeros where it has none, so every rank reduces the same
    tensors; one without a gradient anywhere keeps grad None, as in a single process."""
    has_grad = sum_over_ranks([float(p.grad is not None) for p in params])  # (params,) ranks with a gradient
    grads = []
    for p, ranks in zip(params, has_grad):
        if ranks and p.grad is None:
            p.grad = torch.zeros_like(p)
        if ranks:
            grads.append(p.grad)
    buckets, size = [[]], 0
    for g in grads:
        if buckets[-1] and size + g.numel() > _GRAD_BUCKET_ELEMENTS:
            buckets, size = [*buckets, []], 0
        buckets[-1].append(g)
        size += g.numel()
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([g.flatten() for g in bucket])  # (bucket elements,)
        torch.distributed.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
