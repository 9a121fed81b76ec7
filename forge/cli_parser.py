"""The `forge` command line's parser: one sub-parser per command, each built by its own function.

The parser names the command (`args.command`); forge/cli.py runs it. `forge demo`'s flags are parsed by
forge.demo's own parser when the demo runs, so `forge --help` does not import the trainer.
"""

from __future__ import annotations

import argparse

from forge.cli_config import DEFAULTS, add_config_arguments, parse_bool


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forge",
        description="GRPO fine-tuning for HuggingFace causal LMs.",
        epilog="--debug (anywhere on the line) or FORGE_DEBUG=1: show the Python "
        "traceback of an error instead of only its message.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (add_train, add_eval, add_demo, add_screen, add_plot, add_export, add_vllm_serve):
        add_command(sub)
    parser.commands = sub.choices  # each command's parser, for the unknown-flag message
    for command in parser.commands.values():
        # `--num_generation` is a typo to name, not a prefix of --num_generations
        command.allow_abbrev = False
    return parser


def add_train(sub) -> None:
    train = sub.add_parser("train", help="fine-tune a model with GRPO",
                           description="Fine-tune a model with GRPO. Every GRPOConfig field is a flag.")
    train.add_argument("--config",
                       help="YAML file of GRPOConfig fields (and model/dataset/reward); flags override")
    train.add_argument("--model", default=DEFAULTS["model"],
                       help="hub id, local folder, .gguf file, or 'default' (packaged SmolLM2-135M-Instruct)")
    train.add_argument("--dataset", default=DEFAULTS["dataset"],
                       help="gsm8k, gsm8k-mock, gsm-hard, arithmetic, reasoning-gym:NAME, "
                            "hf:ORG/NAME[:CONFIG][@SPLIT], or a JSONL file of {prompt, reference}")
    train.add_argument(
        "--eval_dataset",
        default=None,
        help="held-out data evaluated per eval_steps (same names; "
        "reasoning-gym:NAME gives its held-out problems, hf: its test split unless @SPLIT says)",
    )
    add_data_arguments(train)
    train.add_argument("--max_samples", type=int, default=None, help="use only the first N dataset rows")
    train.add_argument(
        "--reward",
        default=DEFAULTS["reward"],
        help="comma-separated name[:weight] (exact_match, math_correctness, tag_format, number, "
        "length) or module:function[:weight]",
    )
    train.add_argument("--tools", default=None,
                       help="comma-separated module:function (or path/file.py:function, or the built-in "
                            "'calculator') the model may call during rollouts; see GRPOConfig's tool fields")
    train.add_argument(
        "--environment",
        default=None,
        help="module:Class (or path/file.py:Class): an environment, one instance per completion, "
        "reset with its dataset row, whose public methods the model calls (docs/environments.md)",
    )
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in output_dir")
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="train data-parallel in N processes on this machine "
        "(one per GPU, or gloo on CPU); the same as torchrun / accelerate launch",
    )
    add_config_arguments(train)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """--chat, --prompt_column, --reference_column (of `forge train` and `forge eval`)."""
    parser.add_argument(
        "--chat",
        type=parse_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="prompts as chat messages (--chat, --chat true) or plain text (--chat false), for the "
        "datasets whose prompts Forge writes (gsm8k, gsm-hard, arithmetic, reasoning-gym:, "
        "hf:; default: true when the tokenizer has a chat template); true also wraps every "
        "string prompt (a JSONL file's) as one user message",
    )
    parser.add_argument("--prompt_column", default=None, help="hf: datasets: the question column [question]")
    parser.add_argument("--reference_column", default=None,
                        help="hf: datasets: the reference answer column [answer]")


def add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a model on held-out problems (strict/soft accuracy, pass@k)")
    ev.add_argument("--model", default="default", help="hub id, local folder, checkpoint, or 'default'")
    ev.add_argument("--adapter", default=None, help="LoRA adapter folder to apply on --model")
    ev.add_argument(
        "--data",
        default="arithmetic",
        help="arithmetic, gsm8k, gsm-hard, gsm8k-mock, "
        "reasoning-gym:NAME (its held-out problems), hf:ORG/NAME[:CONFIG][@SPLIT], or a JSONL path",
    )
    add_data_arguments(ev)
    ev.add_argument("--split", default="test")
    ev.add_argument("--n", type=int, default=None, help="number of problems (default: all)")
    ev.add_argument("--max_new_tokens", type=int, default=256)
    ev.add_argument("--num_samples", type=int, default=1,
                    help="samples per problem (>1 enables pass@k, maj@k)")
    ev.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--generation_backend", default="auto", choices=["auto", "eager", "compiled", "vllm"],
                    help="Forge's own decode loop (auto, eager, compiled) or vLLM (docs/scaling.md)")
    ev.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="evaluate two models side by side")
    ev.add_argument(
        "--reward",
        default=None,
        help="also report the mean reward of greedy completions under these "
        "rewards (reward, rewards/NAME), the syntax of `forge train --reward`: for data the math grader "
        "cannot judge",
    )
    ev.add_argument("--out", default=None, help="directory for eval.json / the comparison report")


def add_demo(sub) -> None:
    # `forge demo`'s flags are parsed by forge.demo (cmd_demo), which imports the trainer: not on every
    # `forge` call
    sub.add_parser("demo", help="offline demo: LoRA GRPO makes SmolLM2-135M better at arithmetic",
                   add_help=False)


def add_screen(sub) -> None:
    screen = sub.add_parser("screen", help="keep training prompts with mixed correctness")
    screen.add_argument("--model", default="default")
    screen.add_argument("--dataset", default="arithmetic")
    screen.add_argument("--n", type=int, default=64)
    screen.add_argument("--group_size", type=int, default=8)
    screen.add_argument("--max_new_tokens", type=int, default=64)
    screen.add_argument("--out", default=None, help="JSONL file for the kept prompts")


def add_plot(sub) -> None:
    plot = sub.add_parser("plot", help="draw training curves from OUTPUT_DIR/training_log.jsonl "
                                       "(several runs: on one figure)")
    plot.add_argument("output_dir", nargs="+")
    plot.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/training_curves.png; several "
                                                  "runs: the first one's compared_curves.png)")
    plot.add_argument("--x", choices=["step", "time"], default="step",
                      help="x axis: the optimizer step, or wall-clock seconds since each run's first log row")


def add_export(sub) -> None:
    export = sub.add_parser("export",
                            help="merge a LoRA adapter into its base model (plain transformers folder)")
    export.add_argument("--adapter", required=True)
    export.add_argument("--base", default="default")
    export.add_argument(
        "--out",
        required=True,
        help="a new or empty folder, or an earlier export of the same --adapter and --base (replaced)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out holds (never the --adapter or --base folder)",
    )


def add_vllm_serve(sub) -> None:
    serve = sub.add_parser("vllm-serve", help="serve a model on vLLM for `forge train --vllm_mode server`")
    serve.add_argument("--model", default="default",
                       help="hub id, local folder, or 'default' (packaged SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", help="as GRPOConfig.dtype: the trainer's compute dtype")
    serve.add_argument("--enforce_eager", action="store_true",
                       help="no compiled model: faster start, slower tokens")
    serve.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    serve.add_argument("--vllm_args", nargs=argparse.REMAINDER, default=[],
                       help="the rest goes to vLLM's server")
