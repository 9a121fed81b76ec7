"""The `forge` command line and the example scripts.

The tiny offline model is saved to a folder first (--model takes a local folder), the reward is a
module:function in that folder, and the dataset a JSONL file next to it. Each subprocess spends ~5 s of CPU
importing torch and transformers, so two smoke runs start together as subprocesses, an end-to-end
`python -m forge train` with a YAML config (its reward imported through PYTHONPATH) and
`python examples/train_math.py --dry-run`; the other commands (`forge --help`, `forge train --help`, `plot`,
`export`, a LoRA `train`, the custom-reward example) go through the same entry point, `forge.cli.main`, in
this process.
"""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.cli import build_config, build_parser, main
from forge.core.config import GRPOConfig
from forge.model.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]

REWARD_MODULE = '''
def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]
'''

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


class Command:
    """A command started now whose result is collected later."""

    def __init__(self, argv: list, cwd: Path, env: dict) -> None:
        self.argv = [str(a) for a in argv]
        self.process = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self._result = None

    def result(self) -> subprocess.CompletedProcess:
        if self._result is None:
            try:
                out, err = self.process.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
            self._result = subprocess.CompletedProcess(self.argv, self.process.returncode, out, err)
        return self._result

    def ok(self) -> subprocess.CompletedProcess:
        result = self.result()
        assert result.returncode == 0, (f"{' '.join(self.argv)} exited {result.returncode}\n"
                                        f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}")
        return result


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with the tiny model, a reward module, a dataset and a YAML config."""
    root = tmp_path_factory.mktemp("cli")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "cli_rewards.py").write_text(REWARD_MODULE)
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    # group_size and logging_steps are overridden by flags; the other fields come from here
    (root / "run.yaml").write_text(yaml.safe_dump({"group_size": 4, "logging_steps": 5, "lr_scheduler": "constant",
                                                   "learning_rate": 0.02, "kl_beta": 0.05, "seed": 3}))
    return root


@pytest.fixture(scope="module", autouse=True)
def commands(workspace):
    """The subprocess runs, started with the module's first test so the in-process tests overlap them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(workspace), str(REPO), os.environ.get("PYTHONPATH", "")])}
    forge = [sys.executable, "-m", "forge"]
    started = {
        "train": Command([*forge, "train", "--config", workspace / "run.yaml", *common_flags(workspace),
                          "--max_steps", "2", "--save_steps", "1", "--output_dir", workspace / "out"], workspace, env),
        "train_math": Command([sys.executable, REPO / "examples" / "train_math.py", "--dry-run"], workspace, env),
        "bad_input": Command([*forge, "train", "--max_samples", "0"], workspace, env),  # fails before any import
    }
    yield started
    for command in started.values():
        if command.process.poll() is None:
            command.process.kill()


def common_flags(workspace: Path) -> list:
    return ["--model", workspace / "tiny", "--dataset", workspace / "data.jsonl", "--reward",
            "cli_rewards:vowel_count", "--group_size", "2", "--max_new_tokens", "8", "--logging_steps", "1"]


def forge_main(*argv) -> int:
    """`forge ARGV` through the CLI's entry point, in this process."""
    return main([str(a) for a in argv])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# help


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        forge_main("--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "demo", "screen", "plot", "export"):
        assert re.search(rf"^\s+{name}\s", out, re.MULTILINE), f"`forge --help` does not list {name}"


def test_cli_help_and_public_names_load_transformers_only_when_used():
    """`forge --help` must not pay for transformers; `from forge import GRPOTrainer` still works."""
    code = ("import sys, forge, forge.cli\n"
            "assert 'transformers' not in sys.modules, 'import forge loaded transformers'\n"
            "from forge import GRPOTrainer, GRPOConfig, ExactMatchReward, load_gsm8k\n"
            "assert 'transformers' in sys.modules and GRPOTrainer.__module__ == 'forge.core.trainer'\n"
            "try:\n    forge.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "no attribute 'no_such_name'" in done.stdout


def test_train_help_lists_every_config_field_with_its_docstring(capsys, monkeypatch):
    import forge.cli
    import forge.cli_config

    real_docs = forge.cli_config.field_docs
    # a '%' in a docstring must be printed as is (argparse %-formats help strings)
    monkeypatch.setattr(forge.cli_config, "field_docs",
                        lambda: {**real_docs(), "seed": "Seed (100% reproducible runs)."})
    with pytest.raises(SystemExit) as exit_info:
        forge_main("train", "--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    flat = "".join(out.split())  # argparse re-wraps the text; compare without whitespace
    docs = forge.cli_config.field_docs()
    for name in (f.name for f in GRPOConfig.__dataclass_fields__.values()):
        assert f"--{name}" in out, f"--{name} missing from `forge train --help`"
        assert docs.get(name), f"GRPOConfig.{name} has no docstring"
        assert "".join(docs[name].split()) in flat, f"the docstring of {name} is not its help"
    assert "Seed(100%reproducibleruns).[42]" in flat


# ----------------------------------------------------------------------------------------------------
# train end to end


def test_train_end_to_end(workspace, commands):
    result = commands["train"].ok()
    assert "done: 2 optimizer steps" in result.stdout
    for step in (1, 2):
        assert re.search(rf"step {step} \| epoch [\d.]+ \| loss -?\d+\.\d{{4}} \| reward \d+\.\d{{4}} \| "
                         rf"kl -?\d+\.\d{{4}}", result.stdout), result.stdout

    out = workspace / "out"
    log = read_jsonl(out / "training_log.jsonl")
    assert [row["step"] for row in log] == [1, 2]
    assert all("rewards/vowel_count/mean" in row and "kl" in row for row in log)
    assert read_jsonl(out / "samples.jsonl")
    for name in ("checkpoint-1", "checkpoint-2", "final"):
        for file in ("COMPLETE", "model.safetensors", "config.json", "tokenizer.json", "trainer_state.json"):
            assert (out / name / file).is_file(), f"{name}/{file} missing"

    trained = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    base_weights = dict(base.named_parameters())
    assert any(not torch.equal(p, base_weights[name]) for name, p in trained.named_parameters())


def test_yaml_config_sets_fields_and_flags_override_it(workspace, commands):
    commands["train"].ok()
    saved = json.loads((workspace / "out" / "final" / "forge_config.json").read_text())
    assert (saved["group_size"], saved["logging_steps"]) == (2, 1)  # flags win over the YAML file
    assert (saved["lr_scheduler"], saved["learning_rate"], saved["kl_beta"], saved["seed"]) == ("constant", 0.02,
                                                                                               0.05, 3)
    assert saved["max_steps"] == 2 and saved["reward_weights"] == [1.0]


def test_plot_writes_a_png(workspace, commands, capsys):
    commands["train"].ok()
    assert forge_main("plot", workspace / "out") == 0
    png = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert png.parent == workspace / "out" and png.suffix == ".png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_merges_a_lora_run_into_a_plain_model(workspace, monkeypatch):
    from peft import PeftModel

    monkeypatch.syspath_prepend(str(workspace))  # for --reward cli_rewards:vowel_count
    assert forge_main("train", *common_flags(workspace), "--use_lora", "true", "--lora_r", "4", "--lora_alpha", "8",
                      "--learning_rate", "0.05", "--kl_beta", "0", "--max_steps", "1", "--save_steps", "0",
                      "--output_dir", workspace / "lora_out") == 0
    final = workspace / "lora_out" / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    assert forge_main("export", "--adapter", final, "--base", workspace / "tiny", "--out", workspace / "merged") == 0

    merged = AutoModelForCausalLM.from_pretrained(workspace / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name for name in merged.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(workspace / "merged")
    ids = tokenizer("What is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
        base_logits = base(ids).logits
        adapted_logits = PeftModel.from_pretrained(base, final)(ids).logits
        merged_logits = merged(ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-4)  # the adapter did learn something


# ----------------------------------------------------------------------------------------------------
# configuration errors and YAML (in process: no model is loaded before these fail)


def test_bad_flags_exit_with_code_2_and_the_reason(capsys):
    assert forge_main("train", "--group_size", "1", "--model", "unused") == 2
    assert "group_size=1: GRPO needs >= 2 completions per prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        forge_main("train", "--use_lora", "maybe")
    assert exit_info.value.code == 2
    assert "expected true/false, got 'maybe'" in capsys.readouterr().err


def test_a_user_error_is_one_message_and_exit_2_without_a_traceback(commands):
    result = commands["bad_input"].result()
    assert result.returncode == 2
    assert result.stderr == ("forge: error: --max_samples 0: must be >= 1 (leave it out to use every row)\n"
                             "(run again with --debug, or FORGE_DEBUG=1, to see the traceback)\n")


def write_yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_numbers_without_a_dot_are_floats_for_float_fields(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-5 as the string '1e-5'; for a float field Forge takes the number
    path = write_yaml(tmp_path, "learning_rate: 1e-5\nweight_decay: 1E-2\nreward_weights: [1e-1, 2]\ngroup_size: 4\n")
    assert yaml.safe_load(path.read_text())["learning_rate"] == "1e-5"
    config = build_config(build_parser().parse_args(["train", "--config", str(path)]))
    assert (config.learning_rate, config.weight_decay, config.reward_weights) == (1e-5, 1e-2, [0.1, 2])


@pytest.mark.parametrize("text, message", [
    ('group_size: "4"\n', "group_size='4' (str) must be an int"),
    ('use_lora: "no"\n', "use_lora='no' (str) must be a bool (true or false)"),
    ("shuffle: 'false'\n", "shuffle='false' (str) must be a bool"),
    ("max_steps: 2.5\n", "max_steps=2.5 (float) must be an int"),
    ("learning_rate: .inf\n", "learning_rate=inf must be a finite number"),
    ("learning_rate: fast\n", "learning_rate='fast' (str) must be a float"),
    ("group_size: 4\n  seed: 1\n", "run.yaml, line 2 column 7: not valid YAML (mapping values are not allowed here)"),
    ("- group_size\n", "run.yaml must hold a mapping of GRPOConfig fields (`name: value` lines), got a list"),
    ("grpo: 4\n", "run.yaml: `grpo:` must hold a mapping of GRPOConfig fields, got 4"),
])
def test_yaml_type_and_syntax_errors_are_one_message_naming_the_field(text, message, tmp_path, capsys):
    path = write_yaml(tmp_path, text)
    assert forge_main("train", "--config", path, "--model", "unused") == 2
    err = capsys.readouterr().err
    assert err.startswith("forge: error: ") and message in err and "Traceback" not in err


def test_bad_reward_model_and_max_samples_arguments_are_refused(workspace, tmp_path, capsys):
    (tmp_path / "rewards.py").write_text("def nan(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    cases = [
        (["--reward", f"{tmp_path / 'rewards.py'}:missing_name"], "has no attribute 'missing_name'"),
        (["--reward", f"{tmp_path / 'rewards.py'}:nan"], "the weight 'nan' is not a finite number"),
        (["--reward", "math_correctness:inf"], "'math_correctness:inf': the weight 'inf' is not a finite number"),
        (["--model", tmp_path / "no" / "such" / "model"], "no such file or folder"),
        (["--model", "/nonexistent/path"], "--model /nonexistent/path: no such file or folder"),
        (["--max_samples", "0"], "--max_samples 0: must be >= 1"),
        (["--max_samples", "-3"], "--max_samples -3: must be >= 1"),
        (["--reward_timeout", "inf"], "reward_timeout=inf must be a finite number (or None)"),
        (["--learning_rate", "inf"], "learning_rate=inf must be a finite number"),
    ]
    for flags, message in cases:
        argv = ["train", "--model", workspace / "tiny", "--output_dir", tmp_path / "out", *flags]
        assert forge_main(*argv) == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)


def error_message(capsys) -> str:
    """stderr from Forge's message on (the model loading's progress bars come before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "forge: error: " in err, err
    return err[err.index("forge: error: "):]


@pytest.fixture
def reward_importable(workspace, monkeypatch):
    """common_flags' reward module (cli_rewards, in the workspace) importable in this process."""
    monkeypatch.syspath_prepend(str(workspace))


def test_a_gzipped_dataset_is_named_in_one_message(workspace, tmp_path, capsys, reward_importable):
    import gzip

    packed = tmp_path / "data.jsonl.gz"
    packed.write_bytes(gzip.compress((workspace / "data.jsonl").read_bytes()))
    assert forge_main("train", *common_flags(workspace), "--dataset", packed, "--output_dir", tmp_path / "out") == 2
    assert f"forge: error: {packed} is a gzip-compressed file" in capsys.readouterr().err


def test_a_failing_reward_is_one_message_and_exit_1(workspace, tmp_path, capsys):
    (tmp_path / "failing.py").write_text("def broken(prompts, completions, **kwargs):\n    return 1 / 0\n")
    flags = [*common_flags(workspace), "--reward", f"{tmp_path / 'failing.py'}:broken", "--max_steps", "1",
             "--output_dir", tmp_path / "out"]
    assert forge_main("train", *flags) == 1
    err = error_message(capsys)
    assert err.startswith("forge: error: reward 'broken' raised ZeroDivisionError: division by zero at step 1")
    assert "Traceback" not in err and "checkpoint" not in err  # nothing to resume: no note after the reward's error
    assert err.rstrip().splitlines()[-2].endswith("reward_error_value and go on.")  # then the --debug hint
    from forge.core.scoring import RewardError

    with pytest.raises(RewardError):  # --debug: the exception (and so its traceback) comes through
        forge_main("train", *flags, "--debug")


def save_resumable_checkpoint(path: Path, step: int) -> Path:
    from forge.run.checkpoint import save_checkpoint

    model, tokenizer = build_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return save_checkpoint(path, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                           trainer_state={"global_step": step}, config={})


@pytest.mark.parametrize("error, code, message", [
    (OSError(28, "No space left on device"), 1, "[Errno 28] No space left on device. The newest intact checkpoint is"),
    (PermissionError(13, "Permission denied"), 1, "[Errno 13] Permission denied. The newest intact checkpoint is"),
    (FloatingPointError("3 optimizer steps in a row were non-finite"), 1, "3 optimizer steps in a row were"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C). The newest intact checkpoint is"),
])
def test_run_failures_are_one_message_that_points_to_the_newest_intact_checkpoint(
        error, code, message, workspace, tmp_path, monkeypatch, capsys, reward_importable):
    import forge.core.trainer

    out = tmp_path / "out"
    intact = save_resumable_checkpoint(out / "checkpoint-2", step=2)
    damaged = save_resumable_checkpoint(out / "checkpoint-3", step=3)
    (damaged / "model.safetensors").write_bytes(b"")  # the newest is damaged: not the one to offer

    def fails(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(forge.core.trainer.GRPOTrainer, "train", fails)
    assert forge_main("train", *common_flags(workspace), "--output_dir", out, "--resume") == code  # a resumed run
    err = error_message(capsys)
    assert err.startswith(f"forge: error: {message}") and "Traceback" not in err
    if "intact" in message:
        assert f"is {intact}: " in err and "--resume" in err
    monkeypatch.setenv("FORGE_DEBUG", "1")
    with pytest.raises(type(error)):
        forge_main("train", *common_flags(workspace), "--output_dir", out, "--resume")


def test_a_damaged_checkpoint_on_resume_is_one_message(workspace, tmp_path, capsys, reward_importable):
    out = tmp_path / "out"
    save_resumable_checkpoint(out / "checkpoint-1", step=1)
    (out / "checkpoint-1" / "optimizer.safetensors").unlink()
    assert forge_main("train", *common_flags(workspace), "--output_dir", out, "--resume") == 1
    err = capsys.readouterr().err
    assert f"forge: error: checkpoint {out / 'checkpoint-1'} is damaged: optimizer.safetensors is missing" in err
    assert "Traceback" not in err


def test_yaml_may_hold_run_settings_flat_or_next_to_a_grpo_section(tmp_path):
    parser = build_parser()
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model": "my/model", "reward": "number", "dataset": "gsm8k-mock",
                                      "grpo": {"group_size": 2, "max_new_tokens": 16}}))
    args = parser.parse_args(["train", "--config", str(nested), "--max_new_tokens", "8"])
    config = build_config(args)
    assert (config.group_size, config.max_new_tokens) == (2, 8)
    assert (args.model, args.reward, args.dataset) == ("my/model", "number", "gsm8k-mock")

    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"model": "my/model", "group_size": 3}))
    args = parser.parse_args(["train", "--config", str(flat), "--model", "other/model"])
    assert build_config(args).group_size == 3 and args.model == "other/model"  # the flag wins

    flat.write_text(yaml.safe_dump({"group_sise": 3}))
    with pytest.raises(ValueError, match=r"unknown GRPOConfig fields \['group_sise'\]"):
        build_config(parser.parse_args(["train", "--config", str(flat)]))


# ----------------------------------------------------------------------------------------------------
# examples


def test_train_math_example_dry_run(commands):
    out = commands["train_math"].ok().stdout
    assert "dry run ok: nothing downloaded" in out
    assert "Qwen/Qwen2.5-0.5B-Instruct" in out and '"group_size": 8' in out


def test_custom_reward_example_trains_two_steps(tmp_path, capsys):
    """The template rewards on two responses, then 2 GRPO steps on the tiny model."""
    example = runpy.run_path(str(REPO / "examples" / "custom_reward.py"))  # as a module: __main__ does not run
    assert example["main"](["--output_dir", str(tmp_path / "custom_out")]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    log = read_jsonl(tmp_path / "custom_out" / "training_log.jsonl")
    assert [row["step"] for row in log] == [1, 2] and all("rewards/composite/mean" in row for row in log)
