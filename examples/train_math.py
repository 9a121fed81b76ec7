"""GRPO on GSM8K with one GPU: a correctness reward plus a format reward, evaluated before and after.

The model is asked (forge.format_prompt) to end its solution with a line `Answer: <number>`. Two rewards:

    correctness  MathCorrectnessReward: 1 when the final answer equals the GSM8K reference (numeric compare)
    format       FormatReward: 1 when the response has an `Answer:` line holding a number

weighted 1.0 and 0.2, so a well-formatted wrong answer still beats rambling, but never a correct one. Before
and after training the model is graded greedily on held-out GSM8K test problems with forge.evaluate, which
reads answers with the same grader as the reward, so the training signal and the reported accuracy agree.

    pip install "forge-rl[data,math]"                      # GSM8K from the hub, symbolic answer matching
    python examples/train_math.py                          # Qwen2.5-0.5B-Instruct, full fine-tuning, bf16
    python examples/train_math.py --model HuggingFaceTB/SmolLM2-1.7B-Instruct --use_lora
    python examples/train_math.py --dry-run                # build config and rewards only: no download, no GPU

The defaults (200 steps of 16 prompts x 8 completions, up to 512 new tokens) are sized for one large GPU;
on a smaller one lower micro_batch_size first, then prompts_per_step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import forge
from forge import FormatReward, GRPOConfig, GRPOTrainer, MathCorrectnessReward
from forge.data.answers import extract_answer_line, first_number


def has_answer_line(response: str) -> bool:
    """The format the prompt asks for: an `Answer:` line with a number on it."""
    return first_number(extract_answer_line(response)) is not None


def as_chat(rows: list[dict]) -> list[dict]:
    """Instruct models answer best through their chat template: the GSM8K prompt becomes one user message."""
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]


def build_config(args: argparse.Namespace) -> GRPOConfig:
    return GRPOConfig(
        # generation: 16 prompts x 8 completions per step, long enough for GSM8K's worked solutions
        group_size=8,
        prompts_per_step=16,
        gradient_accumulation_steps=1,
        max_new_tokens=512,
        temperature=1.0,
        # loss: token-mean aggregation and clip-higher (DAPO); no KL term, so no reference copy in memory
        loss_type="dapo",
        clip_epsilon=0.2,
        clip_epsilon_high=0.28,
        kl_beta=args.kl_beta,
        micro_batch_size=32,  # completions per forward/backward; lower it if the loss pass runs out of memory
        # optimizer: full fine-tuning wants a small rate; LoRA adapters a larger one
        learning_rate=args.learning_rate or (1e-5 if args.use_lora else 1e-6),
        lr_scheduler="cosine",
        warmup_ratio=0.05,
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        use_lora=args.use_lora,
        lora_r=32,
        lora_alpha=64,
        # Full fine-tuning keeps fp32 weights: Forge has no fp32 master copy, and in bf16 an update of ~1e-6 is
        # below the rounding step of almost every weight, so AdamW would change next to nothing. LoRA adapters
        # stay fp32 on a bf16 base (peft), so the base can be bf16.
        dtype="bfloat16" if args.use_lora else "float32",
        # rewards: [MathCorrectnessReward, FormatReward]
        reward_weights=[1.0, 0.2],
        # bookkeeping
        logging_steps=1,
        log_completions=4,
        save_steps=50,
        save_total_limit=2,
        output_dir=args.output_dir,
        seed=args.seed,
    ).validate()


def build_rewards() -> list:
    return [MathCorrectnessReward(), FormatReward(has_answer_line)]


def dry_run(args: argparse.Namespace) -> int:
    """Everything but the model and the dataset download: config, rewards, and the rewards on sample answers."""
    config = build_config(args)
    rewards = build_rewards()
    rows = as_chat(forge.load_gsm8k_mock(n=2))  # offline stand-ins with the real GSM8K prompt format
    references = [row["reference"] for row in rows]
    responses = [f"Let me work it out.\nAnswer: {references[0]}", "I think it is about 3 or so."]
    prompts = [row["prompt"] for row in rows]
    scores = [reward(prompts, responses, references=references).scores for reward in rewards]
    print(f"model:   {args.model} ({'LoRA' if config.use_lora else 'full fine-tuning'}, {config.dtype})")
    print(f"steps:   {config.max_steps} x {config.prompts_per_step} prompts x {config.group_size} completions, "
          f"lr {config.learning_rate}")
    print(f"rewards: {[type(r).__name__ for r in rewards]} weights {config.reward_weights}")
    print(f"sample scores (correct + formatted, unformatted): {scores}")
    print(json.dumps(config.to_dict(), indent=2))
    assert scores == [[1.0, 0.0], [1.0, 0.0]], scores
    print("dry run ok: nothing downloaded")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="hub id or local folder")
    parser.add_argument("--use_lora", action="store_true", help="train LoRA adapters instead of all weights")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--learning_rate", type=float, default=None, help="default: 1e-6 full, 1e-5 LoRA")
    parser.add_argument("--kl_beta", type=float, default=0.0)
    parser.add_argument("--train_samples", type=int, default=None, help="GSM8K train problems (default: all)")
    parser.add_argument("--eval_samples", type=int, default=500, help="GSM8K test problems graded before/after")
    parser.add_argument("--output_dir", default="gsm8k_grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="build the config and rewards and check them, without downloading anything")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args)

    import torch

    if not torch.cuda.is_available():
        print("warning: no GPU found; this example is sized for one (try --dry-run, or the offline "
              "`forge demo` on a CPU)", file=sys.stderr)
    config = build_config(args)
    model, tokenizer = forge.load_model(args.model, dtype=config.dtype)
    train_rows = as_chat(forge.load_gsm8k("train", max_samples=args.train_samples))
    test_rows = as_chat(forge.load_gsm8k("test", max_samples=args.eval_samples))

    eval_settings = {"max_new_tokens": config.max_new_tokens, "batch_size": 64}  # greedy decoding
    before = forge.evaluate(model, tokenizer, test_rows, **eval_settings)
    print(f"before: {before.summary()}")

    trainer = GRPOTrainer(model=model, tokenizer=tokenizer, reward_fn=build_rewards(), config=config)
    trainer.train(train_rows)

    after = forge.evaluate(trainer.model, tokenizer, test_rows, **eval_settings)
    print(f"before: {before.summary()}\nafter:  {after.summary()}")
    report = {"model": args.model, "before": before.metrics, "after": after.metrics, "config": config.to_dict()}
    report_path = Path(config.output_dir) / "gsm8k_before_after.json"
    report_path.write_text(json.dumps(report, indent=2))
    print(f"report: {report_path}\ncurves: forge plot {config.output_dir}\nweights: {config.output_dir}/final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
