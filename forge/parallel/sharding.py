"""FSDP2 for a Forge run (GRPOConfig.fsdp, `forge train --nproc N --fsdp`): PyTorch's `fully_shard`, wired in.

Data parallelism keeps the whole model, its gradients and both AdamW moments on every rank: 16 bytes per
trained fp32 parameter per rank. Under FSDP2 every rank keeps 1/N of each, as DTensor shards, and gathers
whole weights only while it needs them:

    shard(model, dist)      fully_shard on every decoder layer (the classes the model names in
                            _no_split_modules), then on the whole model; gradients are summed over the ranks
                            (not averaged), as Forge's own all-reduce does: each rank's loss is its share
    gathered(model)         the rollout and evaluation: every layer all-gathered once, kept whole while the
                            ranks decode (each rank stops at its own EOS; no collective per token), resharded
                            after. Peak memory: the whole weights plus the shards
    forward / backward      FSDP2's per-layer all-gather in forward and reduce-scatter in backward replace
                            Forge's gradient all-reduce; clipping and AdamW run on the shards
    save / load             torch.distributed.checkpoint (DCP) through its Hugging Face storage: every rank
                            writes its shards of the weights and the AdamW state into {checkpoint}/sharded/ as
                            one safetensors file (each shard's offsets in its JSON header); the reader
                            rebuilds the index from those headers, so no file is unpickled (DCP's own format
                            pickles its .metadata). DCP reshards on load, so a run can resume on another
                            number of ranks (then not bit for bit: sums run in another order)
    full_state_dict(model)  the whole weights on rank 0's CPU, for final/ (a plain from_pretrained folder)

Only the trainer (and, through CheckpointParts, the checkpoint code) uses this module.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from forge.safe_json import read_json

SHARDED_DIR = "sharded"
"""The DCP folder of a sharded checkpoint: one safetensors file of model and optimizer shards per rank."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter or gradient (a DTensor); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes its HF model names in `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a PeftModel
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"fsdp=True: cannot find the decoder layers of {type(base).__name__} (it names no "
                         f"_no_split_modules classes that it contains), so there is nothing to shard per "
                         f"layer; train it data-parallel (fsdp=False) or with LoRA")
    return layers


def shard(model: torch.nn.Module, device: torch.device | None) -> torch.nn.Module:
    """Shard `model` in place over every rank of the process group: each decoder layer, then the rest.

    A model on the CPU is moved shard by shard to `device` (this rank's GPU) when one is given."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = device.type if device is not None else "cpu"
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in _fsdp_modules(model):  # each FSDP unit has its own settings
        module.set_gradient_divide_factor(1.0)  # a sum over the ranks, like DataParallel.all_reduce_grads
        module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module):
    """Whole weights on every rank inside the block (generation, evaluation), shards again after.

    Inside it a forward runs no collective, so ranks may decode different numbers of tokens."""
    modules = _fsdp_modules(model)
    for module in modules:
        module.unshard()  # all-gather, in the same order on every rank
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:  # the root keeps its weights after forward, as fully_shard sets it up
            module.set_reshard_after_forward(module is not model, recurse=False)
            module.reshard()


@contextmanager
def kept_until_backward(model: torch.nn.Module, enabled: bool = True):
    """In the loss pass: each unit, once all-gathered for a micro-batch's forward, stays whole through that
    micro-batch's backward (one all-gather per unit instead of one per forward plus one in backward); FSDP2
    reshards it after its backward. Peak memory: the whole weights plus the activations."""
    modules = [m for m in _fsdp_modules(model) if m is not model] if enabled else []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_reshard_after_forward(True, recurse=False)


def state_dicts(model, optimizer) -> dict:
    """{"model": ..., "optimizer": ...}: this rank's shards as DTensors, and the optimizer's settings
    (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every rank writes its shards of `tensors` ({key: DTensor or tensor}) to `directory`, one safetensors
    file per rank; a tensor every rank holds whole is written once (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _first_failure():
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


def load_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` in place from what `save_tensors` wrote, on any number of ranks (collective). Reads the
    safetensors headers (JSON) and tensor bytes only: nothing is unpickled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _first_failure():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)))


@contextmanager
def _first_failure():
    """DCP reports a failure of any rank on every rank as a CheckpointException, a BaseException whose message
    is every rank's traceback: raise the first rank's own exception instead (an OSError of a full disk stays
    one)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failures = [pair[0] for _, pair in sorted(error.failures.items()) if isinstance(pair, tuple) and pair]
        if not failures or not isinstance(failures[0], Exception):
            raise
        raise failures[0] from error


def set_state(model, optimizer, state: dict) -> None:
    """Put a state of `state_dicts`'s shape into the sharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole weights as plain CPU tensors on rank 0 (an empty dict on the other ranks); collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unwrapped_class_name(model) -> str:
    """The model's own class name: fully_shard makes the class FSDP<Name>, which save_pretrained would write
    into config.json's `architectures`."""
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def fix_architectures(folder: Path, model) -> None:
    """Write the unwrapped class name into a saved config.json (see unwrapped_class_name)."""
    config = folder / "config.json"
    if config.is_file():
        data = read_json(config)
        data["architectures"] = [unwrapped_class_name(model)]
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["SHARDED_DIR", "decoder_layers", "fix_architectures", "full_state_dict", "gathered",
           "kept_until_backward", "load_tensors", "local", "save_tensors", "set_state", "shard",
           "state_dicts"]
