"""`forge eval`, `forge export`, `forge train --model` and `forge screen --model` verify a folder Forge saved
before they load it.

A Forge checkpoint (numbered or final/, full weights or a LoRA adapter) whose weights file is truncated or
changed, or whose save never wrote COMPLETE, stops the command with exit code 2 and one line that names the
folder, the file and what to use instead, and export writes nothing. A plain transformers folder has no
manifest and loads as it always did. Everything runs in this process through `forge.cli.main` on the tiny model.
"""

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch

from forge.cli import main
from forge.model.tiny import build_tiny_model
from forge.run.checkpoint import save_checkpoint
from forge.run.integrity import check_saved_model, is_forge_save

ROWS = [{"prompt": "What is 2 + 3?", "reference": "5"}, {"prompt": "What is 4 + 1?", "reference": "5"}]
TRAINER_STATE = {"global_step": 1, "epoch": 0.5, "data_position": 2}
CONFIG = {"model_name": "tiny", "group_size": 2}


def forge_main(*argv) -> int:
    return main([str(a) for a in argv])


def save(path: Path, model, tokenizer, training_state: bool) -> None:
    """A Forge checkpoint of `model`; a numbered one (training_state) with real AdamW and schedule state."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_checkpoint(path, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                    trainer_state=TRAINER_STATE, config=CONFIG, training_state=training_state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """plain/ (a transformers folder), full/final (a full fine-tune's final/), lora/1 and lora/final (a LoRA run's
    numbered checkpoint and final/), data.jsonl."""
    root = tmp_path_factory.mktemp("saved")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    save(root / "full" / "final", model, tokenizer, training_state=False)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.01)
    save(root / "lora" / "checkpoint-1", lora, tokenizer, training_state=True)
    save(root / "lora" / "final", lora, tokenizer, training_state=False)
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return root


def eval_args(saved: Path, *model_args) -> list:
    return ["eval", *model_args, "--data", saved / "data.jsonl", "--n", "2", "--max_new_tokens", "2"]


def test_a_good_checkpoint_evaluates_and_exports_as_before(saved, tmp_path, capsys):
    assert forge_main(*eval_args(saved, "--model", saved / "full" / "final")) == 0
    assert forge_main(*eval_args(saved, "--model", saved / "plain", "--adapter", saved / "lora" / "final")) == 0
    assert forge_main("export", "--adapter", saved / "lora" / "checkpoint-1", "--base", saved / "plain",
                      "--out", tmp_path / "merged") == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "strict_accuracy" in capsys.readouterr().out


def test_an_earlier_forges_plain_numbered_checkpoint_still_evaluates_exports_and_is_named_as_the_way_out(
        saved, tmp_path, capsys):
    """An earlier Forge named its checkpoints `{step}` (`lora/1`): eval and export read it as before, and the
    advice for a damaged later one names it."""
    shutil.copytree(saved / "lora" / "checkpoint-1", tmp_path / "lora" / "1")
    shutil.copytree(saved / "lora" / "checkpoint-1", tmp_path / "lora" / "2")
    old = tmp_path / "lora" / "1"
    assert forge_main(*eval_args(saved, "--model", saved / "plain", "--adapter", old)) == 0
    assert forge_main("export", "--adapter", old, "--base", saved / "plain", "--out", tmp_path / "merged") == 0
    flip(tmp_path / "lora" / "2" / "adapter_model.safetensors")
    capsys.readouterr()
    assert forge_main(*eval_args(saved, "--model", saved / "plain", "--adapter", tmp_path / "lora" / "2")) == 2
    assert f"Use {old} instead" in capsys.readouterr().err.splitlines()[0]


def test_a_plain_transformers_folder_or_hub_id_loads_unchecked(saved, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(saved / "plain", plain)
    (plain / "trainer_state.json").write_text("{}")  # what a transformers Trainer checkpoint holds: not Forge's
    assert not is_forge_save(plain) and not is_forge_save("HuggingFaceTB/SmolLM2-135M-Instruct")
    check_saved_model(plain, "--model")  # no manifest: nothing to verify, nothing raised
    assert forge_main(*eval_args(saved, "--model", plain)) == 0


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-1])


def flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: the file still parses and loads
    file.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (truncate, ["bytes, not the", "recorded in COMPLETE", "is truncated"]),
    "flipped": (flip, ["does not match the sha256 recorded in COMPLETE", "changed or damaged on disk"]),
    "no COMPLETE": (None, ["is incomplete", "no COMPLETE marker", "interrupted"]),
}
# (what is loaded, its run folder, the checkpoint damaged, its weights file, the command)
COMMANDS = {
    "eval --model": ("full", "final", "model.safetensors",
                     lambda saved, folder, out: eval_args(saved, "--model", folder)),
    "eval --adapter": ("lora", "final", "adapter_model.safetensors",
                       lambda saved, folder, out: eval_args(saved, "--model", saved / "plain", "--adapter", folder)),
    "eval --compare": ("full", "final", "model.safetensors",
                       lambda saved, folder, out: [*eval_args(saved, "--compare", saved / "plain", folder), "--out", out]),
    "export": ("lora", "final", "adapter_model.safetensors",
               lambda saved, folder, out: ["export", "--adapter", folder, "--base", saved / "plain", "--out", out]),
    "train --model": ("full", "final", "model.safetensors",
                      lambda saved, folder, out: ["train", "--model", folder, "--dataset", saved / "data.jsonl",
                                                  "--reward", "exact_match", "--group_size", "2", "--max_steps", "1",
                                                  "--max_new_tokens", "2", "--preflight", "off", "--output_dir", out]),
    "screen --model": ("full", "final", "model.safetensors",
                       lambda saved, folder, out: ["screen", "--model", folder, "--dataset", saved / "data.jsonl",
                                                   "--n", "2", "--group_size", "2", "--max_new_tokens", "2",
                                                   "--out", out]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_or_unfinished_checkpoint_exits_2_naming_the_folder_the_file_and_what_to_do(
        saved, tmp_path, capsys, damage, command):
    run_dir, checkpoint, weights, argv = COMMANDS[command]
    shutil.copytree(saved / run_dir, tmp_path / run_dir)
    folder = tmp_path / run_dir / checkpoint
    spoil, words = DAMAGE[damage]
    if spoil is None:
        (folder / "COMPLETE").unlink()
    else:
        spoil(folder / weights)
    out = tmp_path / "merged"

    assert forge_main(*argv(saved, folder, out)) == 2
    err = capsys.readouterr().err
    message = err.splitlines()[0]
    assert message.startswith("forge: error: --") and f"{folder} (a Forge checkpoint)" in message
    assert all(word in message for word in words), message
    if spoil is not None:
        assert weights in message
    if run_dir == "lora":  # the run's numbered checkpoint still verifies: it is named as the way out
        assert f"Use {tmp_path / 'lora' / 'checkpoint-1'} instead" in message
    else:
        assert f"No earlier checkpoint in {tmp_path / 'full'} verifies" in message
    assert "re-run the save" in message
    assert not out.exists()  # export, the comparison report, the run or the kept prompts: nothing written


def test_a_damaged_numbered_checkpoint_is_refused_too_and_the_advice_names_no_newer_one(saved, tmp_path, capsys):
    shutil.copytree(saved / "lora", tmp_path / "lora")
    adapter = tmp_path / "lora" / "checkpoint-1"
    flip(adapter / "adapter_model.safetensors")
    assert forge_main(*eval_args(saved, "--model", saved / "plain", "--adapter", adapter)) == 2
    message = capsys.readouterr().err.splitlines()[0]
    assert f"--adapter {adapter} (a Forge checkpoint)" in message
    assert f"No earlier checkpoint in {tmp_path / 'lora'} verifies" in message  # final/ is newer, not a way back
