"""Async GRPO's rollout source: a second process samples the next steps' groups while the trainer learns.

    trainer process (AsyncRollouts)                          sampling process (sample_forever)
      start(model, version)      -- a copy of the policy -->   its own threads and device
      run_ahead(steps)           -- each step's prompts and     waits for the weights of version
                                    noise, max_staleness        max(first, step - max_staleness), then
                                    steps early ------------>   samples the step's groups
      publish(version, weights)  -- after each optimizer  -->   reads the versions in order, loads the one
                                    step (shared memory)        each step needs
      take(step, prompts)        <-- the step's rollouts, the version that sampled them, the seconds idle

The schedule is fixed, not raced: step s is always sampled by version max(first, s - max_staleness), whatever
either side's speed, so a seeded run repeats its samples and weights, and max_staleness=0 is the synchronous
run's numbers on another process. A group is never older than max_staleness optimizer steps (first = the step
the run started or resumed at: a resumed run samples its first steps from the checkpoint's weights).

Weights go through shared memory as one flat float32 tensor of the trainable parameters (the LoRA adapters
only, under LoRA). The worker ignores Ctrl-C, SIGTERM and SIGHUP, which reach a whole process group (the
trainer finishes its step, saves it and stops the worker); it dies with the trainer (PR_SET_PDEATHSIG, and a
check while it waits); a failure in it reaches the trainer as one line naming the worker (RolloutWorkerError,
after which the run saves its last finished step and names it for --resume).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import multiprocessing
import queue
import signal
import sys
import time
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from forge.core.engine_rollout import generate_on_engine, open_engine
from forge.core.rollout import (
    Rollout,
    SamplingSettings,
    generate,
    prompt_budget,
    sampling_noise,
    sampling_seed,
)
from forge.model.decode_plan import DecodePlan, merged_adapters
from forge.run.loop import StepFailed

POLL_SECONDS = 0.5  # how often a waiting side looks whether the other is still there


class RolloutWorkerError(StepFailed):
    """The sampling process failed, died or stopped answering; the trainer's weights are those of its last
    finished step, which the run saves and names (forge/run/loop.py)."""


@dataclass
class SamplingRequest:
    """The groups of one optimizer step, as the synchronous step would sample them."""

    step: int  # the optimizer step that trains on them (global_step before it)
    rounds: list[tuple[list, torch.Tensor]]  # (prompts, noise (N, T)) per generate call of the step
    settings: SamplingSettings
    max_prompt_length: int


@dataclass
class Sampled:
    """What the worker sends back for one request."""

    step: int
    version: int  # the optimizer step whose weights sampled it
    rollouts: list[Rollout]
    idle_seconds: float  # the worker waiting, for this request or for its weights
    seconds: float  # sampling


@dataclass
class WorkerSpec:
    """Everything the sampling process needs, given once at its start."""

    model: torch.nn.Module  # its own copy of the policy
    tokenizer: object
    precision: object  # forge.model.precision.Precision
    trainable_names: list[str]  # the parameters each publish carries, in order
    version: int  # the weights' version: the trainer's global_step at start
    config: object  # the run's GRPOConfig: group_size, truncate_prompts, share_prompt_prefix, max_staleness,
    # merge_lora_for_generation, generation_backend (and the vLLM server's address)
    threads: int
    device: str  # where its copy runs: sampler_device, or the trainer's device


def flat_weights(params: list[torch.Tensor]) -> torch.Tensor:
    """(sum of numels,) float32 CPU copy of the parameters, one tensor: one shared-memory
    block per publish."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


def load_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat_weights tensor into `params` in place."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def needed_version(step: int, first: int, max_staleness: int) -> int:
    """The weights that sample step `step`: max_staleness steps before it, never before the run's first."""
    return max(first, step - max_staleness)


def sampling_request(config, model_config, step: int, rows: list[dict]) -> SamplingRequest:
    """Step `step`'s generate calls as GRPOTrainer.collect makes them: prompts_per_step rows each, with the
    noise the step's seeded generator draws for them (rollout.sampling_noise), and the sampling settings and
    prompt budget as the config stands when the step is sent."""
    settings = SamplingSettings.from_config(config)
    generator = torch.Generator().manual_seed(sampling_seed(config.seed, step))
    rounds = []
    for start in range(0, len(rows), config.prompts_per_step):
        prompts = [row["prompt"] for row in rows[start:start + config.prompts_per_step]]
        rounds.append((prompts, sampling_noise(generator, len(prompts) * config.group_size,
                                               settings.max_new_tokens)))
    budget = prompt_budget(model_config, settings.max_new_tokens, config.max_prompt_length)
    return SamplingRequest(step, rounds, settings, budget)


# --------------------------------------------------------------------------------------------------
# the sampling process


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the trainer dies, even by kill -9."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _get(q, what: str):
    """q.get(), giving up when the trainer is gone."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                raise SystemExit(f"the trainer exited while the rollout worker waited for {what}") from None


def sample_forever(spec: WorkerSpec, requests, weights, results) -> None:
    """The sampling process: serve requests in order until None, each with the weights its step needs."""
    # a terminal's or a job's stop reaches the whole group: the trainer finishes its step, saves it and
    # stops us
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    _die_with_parent()
    try:
        torch.set_num_threads(spec.threads)
        config, model = spec.config, spec.model.to(spec.device)
        model.eval()
        named = dict(model.named_parameters())
        trainable = [named[name] for name in spec.trainable_names]
        # vLLM or None
        engine = open_engine(config, model, spec.tokenizer, spec.precision.compute, worker=True)
        with spec.precision.autocast(model):
            plan = None if engine else DecodePlan.of(model, config.generation_backend, False)
        version, k = spec.version, config.max_staleness
        while True:
            waited = time.perf_counter()
            request = _get(requests, "the next step's prompts")
            if request is None:
                return
            while version < needed_version(request.step, spec.version, k):
                version, flat = _get(weights, f"the weights of step {request.step - k}")
                load_flat(trainable, flat)
            idle = time.perf_counter() - waited
            started = time.perf_counter()
            rollouts = sample(spec, model, engine, plan, request, version)
            results.put(_portable(Sampled(request.step, version, rollouts, idle,
                                          time.perf_counter() - started)))
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure reaches the trainer, with its traceback
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        results.put(("failed", last, traceback.format_exc()))
        sys.exit(1)


def sample(spec: WorkerSpec, model, engine, plan, request: SamplingRequest, version: int) -> list[Rollout]:
    """One step's rollouts: on the vLLM server (given the weights of `version` first, once), or with the own
    decode loop on the worker's copy of the policy, as the trainer's generate would."""
    config = spec.config
    group, budget, truncate = config.group_size, request.max_prompt_length, config.truncate_prompts
    if engine is not None:
        engine.sync(model, version)  # the server samples this step with these weights
        return [
            generate_on_engine(
                engine, spec.tokenizer, prompts, group, request.settings, budget, truncate, noise
            )
            for prompts, noise in request.rounds
        ]
    with (torch.no_grad(), spec.precision.autocast(model),
          merged_adapters(model, config.merge_lora_for_generation)):
        return [generate(model, spec.tokenizer, prompts, group, request.settings, budget, truncate,
                         config.share_prompt_prefix, noise, plan=plan) for prompts, noise in request.rounds]


# --------------------------------------------------------------------------------------------------
# the trainer's side


@dataclass
class AsyncStats:
    """Who waited on whom, for the step just taken (the async/* metrics)."""

    staleness: int = 0  # global_step - the version that sampled the step (one version samples a whole step)
    trainer_wait_s: float = 0.0  # the trainer blocked on take()
    sampler_idle_s: float = 0.0  # the worker waiting for a request or for weights, before this step
    sampler_s: float = 0.0  # the worker sampling this step
    queue_length: int = 0  # steps sampled and waiting when the trainer asked

    def as_metrics(self) -> dict:
        """async/*: staleness, who waited on whom, and the queue of sampled steps (docs/metrics.md)."""
        return {"async/staleness_mean": float(self.staleness), "async/staleness_max": float(self.staleness),
                "async/trainer_wait_s": self.trainer_wait_s, "async/sampler_idle_s": self.sampler_idle_s,
                "async/sampler_s": self.sampler_s, "async/queue_length": float(self.queue_length)}


class AsyncRollouts:
    """The trainer's handle on the sampling process (module docstring)."""

    def __init__(self, max_staleness: int, threads: int = 0, device: str | None = None,
                 timeout: float | None = None):
        self.max_staleness = max_staleness
        self.threads = threads or max(1, torch.get_num_threads() // 2)  # of the cores torch would use
        self.trainer_threads = None  # the trainer's torch threads before the worker took its share
        self.device, self.timeout = device, timeout  # timeout: seconds one step's groups may take; None: none
        self.process = None
        self.pending: list[Rollout] = []  # the rollouts of the step being collected, in generate order
        self.version = 0  # the weights that sampled them
        self.stats = AsyncStats()

    @classmethod
    def of_run(cls, config, world_size: int, tool_settings) -> AsyncRollouts | None:
        """The rollout worker of a run with this GRPOConfig; None when max_staleness is None (the run samples
        in its own process)."""
        if config.max_staleness is None:
            return None
        if world_size > 1:
            raise ValueError("max_staleness (async GRPO) runs one trainer process and one sampling process; "
                             "with several processes (--nproc, torchrun) leave max_staleness=None")
        if tool_settings is not None:
            raise ValueError("max_staleness (async GRPO) does not sample tool or environment rollouts yet; "
                             "leave max_staleness=None with tools= or environment_factory=")
        return cls(config.max_staleness, config.sampler_threads, config.sampler_device,
                   config.rollout_timeout)

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, model, tokenizer, precision, config, trainable: list[torch.nn.Parameter],
              version: int) -> None:
        """Start the sampling process with a copy of `model` (weights of step `version`)."""
        names = {id(p): name for name, p in model.named_parameters()}
        missing = sum(id(p) not in names for p in trainable)
        if missing:
            raise ValueError("async GRPO publishes the trainable parameters by name; "
                             f"{missing} of them are not parameters of the model")
        ctx = mp.get_context("spawn")
        self.requests, self.weights, self.results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        device = self.device or str(next(model.parameters()).device)
        spec = WorkerSpec(_copy_for_worker(model), tokenizer, precision, [names[id(p)] for p in trainable],
                          version, config, self.threads, device)
        own_loop = config.generation_backend != "vllm"  # on vLLM the server samples; the worker only asks
        # the processes split the cores
        if own_loop and self.device is None and precision.device_type == "cpu":
            self.trainer_threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self.trainer_threads - self.threads))
        self.process = ctx.Process(
            target=sample_forever,
            args=(spec, self.requests, self.weights, self.results),
            name="forge-rollout-worker",
            daemon=True,
        )
        with _main_module_hidden():
            self.process.start()

    def schedule(self, steps: Iterator, trainer) -> Iterator:
        """The run's steps (rows, epoch, position) as the loop walks them (forge/run/loop.py), each step's
        rows sent to the worker max_staleness steps before the step. The worker starts from the trainer's
        weights as they are when the loop asks for the first step, and stops when the steps end or
        the loop leaves."""
        window: list = []
        step = first = trainer.global_step
        self.start(trainer.model, trainer.tokenizer, trainer.precision, trainer.config, trainer.trainable,
                   first)
        try:
            for item in steps:
                if step < trainer.total_steps:
                    self.requests.put(sampling_request(trainer.config, trainer.model.config, step, item[0]))
                window.append(item)
                step += 1
                if len(window) > self.max_staleness:
                    yield window.pop(0)
            while window:
                yield window.pop(0)
        finally:
            self.close()

    def publish(self, version: int, trainable: list[torch.Tensor]) -> None:
        """The weights after optimizer step `version`, for the steps that need them."""
        if self.running:
            self.weights.put((version, flat_weights(trainable)))

    def take(self, step: int, prompts: list) -> Rollout:
        """The next rollout of step `step` (its groups come in the order the step asks for them)."""
        if not self.pending:
            self.stats = AsyncStats()
            waited = time.perf_counter()
            sampled = self._next()
            self.stats.trainer_wait_s = time.perf_counter() - waited
            if sampled.step != step:
                raise RolloutWorkerError(
                    f"rollout worker: sent the groups of step {sampled.step + 1} when step "
                    f"{step + 1} asked (the schedule broke; this is a bug in Forge)"
                )
            self.pending = list(sampled.rollouts)
            self.stats.sampler_idle_s, self.stats.sampler_s = sampled.idle_seconds, sampled.seconds
            self.stats.staleness = step - sampled.version
            self.version = sampled.version
        rollout = self.pending.pop(0)
        if rollout.num_prompts != len(prompts):
            raise RolloutWorkerError(
                f"rollout worker: {rollout.num_prompts} prompts sampled for step {step + 1}, "
                f"which asks for {len(prompts)} (a bug in Forge)"
            )
        rollout.policy_version = self.version
        return rollout

    def _next(self) -> Sampled:
        """The next Sampled from the worker; a failure, death or timeout raises RolloutWorkerError."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                got = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    raise RolloutWorkerError(
                        f"rollout worker (pid {self.process.pid}) died with exit code {code}"
                        f"{' (killed by signal ' + str(-code) + ')' if code is not None and code < 0 else ''}"
                        " before sending its groups") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise RolloutWorkerError(
                        f"rollout worker (pid {self.process.pid}) sent nothing for {self.timeout:.0f} s "
                        "(rollout_timeout)") from None
                continue
            except (EOFError, OSError) as error:  # the worker died while its message was on the way
                raise RolloutWorkerError(f"rollout worker (pid {self.process.pid}) broke off its message: "
                                         f"{error}") from None
            if isinstance(got, tuple) and got and got[0] == "failed":
                raise RolloutWorkerError(f"rollout worker (pid {self.process.pid}) failed: {got[1]}\n"
                                         f"its traceback:\n{got[2]}")
            self.stats.queue_length = self.results.qsize() if _has_qsize() else 0
            got.rollouts = [_with_fields(r, np.ndarray, torch.from_numpy) for r in got.rollouts]
            return got

    def close(self) -> None:
        """Stop the worker (it finishes nothing more); idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if self.trainer_threads is not None:  # the cores go back to the trainer (evaluation, saving)
            torch.set_num_threads(self.trainer_threads)
            self.trainer_threads = None
        with contextlib.suppress(Exception):
            self.requests.put(None)
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        for q in (self.requests, self.weights, self.results):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()


def _portable(sampled: Sampled) -> Sampled:
    """The worker's answer with its tensors as numpy arrays, which a queue sends by value: tensors would be
    sent as shared memory whose file descriptors the trainer fetches from the worker, so a worker that dies
    after sending would take its answer with it."""
    return dataclasses.replace(sampled, rollouts=[_with_fields(r, torch.Tensor, torch.Tensor.numpy)
                                                  for r in sampled.rollouts])


def _with_fields(rollout: Rollout, kind: type, convert) -> Rollout:
    """A copy of `rollout` with each field of type `kind` converted (tensors to numpy arrays, and back), those
    computed when it was built too (set on the copy, not computed again from numpy arrays)."""
    converted = copy.copy(rollout)
    for f in dataclasses.fields(rollout):
        if isinstance(value := getattr(rollout, f.name), kind):
            setattr(converted, f.name, convert(value))
    return converted


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned process runs the parent's main script again unless it sits under `if __name__ == "__main__"`,
    which TRL-style training scripts rarely do: the worker needs none of it, so it is not told of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _copy_for_worker(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the policy for the sampling process, on the CPU: its tensors move to shared memory when the
    process starts (so the trainer's own weights never do), and the worker moves it to its device."""
    return copy.deepcopy(model).cpu()


def _has_qsize() -> bool:
    return sys.platform != "darwin"  # macOS's multiprocessing queues have no qsize
