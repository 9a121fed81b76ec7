"""What each bf16 switch of generation and of the loss pass does to the numbers, along the demo's rollouts.

    python bench/bf16_switches.py [--prompts 8] [--group 4] [--max-new-tokens 64] [--threads 1]
                                  [--adapter DIR] [--tag NAME]

The demo's policy (`forge demo`: the packaged SmolLM2-135M-Instruct with its LoRA adapters, bf16 compute where
the CPU has bf16 units) samples `--prompts` of the demo's arithmetic prompts x `--group` completions once,
with every switch as the code ships it. Those tokens are then the fixed states (prompt + completion prefix)
every configuration below is measured on:

- the reference: the same weights in fp32 (an fp32 copy of the model with the same adapters), one plain
  forward over each prompt + completion: its next-token distribution at every completion position (at the
  sampling temperature) and its log-prob of each sampled token (what an fp32 trainer computes);
- the sampler: the decode loop as `GRPOTrainer.sample_completions` runs it, fed the same tokens instead of sampling (its
  sampling function replaced by one that takes the recorded token), once per combination of the decode's
  switches: `pack` (linear layers on packed oneDNN weights, forge/model/packed_linear.py), `fused` (q/k/v and
  gate/up and the LoRA A matrices as one product: packed_linear.FUSED), `shared_attention` (the decode attends
  over each group's prompt stored once, forge/model/kv_cache.py), `grouped_mask` (the repeated-prompt
  step's 4D mask, decode_plan.DecodePlan.grouped_mask);
- the trainer: `GRPOTrainer.rollout_logprobs` (the loss pass's log-probs, micro-batch by micro-batch, under
  the run's autocast) with `padding_free` (logprobs.PADDING_FREE) and `uncast_lora_inputs` (Precision's
  lora_inputs_uncast) on and off; its next-token distributions are made from the same hidden states its own
  output layer reads.

Per configuration: the mean KL(bf16 || fp32) over the completion positions, and the bias (mean signed
difference) and spread (standard deviation) of the bf16 log-prob of each sampled token minus the fp32
reference's. `plain` is every switch off (the bf16 path before the switches existed); a switch that raises
either figure clearly above `plain` changes what the policy computes beyond bf16 rounding.

Without --adapter the adapters are the run's fresh ones (B = 0: the step-0 policy, where the LoRA path adds
nothing); with --adapter DIR (a `forge demo` run's final/ folder) the trained ones. Needs a CPU (or GPU) where
`dtype="auto"` picks bf16. Writes bench/results/bf16_switches[_<tag>].json.

    python bench/bf16_switches.py demo --seed 1 --threads 1 --output_dir plain_seed1

runs `forge demo` with the arguments after `demo` on the plain path (every switch above off, in training's
sampling, its loss pass and every evaluation), for seed-by-seed comparisons with `forge demo`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SAMPLER_SWITCHES = ("pack", "fused", "shared_attention", "grouped_mask")
TRAINER_SWITCHES = ("padding_free", "uncast_lora_inputs")
# Each sampler configuration: the switches on. "default" is the code as it ships (grouped_mask only acts when
# shared_attention is off; fused only when pack is on).
SAMPLER_CONFIGS = {
    "plain": (),
    "pack": ("pack",),
    "pack+fused": ("pack", "fused"),
    "shared_attention": ("shared_attention",),
    "grouped_mask": ("grouped_mask",),
    "default": SAMPLER_SWITCHES,
    "default-fused": ("pack", "shared_attention", "grouped_mask"),
    "default-pack": ("shared_attention", "grouped_mask"),
    "default-shared_attention": ("pack", "fused", "grouped_mask"),
}
TRAINER_CONFIGS = {
    "plain": (),
    "padding_free": ("padding_free",),
    "uncast_lora_inputs": ("uncast_lora_inputs",),
    "default": TRAINER_SWITCHES,
    "padding_free_forced": ("padding_free", "uncast_lora_inputs", "forced"),
}
# "forced": the padding-free layout for every micro-batch, also where it would compute more positions than the
# padded rows (PaddingFree.pays): the demo's groups often hold completions of one length, where it never runs.


def build_trainer(args, dtype: str, directory: Path):
    """A GRPOTrainer of the demo's recipe (forge/demo.py demo_config) with the bench's sizes."""
    from forge.core.trainer import GRPOTrainer
    from forge.demo import DemoSettings, demo_config, demo_rewards, load_policy

    settings = DemoSettings(
        seed=args.seed,
        group_size=args.group,
        prompts_per_step=args.prompts,
        max_new_tokens=args.max_new_tokens,
        dtype=dtype,
    )
    model, tokenizer, _ = load_policy(settings)
    trainer = GRPOTrainer(model, tokenizer, demo_rewards(), demo_config(settings, directory / dtype))
    if args.adapter:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(Path(args.adapter) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(trainer.model, state)
        if getattr(result, "unexpected_keys", None):
            raise SystemExit(
                f"{args.adapter}: adapter keys this model does not have: {result.unexpected_keys[:3]}"
            )
    return trainer


def reference(trainer32, rollout, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 policy on each prompt + completion, one plain forward per group: (N, T, V) log-probs of the next
    token at each completion position (temperature-scaled) and (N, T) log-probs of the sampled tokens."""
    n, length = rollout.completion_ids.shape
    vocabulary = trainer32.model.get_output_embeddings().weight.shape[0]
    logprobs = torch.zeros(n, length, vocabulary)
    lengths = rollout.completion_lengths
    with torch.no_grad():
        for p in range(rollout.num_prompts):
            prompt = rollout.prompt_ids[p][rollout.prompt_mask[p].bool()]  # (Lp,) without the left padding
            rows = range(p * rollout.group_size, (p + 1) * rollout.group_size)
            ids = torch.cat([prompt.expand(len(rows), -1), rollout.completion_ids[list(rows)]], dim=1)
            logits = trainer32.model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()  # (G, T, V)
            logprobs[list(rows)] = torch.log_softmax(logits / temperature, dim=-1)
    mask = torch.arange(length)[None] < lengths[:, None]  # (N, T)
    tokens = logprobs.gather(2, rollout.completion_ids[:, :, None]).squeeze(2) * mask
    return logprobs, tokens


class Figures:
    """KL(bf16 || fp32) and the log-prob differences of the sampled tokens, summed over positions."""

    def __init__(self):
        self.kl, self.diffs = [], []
        self.extra: dict = {}  # what else the pass reports

    def add(
        self, logprobs: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, ref_token: torch.Tensor
    ):
        """logprobs, reference (k, V) temperature-scaled log-softmaxes at k positions; tokens (k,) sampled there;
        ref_token (k,) the reference's log-probs of them."""
        self.kl.append((logprobs.exp() * (logprobs - reference)).sum(dim=-1))
        self.diffs.append(logprobs.gather(1, tokens[:, None]).squeeze(1) - ref_token)

    def summary(self) -> dict:
        kl, diffs = torch.cat(self.kl).double(), torch.cat(self.diffs).double()
        return {
            **self.extra,
            "positions": len(kl),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "bias": float(diffs.mean()),
            "bias_se": float(diffs.std() / len(diffs) ** 0.5),
            "spread": float(diffs.std()),
            "mean_abs": float(diffs.abs().mean()),
        }


@contextlib.contextmanager
def sampler_switches(trainer, on: tuple):
    """The decode's switches as `on` names them, for the trainer's generate()."""
    from forge.model import packed_linear

    plan, fused = trainer.decode_plan, packed_linear.FUSED
    trainer.decode_plan = replace(
        plan,
        pack=plan.pack and "pack" in on,
        shared_prompt=plan.shared_prompt if "shared_attention" in on else (),
        grouped_mask=plan.grouped_mask and "grouped_mask" in on,
    )
    packed_linear.FUSED = "fused" in on
    try:
        yield
    finally:
        trainer.decode_plan, packed_linear.FUSED = plan, fused


def forced_sampler(
    trainer, prompts: list, rollout, ref: torch.Tensor, ref_tokens: torch.Tensor, temperature: float
) -> Figures:
    """The trainer's decode loop fed the rollout's tokens: its next-token distributions against the reference."""
    from forge.core import rollout as rollout_module

    lengths = rollout.completion_lengths.tolist()
    figures, step = Figures(), [0]
    original = rollout_module.sample_with_logprobs

    def take_recorded(logits, settings, draws, cdf_out=None):  # (n, V) -> the recorded tokens (n,), log-probs
        k = step[0]
        active = torch.tensor([i for i, length in enumerate(lengths) if length > k])  # as the loop keeps them
        assert len(active) == logits.shape[0], "the forced decode lost track of its rows"
        tokens = rollout.completion_ids[active, k]
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (n, V)
        figures.add(logprobs, ref[active, k], tokens, ref_tokens[active, k])
        step[0] += 1
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)

    rollout_module.sample_with_logprobs = take_recorded
    try:
        again = trainer.sample_completions(prompts)
    finally:
        rollout_module.sample_with_logprobs = original
    assert torch.equal(again.completion_ids, rollout.completion_ids), "the forced decode took other tokens"
    return figures


@contextlib.contextmanager
def trainer_switches(trainer, on: tuple):
    from forge.core import logprobs

    precision, free, pays = trainer.precision, logprobs.PADDING_FREE, logprobs.PaddingFree.pays
    if "forced" in on:
        logprobs.PaddingFree.pays = lambda expand, lengths, padded, prompt_length: bool(lengths.sum() > 0)
    trainer.precision = replace(
        precision, uncast_lora_inputs=precision.uncast_lora_inputs and "uncast_lora_inputs" in on
    )
    trainer.loss_autocast = trainer.precision.reusable_autocast(trainer.model)
    logprobs.PADDING_FREE = "padding_free" in on
    try:
        yield
    finally:
        trainer.precision, logprobs.PADDING_FREE, logprobs.PaddingFree.pays = precision, free, pays
        trainer.loss_autocast = precision.reusable_autocast(trainer.model)


def trainer_pass(
    trainer, rollout, ref: torch.Tensor, ref_tokens: torch.Tensor, temperature: float
) -> Figures:
    """The loss pass's log-probs, micro-batch by micro-batch; its distributions from the hidden states its output
    layer reads (the first completion token's from the prompt's logits)."""
    from forge.core import logprobs as module
    from forge.core.logprobs import micro_batches

    figures, current, free_layouts = Figures(), {}, []
    lengths = rollout.completion_lengths
    original_scored, original_first = module.scored, module.token_logprobs_from_logits

    def positions(n_rows: int, width: int, padding_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(completion, t) of each scored position, in the order the pass lays them out (t >= 1)."""
        indices = current["indices"]
        if not padding_free:  # (n, T' - 1): row i, column c predicts token c + 1
            rows, columns = torch.meshgrid(torch.arange(n_rows), torch.arange(width), indexing="ij")
            return indices[rows.reshape(-1)], columns.reshape(-1) + 1
        pairs = [(int(i), t) for i in indices for t in range(1, int(lengths[i]))]  # PaddingFree's order
        return torch.tensor([i for i, _ in pairs]), torch.tensor([t for _, t in pairs])

    def scored(model, states, targets, teacher=None, **scoring):
        head = module.logit_head(model)
        logits = head(states) if head is not None else states  # (B, L, V)
        padding_free = states.shape[0] == 1 and len(current["indices"]) > 1
        free_layouts.append(padding_free)
        completion, t = positions(states.shape[0], states.shape[1], padding_free)
        logprobs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float() / temperature, dim=-1)
        real = t < lengths[completion]
        figures.add(
            logprobs[real],
            ref[completion[real], t[real]],
            rollout.completion_ids[completion[real], t[real]],
            ref_tokens[completion[real], t[real]],
        )
        return original_scored(model, states, targets, teacher, **scoring)

    def first(logits, targets, **scoring):  # (n, 1, V): the first completion token (the pass's first call)
        if current.pop("first", None) is None:  # a chunk of the later tokens (scored's own call)
            return original_first(logits, targets, **scoring)
        indices = current["indices"]
        logprobs = torch.log_softmax(logits[:, 0].float() / temperature, dim=-1)
        figures.add(logprobs, ref[indices, 0], rollout.completion_ids[indices, 0], ref_tokens[indices, 0])
        return original_first(logits, targets, **scoring)

    module.scored, module.token_logprobs_from_logits = scored, first
    try:
        with torch.no_grad():
            for indices in micro_batches(rollout, trainer.micro_batch_size):
                current["indices"], current["first"] = indices, True
                trainer.logprobs(trainer.model, rollout, indices)
    finally:
        module.scored, module.token_logprobs_from_logits = original_scored, original_first
    figures.extra["padding_free_micro_batches"] = f"{sum(free_layouts)} of {len(free_layouts)}"
    return figures


def table(rows: dict, title: str) -> str:
    lines = [title, f"{'configuration':26s} {'KL mean':>10s} {'bias':>11s} {'+-se':>9s} {'spread':>9s}"]
    for name, r in rows.items():
        lines.append(
            f"{name:26s} {r['kl_mean']:10.3e} {r['bias']:+11.3e} {r['bias_se']:9.1e} {r['spread']:9.3e}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def every_switch_off():
    """The plain bf16 path for a whole run: every decode plan without packing, shared-prompt attention or the 4D
    mask (the trainer's and each evaluation's), no fused products, no padding-free loss pass."""
    from forge.core import logprobs
    from forge.model import packed_linear
    from forge.model.decode_plan import DecodePlan

    plan_of, fused, free = DecodePlan.__dict__["of"], packed_linear.FUSED, logprobs.PADDING_FREE

    def plain(cls, *args, **kwargs):
        return replace(
            plan_of.__func__(cls, *args, **kwargs), pack=False, shared_prompt=(), grouped_mask=False
        )

    DecodePlan.of, packed_linear.FUSED, logprobs.PADDING_FREE = classmethod(plain), False, False
    try:
        yield
    finally:
        DecodePlan.of, packed_linear.FUSED, logprobs.PADDING_FREE = plan_of, fused, free


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # `forge demo ...` on the plain bf16 path
        from forge.cli import main as forge_main

        with every_switch_off():
            return forge_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--adapter", default="", help="a forge demo run's final/ folder (default: fresh adapters)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from workloads import machine_info

    from forge.core.trainer import seed_everything
    from forge.data.arithmetic import ARITHMETIC_TASK
    from forge.model import cpu_name

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        trainer = build_trainer(args, "auto", Path(directory))
        if trainer.precision.compute != torch.bfloat16:
            raise SystemExit(
                f"dtype='auto' picks {trainer.precision.compute} here ({trainer.precision.reason}): "
                "nothing to measure; run on a CPU with bf16 units or a bf16 GPU"
            )
        trainer32 = build_trainer(args, "float32", Path(directory))
        trainer32.model.load_state_dict(
            {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}, strict=False
        )
    temperature = trainer.config.temperature
    rows = ARITHMETIC_TASK.rows(n=args.prompts, seed=args.seed, chat=True)
    prompts = [row["prompt"] for row in rows]
    seed_everything(args.seed)
    rollout = trainer.sample_completions(prompts)  # every switch as shipped
    ref, ref_tokens = reference(trainer32, rollout, temperature)
    print(
        f"rollout: {len(rollout.completion_ids)} completions, {int(rollout.completion_lengths.sum())} tokens; "
        f"fp32 reference in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    sampler, trainer_rows, seconds = {}, {}, {}
    for name, on in SAMPLER_CONFIGS.items():
        tick = time.process_time()
        with sampler_switches(trainer, on):
            sampler[name] = forced_sampler(trainer, prompts, rollout, ref, ref_tokens, temperature).summary()
        seconds[f"sampler/{name}"] = time.process_time() - tick
        print(
            f"sampler {name:26s} KL {sampler[name]['kl_mean']:.3e}  bias {sampler[name]['bias']:+.3e}",
            flush=True,
        )
    for name, on in TRAINER_CONFIGS.items():
        tick = time.process_time()
        with trainer_switches(trainer, on):
            trainer_rows[name] = trainer_pass(trainer, rollout, ref, ref_tokens, temperature).summary()
        seconds[f"trainer/{name}"] = time.process_time() - tick
        print(
            f"trainer {name:26s} KL {trainer_rows[name]['kl_mean']:.3e}  bias {trainer_rows[name]['bias']:+.3e}",
            flush=True,
        )
    print(table(sampler, "\nsampler (decode loop, fed the rollout's tokens) against fp32"))
    print(table(trainer_rows, "\ntrainer (loss pass's log-probs) against fp32"))
    result = {
        "what": (
            "KL(bf16 || fp32) of next-token distributions (temperature-scaled) and bf16 - fp32 log-prob of the "
            "sampled tokens, per switch configuration, on one rollout of the demo's policy"
        ),
        "cpu": cpu_name(),
        "sizes": {
            "prompts": args.prompts,
            "group": args.group,
            "max_new_tokens": args.max_new_tokens,
            "temperature": temperature,
            "completion_tokens": int(rollout.completion_lengths.sum()),
        },
        "adapter": args.adapter or "fresh (B = 0)",
        "seed": args.seed,
        "sampler": sampler,
        "trainer": trainer_rows,
        "cpu_seconds": seconds,
        "wall_seconds": time.perf_counter() - started,
        "machine": machine_info(args.threads),
        "command": "python bench/bf16_switches.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    name = "bf16_switches" + (f"_{args.tag}" if args.tag else "") + ".json"
    (HERE / "results" / name).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
