"""Checkpoints handed over by someone else, a full disk inside a save, and output dirs left by killed runs.

- A pickle payload (it creates a marker file when unpickled) planted in every file of every checkpoint kind (full,
  LoRA, sharded, final/), with COMPLETE rewritten to match as whoever hands over a checkpoint can: loading refuses
  the file with a CheckpointError that names it, or never reads it; the payload never runs. Loading a clean
  checkpoint of each kind calls no unpickler at all (pickle and torch.load are tripwired). Checkpoints of an older
  Forge that hold pickled state are refused with what to do.
- A full disk at any write of a save: one-line CheckpointError naming the folder and what to do; the checkpoints
  already there untouched, no temporary left.
- Output dirs: `N.old-<pid>` is put back only when it verifies, and the console says so; --overwrite_output_dir
  deletes only Forge's files; a folder with a step's name that is not Forge's is never deleted or saved over; a
  directory holding only a killed run's logs can be resumed with a hint or started afresh.
"""

import errno
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model
from forge.run import checkpoint as ckpt
from forge.run import integrity, state_files
from forge.run.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from forge.run.checkpoint_names import checkpoint_dir
from forge.run.integrity import CheckpointError
from forge.run.lifecycle import OutputDirInUse, check_before_launch, claim_output_dir

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]
CONFIG = {"model_name": "tiny", "group_size": 4, "use_lora": False}


class Payload:
    """Unpickling this creates `marker`: proof that a checkpoint's file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps({"state": Payload(marker)})


def rehash(checkpoint: Path) -> None:
    """Rewrite COMPLETE to match the files as they are now: what anyone handing over a checkpoint can do."""
    manifest = json.loads((checkpoint / "COMPLETE").read_text())
    files = [p for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != "COMPLETE"]
    manifest["sha256"] = {p.relative_to(checkpoint).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                          for p in files}
    manifest["bytes"] = {p.relative_to(checkpoint).as_posix(): p.stat().st_size for p in files}
    (checkpoint / "COMPLETE").write_text(json.dumps(manifest))


def install_tripwire(monkeypatch) -> None:
    """Every way to unpickle fails the test: pickle's loaders and Unpickler, torch.load and its weights-only
    unpickler."""
    import torch._weights_only_unpickler as weights_only

    def unpickled(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for target, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                         (torch.serialization, "load"), (weights_only, "Unpickler"), (weights_only, "load")]:
        monkeypatch.setattr(target, name, unpickled)


@pytest.fixture
def tripwire(monkeypatch):
    install_tripwire(monkeypatch)


def train_one_step(model, tokenizer):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    input_ids = tokenizer("What is 12 + 7? Answer: 19", return_tensors="pt").input_ids  # (1, T)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def write_checkpoint(kind: str, root: Path, tiny_tokenizer) -> Path:
    model = build_tiny_model(tiny_tokenizer, seed=0)[0]
    if kind == "lora":
        model = lora(model)
    optimizer, scheduler = train_one_step(model, tiny_tokenizer)
    final = kind == "final"
    return save_checkpoint(root / ("final" if final else "1"), model=model, tokenizer=tiny_tokenizer,
                           optimizer=optimizer, scheduler=scheduler, trainer_state={"global_step": 1},
                           config=CONFIG, training_state=not final)


def load_everything(kind: str, checkpoint: Path, tiny_tokenizer) -> None:
    """What resuming (a numbered checkpoint) or using final/ reads of a checkpoint."""
    from forge.model.loading import load_model

    state = load_checkpoint(checkpoint, require_training_state=kind != "final")
    model = build_tiny_model(tiny_tokenizer, seed=1)[0]
    if kind == "lora":
        model = lora(model)
    load_model_weights(model, checkpoint)
    if state.optimizer_state is not None:
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3).load_state_dict(
            state.optimizer_state)
    if kind == "final":  # final/ is also a from_pretrained folder (`--model out/final`): transformers reads it
        try:
            load_model(str(checkpoint))
        except Exception as error:  # transformers' own errors for a damaged file; the test's point is the marker
            raise ValueError(f"from_pretrained refused {checkpoint}: {type(error).__name__}") from error


@pytest.mark.parametrize("kind", ["full", "lora", "final"])
def test_a_clean_checkpoint_of_each_kind_loads_without_unpickling(kind, tmp_path, tiny_tokenizer, tripwire):
    load_everything(kind, write_checkpoint(kind, tmp_path, tiny_tokenizer), tiny_tokenizer)


@pytest.mark.parametrize("kind", ["full", "lora", "final"])
def test_a_pickle_payload_in_any_file_never_runs(kind, tmp_path, tiny_tokenizer):
    pristine = write_checkpoint(kind, tmp_path / "pristine", tiny_tokenizer)
    names = sorted(p.relative_to(pristine).as_posix() for p in pristine.rglob("*") if p.is_file())
    assert {"COMPLETE", "trainer_state.json", "forge_config.json"} <= set(names)
    marker = tmp_path / "payload-ran"
    refused = []
    for name in names:
        checkpoint = tmp_path / name.replace("/", "_") / pristine.name
        shutil.copytree(pristine, checkpoint)
        (checkpoint / name).write_bytes(payload_bytes(marker))
        if name != "COMPLETE":
            rehash(checkpoint)  # the payload passes the checksums
        try:
            load_everything(kind, checkpoint, tiny_tokenizer)
        except (CheckpointError, ValueError, OSError) as error:  # refused; transformers' own errors for final/
            refused.append(name)
            assert "\n" not in str(error).strip() or kind == "final", str(error)
            if name in ("COMPLETE", "trainer_state.json", "forge_config.json") or name.endswith(".safetensors"):
                assert isinstance(error, CheckpointError) and f"checkpoint {checkpoint}" in str(error), str(error)
                assert name in str(error) or "cannot be read" in str(error), str(error)
        assert not marker.exists(), f"the payload in {kind}/{name} ran"
    # every file that holds state is refused; the tokenizer's extra files are never read (ignored)
    assert {n for n in names if n.endswith(".safetensors")} | {"COMPLETE", "trainer_state.json"} <= set(refused)


def test_planted_pickle_files_next_to_the_safetensors_ones_are_ignored(tmp_path, tiny_tokenizer, tripwire):
    checkpoint = write_checkpoint("full", tmp_path, tiny_tokenizer)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pt"):
        (checkpoint / name).write_bytes(payload_bytes(tmp_path / "payload-ran"))
    rehash(checkpoint)
    load_everything("full", checkpoint, tiny_tokenizer)
    (checkpoint / "sharded").mkdir()  # a whole checkpoint with torch's sharded metadata planted: not loadable
    (checkpoint / "sharded" / ".metadata").write_bytes(payload_bytes(tmp_path / "payload-ran"))
    rehash(checkpoint)
    with pytest.raises(CheckpointError, match=r"sharded/.metadata is in torch's pickle format"):
        load_everything("full", checkpoint, tiny_tokenizer)
    assert not (tmp_path / "payload-ran").exists()


@pytest.mark.parametrize("pickled", ["optimizer.pt", "scheduler.pt", "rng_state.pt", "sharded/.metadata"])
def test_a_checkpoint_in_an_older_pickle_format_is_refused_with_what_to_do(pickled, tmp_path, tiny_tokenizer):
    checkpoint = write_checkpoint("full", tmp_path, tiny_tokenizer)
    replaced = integrity.PICKLED_NAMES[pickled]
    if pickled.startswith("sharded/"):
        (checkpoint / "sharded").mkdir()
        (checkpoint / "model.safetensors").unlink()  # an older FSDP checkpoint: shards only
    else:
        (checkpoint / replaced).unlink()
    (checkpoint / pickled).write_bytes(payload_bytes(tmp_path / "payload-ran"))
    rehash(checkpoint)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(checkpoint)
    message = str(caught.value)
    assert f"checkpoint {checkpoint} cannot be loaded: {pickled} is in torch's pickle format" in message
    assert "Forge never unpickles a checkpoint" in message
    assert f"--model {tmp_path / 'final'}" in message if pickled.startswith("sharded/") else \
        f"--model {checkpoint}" in message
    assert integrity.latest_verified_checkpoint(tmp_path) is None  # never offered as a place to resume from
    assert not (tmp_path / "payload-ran").exists()


def test_a_state_file_round_trips_exactly_and_refuses_what_json_would_change(tmp_path):
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}},
             "param_groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "params": [0], "foreach": None,
                               "weight_decay": float("inf"), "name": "decoder"}],
             "python": [3, list(range(5)), None], "keys": {"a": True, 1.5: -0}}
    state_files.save_state(tmp_path / "s.safetensors", state)
    back = state_files.load_state(tmp_path / "s.safetensors")
    assert back["param_groups"][0]["betas"] == (0.9, 0.999) and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["param_groups"][0]["lr"] == 0.1 + 0.2 and list(back["state"]) == [0]  # int keys stay ints
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["keys"] == {"a": True, 1.5: 0} and back["python"] == [3, [0, 1, 2, 3, 4], None]
    import numpy as np

    with pytest.raises(TypeError, match=r"state value at lr is a float32"):
        state_files.save_state(tmp_path / "t.safetensors", {"lr": np.float32(1.0)})
    (tmp_path / "u.safetensors").write_bytes(payload_bytes(tmp_path / "payload-ran"))
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error: not a safetensors file
        state_files.load_state(tmp_path / "u.safetensors")
    assert not (tmp_path / "payload-ran").exists()


# ----------------------------------------------------------------------------------------------------
# sharded checkpoints (FSDP2), in this process on a one-rank gloo group


class OneRank:
    is_main, main_pid = True, os.getpid()

    def barrier(self):
        pass

    def any(self, flag):
        return bool(flag)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model(tokenizer, seed):
    from forge.parallel import sharding

    model = sharding.shard(build_tiny_model(tokenizer, seed=seed)[0], None)
    optimizer, scheduler = train_one_step(model, tokenizer)
    return model, optimizer, scheduler


def whole(tensors):
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]


def test_sharded_checkpoints_are_safetensors_and_json_and_load_without_unpickling(
        tmp_path, tiny_tokenizer, one_rank_group, monkeypatch):
    model, optimizer, scheduler = sharded_model(tiny_tokenizer, seed=0)
    checkpoint = ckpt.save_sharded_checkpoint(tmp_path / "run" / "checkpoint-1", model=model,
                                              tokenizer=tiny_tokenizer, optimizer=optimizer, scheduler=scheduler,
                                              trainer_state={"global_step": 1}, config=CONFIG, rng_state=None,
                                              ranks=OneRank())
    assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [
        "layout.json", "shard-00001-model-00001-of-00001.safetensors"]
    fresh, fresh_optimizer, _ = sharded_model(tiny_tokenizer, seed=1)
    with monkeypatch.context() as patched:
        install_tripwire(patched)
        load_checkpoint(checkpoint)
        ckpt.load_sharded_state(checkpoint, fresh, fresh_optimizer)
    for mine, saved in zip(whole(fresh.parameters()), whole(model.parameters()), strict=True):
        assert torch.equal(mine, saved)
    for mine, saved in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert all(torch.equal(*whole([mine[k], saved[k]])) for k in saved)
    assert fresh_optimizer.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]

    marker = tmp_path / "payload-ran"
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    for name in [*names, "sharded/.metadata"]:  # every file, and torch's own metadata file planted
        planted = tmp_path / "planted" / name.replace("/", "_")
        shutil.copytree(checkpoint, planted)
        (planted / name).write_bytes(payload_bytes(marker))
        if name != "COMPLETE":
            rehash(planted)
        try:
            load_checkpoint(planted)
            ckpt.load_sharded_state(planted, fresh, fresh_optimizer)
        except CheckpointError as error:
            assert f"checkpoint {planted}" in str(error) and "\n" not in str(error), str(error)
        else:
            assert name in ("sharded/.metadata", "config.json", "generation_config.json") or \
                name.startswith(("tokenizer", "special", "chat_template")), f"{name} was loaded"
        assert not marker.exists(), f"the payload in sharded/{name} ran"


def test_a_full_disk_inside_the_sharded_write_is_one_line_and_the_previous_checkpoint_stays(
        tmp_path, tiny_tokenizer, one_rank_group, monkeypatch):
    import safetensors.torch

    model, optimizer, scheduler = sharded_model(tiny_tokenizer, seed=0)
    save = {"model": model, "tokenizer": tiny_tokenizer, "optimizer": optimizer, "scheduler": scheduler,
            "config": CONFIG, "rng_state": None, "ranks": OneRank()}
    previous = ckpt.save_sharded_checkpoint(tmp_path / "checkpoint-1", trainer_state={"global_step": 1}, **save)
    monkeypatch.setattr(safetensors.torch, "save", safetensors_no_space)  # what DCP's writer calls
    with pytest.raises(CheckpointError) as caught:
        ckpt.save_sharded_checkpoint(tmp_path / "checkpoint-2", trainer_state={"global_step": 2}, **save)
    assert str(caught.value).startswith(f"cannot write checkpoint {tmp_path / 'checkpoint-2'}: the disk holding "
                                        f"{tmp_path} is full") and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "rendezvous"]
    assert integrity.verify_checkpoint(previous)


# ----------------------------------------------------------------------------------------------------
# a full disk inside a save


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def safetensors_no_space(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


@pytest.mark.parametrize("where, fails", [
    ("forge.run.state_files.save_file", safetensors_no_space),  # the optimizer / schedule / RNG state
    ("transformers.PreTrainedTokenizerBase.save_pretrained", no_space),
    ("forge.run.checkpoint.write_manifest", no_space),  # COMPLETE, the last write
    ("forge.run.checkpoint._fresh_temporary", no_space),  # the first
])
def test_a_full_disk_inside_a_save_is_one_line_and_the_previous_checkpoint_stays(
        where, fails, tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    optimizer, scheduler = train_one_step(tiny_model, tiny_tokenizer)
    save = {"model": tiny_model, "tokenizer": tiny_tokenizer, "optimizer": optimizer, "scheduler": scheduler,
            "config": CONFIG}
    previous = save_checkpoint(tmp_path / "checkpoint-1", trainer_state={"global_step": 1}, **save)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    monkeypatch.setattr(where, fails)
    for step in (2, 1):  # a new step, and a checkpoint that replaces one
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(checkpoint_dir(tmp_path, step), trainer_state={"global_step": step}, **save)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"cannot write checkpoint {checkpoint_dir(tmp_path, step)}: the disk holding "
                                  f"{tmp_path} is full")
        assert "Free space there, or choose an output_dir on another disk" in message
        assert f"the newest is {previous}: continue from it with the same command plus --resume" in message
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no temporary, no half checkpoint
        assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert integrity.verify_checkpoint(previous)


def test_a_full_disk_mid_run_exits_1_with_one_message_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    from forge.cli import main

    model, tokenizer = build_tiny_model()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "rewards_mod.py").write_text("def length(prompts, completions, **kw):\n"
                                             "    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = state_files.save_file
    saves = []

    def full_from_the_second_save(*args, **kwargs):
        saves.append(1)
        if len(saves) > 3:  # 3 state files per checkpoint: step 1 saves, step 2 finds the disk full
            safetensors_no_space()
        return real(*args, **kwargs)

    monkeypatch.setattr(state_files, "save_file", full_from_the_second_save)
    out = tmp_path / "out"
    code = main([str(a) for a in ["train", "--model", tmp_path / "tiny", "--dataset", tmp_path / "data.jsonl",
                                  "--reward", "rewards_mod:length", "--group_size", "2", "--max_new_tokens", "4",
                                  "--max_steps", "3", "--save_steps", "1", "--output_dir", out, "--preflight", "off"]])
    err = capsys.readouterr().err
    message = err[err.index("forge: error: "):].splitlines()
    assert code == 1 and "Traceback" not in err
    assert message[0] == (f"forge: error: cannot write checkpoint {out / 'checkpoint-2'}: the disk holding {out} is "
                          f"full (no space left on device). Free space there, or choose an output_dir on another "
                          f"disk; the checkpoints already there are untouched (the newest is {out / 'checkpoint-1'}: "
                          f"continue from it with the same command plus --resume).")
    assert integrity.verify_checkpoint(out / "checkpoint-1") and not (out / "checkpoint-2").exists()


# ----------------------------------------------------------------------------------------------------
# output dirs left by killed runs


def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer(tmp_path, **overrides) -> GRPOTrainer:
    values = {"group_size": 2, "max_new_tokens": 4, "gradient_accumulation_steps": 1, "max_steps": 1,
              "save_steps": 1, "logging_steps": 1, "kl_beta": 0.0, "preflight": "off",
              "output_dir": str(tmp_path / "run")}
    model, tokenizer = build_tiny_model()
    return GRPOTrainer(model, tokenizer, text_length, GRPOConfig(**(values | overrides)))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def killed_before_its_first_checkpoint(run: Path) -> None:
    """What `forge train` leaves when killed in step 2 of a run that saves every 5 steps."""
    run.mkdir(parents=True)
    (run / "training_log.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (run / "samples.jsonl").write_text('{"step": 1}\n')
    (run / f"checkpoint-5.tmp-{dead_pid()}").mkdir()  # a save under way when it was killed
    (run / "notes.txt").write_text("mine")


def test_resume_of_a_run_killed_before_its_first_checkpoint_says_how_to_start_afresh(tmp_path):
    killed_before_its_first_checkpoint(tmp_path / "run")
    with pytest.raises(FileNotFoundError) as caught:
        trainer(tmp_path, resume_from="latest").train(ROWS)
    assert str(caught.value) == (
        f"resume_from='latest' (--resume) but {tmp_path / 'run'} holds no complete checkpoint: the run that wrote "
        f"samples.jsonl, training_log.jsonl there stopped before its first checkpoint was complete, so there is "
        f"nothing to resume. To start afresh, run the same command without --resume (resume_from=None): it "
        f"replaces those logs and touches nothing else.")


def test_a_plain_rerun_takes_over_a_directory_holding_only_a_killed_runs_logs(tmp_path, capsys):
    run = tmp_path / "run"
    killed_before_its_first_checkpoint(run)
    trainer(tmp_path).train(ROWS)
    said = capsys.readouterr()
    assert (f"forge: {run} held only the logs of a run that stopped before its first checkpoint (samples.jsonl, "
            f"training_log.jsonl): there is nothing to resume, so this run starts afresh and replaces them") in \
        said.out + said.err
    log = [json.loads(line) for line in (run / "training_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1] and log[0]["loss"] != 0.5  # this run's step 1 only
    assert (run / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "final", "notes.txt", "samples.jsonl",
                                                     "training_log.jsonl"]


def forge_run_with_a_foreign_folder(tmp_path) -> Path:
    run = tmp_path / "run"
    trainer(tmp_path, max_steps=2).train(ROWS)
    (run / "checkpoint-7").mkdir()
    (run / "checkpoint-7" / "results.csv").write_text("not Forge's")
    (run / "data").mkdir()
    (run / "data" / "train.jsonl").write_text("{}")
    return run


def test_overwrite_output_dir_deletes_only_forges_files(tmp_path, capsys):
    run = tmp_path / "run"
    trainer(tmp_path, max_steps=2).train(ROWS)
    (run / "data").mkdir()
    (run / "data" / "train.jsonl").write_text("{}")
    (run / "checkpoint-1" / "COMPLETE").write_text("{}")  # not Forge's manifest any more: not Forge's to delete
    with pytest.raises(OutputDirInUse, match=r"holds checkpoint-1/, named like a Forge checkpoint but not "
                                             r"Forge's .* Move it out of"):
        trainer(tmp_path, overwrite_output_dir=True).train(ROWS)
    assert (run / "checkpoint-2").is_dir() and (run / "final").is_dir()  # refused before anything was deleted
    (run / "checkpoint-1").rename(tmp_path / "kept-1")
    capsys.readouterr()
    lock = claim_output_dir(run, resuming=False, overwrite=True, is_main=True)
    lock.release()
    said = capsys.readouterr()
    assert (f"--overwrite_output_dir: deleted the earlier run's checkpoint-2, final, samples.jsonl, training_log.jsonl "
            f"in {run}") in said.out + said.err
    assert sorted(p.name for p in run.iterdir()) == ["data"] and (run / "data" / "train.jsonl").read_text() == "{}"


def test_a_folder_with_a_steps_name_that_is_not_forges_is_never_deleted_or_saved_over(tmp_path):
    run = forge_run_with_a_foreign_folder(tmp_path)
    for flags in ({"overwrite_output_dir": True}, {"resume_from": "latest", "max_steps": 8}, {}):
        with pytest.raises(OutputDirInUse, match=r"holds checkpoint-7/, named like a Forge checkpoint but not"):
            trainer(tmp_path, **flags).train(ROWS)
        assert (run / "checkpoint-7" / "results.csv").read_text() == "not Forge's" and (run / "checkpoint-2").is_dir()
    model, tokenizer = build_tiny_model()
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*7: a folder that is not a Forge checkpoint"):
        save_checkpoint(run / "checkpoint-7", model=model, tokenizer=tokenizer, trainer_state={}, config=CONFIG)
    assert (run / "checkpoint-7" / "results.csv").read_text() == "not Forge's"


def test_a_leftover_of_a_killed_replace_is_put_back_only_when_it_verifies_and_the_console_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    trainer(tmp_path, max_steps=2).train(ROWS)
    gone = dead_pid()
    (run / "checkpoint-2").rename(run / f"checkpoint-2.old-{gone}")  # killed between the two renames of a save
    (run / "checkpoint-1").rename(run / f"checkpoint-1.old-{gone}")
    (run / f"checkpoint-1.old-{gone}" / "model.safetensors").write_bytes(b"damaged")  # no longer matches COMPLETE
    capsys.readouterr()
    trainer(tmp_path, max_steps=3, resume_from="latest").train(ROWS)
    said = capsys.readouterr()
    said = said.out + said.err
    assert (f"forge: restored checkpoint {run / 'checkpoint-2'} from checkpoint-2.old-{gone}, left by a save that "
            f"was killed while replacing it (every file verifies against its COMPLETE)") in said
    assert (f"forge: left {run / f'checkpoint-1.old-{gone}'} as it is: a leftover of a killed save that is not a "
            f"whole") in said
    assert f"resumed from step 2 ({run / 'checkpoint-2'})" in said
    assert not (run / "checkpoint-1").exists() and (run / f"checkpoint-1.old-{gone}").is_dir()


@pytest.mark.parametrize("saved", [{}, {"group_size": 2}], ids=["emptied", "settings-removed"])
def test_a_forge_config_without_the_settings_a_save_writes_is_a_damaged_checkpoint(saved, tmp_path):
    """forge_config.json rewritten without settings every save writes (and COMPLETE rehashed to match): the
    checkpoint is damaged, said in one line with the older checkpoint to resume from, not a list of settings
    'saved' as <not set> to set back."""
    run = tmp_path / "run"
    trainer(tmp_path, max_steps=2).train(ROWS)
    (run / "checkpoint-2" / "forge_config.json").write_text(json.dumps(saved))
    rehash(run / "checkpoint-2")
    resuming = trainer(tmp_path, max_steps=3, resume_from="latest")
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is damaged: forge_config.json holds no ") as caught:
        resuming.train(ROWS)
    assert "\n" not in str(caught.value) and "seed" in str(caught.value)
    assert f"The newest older checkpoint that verifies is {run / 'checkpoint-1'}" in str(caught.value)
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is damaged: forge_config.json holds no "):
        check_before_launch(run, "latest", resuming.config.to_dict())


def test_forge_train_nproc_checks_the_checkpoint_to_resume_from_before_it_starts_the_processes(tmp_path):
    """`check_before_launch`: the checkpoint --resume (or resume_from) names, verified in `forge train`
    itself, so a damaged one, or one whose run had other settings a resume needs unchanged, is refused in one
    line instead of once per process; where a leftover of a killed save may be put back first, the processes
    decide."""
    run = tmp_path / "run"
    two_steps = trainer(tmp_path, max_steps=2)
    two_steps.train(ROWS)
    config = two_steps.config.to_dict()
    assert check_before_launch(run, "latest", config) == run / "checkpoint-2"
    assert check_before_launch(run, str(run / "checkpoint-1"), config) == run / "checkpoint-1"
    with pytest.raises(ValueError, match="final/ holds the trained model only"):
        check_before_launch(run, str(run / "final"), config)
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        check_before_launch(tmp_path / "elsewhere", "latest", config)
    with pytest.raises(ValueError, match=r"checkpoint-2: its config differs from this run's in group_size \(saved 2, "
                                         r"current 4\); set these back"):
        check_before_launch(run, "latest", config | {"group_size": 4})
    assert check_before_launch(run, "latest", config | {"learning_rate": 1.0}) == run / "checkpoint-2"  # may change
    (run / "checkpoint-2" / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is damaged: model.safetensors is 7 bytes") as caught:
        check_before_launch(run, "latest", config)
    assert f"The newest older checkpoint that verifies is {run / 'checkpoint-1'}" in str(caught.value)
    (run / "checkpoint-1").rename(run / f"checkpoint-1.old-{dead_pid()}")
    assert check_before_launch(run, "latest", config) is None
