"""A checkpoint whose files were changed and COMPLETE rehashed to match (what anyone handing over a checkpoint
can do): every field is checked against what the resuming run expects, and each refusal is one line naming the
checkpoint and the file (a CheckpointError: exit code 1 on the command line). None of these plants runs code;
each would change the run: weights read from outside the folder, gradient ascent, a run that ends at once,
weights cast silently, or a traceback."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_attacks import CONFIG, OneRank, one_rank_group, rehash, sharded_model  # noqa: F401

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model
from forge.run import state_files
from forge.run.integrity import CheckpointError

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer(output_dir: Path, **overrides) -> GRPOTrainer:
    values = {"group_size": 2, "max_new_tokens": 4, "gradient_accumulation_steps": 1, "max_steps": 1,
              "save_steps": 1, "logging_steps": 1, "kl_beta": 0.0, "preflight": "off", "output_dir": str(output_dir)}
    model, tokenizer = build_tiny_model()
    return GRPOTrainer(model, tokenizer, text_length, GRPOConfig(**(values | overrides)))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fields") / "run"
    trainer(run).train(ROWS)
    return run


@pytest.fixture
def run(saved_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy, symlinks=True)
    return copy


def resume(run: Path) -> str:
    """Resume `run` from its checkpoint 1 after the plant (COMPLETE rehashed); the one-line refusal."""
    rehash(run / "checkpoint-1")
    with pytest.raises(CheckpointError) as caught:
        trainer(run, max_steps=2, resume_from="latest").train(ROWS)
    message = str(caught.value)
    assert "\n" not in message and f"checkpoint {run / 'checkpoint-1'}" in message, message
    return message


def edit_state(file: Path, change) -> None:
    state = state_files.load_state(file)
    change(state)
    state_files.save_state(file, state)


def edit_weights(file: Path, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------------
# weights only from inside the checkpoint


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_an_index_naming_a_weights_file_outside_the_checkpoint_is_refused(run, tmp_path, where):
    outside = tmp_path / "elsewhere" / "evil.safetensors"
    outside.parent.mkdir()
    shutil.move(run / "checkpoint-1" / "model.safetensors", outside)
    name = str(outside) if where == "absolute" else os.path.relpath(outside, run / "checkpoint-1")
    keys = load_file(outside).keys()
    (run / "checkpoint-1" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        key: name for key in keys}}))
    message = resume(run)
    assert "model.safetensors.index.json" in message and "outside the checkpoint" in message


def test_a_weights_file_linked_to_outside_the_checkpoint_is_refused(run, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(run / "checkpoint-1" / "model.safetensors", outside)
    (run / "checkpoint-1" / "model.safetensors").symlink_to(outside)
    message = resume(run)
    assert "model.safetensors" in message and "outside the checkpoint" in message


# ----------------------------------------------------------------------------------------------------
# the weights against the model


def test_weights_of_another_dtype_are_refused_not_cast(run):
    edit_weights(run / "checkpoint-1" / "model.safetensors", lambda t: t.update({k: v.half() for k, v in t.items()}))
    message = resume(run)
    assert "model.safetensors" in message and "float16" in message and "float32" in message


def test_weights_of_another_shape_are_one_line(run):
    def grow(tensors):
        key = next(k for k in tensors if k.endswith("q_proj.weight"))
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])

    edit_weights(run / "checkpoint-1" / "model.safetensors", grow)
    message = resume(run)
    assert "model.safetensors" in message and "shape" in message


# ----------------------------------------------------------------------------------------------------
# the optimizer against the run's


def test_adamw_maximize_is_refused(run):
    edit_state(run / "checkpoint-1" / "optimizer.safetensors", lambda s: s["param_groups"][0].update(maximize=True))
    message = resume(run)
    assert "optimizer.safetensors" in message and "maximize" in message


@pytest.mark.parametrize("field, value", [("lr", "0.1"), ("eps", "tiny"), ("betas", ("a", "b")),
                                          ("weight_decay", float("nan"))])
def test_optimizer_hyperparameters_that_are_not_numbers_are_refused(run, field, value):
    edit_state(run / "checkpoint-1" / "optimizer.safetensors", lambda s: s["param_groups"][0].update({field: value}))
    message = resume(run)
    assert "optimizer.safetensors" in message and field in message


@pytest.mark.parametrize("plant", ["shape", "dtype"])
def test_optimizer_moments_of_another_shape_or_dtype_are_refused(run, plant):
    def change(state):
        moments = next(iter(state["state"].values()))
        moments["exp_avg"] = (moments["exp_avg"].half() if plant == "dtype"
                              else torch.zeros(moments["exp_avg"].numel() + 1))

    edit_state(run / "checkpoint-1" / "optimizer.safetensors", change)
    message = resume(run)
    assert "optimizer.safetensors" in message and "exp_avg" in message


# ----------------------------------------------------------------------------------------------------
# the trainer state, the schedule and the RNG state


@pytest.mark.parametrize("field, value", [("global_step", 10**30), ("global_step", -1), ("global_step", 7),
                                          ("epoch", "two"), ("position", -3), ("skipped_steps", 10**9),
                                          ("loss_scale", float("inf")), ("log_history", "rows"),
                                          ("log_history", [1, 2])])
def test_trainer_state_values_out_of_range_are_refused(run, field, value):
    file = run / "checkpoint-1" / "trainer_state.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | {field: value}))
    message = resume(run)
    assert "trainer_state.json" in message and field in message


def test_a_trainer_state_that_is_not_an_object_is_refused(run):
    (run / "checkpoint-1" / "trainer_state.json").write_text("[1, 2]")
    assert "trainer_state.json" in resume(run)


def test_a_short_rng_state_is_one_line(run):
    edit_state(run / "checkpoint-1" / "rng_state.safetensors", lambda s: s.update(torch=s["torch"][:10]))
    assert "rng_state.safetensors" in resume(run)


def test_a_bad_scheduler_layout_is_one_line(run):
    state_files.save_state(run / "checkpoint-1" / "scheduler.safetensors", {"last_epoch": "soon"})
    assert "scheduler.safetensors" in resume(run)


def test_adamw_maximize_in_an_fsdp_layout_is_refused(tmp_path, tiny_tokenizer, one_rank_group):  # noqa: F811
    from forge.run.checkpoint import load_checkpoint, save_sharded_checkpoint
    from forge.run.lifecycle import load_weights_and_optimizer

    model, optimizer, scheduler = sharded_model(tiny_tokenizer, seed=0)
    checkpoint = save_sharded_checkpoint(tmp_path / "run" / "checkpoint-1", model=model, tokenizer=tiny_tokenizer,
                                         optimizer=optimizer, scheduler=scheduler, trainer_state={"global_step": 1},
                                         config=CONFIG, rng_state=None, ranks=OneRank())
    layout = checkpoint / "sharded" / "layout.json"
    planted = []

    def plant(node):  # every ["maximize", false] pair of the layout's dicts -> true
        if isinstance(node, list) and node == ["maximize", False]:
            node[1] = True
            planted.append(node)
        for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            plant(child)

    saved = json.loads(layout.read_text())
    plant(saved)
    assert planted
    layout.write_text(json.dumps(saved))
    rehash(checkpoint)
    fresh, fresh_optimizer, _ = sharded_model(tiny_tokenizer, seed=1)
    with pytest.raises(CheckpointError, match=r"sharded/layout\.json has param_groups/0/maximize=True where this "
                                              r"run's AdamW has False \(a resumed run would do gradient ascent\)"):
        load_weights_and_optimizer(checkpoint, load_checkpoint(checkpoint), fresh, fresh_optimizer, sharded=True)


def test_weights_missing_a_tensor_are_the_checkpoints_fault_exit_1_naming_the_file(run):
    edit_weights(run / "checkpoint-1" / "model.safetensors",
                 lambda t: t.pop(next(k for k in t if k.endswith("q_proj.weight"))))
    message = resume(run)  # a CheckpointError (exit 1): the run's own file, not the user's input
    assert "model.safetensors does not fit the model: missing 1 keys" in message
