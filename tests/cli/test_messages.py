"""Bad input given to `forge train` is one line naming the input and what to do, exit code 2, before the run
starts; and `forge train` watches its training process, so an exit no `except` catches (os._exit() in a reward)
is said, exits 1 and leaves a run `--resume` continues. The messages in this process on the tiny offline model;
the watched runs as `python -m forge` subprocesses."""

import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from forge.cli import main
from forge.core.config_checks import VLLM_INSTALL
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]
REWARDS = '''
import os


def vowels(prompts, completions, **kwargs):
    return [float(sum(c in "aeiou" for c in t)) for t in completions]


def exits_at_step(prompts, completions, trainer_state=None, **kwargs):
    """vowels, but os._exit(EXIT_CODE) in step EXIT_AT_STEP; sleeps PAUSE_SECONDS in step PAUSE_AT_STEP."""
    step = trainer_state.global_step + 1  # the step being scored
    if str(step) == os.environ.get("EXIT_AT_STEP"):
        os._exit(int(os.environ.get("EXIT_CODE", "0")))
    if str(step) == os.environ.get("PAUSE_AT_STEP"):
        open(os.environ["READY_FILE"], "w").close()
        import time
        time.sleep(float(os.environ["PAUSE_SECONDS"]))
    return vowels(prompts, completions)
'''


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (root / "forge_test_rewards.py").write_text(REWARDS)
    return root


def forge_main(*argv) -> int:
    return main([str(a) for a in argv])


def train_flags(workspace, out, dataset=None) -> list:
    return ["--model", workspace / "tiny", "--dataset", dataset or workspace / "data.jsonl", "--reward",
            f"{workspace / 'forge_test_rewards.py'}:vowels", "--group_size", "2", "--max_new_tokens", "4",
            "--max_steps", "1", "--save_steps", "0", "--preflight", "off", "--output_dir", out]


def error_of(capsys) -> str:
    """The one-line message `forge` printed (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "forge: error: " in err, err
    return err[err.index("forge: error: "):].splitlines()[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    import forge.core.trainer

    def loads_a_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(forge.core.trainer, "GRPOTrainer", loads_a_model)


# ----------------------------------------------------------------------------------------------------
# bad input: exit 2, one line naming it


def test_an_invalid_reasoning_gym_setting_names_the_dataset(workspace, tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    spec = "reasoning-gym:chain_sum:min_terms=5,max_terms=2"
    assert forge_main("train", *train_flags(workspace, tmp_path / "out", dataset=spec)) == 2
    message = error_of(capsys)
    assert f"'{spec}': the task refuses these settings (max_terms must be >= min_terms); change the KEY=VALUE" \
        in message


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "What is \\udcff?", "reference": "1"}',
     r"line 2: 'prompt' holds '\udcff', an escape of half a UTF-16 pair that is no character"),
    ('{"prompt": "p", "reference": "1", "meta": {"note": ["ok", "\\ud800"]}}', r"line 2: 'meta' holds '\ud800'"),
    ('{"prompt": "p", "reference": "1", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "line 2: JSON nested too deeply to read; a row is one JSON object"),
    ('{"prompt": "p", "reference": "1", "deep": ' + "[" * 200 + "]" * 200 + "}",
     "line 2: 'deep' is nested more than 100 levels deep"),
], ids=["surrogate-in-prompt", "surrogate-in-a-column", "nested-past-the-recursion-limit", "nested-200-deep"])
def test_a_jsonl_row_no_tokenizer_or_reward_can_use_is_refused_when_loaded(line, problem, workspace, tmp_path,
                                                                          capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    assert forge_main("train", *train_flags(workspace, tmp_path / "out", dataset=data)) == 2
    assert error_of(capsys).startswith(f"forge: error: {data}, {problem}")
    assert not (tmp_path / "out" / "training_log.jsonl").exists()  # refused before any step


def test_a_missing_model_path_in_the_yaml_file_is_named(workspace, tmp_path, capsys, no_model_loading):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(tmp_path / "no_such_model"), "group_size": 2}))
    flags = train_flags(workspace, tmp_path / "out")
    flags = flags[2:]  # the model comes from the file
    assert forge_main("train", "--config", config, *flags) == 2
    assert error_of(capsys) == (f"forge: error: {config}: model: {tmp_path / 'no_such_model'}: no such file or "
                                f"folder; pass a local model folder (with config.json), a .gguf file, a hub id like "
                                f"HuggingFaceTB/SmolLM2-135M-Instruct, or 'default'")


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_file_or_a_folder_without_config_json_is_not_a_model(kind, workspace, tmp_path, capsys, no_model_loading):
    model = tmp_path / ("notes.txt" if kind == "file" else "empty_folder")
    model.write_text("hello") if kind == "file" else model.mkdir()
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), "--model", model) == 2
    what = "is a file, not a model folder" if kind == "file" else "is a folder without config.json, so not a model"
    assert error_of(capsys).startswith(f"forge: error: --model {model} {what}")


@pytest.mark.parametrize("name", ["hf:{tmp}/no_such_folder", "hf:forge-tests/no-such-dataset"])
def test_a_missing_hf_dataset_exits_2_naming_it(name, workspace, tmp_path, capsys, monkeypatch):
    datasets_config = pytest.importorskip("datasets.config")
    import huggingface_hub.constants

    for module in (datasets_config, huggingface_hub.constants):  # offline: no waiting on the network here
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
    name = name.format(tmp=tmp_path)
    assert forge_main("train", *train_flags(workspace, tmp_path / "out", dataset=name)) == 2
    message = error_of(capsys)
    path = name[len("hf:"):]
    said = (f"no such folder or file {path}; pass an existing folder" if path.startswith("/") else
            f"cannot load {path} (Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)); check the name")
    assert message.startswith(f"forge: error: {name}: {said}") and "checkpoint" not in message


def test_a_model_folder_whose_pickle_holds_more_than_tensors_is_one_line_and_nothing_in_it_runs(workspace,
                                                                                              tmp_path, capsys):
    import pickle

    folder, marker = tmp_path / "pickled", tmp_path / "payload-ran"
    shutil.copytree(workspace / "tiny", folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps((Path.touch, (marker,))))  # what torch.save writes: pickle
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), "--model", folder) == 2
    assert error_of(capsys).startswith(f"forge: error: model {folder}: its weights (pytorch_model.bin) are a pickle "
                                       f"(torch.save) that holds more than tensors; torch's weights-only loader "
                                       f"refused it (Weights only load failed), so nothing in it ran")
    assert not marker.exists()


def test_a_dataset_folder_with_a_loading_script_is_refused_in_one_line(workspace, tmp_path, capsys):
    pytest.importorskip("datasets")
    folder = tmp_path / "scripted"
    folder.mkdir()
    (folder / "scripted.py").write_text("import datasets\n\nclass Scripted(datasets.GeneratorBasedBuilder):\n    pass\n")
    name = f"hf:{folder}"
    assert forge_main("train", *train_flags(workspace, tmp_path / "out", dataset=name)) == 2
    assert error_of(capsys).startswith(f"forge: error: {name}: the folder holds a loading script (scripted.py)")


def test_a_missing_dataset_file_exits_2_naming_it(workspace, tmp_path, capsys):
    missing = tmp_path / "nowhere" / "data.jsonl"
    assert forge_main("train", *train_flags(workspace, tmp_path / "out", dataset=missing)) == 2
    message = error_of(capsys)
    assert f"dataset '{missing}' is neither an existing .jsonl file" in message and "checkpoint" not in message


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_a_seed_torch_cannot_take_is_refused_before_the_model_loads(seed, workspace, tmp_path, capsys,
                                                                   no_model_loading):
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), "--seed", seed) == 2
    assert error_of(capsys).startswith(f"forge: error: --seed {seed} is out of range; torch takes -2**63 .. 2**64-1")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"seed": seed}))
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), "--config", config) == 2
    assert f"\n  - seed={seed} is out of range; torch takes -2**63 .. 2**64-1 (e.g. 42)" in capsys.readouterr().err
    assert forge_main("eval", "--seed", seed) == 2
    assert error_of(capsys).startswith(f"forge: error: --seed {seed} is out of range")


BAD_REWARDS = [
    ("no_such_reward_module:fn", "there is no module 'no_such_reward_module' in this folder or on PYTHONPATH; "
     "give the file instead (path/to/file.py:name), or add its folder to PYTHONPATH"),
    ("no_such_reward_package.rewards:fn", "there is no module 'no_such_reward_package' in this folder or on "
     "PYTHONPATH"),
    ("imports_missing:fn", "its module imports 'forge_test_not_installed', which is not installed here; "
     "install it where forge runs"),
    ("{root}/absent.py:fn", "reward file '{root}/absent.py' does not exist; give the path of the .py file that "
     "defines the function"),
    ("imports_a_missing_name:fn", "importing its module failed (cannot import name 'no_such_name' from 'json'"),
]


@pytest.mark.parametrize("spec, said", BAD_REWARDS,
                         ids=["no-module", "no-package", "missing-import", "no-file", "missing-name"])
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one-process", "nproc-2"])
def test_a_reward_that_does_not_import_is_one_line_before_the_model_loads_or_any_process_starts(
        spec, said, nproc, workspace, tmp_path, capsys, monkeypatch, no_model_loading):
    (tmp_path / "imports_missing.py").write_text("import forge_test_not_installed\n\n\ndef fn(p, c):\n    pass\n")
    (tmp_path / "imports_a_missing_name.py").write_text("from json import no_such_name\n")
    monkeypatch.chdir(tmp_path)

    def starts_a_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", starts_a_process)
    spec, said = spec.format(root=tmp_path), said.format(root=tmp_path)
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), *nproc, "--reward", spec) == 2
    message = error_of(capsys)
    assert message.startswith(f"forge: error: --reward {spec!r}: {said}"), message


@pytest.mark.parametrize("flag, spec, named", [("--tools", "no_such_tools_module:fn", "--tools entry"),
                                               ("--environment", "no_such_env_module:Game", "--environment")])
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one-process", "nproc-2"])
def test_a_tools_or_environment_module_that_is_not_there_is_one_line_before_the_model_loads(
        flag, spec, named, nproc, workspace, tmp_path, capsys, monkeypatch, no_model_loading):
    monkeypatch.chdir(tmp_path)

    def starts_a_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", starts_a_process)
    assert forge_main("train", *train_flags(workspace, tmp_path / "out"), *nproc, flag, spec) == 2
    module = spec.partition(":")[0]
    assert error_of(capsys) == (f"forge: error: {named} {spec!r}: there is no module {module!r} in this folder or "
                                f"on PYTHONPATH; give the file instead (path/to/file.py:name), or add its folder "
                                f"to PYTHONPATH")


def test_a_reward_module_in_the_current_folder_is_found_without_pythonpath(tmp_path, monkeypatch):
    """The installed `forge` program does not put the current folder on sys.path, as `python -m forge` does;
    `--reward module:function` (and `--tools`, `--environment`) finds a module there all the same."""
    from forge.core.reward_sources import load_reward_from_path

    (tmp_path / "forge_test_here.py").write_text("def ones(prompts, completions, **kwargs):\n"
                                                 "    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "forge_test_here", raising=False)
    reward = load_reward_from_path("forge_test_here:ones")
    assert reward(["p", "q"], ["a", "b"]).scores == [1.0, 1.0]
    from forge.tools.calls import load_object  # --tools and --environment: the same lookup

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "forge_test_here")  # imported afresh
    assert load_object("forge_test_here:ones", "--tools entry")(["p"], ["a"]) == [1.0]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: nothing to refuse")
@pytest.mark.parametrize("command", ["eval", "demo"])
def test_the_vllm_backend_without_vllm_is_refused_before_any_model_loads(command, workspace, capsys, monkeypatch):
    def loads_a_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(importlib.import_module("forge.eval.evaluate"), "load_for_eval", loads_a_model)
    monkeypatch.setattr(importlib.import_module("forge.demo"), "load_model", loads_a_model)
    assert forge_main(command, "--generation_backend", "vllm", "--model", workspace / "tiny") == 2
    assert error_of(capsys) == f"forge: error: {VLLM_INSTALL}"


# ----------------------------------------------------------------------------------------------------
# the watched training process


def forge_train(workspace, out, *extra, env=None, **popen) -> subprocess.Popen:
    """`python -m forge train` (watched) of 3 steps, a checkpoint after each, the exits_at_step reward."""
    flags = [*train_flags(workspace, out), "--max_steps", "3", "--save_steps", "1", "--logging_steps", "1", "--reward",
             "forge_test_rewards:exits_at_step", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(workspace), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "forge", "train", *map(str, flags)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sighup_at_its_default,
                            **popen)


def sighup_at_its_default() -> None:
    """As in a terminal's run, even when the tests themselves run under nohup (which Forge keeps ignoring)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_os_exit_in_a_reward_is_reported_exits_1_and_the_run_resumes(workspace, tmp_path):
    out, code = tmp_path / "out", 0  # os._exit(0): a process that says it succeeded
    run = forge_train(workspace, out, env={"EXIT_AT_STEP": "2", "EXIT_CODE": str(code)})
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"forge: error: the training process exited with code {code} before the run ended (os._exit() in a reward "
        f"or tool ends a process without a word); the last finished step is saved in {out / 'checkpoint-1'}: "
        f"continue with the same command plus --resume")
    resumed = forge_train(workspace, out, "--resume")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    steps = [json.loads(line)["step"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and (out / "final").is_dir()


def test_an_exit_before_any_checkpoint_says_nothing_is_saved(workspace, tmp_path):
    out = tmp_path / "out"
    run = forge_train(workspace, out, env={"EXIT_AT_STEP": "1"})
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1
    assert stderr.strip().splitlines()[-1].endswith(f"; no finished step is saved in {out}, so start the run again")


def started(run: subprocess.Popen, ready: Path) -> None:
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the pause"
        time.sleep(0.1)


def test_ctrl_c_reaches_the_training_once_and_exits_130(workspace, tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    run = forge_train(workspace, out, env={"PAUSE_AT_STEP": "2", "READY_FILE": str(ready), "PAUSE_SECONDS": "2"},
                      start_new_session=True)  # its own process group, as a terminal's foreground job
    started(run, ready)
    os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: both processes get it
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 130, stderr
    said = stdout + stderr
    assert said.count("SIGINT received") == 1 and "a second SIGINT" not in said  # one signal, not two
    assert "forge: stopped by SIGINT after step 2 of 3" in stderr and (out / "checkpoint-2" / "COMPLETE").is_file()


def test_sigterm_to_forge_train_is_passed_on_and_kill_9_stops_the_training(workspace, tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    env = {"PAUSE_AT_STEP": "2", "READY_FILE": str(ready), "PAUSE_SECONDS": "2"}
    run = forge_train(workspace, out, env=env)
    started(run, ready)
    run.send_signal(signal.SIGTERM)  # to the watching process alone
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 130 and "forge: stopped by SIGTERM after step 2 of 3" in stderr, stderr

    ready.unlink()
    run = forge_train(workspace, tmp_path / "killed", env={**env, "PAUSE_SECONDS": "600"})
    started(run, ready)
    run.kill()  # SIGKILL to the watching process: the training process dies with it (PR_SET_PDEATHSIG)
    run.communicate(timeout=60)  # returns once every holder of its pipes, the training process too, is gone


def training_process(run: subprocess.Popen) -> int:
    """The pid of the process `forge train` (pid run.pid) forked to train."""
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


SLOW = pytest.mark.slow  # each signal reaches each process in the default suite; the other pairs run with -m slow


@pytest.mark.parametrize("signum, target", [  # SIGTERM to forge train: test_sigterm_to_forge_train_is_passed_on_...
    (signal.SIGINT, "forge train"), pytest.param(signal.SIGHUP, "forge train", marks=SLOW),
    pytest.param(signal.SIGINT, "the training process", marks=SLOW), (signal.SIGTERM, "the training process"),
    (signal.SIGHUP, "the training process")],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value.replace(" ", "-"))
def test_a_stop_signal_to_either_process_finishes_the_step_saves_it_and_exits_130(workspace, tmp_path, signum,
                                                                                  target):
    out, ready = tmp_path / "out", tmp_path / "ready"
    run = forge_train(workspace, out, env={"PAUSE_AT_STEP": "2", "READY_FILE": str(ready), "PAUSE_SECONDS": "2"})
    started(run, ready)
    os.kill(run.pid if target == "forge train" else training_process(run), signum)  # kill -INT, timeout -s, ...
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 130, stderr
    assert (stdout + stderr).count(f"{signum.name} received") == 1, stderr
    assert f"forge: stopped by {signum.name} after step 2 of 3" in stderr
    assert (out / "checkpoint-2" / "COMPLETE").is_file()
    assert not (out / "checkpoint-3").exists()


def test_a_stop_signal_to_the_process_group_counts_once(workspace, tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"  # what `timeout -s TERM`, systemd or Slurm do: both get it
    run = forge_train(workspace, out, env={"PAUSE_AT_STEP": "2", "READY_FILE": str(ready), "PAUSE_SECONDS": "2"},
                      start_new_session=True)
    started(run, ready)
    os.killpg(run.pid, signal.SIGTERM)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 130 and "a second SIGTERM" not in stdout + stderr, stderr
    assert "forge: stopped by SIGTERM after step 2 of 3" in stderr and (out / "checkpoint-2" / "COMPLETE").is_file()


@pytest.mark.parametrize("code, said", [
    (-signal.SIGKILL, "the training process was killed by SIGKILL (the kernel's out-of-memory killer sends it"),
    (-signal.SIGSEGV, "the training process was killed by SIGSEGV (a crash in native code)"),
    (-signal.SIGUSR1, "the training process was killed by SIGUSR1; "),
    (7, "the training process exited with code 7 before the run ended"),
])
def test_how_the_training_process_ended_is_named(code, said, tmp_path):
    from forge.run.supervisor import unfinished_exit

    assert unfinished_exit(code, tmp_path).startswith(said)


def test_the_resume_hint_never_points_back_to_the_checkpoint_a_run_stopped_on(tmp_path, monkeypatch):
    from forge.run import supervisor

    saved = tmp_path / "checkpoint-2"  # what latest_verified_checkpoint finds (checked: tests/units/test_checkpoint.py)
    monkeypatch.setattr(supervisor, "latest_verified_checkpoint", lambda d: saved if d == tmp_path else None)
    assert supervisor.resume_hint(tmp_path) == (
        f"the last finished step is saved in {saved}: continue with the same command plus --resume")
    assert supervisor.resume_hint(tmp_path, resumed_from=saved) == (
        f"it stopped before finishing a step after {saved}, which it resumed from: if the lines above refuse that "
        f"checkpoint, restore it or remove it to resume from an earlier one")
    assert supervisor.resume_hint(tmp_path, resumed_from=tmp_path / "checkpoint-1").endswith("plus --resume")
    assert supervisor.resume_hint(tmp_path / "empty").startswith("no finished step is saved")
