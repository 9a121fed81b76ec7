"""The cost of checkpoints that hold no pickle: save and load times against torch's pickle formats.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/checkpoint_format.py sharded [ROUNDS]
    python bench/checkpoint_format.py state [ROUNDS] [MODEL]

sharded: the shards of an FSDP2 run (the tiny model, AdamW state after one step, 2 gloo ranks on the CPU):
    torch.distributed.checkpoint's default format (.distcp files and a pickled .metadata, read back with
    pickle and torch.load) against Forge's (`save_sharded_checkpoint`'s shards: safetensors through DCP's
    Hugging Face storage plus layout.json; `load_sharded_state`).
state: the optimizer state of a whole-model run (MODEL: tiny, or a folder such as the packaged SmolLM2):
    torch.save / torch.load(weights_only=True) against forge.run.state_files.save_state / load_state.
Prints the median seconds of ROUNDS (default 7) of each, and the ratio Forge / torch.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from forge.model.tiny import build_tiny_model
from forge.run import checkpoint as ckpt
from forge.run import state_files


def one_step(model, tokenizer):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids = tokenizer("What is 12 + 7? Answer: 19", return_tensors="pt").input_ids  # (1, T)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    return optimizer


def timed(function, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sharded(rounds: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from forge.parallel import sharding

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, tokenizer = build_tiny_model(seed=0)
    sharding.shard(model, None)
    optimizer = one_step(model, tokenizer)
    work = Path(tempfile.mkdtemp(prefix="forge-ckpt-bench-")) if rank == 0 else None
    shared = [str(work)]
    dist.broadcast_object_list(shared)
    work = Path(shared[0])

    def barrier_after(function):
        def run():
            function()
            dist.barrier()
        return run

    def torch_save():
        dcp.save(sharding.state_dicts(model, optimizer), checkpoint_id=str(work / "torch"))

    def torch_load():
        state = sharding.state_dicts(model, optimizer)
        dcp.load(state, checkpoint_id=str(work / "torch"))
        sharding.set_state(model, optimizer, state)

    def forge_save():
        ckpt._save_shards(work / "forge", model, optimizer, rank == 0)

    def forge_load():
        ckpt.load_sharded_state(work / "forge", model, optimizer)

    (work / "forge").mkdir(exist_ok=True)
    results = {name: timed(barrier_after(f), rounds) for name, f in
               [("torch save", torch_save), ("forge save", forge_save), ("torch load", torch_load),
                ("forge load", forge_load)]}
    if rank == 0:
        size = {kind: sum(p.stat().st_size for p in (work / kind).rglob("*") if p.is_file())
                for kind in ("torch", "forge")}
        print(f"sharded tiny model, 2 gloo ranks, median of {rounds}: " + ", ".join(
            f"{name} {seconds * 1000:.1f} ms" for name, seconds in results.items()))
        print(f"  save forge/torch {results['forge save'] / results['torch save']:.2f}x, load forge/torch "
              f"{results['forge load'] / results['torch load']:.2f}x; bytes torch {size['torch']}, forge {size['forge']}")
        shutil.rmtree(work)
    dist.destroy_process_group()


def state(rounds: int, model_name: str) -> None:
    if model_name == "tiny":
        model, tokenizer = build_tiny_model(seed=0)
    else:
        from forge.model.loading import load_model
        model, tokenizer = load_model(model_name, dtype="float32")
    optimizer_state = one_step(model, tokenizer).state_dict()
    work = Path(tempfile.mkdtemp(prefix="forge-state-bench-"))
    results = {
        "torch save": timed(lambda: torch.save(optimizer_state, work / "optimizer.pt"), rounds),
        "forge save": timed(lambda: state_files.save_state(work / "optimizer.safetensors", optimizer_state), rounds),
        "torch load": timed(lambda: torch.load(work / "optimizer.pt", weights_only=True), rounds),
        "forge load": timed(lambda: state_files.load_state(work / "optimizer.safetensors"), rounds),
    }
    print(f"optimizer state of {model_name}, median of {rounds}: " + ", ".join(
        f"{name} {seconds * 1000:.1f} ms" for name, seconds in results.items()))
    print(f"  save forge/torch {results['forge save'] / results['torch save']:.2f}x, load forge/torch "
          f"{results['forge load'] / results['torch load']:.2f}x; bytes torch {(work / 'optimizer.pt').stat().st_size}, "
          f"forge {(work / 'optimizer.safetensors').stat().st_size}")
    shutil.rmtree(work)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "sharded"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    if what == "sharded":
        sharded(count)
    else:
        state(count, sys.argv[3] if len(sys.argv) > 3 else "tiny")
