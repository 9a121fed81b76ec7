"""The `forge` command line: train, eval, demo, screen, plot, export.

Every GRPOConfig field is a `forge train` flag whose help is the field's docstring; a YAML file given
with --config sets fields too, and flags override it (forge/cli_config.py).

A failure the user can act on (bad input, a failing reward, NaN/inf training, a full disk, a damaged
checkpoint) prints one message saying what happened and what to do, and exits non-zero: 2 for bad
input, 1 for a run that failed, 130 when interrupted. `--debug` anywhere on the line (or FORGE_DEBUG=1)
shows the Python traceback instead. Any other exception is a bug in Forge and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path

from forge.cli_config import DEFAULTS, build_config
from forge.cli_parser import build_parser
from forge.core.trl_names import TRL_REFUSED
from forge.logging.logger import install_warning_format, is_other_process
from forge.user_code import import_problem


def parse_rewards(spec: str):
    """'math_correctness:1.0,tag_format:0.1' or 'mymodule:my_reward' -> (rewards, weights)."""
    from forge.core.reward_sources import build_reward

    rewards, weights = [], []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        name, _, weight = (
            item.rpartition(":")
            if item.count(":") >= 1 and _is_number(item.rsplit(":", 1)[1])
            else (item, "", "1.0")
        )
        if not name:
            name = item
        if not math.isfinite(float(weight or 1.0)):
            raise ValueError(
                f"--reward {item!r}: the weight {weight!r} is not a finite number; give a weight "
                f"like {name}:0.5 (a reward function cannot be called {weight!r})"
            )
        if ":" in name or "." in name:
            rewards.append(_load_user_reward(name, item))
        else:
            rewards.append(build_reward(name))
        weights.append(float(weight or 1.0))
    if not rewards:
        raise ValueError(f"--reward {spec!r} names no reward")
    return rewards, weights


def _load_user_reward(name: str, item: str):
    """load_reward_from_path, with a missing module, file or function, a module the reward file imports that
    is not installed, or a broken reward file said as a one-line ValueError."""
    from forge.core.reward_sources import load_reward_from_path

    try:
        return load_reward_from_path(name)
    except AttributeError as error:
        raise ValueError(f"--reward {item!r}: {error}; check the function's name") from None
    except SyntaxError as error:
        raise ValueError(f"--reward {item!r}: {error.filename}, line {error.lineno}: {error.msg}") from None
    except FileNotFoundError as error:
        raise ValueError(f"--reward {item!r}: {error}; give the path of the .py file that defines "
                         f"the function") from None
    except ImportError as error:  # the module is not there, or an import in it fails
        module = name.rpartition(":")[0] or name.rpartition(".")[0]
        raise ValueError(f"--reward {item!r}: {import_problem(error, module)}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------------
# commands


def cmd_train(args: argparse.Namespace) -> int:
    from forge.run.lifecycle import check_output_dir_is_free

    overrides = {"resume_from": "latest"} if args.resume else {}
    config = build_config(args, overrides)
    if args.nproc and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        _load_named_code(args)  # a module that does not import is said once, before any process starts
        return _relaunch(args.nproc, getattr(args, "argv", None) or sys.argv[1:], config)
    from_file = args.config and args.model != getattr(args, "given_model", args.model)  # `model:` in the YAML
    _check_model(args.model, f"{args.config}: model:" if from_file else "--model")
    check_output_dir_is_free(
        Path(config.output_dir),
        resuming=bool(config.resume_from),  # before the model loads
        overwrite=config.overwrite_output_dir,
        is_main=not is_other_process(),
    )
    if getattr(args, "watched", False) and "WORLD_SIZE" not in os.environ:  # the `forge` program, one process
        from forge.run.supervisor import run_watched

        # os._exit() in a reward is reported
        return run_watched(lambda: _train(args, config), config.output_dir)
    return _train(args, config)


def _load_named_code(args: argparse.Namespace) -> None:
    """Import what --reward, --tools and --environment name (ValueError naming the flag when one fails)."""
    parse_rewards(args.reward)
    _tools_and_environment(args)


def _tools_and_environment(args: argparse.Namespace) -> tuple:
    """(the functions --tools names or None, the class --environment names or None), imported."""
    from forge.envs import load_environment
    from forge.tools.calls import load_tools

    return (load_tools(args.tools) if args.tools else None,
            load_environment(args.environment) if args.environment else None)


def _train(args: argparse.Namespace, config) -> int:
    """cmd_train once the config and the output directory are checked: load, train, say where the run is."""
    from forge.core.evaluator import greedy_reward_evaluator
    from forge.core.trainer import GRPOTrainer, TrainingInterrupted
    from forge.eval.evaluate import graded_by_math, heldout_metrics

    tools, environment = _tools_and_environment(args)
    rewards, weights = _rewards_for(args, environment)
    if config.reward_weights is None:
        config.reward_weights = weights
    trainer = GRPOTrainer(
        args.model,
        None,
        rewards,
        config,
        evaluator=heldout_metrics,  # eval_strict_accuracy, ...
        tools=tools,
        environment_factory=environment,
    )
    dataset, eval_rows = _training_data(args, trainer.tokenizer)
    # the math grader would count every answer wrong
    if eval_rows is not None and not graded_by_math(eval_rows):
        trainer.evaluator = greedy_reward_evaluator(trainer.rewards, config, trainer.tool_settings)
        if trainer.dist.is_main:
            print(
                f"forge: --eval_dataset {args.eval_dataset}: most references are not numbers the math "
                "grader reads, so evaluation reports the mean reward of greedy completions under "
                "--reward (eval_reward)",
                file=sys.stderr,
            )
    try:
        trainer.train(dataset, eval_dataset=eval_rows)
    except TrainingInterrupted as interrupted:  # SIGINT/SIGTERM: a checkpoint was saved; say how to go on
        if not trainer.dist.is_main:  # rank 0 speaks for the run: its 130, after its line, is the launcher's
            return 0
        print(f"forge: {interrupted}", file=sys.stderr)
        return 130
    if trainer.dist.is_main:
        print(f"done: {trainer.global_step} optimizer steps; checkpoints and logs in {config.output_dir}")
    return 0


def _rewards_for(args: argparse.Namespace, environment=None) -> tuple[list, list[float]]:
    """--reward's rewards and weights. Left at its default (math_correctness:1.0,tag_format:0.1) for a
    built-in task (`forge.data.dataset.task_for`), the correctness term is the task's own reward, which pays
    what its evaluation counts as right: the math tasks' `math_correctness`, reasoning-gym's own score_answer.
    Left at its default with an --environment that has `get_reward`, the environment's reward
    is the only one."""
    from forge.data.dataset import task_for
    from forge.data.task import math_correctness
    from forge.envs.protocol import environment_reward

    if args.reward == DEFAULTS["reward"] and environment is not None and environment_reward(environment):
        print(
            f"forge: --environment {args.environment}: its get_reward is the reward (weight 1.0); give "
            "--reward to add others",
            file=sys.stderr,
        )
        return [], []
    rewards, weights = parse_rewards(args.reward)
    task = task_for(args.dataset) if args.reward == DEFAULTS["reward"] else None
    if task is not None:
        rewards[0] = task.reward
        if task.reward is not math_correctness:
            print(f"forge: {args.dataset}: reward {task.reward!r} (the task's own grader) weighted 1.0, and "
                  f"tag_format 0.1", file=sys.stderr)
    return rewards, weights


def _training_data(args: argparse.Namespace, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The training rows and the optional eval rows of `forge train`: prompts as chat messages when the
    tokenizer has a chat template, unless --chat says otherwise; --eval_dataset's held-out split. --chat true
    also wraps string prompts of any source (a JSONL file) as one user message; without --chat, string prompts
    for a tokenizer with a chat template are warned about."""
    from forge.data.dataset import as_chat_rows, load_rows, pick_chat, source_kwargs, warn_if_raw_prompts

    columns = {"prompt_column": getattr(args, "prompt_column", None),
               "reference_column": getattr(args, "reference_column", None)}
    chat = pick_chat(getattr(args, "chat", None), tokenizer, args.dataset)
    dataset = load_rows(args.dataset, **source_kwargs(args.dataset, chat=chat, n=args.max_samples, **columns))
    if args.max_samples:
        dataset = dataset[: args.max_samples]
    eval_rows = None
    if args.eval_dataset:
        eval_chat = pick_chat(getattr(args, "chat", None), tokenizer, args.eval_dataset, announce=False)
        eval_rows = load_rows(
            args.eval_dataset, **source_kwargs(args.eval_dataset, chat=eval_chat, heldout=True, **columns)
        )
    if getattr(args, "chat", None):
        return as_chat_rows(dataset), eval_rows and as_chat_rows(eval_rows)
    if getattr(args, "chat", None) is None:
        warn_if_raw_prompts([*dataset, *(eval_rows or [])], tokenizer)
    return dataset, eval_rows


def _relaunch(nproc: int, argv: list[str], config) -> int:
    """forge train --nproc N: run the same command in N processes under torch.distributed's launcher
    (forge/parallel/launch.py). When a process fails, the launcher stops the others and this says which step
    is saved for --resume. A checkpoint to resume from is verified first (`check_before_launch`): a damaged
    one is refused in one line, before any process starts.

    Each process sees WORLD_SIZE=N and trains instead of relaunching. The launcher runs in a session of its
    own, so a stop signal (SIGINT from Ctrl-C or `kill -INT`, SIGTERM, SIGHUP) reaches the processes once,
    passed on by this one to the launcher and by the launcher to them; and the launcher gets SIGTERM when this
    process dies. They finish the step and rank 0 saves a checkpoint, so the launcher is given a longer grace
    period than its default 30 s before it kills them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, in seconds, sets it).
    """
    import signal
    import subprocess

    from forge.run.signals import STOP_SIGNALS

    # The processes do not need --nproc, and the launcher would take it for an abbreviation of its own option.
    argv = [a for i, a in enumerate(argv) if a != "--nproc" and not a.startswith("--nproc=")
            and not (i > 0 and argv[i - 1] == "--nproc")]
    command = [sys.executable, "-m", "forge.parallel.launch", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "forge", *argv]
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600", "OMP_NUM_THREADS": "1", **os.environ}
    from forge.run.lifecycle import check_before_launch
    from forge.run.supervisor import newest_checkpoint, resume_hint

    output_dir, resume_from = config.output_dir, config.resume_from
    resumed_from = (check_before_launch(Path(output_dir), resume_from, config.to_dict())
                    or newest_checkpoint(output_dir) if resume_from else None)
    launcher = subprocess.Popen(command, env={**env, "FORGE_PARENT_PID": str(os.getpid())},
                                start_new_session=True)  # signals reach it through this process alone
    previous = {
        signum: signal.signal(signum, lambda signum, frame: launcher.send_signal(signum))
        for signum in STOP_SIGNALS  # SIGHUP stays ignored under nohup
        if not (signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) is signal.SIG_IGN)
    }
    try:
        code = launcher.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code not in (0, 130):  # 130: interrupted, and rank 0 said where it saved
        print(
            f"forge: error: the {nproc}-process run did not finish; {resume_hint(output_dir, resumed_from)}",
            file=sys.stderr,
        )
    return code


def cmd_eval(args: argparse.Namespace) -> int:
    from forge.eval.evaluate import evaluate_model

    common = {"data": args.data, "split": args.split, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "num_samples": args.num_samples, "temperature": args.temperature, "seed": args.seed,
              "generation_backend": args.generation_backend}
    data_options = {"chat": args.chat, "prompt_column": args.prompt_column,
                    "reference_column": args.reference_column}
    if args.reward:
        if args.compare:
            raise ValueError("--reward scores one model's greedy completions: use it with "
                             "--model, not --compare")
        data_options["rewards"], data_options["reward_weights"] = parse_rewards(args.reward)
    _check_saved_folders(("--model", args.model), ("--adapter", args.adapter),
                         *(("--compare", model) for model in args.compare or ()))
    if args.compare:
        from forge.eval.report import compare_models

        before, after = args.compare
        json_path, md_path, summary = compare_models(before, after, out_dir=args.out, adapter=args.adapter,
                                                     **common)
        print(summary)
        print(f"report: {md_path}\n        {json_path}")
        return 0
    result = evaluate_model(args.model, adapter=args.adapter, **common, **data_options)
    print(json.dumps(result.metrics, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "eval.json").write_text(json.dumps({"metrics": result.metrics,
                                                              "records": result.records}, indent=2))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from forge.eval.plot import plot_training_curves

    runs = args.output_dir if len(args.output_dir) > 1 else args.output_dir[0]
    print(plot_training_curves(runs, args.out, x=args.x))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from forge.model import merge_and_export

    # before anything is written to --out
    _check_saved_folders(("--adapter", args.adapter), ("--base", args.base))
    print(merge_and_export(args.adapter, args.base, args.out, overwrite=args.overwrite))
    return 0


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    from forge.core.config import require_vllm
    from forge.model.loading import _DEFAULT_ALIASES, packaged_model_path
    from forge.model.precision import choose_precision
    from forge.model.vllm_engine import dtype_name, engine_dtype, serve

    require_vllm()
    folder = str(packaged_model_path()) if args.model in _DEFAULT_ALIASES else args.model
    dtype = dtype_name(engine_dtype(choose_precision(args.dtype).compute))
    serve(folder, args.host, args.port, dtype, args.enforce_eager, args.gpu_memory_utilization,
          args.vllm_args)
    return 0


def _check_saved_folders(*given: tuple[str, str | None]) -> None:
    """A folder Forge saved, given to `forge eval` or `forge export`, must verify before it loads (an
    UnverifiedSave, exit code 2, names the folder, the file and what to load instead); then the files any
    local folder's load reads must be whole and finite (forge/run/model_files.py). A hub id loads as is."""
    from forge.run.integrity import check_saved_model
    from forge.run.model_files import check_model_files

    for flag, value in given:
        if value:
            check_saved_model(Path(value).expanduser(), flag)
            check_model_files(value, flag)


def cmd_screen(args: argparse.Namespace) -> int:
    from forge.data.dataset import load_rows
    from forge.eval.screen import screen_prompts
    from forge.model import load_model

    _check_model(args.model, "--model")
    model, tokenizer = load_model(args.model)
    rows = load_rows(args.dataset)[: args.n]
    result = screen_prompts(model, tokenizer, rows, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens)
    print(result.summary())
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in result.kept)
        print(f"kept prompts written to {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from forge.demo import DemoSettings, demo_parser, run_demo

    parser = demo_parser(args.demo_argv)  # the flags after `forge demo` (forge.demo's own parser)
    demo_args, unknown = parser.parse_known_args(args.demo_argv)
    if unknown:
        raise ValueError(_unknown_arguments(unknown, parser))
    _check_arguments(demo_args)
    if demo_args.env:  # the environment demo (forge/demo_env.py)
        from forge.demo_env import run_env_demo

        run_env_demo(DemoSettings.from_args(demo_args))
        return 0
    if demo_args.tools:  # the calculator-tool demo (forge/demo_tools.py)
        from forge.demo_tools import run_tool_demo

        run_tool_demo(DemoSettings.from_args(demo_args))
        return 0
    run_demo(DemoSettings.from_args(demo_args))
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "demo": cmd_demo, "screen": cmd_screen, "plot": cmd_plot,
            "export": cmd_export, "vllm-serve": cmd_vllm_serve}
"""What each command of the parser (forge/cli_parser.py) runs."""


def _unknown_arguments(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """The message for arguments `parser` does not take: each unknown flag with the closest ones it has, a TRL
    name Forge does not take with what to set instead."""
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")]
    if not flags:
        return f"{parser.prog}: unexpected arguments: {' '.join(unknown)}"
    known = sorted(option for action in parser._actions for option in action.option_strings
                   if option.startswith("--"))
    problems = []
    for flag in flags:
        if flag[2:] in TRL_REFUSED and "--num_generations" in known:  # a command that takes TRL's names
            problems.append(f"{flag} is TRL's and has no Forge equivalent as is: {TRL_REFUSED[flag[2:]]}")
            continue
        guesses = difflib.get_close_matches(flag, known, n=2)
        problems.append(f"unknown option {flag}"
                        + (f" (did you mean {' or '.join(guesses)}?)" if guesses else ""))
    return f"{parser.prog}: " + "; ".join(problems) + f". `{parser.prog} --help` lists every option"


def _check_arguments(args: argparse.Namespace) -> None:
    """Arguments that argparse accepts but that mean nothing (or something else): refused before any work."""
    max_samples = getattr(args, "max_samples", None)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max_samples {max_samples}: must be >= 1 (leave it out to use every row)")
    _check_model(getattr(args, "model", None), "--model")
    if getattr(args, "generation_backend", None) == "vllm":  # forge eval's, forge demo's (and forge train's)
        from forge.core.config import require_vllm

        require_vllm()  # GRPOConfig's install line, before any model or data loads
    seed = getattr(args, "seed", None)  # forge eval's (forge train's is GRPOConfig's, checked by validate())
    if isinstance(seed, int) and not -2**63 <= seed < 2**64:
        raise ValueError(f"--seed {seed} is out of range; torch takes -2**63 .. 2**64-1 (e.g. 0)")


def _check_model(model, given_as: str) -> None:
    """A model named by a path must be a model folder (config.json, or a LoRA adapter's adapter_config.json)
    or a .gguf file: a missing path or another file is refused here, before the hub is asked for
    it as a repo id."""
    if not isinstance(model, str):
        return
    path = Path(model).expanduser()
    what = ("pass a local model folder (with config.json), a .gguf file, a hub id like "
            "HuggingFaceTB/SmolLM2-135M-Instruct, or 'default'")
    if not path.exists():
        if _looks_like_a_path(model):
            raise FileNotFoundError(f"{given_as} {model}: no such file or folder; {what}")
    elif path.is_file() and not model.lower().endswith(".gguf"):
        raise ValueError(f"{given_as} {model} is a file, not a model folder; {what}")
    elif path.is_dir() and not any((path / name).is_file()
                                   for name in ("config.json", "adapter_config.json")):
        raise ValueError(f"{given_as} {model} is a folder without config.json, so not a model folder; {what}")
    if path.is_dir():  # a folder Forge saved must verify (UnverifiedSave, exit 2); another loads as is
        _check_saved_folders((given_as, str(path)))


def _looks_like_a_path(name: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything rooted, relative, nested deeper or a .gguf is a path."""
    return name.startswith(("/", "./", "../", "~", "\\")) or name.count("/") > 1 or name.endswith(".gguf") \
        or (len(name) > 1 and name[1] == ":")  # C:\...


def _newest_intact_checkpoint_hint(args: argparse.Namespace) -> str:
    config = getattr(args, "resolved_config", None)
    output_dir = getattr(config, "output_dir", None) or getattr(args, "output_dir", None)
    if not output_dir or getattr(args, "command", None) != "train":
        return ""
    from forge.run.integrity import latest_verified_checkpoint

    try:
        newest = latest_verified_checkpoint(output_dir)
    except OSError:
        newest = None
    if newest is None:
        return f" {output_dir} holds no intact checkpoint to resume from."
    return (f" The newest intact checkpoint is {newest}: fix the cause (free disk space, make {output_dir} "
            f"writable) and continue with the same command plus --resume.")


def _user_error(error: BaseException, args: argparse.Namespace) -> tuple[str, int] | None:
    """(message, exit code) for an error the user can act on; None for a bug in Forge
    (keeps its traceback)."""
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted (Ctrl-C).{_newest_intact_checkpoint_hint(args)}", 130
    run_failures = [FloatingPointError]  # Forge's own, looked up only if loaded: `forge` must start fast
    for module, name in (("forge.run.loop", "StepFailed"), ("forge.run.checkpoint", "CheckpointError")):
        if module in sys.modules:
            run_failures.append(getattr(sys.modules[module], name))
    if isinstance(error, tuple(run_failures)):
        return str(error), 1
    if isinstance(error, (FileNotFoundError, ValueError, ImportError)):
        return str(error), 2  # bad input: a missing file, a bad value, a reward module that does not import
    if isinstance(error, OSError):  # disk full, read-only or vanished output dir, no network for a hub id
        return f"{error}.{_newest_intact_checkpoint_hint(args)}", 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and isinstance(error, RuntimeError) and any(
            backend in str(error) for backend in ("gloo", "NCCL", "nccl")):  # a collective lost its peers
        detail = str(error).strip().splitlines()[0][:200]
        return (
            f"process {os.environ.get('RANK', '?')} stopped: a collective with the other processes failed "
            f"({detail}); another process of the run most likely ended first, and its output says why"
        ), 1
    return None


def _debug_requested(argv: list[str]) -> bool:
    """--debug anywhere on the command line, or FORGE_DEBUG=1."""
    return "--debug" in argv or os.environ.get("FORGE_DEBUG", "").lower() not in ("", "0", "false", "no")


def main(argv: list[str] | None = None) -> int:
    """The `forge` program (argv None: the command line, and `forge train` runs watched) or
    a call with argv."""
    watched = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debug_requested(argv)
    install_warning_format()  # Forge's warnings as one line each
    parser = build_parser()
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    args.demo_argv = extra if args.command == "demo" else []
    args.argv = argv  # what `forge train --nproc N` runs N times (--debug included)
    args.watched = watched  # train in a child process this one watches (forge/run/supervisor.py)
    args.given_model = getattr(args, "model", None)  # --model as typed; a --config file may replace it
    try:
        if extra and args.command != "demo":
            raise ValueError(_unknown_arguments(extra, parser.commands[args.command]))
        _check_arguments(args)
        return COMMANDS[args.command](args)
    except BaseException as error:  # sorted below: a message for the user, or re-raised
        if debug or isinstance(error, SystemExit):
            raise
        known = _user_error(error, args)
        if known is None:
            raise
        message, code = known
        print(f"forge: error: {message}\n(run again with --debug, or FORGE_DEBUG=1, to see the traceback)",
              file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
