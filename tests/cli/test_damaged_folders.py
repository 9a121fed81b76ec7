"""`forge eval` and `forge export` never destroy a model or trust a folder blindly.

`forge export --out` writes only into an empty or new folder, or over its own earlier export of the same adapter and
base; --overwrite replaces anything else, but never a folder export reads from. A folder whose files are damaged in
a way its hashes cannot tell (it has none, or they were rewritten with the damage) stops eval and export with exit
code 2 and one line naming the folder and the file, before anything is written: NaN/inf weights, a pickle or a
system file where safetensors should be, a tensor shape that lies, JSON that does not parse, a config.json or an
adapter_config.json that does not describe the weights. Everything runs in this process on the tiny model.
"""

import json
import pickle
import shutil
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from forge.cli import main
from forge.model.tiny import build_tiny_model
from forge.run.checkpoint import save_checkpoint
from forge.run.integrity import check_saved_model, write_manifest

ROWS = [{"prompt": "What is 2 + 3?", "reference": "5"}, {"prompt": "What is 4 + 1?", "reference": "5"}]


def forge_main(*argv) -> int:
    return main([str(a) for a in argv])


def save(path: Path, model, tokenizer) -> None:
    """A Forge final/ of `model` (weights, config, tokenizer, COMPLETE with every file's sha256)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_checkpoint(path, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                    trainer_state={"global_step": 1}, config={"model_name": "tiny"}, training_state=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """plain/ (a transformers folder), full/final (a full fine-tune's final/), lora/final and lora2/final (two
    LoRA runs' final/ on plain/), data.jsonl."""
    root = tmp_path_factory.mktemp("saved")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    save(root / "full" / "final", model, tokenizer)
    for run, value in (("lora", 0.01), ("lora2", 0.02)):
        lora = peft.get_peft_model(build_tiny_model(tokenizer, seed=0)[0], peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # a trained adapter: B is no longer zero
            for name, parameter in lora.named_parameters():
                if "lora_B" in name:
                    parameter.fill_(value)
        save(root / run / "final", lora, tokenizer)
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return root


def eval_args(saved: Path, *model_args) -> list:
    return ["eval", *model_args, "--data", saved / "data.jsonl", "--n", "2", "--max_new_tokens", "2"]


def export_args(saved: Path, out: Path, adapter: Path | None = None, base: Path | None = None) -> list:
    return ["export", "--adapter", adapter or saved / "lora" / "final", "--base", base or saved / "plain", "--out", out]


def error_line(capsys) -> str:
    """The one line of the error: nothing else on stderr but the --debug hint (no traceback, no load report)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]  # transformers' progress bar
    assert len(lines) == 2 and lines[0].startswith("forge: error: ") and lines[1].startswith("(run again"), err
    return lines[0]


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------
# export --out


def test_export_refuses_a_folder_holding_a_trained_model_and_names_it(saved, tmp_path, capsys):
    trained = tmp_path / "trained"
    shutil.copytree(saved / "full" / "final", trained)
    before = contents(trained)

    assert forge_main(*export_args(saved, trained)) == 2
    message = error_line(capsys)
    assert f"--out {trained}" in message and "a Forge checkpoint" in message and "model.safetensors" in message
    assert "--overwrite" in message
    assert contents(trained) == before
    check_saved_model(trained, "--model")  # still verifies


def test_export_refuses_a_folder_holding_other_files_and_names_them(saved, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert forge_main(*export_args(saved, out)) == 2
    message = error_line(capsys)
    assert f"--out {out}" in message and "notes.txt" in message and "--overwrite" in message
    assert contents(out) == {"notes.txt": b"mine"}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("which", ["--adapter", "--base"])
def test_export_never_writes_into_a_folder_it_reads_from(saved, tmp_path, capsys, which, overwrite):
    adapter, base = tmp_path / "lora" / "final", tmp_path / "plain"
    shutil.copytree(saved / "lora", tmp_path / "lora")
    shutil.copytree(saved / "plain", base)
    source = adapter if which == "--adapter" else base
    before = contents(tmp_path)

    argv = export_args(saved, source, adapter=adapter, base=base) + (["--overwrite"] if overwrite else [])
    assert forge_main(*argv) == 2
    message = error_line(capsys)
    assert f"--out {source}" in message and f"{which} folder" in message
    assert contents(tmp_path) == before
    check_saved_model(adapter, "--adapter")  # the adapter still verifies
    assert forge_main(*eval_args(saved, "--model", base, "--adapter", adapter)) == 0


def test_export_refuses_a_folder_that_holds_what_it_reads_even_with_overwrite(saved, tmp_path, capsys):
    shutil.copytree(saved / "lora", tmp_path / "run" / "lora")
    assert forge_main(*export_args(saved, tmp_path / "run", adapter=tmp_path / "run" / "lora" / "final"),
                      "--overwrite") == 2
    assert "--adapter folder" in error_line(capsys)
    check_saved_model(tmp_path / "run" / "lora" / "final", "--adapter")


def test_export_writes_over_its_own_earlier_export_of_the_same_adapter_and_base(saved, tmp_path, capsys):
    out = tmp_path / "merged"
    assert forge_main(*export_args(saved, out)) == 0
    first = contents(out)
    assert "model.safetensors" in first
    assert forge_main(*export_args(saved, out)) == 0  # the same command again
    assert contents(out) == first
    capsys.readouterr()

    # another adapter over it: refused, naming the export that is there
    assert forge_main(*export_args(saved, out, adapter=saved / "lora2" / "final")) == 2
    message = error_line(capsys)
    assert f"--out {out}" in message and str(saved / "lora" / "final") in message and "--overwrite" in message
    assert contents(out) == first

    # a file of the user's next to the export: no longer only an export
    (out / "notes.txt").write_text("mine")
    assert forge_main(*export_args(saved, out)) == 2
    assert "notes.txt" in error_line(capsys)


def test_overwrite_replaces_the_folder_with_the_export_alone(saved, tmp_path):
    out = tmp_path / "trained"
    shutil.copytree(saved / "full" / "final", out)
    (out / "notes.txt").write_text("mine")
    assert forge_main(*export_args(saved, out), "--overwrite") == 0
    fresh = tmp_path / "fresh"
    assert forge_main(*export_args(saved, fresh)) == 0
    assert contents(out) == contents(fresh)  # the export and nothing of what was there
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("trained", "fresh")] == []  # no temporaries left


# --------------------------------------------------------------------------------------------------
# damaged folders: one line naming the folder and the file, exit 2, nothing written


def rewrite_header(file: Path, change) -> None:
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size:])


def first_tensor(header: dict) -> dict:
    return header[min(name for name in header if name != "__metadata__")]


def nonfinite(value):
    def spoil(file: Path) -> None:
        tensors = load_file(file)
        tensors[max(tensors)].view(-1)[0] = value
        save_file(tensors, file, metadata={"format": "pt"})
    return spoil


def pickled(file: Path) -> None:
    file.write_bytes(pickle.dumps({name: tensor.numpy() for name, tensor in load_file(file).items()}))


def header_shape_lie(file: Path) -> None:
    rewrite_header(file, lambda header: first_tensor(header).update(
        shape=[2 * first_tensor(header)["shape"][0], *first_tensor(header)["shape"][1:]]))


def shape_unlike_config(file: Path) -> None:
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:16].clone()
    save_file(tensors, file, metadata={"format": "pt"})


def system_file(file: Path) -> None:
    file.unlink()
    file.symlink_to("/etc/passwd")


def garbage(file: Path) -> None:
    file.write_text('{"model_type": "llama", ')


def change_json(**values):
    def spoil(file: Path) -> None:
        file.write_text(json.dumps(json.loads(file.read_text()) | values))
    return spoil


# case: (what is damaged: model or adapter, the file, how, words the message holds)
DAMAGE = {
    "NaN in the weights": ("model", "model.safetensors", nonfinite(float("nan")), ["NaN/inf"]),
    "inf in the adapter": ("adapter", "adapter_model.safetensors", nonfinite(float("inf")), ["NaN/inf"]),
    "a pickle as model.safetensors": ("model", "model.safetensors", pickled, ["pickle", "never"]),
    "a pickled adapter": ("adapter", "adapter_model.safetensors", pickled, ["pickle", "never"]),
    "a tensor shape that lies": ("model", "model.safetensors", header_shape_lie, ["shape"]),
    "a shape config.json does not make": ("model", "model.safetensors", shape_unlike_config,
                                          ["config.json", "[16, 32]"]),
    # a Forge save refuses the link as leading out of the checkpoint; a plain folder as not being safetensors
    "a weights link to a system file": ("model", "model.safetensors", system_file, ["/etc/passwd"]),
    "an adapter rank that lies": ("adapter", "adapter_config.json", change_json(r=8),
                                  ["adapter_model.safetensors", "size mismatch"]),
    "garbage config.json": ("model", "config.json", garbage, ["not valid JSON"]),
    "garbage tokenizer.json": ("model", "tokenizer.json", garbage, ["not valid JSON"]),
    "garbage adapter_config.json": ("adapter", "adapter_config.json", garbage, ["not valid JSON"]),
    "a model_type lie": ("model", "config.json", change_json(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                         ["gpt2", "model.safetensors", "missing"]),
}


def damaged_folder(saved: Path, tmp_path: Path, case: str, forge_save: bool) -> tuple[str, Path, str]:
    """(the flag, the damaged copy, its damaged file); a Forge save's COMPLETE is rewritten with the damage, so
    the hashes pass."""
    kind, name, spoil, _ = DAMAGE[case]
    source = {"adapter": saved / "lora" / "final", "model": saved / "full" / "final"}[kind]
    folder = tmp_path / "damaged"
    shutil.copytree(source if forge_save else saved / "plain", folder)
    if not forge_save:
        (folder / "COMPLETE").unlink(missing_ok=True)
    spoil(folder / name)
    if forge_save:
        write_manifest(folder)
    return ("--adapter" if kind == "adapter" else "--model"), folder, name


def check_refusal(message: str, flag: str, folder: Path, name: str, words: list[str]) -> None:
    """Named as `--model FOLDER: FILE ...`, or by the loader (`model folder FOLDER: ...`) for what only loading
    tells: a config.json or adapter_config.json that does not describe the weights."""
    assert message.startswith((f"forge: error: {flag} {folder}", f"forge: error: model folder {folder}",
                               f"forge: error: adapter folder {folder}")), message
    assert name in message, message
    assert all(word in message for word in words), message


@pytest.mark.parametrize("case, forge_save", [
    pytest.param(case, forge_save, id=f"{case}-{'forge-save' if forge_save else 'plain-folder'}")
    for case in DAMAGE for forge_save in (True, False) if forge_save or DAMAGE[case][0] == "model"])
def test_a_damaged_folder_stops_eval_and_export_in_one_line(saved, tmp_path, capsys, case, forge_save):
    flag, folder, name = damaged_folder(saved, tmp_path, case, forge_save)
    words = DAMAGE[case][3]
    out = tmp_path / "out"

    model_args = ["--model", saved / "plain", "--adapter", folder] if flag == "--adapter" else ["--model", folder]
    assert forge_main(*eval_args(saved, *model_args), "--out", out) == 2
    check_refusal(error_line(capsys), flag, folder, name, words)

    argv = export_args(saved, out, adapter=folder) if flag == "--adapter" else export_args(saved, out, base=folder)
    assert forge_main(*argv) == 2
    check_refusal(error_line(capsys), "--adapter" if flag == "--adapter" else "--base", folder, name, words)
    assert not out.exists()  # nothing written


class RunsCode:
    """What a hostile pickle holds: unpickling it calls Path.touch, creating the file it names."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_a_pickled_adapter_bin_is_refused_and_never_unpickled(saved, tmp_path, capsys):
    adapter = tmp_path / "adapter"  # a plain peft folder: adapter_config.json and adapter_model.bin
    shutil.copytree(saved / "lora" / "final", adapter, ignore=lambda *_: ["COMPLETE", "adapter_model.safetensors",
                                                                          "forge_config.json", "trainer_state.json"])
    touched = tmp_path / "code-ran"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(RunsCode(touched)))
    out = tmp_path / "out"

    assert forge_main(*eval_args(saved, "--model", saved / "plain", "--adapter", adapter), "--out", out) == 2
    check_refusal(error_line(capsys), "--adapter", adapter, "adapter_model.bin", ["never unpickles"])
    assert forge_main(*export_args(saved, out, adapter=adapter)) == 2
    message = error_line(capsys)
    check_refusal(message, "--adapter", adapter, "adapter_model.bin", ["never unpickles"])
    assert "weights_only" not in message  # torch's advice to unpickle it anyway is not passed on
    assert not touched.exists() and not out.exists()


def test_eval_compare_refuses_nan_weights_before_writing_the_report(saved, tmp_path, capsys):
    _, folder, name = damaged_folder(saved, tmp_path, "NaN in the weights", forge_save=True)
    out = tmp_path / "report"
    assert forge_main(*eval_args(saved, "--compare", saved / "plain", folder), "--out", out) == 2
    check_refusal(error_line(capsys), "--compare", folder, name, ["NaN/inf"])
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# the preflight: a reward that raises KeyboardInterrupt or SystemExit


def test_a_reward_raising_keyboard_interrupt_in_the_preflight_is_the_rewards_failure(saved, tmp_path, capsys):
    (tmp_path / "rewards.py").write_text(
        "def interrupts(prompts, completions, **kwargs):\n    raise KeyboardInterrupt\n")
    argv = ["train", "--model", saved / "plain", "--dataset", saved / "data.jsonl", "--group_size", "2",
            "--max_steps", "1", "--max_new_tokens", "2", "--preflight_prompts", "2",
            "--reward", f"{tmp_path / 'rewards.py'}:interrupts"]
    assert forge_main(*argv, "--output_dir", tmp_path / "raise") == 1
    message = capsys.readouterr().err
    assert "reward 'interrupts' raised KeyboardInterrupt" in message and "interrupted" not in message


# --------------------------------------------------------------------------------------------------
# what a folder can hold besides damaged weights: a symlink loop, JSON nested past the recursion limit, an index
# whose weight_map is not a map; each is one line naming the file, exit 2, before anything loads


DEEP_JSON = "[" * 200_000 + "]" * 200_000  # json.loads recurses once per level: a RecursionError unchecked


@pytest.fixture(scope="module")
def sharded(saved, tmp_path_factory):
    """plain/ saved in shards (model-0000N-of-0000M.safetensors and model.safetensors.index.json), and the same
    as a Forge save (forge_config.json, trainer_state.json, COMPLETE)."""
    root = tmp_path_factory.mktemp("sharded")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "plain", max_shard_size="40KB")
    tokenizer.save_pretrained(root / "plain")
    shutil.copytree(root / "plain", root / "forge")
    (root / "forge" / "forge_config.json").write_text(json.dumps({"model_name": "tiny"}))
    (root / "forge" / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    write_manifest(root / "forge")
    return root


@pytest.mark.parametrize("run", ["full", "lora"])
def test_a_symlink_loop_in_a_saved_folder_stops_eval_and_export_in_one_line(saved, tmp_path, capsys, run):
    folder = tmp_path / "looped"
    shutil.copytree(saved / run / "final", folder)
    (folder / "loop").symlink_to("loop")  # `ln -s loop F/loop`: following it never ends
    out = tmp_path / "out"

    model_args = ["--model", folder] if run == "full" else ["--model", saved / "plain", "--adapter", folder]
    assert forge_main(*eval_args(saved, *model_args), "--out", out) == 2
    message = error_line(capsys)
    assert str(folder) in message and "loop is a symlink loop" in message, message

    argv = export_args(saved, out, base=folder) if run == "full" else export_args(saved, out, adapter=folder)
    assert forge_main(*argv) == 2
    message = error_line(capsys)
    assert str(folder) in message and "loop is a symlink loop" in message, message
    assert not out.exists()


def test_a_symlink_loop_in_a_checkpoint_stops_train_resume_in_one_line(saved, tmp_path, capsys):
    output_dir = tmp_path / "run"
    argv = ["train", "--model", saved / "plain", "--dataset", saved / "data.jsonl", "--group_size", "2",
            "--prompts_per_step", "2", "--max_new_tokens", "2", "--preflight", "off", "--save_steps", "1",
            "--output_dir", output_dir]
    assert forge_main(*argv, "--max_steps", "1") == 0
    (output_dir / "checkpoint-1" / "loop").symlink_to("loop")
    capsys.readouterr()

    assert forge_main(*argv, "--max_steps", "2", "--resume") == 1  # a damaged checkpoint: a CheckpointError
    err = capsys.readouterr().err  # after the model's loading lines
    (message,) = [line for line in err.splitlines() if line.startswith("forge: error: ")]
    assert "Traceback" not in err
    assert f"checkpoint {output_dir / 'checkpoint-1'}" in message and "loop is a symlink loop" in message, message


def deep_header(file: Path) -> None:
    header = DEEP_JSON.encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header)


# case: (the folder: a plain transformers folder or a Forge save, whole or sharded; the file; its new bytes or a
# function of the file; words the message holds)
BAD_JSON = {
    "deep config.json": ("plain", "config.json", DEEP_JSON, ["levels deep"]),
    "deep COMPLETE": ("full", "COMPLETE", '{"format": ' + DEEP_JSON + "}", ["levels deep"]),
    "deep adapter_config.json": ("lora", "adapter_config.json", DEEP_JSON, ["levels deep"]),
    "deep safetensors header": ("plain", "model.safetensors", deep_header, ["levels deep"]),
    "deep index": ("sharded", "model.safetensors.index.json", DEEP_JSON, ["levels deep"]),
    "deep index of a Forge save": ("sharded-forge", "model.safetensors.index.json", DEEP_JSON,
                                   ["levels deep"]),
    "a weight_map list": ("sharded", "model.safetensors.index.json", json.dumps({"weight_map": [1, 2]}),
                          ["weight_map", "an array"]),
    "a weight_map list in a Forge save": ("sharded-forge", "model.safetensors.index.json",
                                          json.dumps({"weight_map": [1, 2]}), ["weight_map", "an array"]),
    "a weight_map of numbers": ("sharded", "model.safetensors.index.json",
                                json.dumps({"weight_map": {"model.norm.weight": 7}}), ["weight_map", "7"]),
}


@pytest.mark.parametrize("case", BAD_JSON)
def test_json_a_load_would_choke_on_stops_eval_in_one_line_naming_the_file(saved, sharded, tmp_path, capsys, case):
    kind, name, damage, words = BAD_JSON[case]
    source = {"plain": saved / "plain", "full": saved / "full" / "final", "lora": saved / "lora" / "final",
              "sharded": sharded / "plain", "sharded-forge": sharded / "forge"}[kind]
    folder = tmp_path / "damaged"
    shutil.copytree(source, folder)
    damage(folder / name) if callable(damage) else (folder / name).write_text(damage)
    if kind in ("lora", "sharded-forge"):
        write_manifest(folder)  # the hashes pass: the damage came with them
    model_args = ["--model", saved / "plain", "--adapter", folder] if kind == "lora" else ["--model", folder]

    assert forge_main(*eval_args(saved, *model_args)) == 2
    message = error_line(capsys)
    assert str(folder) in message and name in message, message
    assert all(word in message for word in words), message


def test_an_overwrite_over_a_step_folder_with_deep_json_in_complete_is_one_line(saved, tmp_path, capsys):
    output_dir = tmp_path / "run"
    (output_dir / "checkpoint-7").mkdir(parents=True)
    (output_dir / "checkpoint-7" / "COMPLETE").write_text(DEEP_JSON)  # not Forge's COMPLETE: the folder is not Forge's
    argv = ["train", "--model", saved / "plain", "--dataset", saved / "data.jsonl", "--max_steps", "1",
            "--output_dir", output_dir, "--overwrite_output_dir"]
    assert forge_main(*argv) == 2
    message = error_line(capsys)
    assert "checkpoint-7/" in message and "not Forge's" in message, message
    assert (output_dir / "checkpoint-7" / "COMPLETE").read_text() == DEEP_JSON  # never deleted


@pytest.mark.parametrize("holds", ["a checkpoint", "a training log"])
def test_export_never_replaces_a_training_runs_output_dir_not_with_overwrite_either(saved, tmp_path, capsys, holds):
    run = tmp_path / "run"
    if holds == "a checkpoint":
        shutil.copytree(saved / "full" / "final", run / "checkpoint-3")
    else:
        run.mkdir()
        (run / "training_log.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    before = contents(run)
    assert forge_main(*export_args(saved, run), "--overwrite") == 2
    message = error_line(capsys)
    assert f"--out {run} is a training run's output_dir" in message and "not with --overwrite" in message, message
    assert ("checkpoint-3/" if holds == "a checkpoint" else "training_log.jsonl") in message, message
    assert contents(run) == before


@pytest.mark.parametrize("leads_to", ["a folder", "a folder not made yet"])
def test_export_onto_a_link_writes_the_folder_it_leads_to_and_keeps_the_link(saved, tmp_path, leads_to):
    real = tmp_path / "real"
    if leads_to == "a folder":
        real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    for _ in range(2):  # the second time over its own export
        assert forge_main(*export_args(saved, link)) == 0
    assert link.is_symlink() and (real / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no temporary, nothing moved aside


def test_export_onto_a_symlink_loop_is_one_line(saved, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    assert forge_main(*export_args(saved, loop)) == 2
    assert f"--out {loop} is a symlink loop" in error_line(capsys)
