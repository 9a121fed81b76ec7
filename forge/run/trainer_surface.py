"""The part of transformers' Trainer a TRL script touches, around a Forge run (docs/from-trl.md).

    GRPOTrainer(..., callbacks=[MyCallback()])     transformers' own TrainerCallback objects
    trainer.state.log_history / .global_step / .epoch      transformers' own TrainerState
    trainer.save_model(path), trainer.evaluate(), trainer.train(resume_from_checkpoint=True)
    trainer.model, trainer.processing_class, trainer.args (the GRPOConfig)
    trainer.accelerator.print(...), trainer.end()          what TRL's scripts call after training
    result = trainer.train(); result.metrics; trainer.log_metrics / save_metrics("train", ...); save_state()

`RunEvents` holds transformers' CallbackHandler, TrainerState and TrainerControl for one trainer; the run loop
(forge/run/loop.py) reports to it once per event, and the callbacks receive `args, state, control` as in
transformers:

    on_init_end       the trainer is built
    on_train_begin    after resuming and the preflight, before the first step
    on_epoch_begin / on_epoch_end    around each pass over the dataset
    on_step_begin / on_step_end      around each optimizer step; on_step_end before the step is logged,
                                     evaluated and saved, so a callback can ask for those
    on_log            each row written to training_log.jsonl (training and eval_ rows), after it joins
                      state.log_history
    on_evaluate       after an evaluation, with its eval_ metrics
    on_save           after a numbered checkpoint is written
    on_train_end      after final/ is written

A callback that sets `control.should_training_stop` ends the run after that step as reaching max_steps does:
the step is logged, final/ is saved, on_train_end is called. `should_save`, `should_evaluate` and `should_log`
add a numbered checkpoint, an evaluation or a log row at that step; `should_epoch_stop` is not read. `args` is
the GRPOConfig: a callback reads `args.output_dir`, `args.logging_steps`, ... (Forge's field names,
docs/config.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerControl, TrainerState
from transformers import trainer_pt_utils as transformers_trainer
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging as transformers_logging

from forge.data.dataset import checked_rows
from forge.model.decode_plan import merged_adapters
from forge.model.export import forge_checkpoint


class RunEvents:
    """transformers' callback machinery for one trainer: `handler` calls the callbacks, `state` and `control`
    are what they see and set. The loop calls one method per event; each returns nothing and
    keeps `control`."""

    def __init__(self, callbacks: list | None, args: Any, model: Any, tokenizer: Any, optimizer: Any,
                 is_main: bool = True):
        # transformers warns when its DefaultFlowCallback is missing: here Forge's loop decides when to log,
        # evaluate and save (the callback would read TrainingArguments fields the GRPOConfig does not have).
        quiet = transformers_logging.get_logger("transformers.trainer_callback")
        level = quiet.level
        quiet.setLevel(transformers_logging.ERROR)
        try:
            self.handler = CallbackHandler(list(callbacks or []), model, tokenizer, optimizer, None)
        finally:
            quiet.setLevel(level)
        self.args = args
        self.state = TrainerState(is_local_process_zero=int(os.environ.get("LOCAL_RANK", "0")) == 0,
                                  is_world_process_zero=is_main)
        self.control = TrainerControl()
        self.epoch_seen: int | None = None  # the epoch on_epoch_begin was last called for
        self.call("on_init_end")

    def call(self, event: str, **kwargs: Any) -> None:
        self.control = getattr(self.handler, event)(self.args, self.state, self.control, **kwargs)

    def train_begin(self, args: Any, total_steps: int, global_step: int, scheduler: Any) -> None:
        self.args = args
        self.handler.lr_scheduler = scheduler
        state = self.state
        state.max_steps, state.global_step = total_steps, global_step
        state.num_train_epochs = args.num_train_epochs
        state.logging_steps, state.eval_steps = args.logging_steps, args.eval_steps
        state.save_steps = args.save_steps
        state.train_batch_size = args.prompts_per_step * args.group_size  # completions per rollout batch
        self.epoch_seen = None
        self.call("on_train_begin")

    def step_begin(self, epoch: int) -> None:
        if epoch != self.epoch_seen:
            if self.epoch_seen is not None:
                self.call("on_epoch_end")
            self.epoch_seen = epoch
            self.call("on_epoch_begin")
        self.call("on_step_begin")

    def step_end(self, global_step: int, epoch: float) -> None:
        self.state.global_step, self.state.epoch = global_step, epoch
        self.call("on_step_end")

    def log(self, metrics: dict, step: int, epoch: float) -> None:
        """A row of training_log.jsonl: its numbers, with step and epoch, join state.log_history;
        on_log gets them."""
        row = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        row |= {"epoch": epoch, "step": step}
        self.state.log_history.append(row)
        self.call("on_log", logs=row)

    def evaluated(self, metrics: dict) -> None:
        self.call("on_evaluate", metrics=metrics)

    def saved(self) -> None:
        self.call("on_save")

    def train_end(self) -> None:
        if self.epoch_seen is not None:
            self.call("on_epoch_end")
        self.call("on_train_end")


class TrainResult(dict):
    """What train() returns: {'global_step': n}, with transformers' TrainOutput's fields as attributes
    (`global_step`, `training_loss`, and `metrics`, the run's summary row: train_runtime, train_loss,
    train_samples_per_second, train_steps_per_second, epoch)."""

    def __init__(self, global_step: int, summary: dict) -> None:
        super().__init__(global_step=global_step)
        self.global_step, self.metrics = global_step, dict(summary)
        self.training_loss = self.metrics.get("train_loss", float("nan"))


class ScriptAccelerator:
    """What a TRL script reads of `trainer.accelerator` (accelerate's Accelerator, which Forge does not use):
    which process this is, `print` on the main process only, `wait_for_everyone`."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist

    @property
    def is_main_process(self) -> bool:
        return self.dist.is_main

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def process_index(self) -> int:
        return self.dist.rank

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def num_processes(self) -> int:
        return self.dist.world_size

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.dist.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.dist.barrier()


def with_resume(config: Any, resume_from_checkpoint: bool | str | None) -> Any:
    """The config with TRL's train(resume_from_checkpoint=) applied: True = the newest checkpoint in
    output_dir (resume_from='latest'), a path = that checkpoint; None or False leave it as it is."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return config
    where = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
    return config.replace(resume_from=where)  # GRPOConfig.replace: the TRL values given kept


def taking_quantization_config(init):
    """A trainer's __init__ that also takes TRL's quantization_config: None, which TRL's scripts pass unless
    asked to quantize (--load_in_4bit / --load_in_8bit), is accepted; a value is refused."""

    @functools.wraps(init)
    def wrapped(self, *args: Any, quantization_config: Any = None, **kwargs: Any) -> None:
        if quantization_config is not None:
            raise TypeError(
                f"{type(self).__name__}(quantization_config=...): Forge trains unquantized weights "
                f"(float32 masters, LoRA or full); load the model unquantized, or leave "
                f"quantization_config out"
            )
        init(self, *args, **kwargs)

    signature = inspect.signature(init)
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    parameters.insert(at, inspect.Parameter("quantization_config", inspect.Parameter.KEYWORD_ONLY,
                                            default=None))
    wrapped.__signature__ = signature.replace(parameters=parameters)
    return wrapped


class TrainerSurface:
    """Mixed into GRPOTrainer: transformers Trainer's names for what Forge's trainer has (`events` is its
    RunEvents, `config` its GRPOConfig, `tokenizer`, `model`, `dist`, `eval_dataset`), and TRL's trainer
    keyword quantization_config on the __init__ of every trainer class (taking_quantization_config)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = taking_quantization_config(cls.__dict__["__init__"])

    @property
    def state(self) -> TrainerState:
        return self.events.state

    @property
    def control(self) -> TrainerControl:
        return self.events.control

    @property
    def callback_handler(self) -> CallbackHandler:
        return self.events.handler

    @property
    def args(self):
        return self.config

    @property
    def processing_class(self):
        return self.tokenizer

    # transformers' Trainer.log_metrics / save_metrics / save_state, which its example scripts and open-r1
    # call after train() and evaluate(): the metrics printed, {output_dir}/{split}_results.json and
    # all_results.json, {output_dir}/trainer_state.json (the main process)
    log_metrics = transformers_trainer.log_metrics
    save_metrics = transformers_trainer.save_metrics
    save_state = transformers_trainer.save_state

    def is_world_process_zero(self) -> bool:
        return self.dist.is_main

    def is_local_process_zero(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    @property
    def accelerator(self) -> ScriptAccelerator:
        return ScriptAccelerator(self.dist)

    def end(self) -> None:
        """transformers' Trainer.end(), the last line of TRL's scripts: the trackers closed when train()
        returned; this ends the processes' group, as transformers does (a later collective fails)."""
        if self.dist.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def add_callback(self, callback) -> None:
        self.events.handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.events.handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.events.handler.remove_callback(callback)

    @contextlib.contextmanager
    def sampling(self):
        """The policy as sampling runs it: the run's autocast, whole weights, LoRA merged, vLLM synced."""
        if self.engine is not None:
            self.engine.sync(self.model, self.global_step)
        with self.precision.autocast(self.model), self.dist.whole_weights(self.model), merged_adapters(
                self.model, self.config.merge_lora_for_generation and not self.dist.fsdp):
            yield

    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """The evaluator's metrics on `rows` (default: eval_dataset) in the run's precision, whole merged
        weights, named as transformers' Trainer.evaluate names them: eval_<metric>, eval_runtime (seconds) and
        eval_samples_per_second (rows)."""
        rows = self.eval_rows() if rows is None else rows
        started = time.perf_counter()
        with self.sampling():
            metrics = self.evaluator(self.model, self.tokenizer, rows,
                                     max_new_tokens=self.config.max_new_tokens,
                                     max_prompt_length=self.max_prompt_length)
        runtime = time.perf_counter() - started
        return {**{f"eval_{key}": value for key, value in metrics.items()}, "eval_runtime": runtime,
                "eval_samples_per_second": len(rows) / max(runtime, 1e-9)}

    def eval_rows(self) -> list[dict]:
        """The rows of eval_dataset, checked, for evaluate() without rows."""
        if self.eval_dataset is None:
            raise ValueError(
                "evaluate() without rows evaluates eval_dataset, and this trainer has none: pass "
                "GRPOTrainer(..., eval_dataset=...) or trainer.evaluate(rows)"
            )
        return checked_rows(self.eval_dataset)

    def save_model(self, output_dir: str | os.PathLike | None = None) -> Path:
        """Write the model as it is now (the adapter alone under LoRA, as peft saves it) and its tokenizer
        into `output_dir` (default: the config's output_dir), next to what the folder holds; returns the
        folder. A Forge checkpoint (a numbered one, final/) is refused as `forge export` refuses it: writing
        into it would break it."""
        path = Path(self.config.output_dir if output_dir is None else output_dir)
        if self.dist.fsdp:
            raise ValueError(
                f"save_model under fsdp=True: the weights are sharded over the processes; the run "
                f"writes them whole to {Path(self.config.output_dir) / 'final'} when it ends"
            )
        checkpoint = forge_checkpoint(path) if path.is_dir() else None
        if checkpoint is not None:
            raise ValueError(
                f"save_model({str(path)!r}): {path} holds {checkpoint}; writing the model into it would "
                f"change files its COMPLETE records, so it would no longer verify or resume. Save to a "
                f"new folder (e.g. {Path(self.config.output_dir) / 'saved'})"
            )
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(path, safe_serialization=True)
            self.tokenizer.save_pretrained(path)
        self.dist.barrier()
        return path


__all__ = ["RunEvents", "ScriptAccelerator", "TrainResult", "TrainerSurface", "taking_quantization_config",
           "with_resume"]
