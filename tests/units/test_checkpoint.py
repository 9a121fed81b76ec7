"""Checkpoints: round trip of weights, optimizer and RNG; atomicity under a crash; pruning; LoRA adapters."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from forge.model.tiny import build_tiny_model
from forge.run.checkpoint import (
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from forge.run.checkpoint_fields import check_compatible
from forge.run.checkpoint_names import checkpoint_dir, step_of
from forge.run.integrity import (
    CheckpointError,
    latest_checkpoint,
    latest_verified_checkpoint,
    numbered_checkpoints,
    prune_checkpoints,
    remove_stale_temporaries,
)
from forge.run.rng import capture_rng_state, restore_rng_state

CONFIG = {"model_name": "tiny", "group_size": 4, "use_lora": False, "learning_rate": 1e-3}


def train_one_step(model, tokenizer):
    """One AdamW + LambdaLR step on a short text, so the optimizer and scheduler have real state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    input_ids = tokenizer("What is 12 + 7? Answer: 19", return_tensors="pt").input_ids  # (1, T)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return optimizer, scheduler


def save(path, model, tokenizer, step=1, **kwargs):
    return save_checkpoint(
        path,
        model=model,
        tokenizer=tokenizer,
        trainer_state={"global_step": step, "epoch": 0.5, "data_position": 3 * step},
        config=CONFIG,
        **kwargs,
    )


def assert_nested_equal(actual, expected):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_nested_equal(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_nested_equal(a, e)
    else:
        assert actual == expected


def test_round_trip_weights_optimizer_and_state(tmp_path, tiny_model, tiny_tokenizer):
    optimizer, scheduler = train_one_step(tiny_model, tiny_tokenizer)
    path = save(
        checkpoint_dir(tmp_path, 1), tiny_model, tiny_tokenizer, optimizer=optimizer, scheduler=scheduler
    )
    assert path == tmp_path / "checkpoint-1"
    assert {
        "model.safetensors",
        "optimizer.safetensors",
        "scheduler.safetensors",
        "trainer_state.json",
        "rng_state.safetensors",
        "forge_config.json",
        "COMPLETE",
        "tokenizer.json",
    } <= {p.name for p in path.iterdir()}

    state = load_checkpoint(path)
    assert state.path == path
    assert state.trainer_state == {"global_step": 1, "epoch": 0.5, "data_position": 3}
    assert state.config == CONFIG
    assert_nested_equal(state.optimizer_state, optimizer.state_dict())
    assert state.scheduler_state == scheduler.state_dict()

    fresh_model, _ = build_tiny_model(tiny_tokenizer, seed=1)
    load_model_weights(fresh_model, path)
    trained = tiny_model.state_dict()
    for name, tensor in fresh_model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    # The loaded state drives a fresh optimizer to the same place.
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    fresh_optimizer.load_state_dict(state.optimizer_state)
    assert_nested_equal(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_rng_restore_reproduces_draws(tmp_path, tiny_model, tiny_tokenizer):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    path = save(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer)

    def draws():
        return (
            random.random(),
            random.gauss(0, 1),
            np.random.rand(3).tolist(),
            np.random.normal(),
            torch.rand(3).tolist(),
        )

    expected = draws()
    draws()  # move every generator on
    restore_rng_state(load_checkpoint(path, require_training_state=False).rng_state)
    assert draws() == expected


def test_capture_restore_in_memory():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.randn(2).tolist())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.randn(2).tolist()) == first


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    good = save(checkpoint_dir(tmp_path, 1), tiny_model, tiny_tokenizer, step=1)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_tokenizer, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save(checkpoint_dir(tmp_path, 2), tiny_model, tiny_tokenizer, step=2)
    with pytest.raises(RuntimeError, match="disk full"):  # overwriting an existing checkpoint
        save(good, tiny_model, tiny_tokenizer, step=5)

    assert latest_checkpoint(tmp_path) == good
    assert load_checkpoint(good, require_training_state=False).trainer_state["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_latest_ignores_final_tmp_and_incomplete(tmp_path, tiny_model, tiny_tokenizer):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    save(checkpoint_dir(tmp_path, 2), tiny_model, tiny_tokenizer, step=2)
    save(checkpoint_dir(tmp_path, 10), tiny_model, tiny_tokenizer, step=10)
    save(tmp_path / "final", tiny_model, tiny_tokenizer, step=99)
    (tmp_path / "checkpoint-30").mkdir()  # a save killed before it was renamed would not even be here
    (tmp_path / "checkpoint-40.tmp-123").mkdir()
    (tmp_path / "training_log.jsonl").write_text("")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def test_overwrite_replaces_existing(tmp_path, tiny_model, tiny_tokenizer):
    path = save(tmp_path / "final", tiny_model, tiny_tokenizer, step=1)
    save(path, tiny_model, tiny_tokenizer, step=2)
    assert load_checkpoint(path, require_training_state=False).trainer_state["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_prune_keeps_newest(tmp_path, tiny_model, tiny_tokenizer):
    for step in (5, 10, 15, 20):
        save(checkpoint_dir(tmp_path, step), tiny_model, tiny_tokenizer, step=step)
    save(tmp_path / "final", tiny_model, tiny_tokenizer)
    assert prune_checkpoints(tmp_path, None) == []
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["checkpoint-10", "checkpoint-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-15", "checkpoint-20", "final"]


def test_an_earlier_forges_plain_numbered_folders_are_read_and_the_newest_step_wins(tmp_path, tiny_model,
                                                                                    tiny_tokenizer):
    """An earlier Forge wrote `{output_dir}/{step}`: such folders are listed, resumed and pruned with the
    `checkpoint-{step}` ones, the newest step wins whatever its form, and `checkpoint-{step}` wins a tie."""
    new_2 = save_resumable(checkpoint_dir(tmp_path, 2), tiny_model, tiny_tokenizer, step=2)
    old_4 = save_resumable(tmp_path / "4", tiny_model, tiny_tokenizer, step=4)
    assert latest_checkpoint(tmp_path) == old_4 and latest_verified_checkpoint(tmp_path) == old_4
    old_6 = save_resumable(tmp_path / "6", tiny_model, tiny_tokenizer, step=6)
    new_6 = save_resumable(checkpoint_dir(tmp_path, 6), tiny_model, tiny_tokenizer, step=6)
    assert [(step, path.name) for step, path in numbered_checkpoints(tmp_path)] == [
        (2, "checkpoint-2"), (4, "4"), (6, "6"), (6, "checkpoint-6")]
    assert latest_checkpoint(tmp_path) == new_6 and latest_verified_checkpoint(tmp_path) == new_6
    assert latest_verified_checkpoint(tmp_path, before_step=6) == old_4
    assert prune_checkpoints(tmp_path, keep=2) == [new_2, old_4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "checkpoint-6"]
    assert step_of("checkpoint-12") == step_of("12") == 12 and step_of("checkpoint-12.tmp-5") is None


def test_incomplete_checkpoint_raises(tmp_path, tiny_model, tiny_tokenizer):
    path = save(tmp_path / "checkpoint-3", tiny_model, tiny_tokenizer)
    (path / "COMPLETE").unlink()
    with pytest.raises(
        ValueError, match=r"checkpoint .*3 is incomplete \(interrupted save\?\); use an earlier one"
    ):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) is None


def test_load_weights_rejects_missing_keys(tmp_path, tiny_model, tiny_tokenizer):
    from safetensors.torch import load_file, save_file

    path = save(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer)
    weights = load_file(path / "model.safetensors")
    weights.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 keys"):
        load_model_weights(build_tiny_model(tiny_tokenizer)[0], path)


def lora_b_key(state_dict):
    return next(name for name in state_dict if "lora_B" in name)


def test_lora_saves_only_adapter_and_round_trips(tmp_path, tiny_model, tiny_tokenizer):
    peft = pytest.importorskip("peft")
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    lora_model = peft.get_peft_model(tiny_model, lora_config)
    path = save(tmp_path / "checkpoint-1", lora_model, tiny_tokenizer)
    names = {p.name for p in path.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names

    fresh = peft.get_peft_model(build_tiny_model(tiny_tokenizer, seed=0)[0], lora_config)  # new random LoRA
    trained = lora_model.state_dict()
    assert not torch.equal(fresh.state_dict()[lora_b_key(trained)], trained[lora_b_key(trained)])
    load_model_weights(fresh, path)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    with pytest.raises(ValueError, match="not a peft model"):
        load_model_weights(build_tiny_model(tiny_tokenizer)[0], path)


def test_lora_adapter_with_other_targets_is_rejected(tmp_path, tiny_model, tiny_tokenizer):
    peft = pytest.importorskip("peft")
    saved = peft.get_peft_model(tiny_model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    path = save(tmp_path / "checkpoint-1", saved, tiny_tokenizer)
    other = peft.get_peft_model(
        build_tiny_model(tiny_tokenizer)[0], peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    with pytest.raises(ValueError, match="missing 4 keys"):
        load_model_weights(other, path)


def test_check_compatible():
    check_compatible(CONFIG, {**CONFIG, "learning_rate": 5e-4})  # other keys may change
    check_compatible({"lora_target_modules": ("q_proj",)}, {"lora_target_modules": ["q_proj"]})
    with pytest.raises(ValueError) as excinfo:
        check_compatible(CONFIG, {**CONFIG, "group_size": 8, "use_lora": True}, checkpoint_path="out/checkpoint-10")
    message = str(excinfo.value)
    assert "checkpoint out/checkpoint-10" in message
    assert "its config differs from this run's in group_size (saved 4, current 8), use_lora (saved False, " \
        "current True); set these back" in message
    assert "fresh run" in message and "\n" not in message  # one line


def test_trainer_state_is_plain_json(tmp_path, tiny_model, tiny_tokenizer):
    path = save(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=7)
    assert json.loads((path / "trainer_state.json").read_text())["global_step"] == 7


# ---------------------------------------------------------------------------------------------------
# Checksums, damaged files, finite weights, stale temporaries (issue 18)


def save_resumable(path, model, tokenizer, step):
    """A checkpoint as the trainer writes it: with optimizer and scheduler state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return save(path, model, tokenizer, step=step, optimizer=optimizer, scheduler=scheduler)


def make_old_format(path):
    """What a Forge from before checksums wrote: COMPLETE holds just 'ok'."""
    (path / "COMPLETE").write_text("ok\n")


def test_complete_marker_holds_the_sha256_of_every_other_file(tmp_path, tiny_model, tiny_tokenizer):
    path = save_resumable(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=1)
    manifest = json.loads((path / "COMPLETE").read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != "COMPLETE")
    assert sorted(manifest["sha256"]) == files
    for name in files:
        assert manifest["sha256"][name] == hashlib.sha256((path / name).read_bytes()).hexdigest(), name


def test_a_bit_flip_in_the_weights_is_named_and_the_previous_checkpoint_offered(
        tmp_path, tiny_model, tiny_tokenizer):
    first = save_resumable(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=1)
    second = save_resumable(tmp_path / "checkpoint-2", tiny_model, tiny_tokenizer, step=2)
    weights = second / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])  # a 4 KB bit flip
    weights.write_bytes(bytes(data))

    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(second)
    message = str(excinfo.value)
    assert f"checkpoint {second} is damaged: model.safetensors does not match the sha256" in message
    assert f"resume_from='{first}'" in message
    assert latest_checkpoint(tmp_path) == second  # still the newest complete one: resuming it is an error
    assert latest_verified_checkpoint(tmp_path) == first
    assert latest_verified_checkpoint(tmp_path, before_step=1) is None


def _empty(file):
    file.write_bytes(b"")


def _halve(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize("old_format", [False, True], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("name, damage, reason", [
    ("model.safetensors", _empty, "is empty (0 bytes)"),
    ("model.safetensors", _halve, "is truncated"),
    ("optimizer.safetensors", os.remove, "is missing"),
    ("scheduler.safetensors", os.remove, "is missing"),
    ("rng_state.safetensors", os.remove, "is missing"),
])
def test_a_damaged_or_missing_file_next_to_complete_is_a_clear_error(
        name, damage, reason, old_format, tmp_path, tiny_model, tiny_tokenizer):
    first = save_resumable(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=1)
    second = save_resumable(tmp_path / "checkpoint-2", tiny_model, tiny_tokenizer, step=2)
    if old_format:
        make_old_format(second)
    damage(second / name)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(second)
    message = str(excinfo.value)
    assert f"checkpoint {second} is damaged: {name}" in message and reason in message
    assert f"resume_from='{first}'" in message
    if name == "model.safetensors":  # loading only the weights names the file too
        with pytest.raises(CheckpointError, match=re.escape(f"{second} is damaged: {name} {reason}")):
            load_model_weights(build_tiny_model(tiny_tokenizer)[0], second)


def test_a_checkpoint_saved_without_optimizer_state_cannot_resume(tmp_path, tiny_model, tiny_tokenizer):
    path = save(tmp_path / "checkpoint-4", tiny_model, tiny_tokenizer, step=4)
    with pytest.raises(CheckpointError, match=r"4 cannot resume a run: optimizer.safetensors was not saved in it"):
        load_checkpoint(path)
    assert load_checkpoint(path, require_training_state=False).optimizer_state is None


def test_an_old_checkpoint_without_checksums_loads_with_a_warning(tmp_path, tiny_model, tiny_tokenizer):
    path = save_resumable(tmp_path / "checkpoint-3", tiny_model, tiny_tokenizer, step=3)
    make_old_format(path)
    with pytest.warns(UserWarning, match="has no checksums"):
        state = load_checkpoint(path)
    assert not state.verified and state.step == 3
    fresh = build_tiny_model(tiny_tokenizer, seed=1)[0]
    load_model_weights(fresh, path)
    assert all(torch.equal(t, tiny_model.state_dict()[k]) for k, t in fresh.state_dict().items())
    assert latest_verified_checkpoint(tmp_path) == path


def test_load_says_which_checkpoint_it_loaded(tmp_path, tiny_model, tiny_tokenizer):
    path = save_resumable(tmp_path / "checkpoint-7", tiny_model, tiny_tokenizer, step=7)
    state = load_checkpoint(path)
    assert (state.step, state.path, state.verified) == (7, path, True)
    assert state.describe() == f"step 7 from {path} (sha256 verified)"


def test_save_refuses_nonfinite_weights_and_writes_nothing(tmp_path, tiny_model, tiny_tokenizer):
    with torch.no_grad():
        tiny_model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to write checkpoint .*5: 1 weight tensors hold NaN/inf "
                                              r"\(e.g. \['model.layers.0.mlp.up_proj.weight'\]\)"):
        save_resumable(tmp_path / "checkpoint-5", tiny_model, tiny_tokenizer, step=5)
    assert list(tmp_path.iterdir()) == []


def test_an_old_nonfinite_checkpoint_is_never_offered(tmp_path, tiny_model, tiny_tokenizer):
    from safetensors.torch import load_file, save_file

    first = save_resumable(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=1)
    second = save_resumable(tmp_path / "checkpoint-2", tiny_model, tiny_tokenizer, step=2)
    make_old_format(second)  # an older Forge wrote NaN weights and no checksums
    weights = load_file(second / "model.safetensors")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, second / "model.safetensors", metadata={"format": "pt"})
    assert latest_verified_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="model.safetensors holds NaN/inf in 1 tensors"):
        load_checkpoint(second)
    with pytest.raises(CheckpointError, match=r"holds NaN/inf in 1 tensors \(e.g. \['model.norm.weight'\]\)"):
        load_model_weights(build_tiny_model(tiny_tokenizer)[0], second)


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temporaries_are_cleaned_and_live_ones_kept(tmp_path, tiny_model, tiny_tokenizer):
    gone, alive = dead_pid(), os.getppid()  # the parent of this test process is running
    kept = save_resumable(tmp_path / "checkpoint-3", tiny_model, tiny_tokenizer, step=3)
    (tmp_path / f"checkpoint-4.tmp-{gone}").mkdir()  # killed while writing step 4
    (tmp_path / f"checkpoint-4.tmp-{gone}" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / f"checkpoint-5.tmp-{alive}").mkdir()  # another process is writing step 5 right now
    (tmp_path / f"checkpoint-3.old-{gone}").mkdir()  # killed after step 3 was replaced: the new 3 is in place
    moved = save_resumable(tmp_path / f"checkpoint-6.old-{gone}", tiny_model, tiny_tokenizer,
                           step=6)  # killed between renames
    (tmp_path / f"final.tmp-{os.getpid()}").mkdir()  # an earlier process with this process's id

    damaged = save_resumable(tmp_path / f"checkpoint-8.old-{gone}", tiny_model, tiny_tokenizer, step=8)
    (damaged / "model.safetensors").write_bytes(b"")  # its COMPLETE no longer verifies: not put back as 8

    cleaned = remove_stale_temporaries(tmp_path)
    assert sorted((p.name, action) for p, action in cleaned) == sorted(
        [(f"checkpoint-4.tmp-{gone}", "deleted"), (f"checkpoint-3.old-{gone}", "deleted"), (moved.name, "restored"),
         (f"final.tmp-{os.getpid()}", "deleted"), (damaged.name, "kept")])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint-3", "checkpoint-6",
                                                                 f"checkpoint-5.tmp-{alive}", damaged.name])
    assert load_checkpoint(tmp_path / "checkpoint-6").step == 6 and kept.is_dir()
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_finite_weights_whose_sum_overflows_are_not_taken_for_nan(tmp_path, tiny_model, tiny_tokenizer):
    with torch.no_grad():  # 3e38 + 3e38 overflows float32 (max 3.4e38): the sum is inf, every value finite
        tiny_model.model.norm.weight[:2] = 3e38
    path = save_resumable(tmp_path / "checkpoint-1", tiny_model, tiny_tokenizer, step=1)
    fresh = build_tiny_model(tiny_tokenizer, seed=1)[0]
    load_model_weights(fresh, path)
    assert fresh.model.norm.weight[0].item() == pytest.approx(3e38)
