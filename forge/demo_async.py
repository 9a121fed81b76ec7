"""`forge demo --async`: where the sampler runs, and who waited on whom.

With the own decode loop the rollout worker is a process of the trainer's (GRPOConfig.sampler_threads: half
the cores); on vLLM (`--generation_backend vllm`) it is a `forge vllm-serve` the demo starts on half the cores
and stops at the end (forge/model/local_server.py), and the worker only asks it. `async_summary` reads the
async/* metrics back from the training log for the demo's result.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from forge.model.local_server import local_server, split_cores


@contextlib.contextmanager
def sampling_server(settings, run):
    """--async on vLLM: a `forge vllm-serve` of the demo's model on half the cores (the training process keeps
    the other half), yielding the GRPOConfig fields that point the rollout worker at it; otherwise nothing."""
    if not (settings.asynchronous and settings.generation_backend == "vllm"):
        yield {}
        return
    trainer_cores, server_cores = split_cores(sorted(os.sched_getaffinity(0)))
    torch.set_num_threads(len(trainer_cores))
    run.say(f"starting a vLLM server on core(s) {server_cores} (its log: {run.out / 'vllm_server.log'})")
    with local_server(settings.model, settings.dtype, server_cores, run.out / "vllm_server.log") as url:
        yield {"vllm_mode": "server", "vllm_server_base_url": url, "vllm_server_timeout": 900.0}


def async_summary(log_path: Path) -> dict:
    """Who waited on whom over an async run: the per-step means of the async/* metrics and their sums."""
    rows = [row for row in map(json.loads, log_path.read_text().splitlines())
            if "async/trainer_wait_s" in row]
    total = {key: sum(row[f"async/{key}"] for row in rows)
             for key in ("trainer_wait_s", "sampler_idle_s", "sampler_s")}
    return {"steps": len(rows), "trainer_wait_s_total": total["trainer_wait_s"],
            "sampler_idle_s_total": total["sampler_idle_s"], "sampler_s_total": total["sampler_s"],
            "step_seconds_total": sum(row["step_time"] for row in rows),
            "staleness_max": max((row["async/staleness_max"] for row in rows), default=0.0)}
