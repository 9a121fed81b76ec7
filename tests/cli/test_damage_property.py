"""Any damage to any file of a saved folder ends `forge eval`, `forge export` and `forge train --resume` in
success or in one line, never in a traceback (property-based, hypothesis).

Built once: a plain transformers folder (one weights file, and one in shards with their index), a LoRA run and
a full fine-tune run of one step each (their numbered checkpoint, final/, training_log.jsonl, samples.jsonl).
Each example copies one of them, damages one file in a way hypothesis draws (cut at a drawn byte, emptied,
JSON nested deep, a JSON value or one field of another type, random bytes, a link to elsewhere, a link loop, a
folder or nothing in its place, a huge sparse file), sometimes rewrites COMPLETE to match the damage (as
whoever hands a checkpoint over can), and runs the command through `forge.cli.main` in this process: it must
exit 0, or print exactly one `forge: error:` line (and the --debug hint) and exit 1 or 2. A traceback is a bug
in Forge's readers (forge/safe_json.py, forge/run/integrity.py, forge/run/model_files.py); each one found is
kept below as an @example. One subprocess per command shows the same from the shell.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from forge.cli import main as forge_main
from forge.model.tiny import build_tiny_model
from forge.run.integrity import COMPLETE_MARKER, has_forge_manifest, latest_checkpoint, write_manifest

HUGE = 1 << 36  # 64 GiB, sparse: nothing may read it whole
EXAMPLES = int(os.environ.get("FORGE_DAMAGE_EXAMPLES", "30"))  # more for a longer search
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
DAMAGES = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True)),
    st.just(("empty",)),
    st.tuples(st.just("nested"), st.integers(101, 200_000)),
    st.tuples(st.just("json"), JSON_VALUES),
    st.tuples(st.just("field"), st.integers(0, 40), JSON_VALUES),
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(st.just("link"), st.sampled_from(["/etc/passwd", "/dev/zero", "/", "sibling", "nowhere"])),
    st.just(("loop",)),
    st.just(("folder",)),
    st.just(("removed",)),
    st.just(("huge",)),
)


# --------------------------------------------------------------------------------------------------
# the folders, built once


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    tokenizer.save_pretrained(root / "sharded")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    rows = [{"prompt": f"What is {a} + 1?", "reference": str(a + 1)} for a in range(4)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for run, lora in (("full", []), ("lora", ["--use_lora", "true", "--lora_r", "2"])):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert forge_main(train_args(root, root / run, *lora)) == 0
    return root


def train_args(root: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(root / "plain"), "--dataset", str(root / "data.jsonl"), "--output_dir",
            str(output_dir), "--group_size", "2", "--prompts_per_step", "2",
            "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "2", "--max_steps", "1", "--save_steps", "1", "--logging_steps", "1",
            "--preflight", "off", *extra]


def eval_args(root: Path, *model: Path) -> list[str]:
    flags = ["--model", str(model[0])] + (["--adapter", str(model[1])] if len(model) > 1 else [])
    return ["eval", *flags, "--data", str(root / "data.jsonl"), "--n", "1", "--max_new_tokens", "1"]


def files_of(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------------
# damage


def damage(folder: Path, name: str, how: tuple) -> None:
    """Damage the file `name` of `folder` as `how` says."""
    file = folder / name
    kind, *args = how
    data = file.read_bytes()
    if kind in ("link", "loop", "folder", "removed"):
        file.unlink()
    if kind == "cut":
        file.write_bytes(data[: int(len(data) * args[0])])
    elif kind == "empty":
        file.write_bytes(b"")
    elif kind == "nested":
        file.write_text("[" * args[0] + "]" * args[0])
    elif kind == "json":
        file.write_text(json.dumps(args[0]))
    elif kind == "field":
        file.write_bytes(with_a_field_changed(data, *args))
    elif kind == "bytes":
        file.write_bytes(args[0])
    elif kind == "link":
        target = {"sibling": min(p for p in folder.rglob("*") if p.is_file() and p != file),
                  "nowhere": folder / "no-such-file"}.get(args[0], args[0])
        file.symlink_to(target)
    elif kind == "loop":
        file.symlink_to(file.name)
    elif kind == "folder":
        file.mkdir()
        (file / "x").write_text("{}")
    elif kind == "huge":
        os.truncate(file, HUGE)


def with_a_field_changed(data: bytes, index: int, value) -> bytes:
    """The JSON object in `data` (or the last row of a JSONL file) with its index-th field set to `value`; the
    bytes as they were when there is no such object."""
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines() or [""]
    try:
        row = json.loads(lines[-1] if len(lines) > 1 else text)
    except ValueError:
        return data
    if not isinstance(row, dict) or not row:
        return data
    row[sorted(row)[index % len(row)]] = value
    if len(lines) > 1:
        return ("\n".join(lines[:-1] + [json.dumps(row)]) + "\n").encode()
    return json.dumps(row).encode()


def run_damaged(command: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `forge.cli.main`; a bug in Forge raises out of it with its traceback."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = forge_main(command)
    return code, err.getvalue()


def assert_success_or_one_line(code: int, stderr: str, damaged: str) -> None:
    if code == 0:
        return
    lines = stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("forge: error: ")]
    assert code in (1, 2) and len(errors) == 1, (damaged, code, stderr[-3000:])
    assert lines[errors[0] + 1].startswith("(run again with --debug"), (damaged, stderr[-3000:])
    assert "Traceback" not in stderr, (damaged, stderr[-3000:])


def damaged_copy(source: Path, workdir: Path, name: str, how: tuple, rehash: bool) -> Path:
    """A copy of `source` in `workdir` with `name` damaged; COMPLETE rewritten to match when `rehash`."""
    copy = workdir / source.name
    shutil.copytree(source, copy, symlinks=True)
    damage(copy, name, how)
    if rehash and how[0] != "huge":
        for marker in copy.rglob(COMPLETE_MARKER):
            if marker.is_file() and not marker.is_symlink() and has_forge_manifest(marker.parent) \
                    and marker.as_posix() != (copy / name).as_posix():
                write_manifest(marker.parent)
    return copy


# --------------------------------------------------------------------------------------------------
# the properties


# every file the folders hold, by name (a checkpoint's as "checkpoint/NAME"); a name a folder lacks stands for
# one it holds (`pick`), so every draw damages a file and an @example names the file it damages
NAMES = ["config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
         "model-00001-of-00003.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "COMPLETE", "trainer_state.json", "forge_config.json", "adapter_config.json",
         "adapter_model.safetensors", "README.md", "checkpoint/COMPLETE", "checkpoint/trainer_state.json",
         "checkpoint/optimizer.safetensors", "checkpoint/rng_state.safetensors",
         "checkpoint/scheduler.safetensors", "checkpoint/model.safetensors",
         "checkpoint/adapter_model.safetensors", "checkpoint/adapter_config.json", "checkpoint/config.json",
         "checkpoint/forge_config.json", "training_log.jsonl", "samples.jsonl"]


def pick(folder: Path, name: str, checkpoint: str | None = None) -> str:
    """`name` as a file of `folder` (checkpoint/ standing for the run's checkpoint), or, where it has none of
    that name, the file of `folder` the name stands for."""
    names = files_of(folder)
    if checkpoint is not None:
        names = [n for n in names if n.startswith(f"{checkpoint}/") or "/" not in n]
        name = name.replace("checkpoint/", f"{checkpoint}/")
    if name in names:
        return name
    return names[NAMES.index(name.replace(f"{checkpoint}/", "checkpoint/")) % len(names)]


@SETTINGS
@given(target=st.sampled_from(["plain", "sharded", "full/final", "lora/final"]), name=st.sampled_from(NAMES),
       how=DAMAGES, rehash=st.booleans())
@example(target="sharded", name="model.safetensors.index.json", how=("nested", 200_000), rehash=False)
@example(target="sharded", name="tokenizer.json", how=("loop",), rehash=False)
@example(target="plain", name="tokenizer.json", how=("json", {"a": [1]}), rehash=False)
@example(target="plain", name="tokenizer_config.json", how=("link", "sibling"), rehash=False)
@example(target="lora/final", name="tokenizer.json", how=("huge",), rehash=False)
def test_forge_eval_of_a_damaged_folder_succeeds_or_says_one_line(pristine, target, name, how, rehash):
    name = pick(pristine / target, name)
    with tempfile.TemporaryDirectory() as workdir:
        copy = damaged_copy(pristine / target, Path(workdir), name, how, rehash)
        models = (pristine / "plain", copy) if target == "lora/final" else (copy,)  # an adapter on its base
        code, stderr = run_damaged(eval_args(pristine, *models))
    assert_success_or_one_line(code, stderr, f"{target}/{name}: {how}")


@SETTINGS
@given(target=st.sampled_from(["lora/final", "plain"]), name=st.sampled_from(NAMES), how=DAMAGES,
       rehash=st.booleans())
@example(target="lora/final", name="adapter_config.json", how=("json", {"a": [1]}), rehash=True)
@example(target="lora/final", name="tokenizer.json", how=("huge",), rehash=False)
@example(target="plain", name="tokenizer.json", how=("link", "sibling"), rehash=False)
def test_forge_export_of_a_damaged_folder_succeeds_or_says_one_line(pristine, target, name, how, rehash):
    name = pick(pristine / target, name)
    with tempfile.TemporaryDirectory() as workdir:
        copy = damaged_copy(pristine / target, Path(workdir), name, how, rehash)
        lora = pristine / "lora" / "final"
        adapter, base = (copy, pristine / "plain") if target != "plain" else (lora, copy)
        command = ["export", "--adapter", str(adapter), "--base", str(base), "--out", f"{workdir}/merged"]
        code, stderr = run_damaged(command)
    assert_success_or_one_line(code, stderr, f"{target}/{name}: {how}")


@SETTINGS
@given(run=st.sampled_from(["full", "lora"]), name=st.sampled_from(NAMES), how=DAMAGES, rehash=st.booleans())
@example(run="full", name="checkpoint/optimizer.safetensors", how=("huge",), rehash=False)
@example(run="full", name="training_log.jsonl", how=("json", [1, 2, 3]), rehash=False)
@example(run="full", name="training_log.jsonl", how=("field", 5, []), rehash=False)  # a metric that is a list
@example(run="full", name="samples.jsonl", how=("huge",), rehash=False)
@example(run="full", name="checkpoint/forge_config.json", how=("json", {}), rehash=True)  # was a list of settings
def test_forge_train_resume_from_a_damaged_checkpoint_succeeds_or_says_one_line(pristine, run, name, how,
                                                                                rehash):
    checkpoint = latest_checkpoint(pristine / run).relative_to(pristine / run).as_posix()
    name = pick(pristine / run, name, checkpoint)
    with tempfile.TemporaryDirectory() as workdir:
        copy = damaged_copy(pristine / run, Path(workdir), name, how, rehash)
        lora = ["--use_lora", "true", "--lora_r", "2"] if run == "lora" else []
        code, stderr = run_damaged(train_args(pristine, copy, *lora, "--resume"))
    assert_success_or_one_line(code, stderr, f"{run}/{name}: {how}")


# --------------------------------------------------------------------------------------------------
# from the shell: one line, a non-zero exit


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_the_command_line_says_one_line_of_a_damaged_file(pristine, tmp_path, command):
    source = {"eval": "plain", "export": "lora/final", "resume": "full"}[command]
    copy = tmp_path / "copy"
    shutil.copytree(pristine / source, copy)
    damaged = copy / (f"{latest_checkpoint(copy).name}/trainer_state.json" if command == "resume"
                      else "config.json" if command == "eval" else "adapter_config.json")
    damaged.write_text("[" * 200_000 + "]" * 200_000)
    argv = {"eval": eval_args(pristine, copy),
            "export": ["export", "--adapter", str(copy), "--base", str(pristine / "plain"), "--out",
                       str(tmp_path / "merged")],
            "resume": train_args(pristine, copy, "--resume")}[command]
    done = subprocess.run([sys.executable, "-m", "forge", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FORGE_DEBUG": ""}, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("forge: error: ")]
    assert done.returncode in (1, 2) and len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr and damaged.name in errors[0], done.stderr
