"""How far generation and the loss pass are from what this machine's memory and arithmetic allow.

For the demo's workload (packaged SmolLM2-135M, LoRA, 4 prompts x 8 completions, max_new_tokens 64, in the run's
precision) on the machine it runs on:

- measures the memory bandwidth (the best of reading a 512 MiB tensor and copying it) and the matmul peak in
  the compute dtype (a 2048^3 matmul);
- the floor of one decode step with n rows at context length L: it must read every weight once (the weights in
  the compute dtype, the tied output embedding included) and every row's KV cache (2 x layers x kv_heads x head_dim
  x L values per row), and do 2 x params x n multiply-adds plus attention's 4 x layers x heads x head_dim x L x n;
  floor = max(bytes / bandwidth, FLOPs / peak). Generation's floor sums it over the steps actually taken (rows
  leave the decode batch at their EOS), plus the prefill's FLOP floor;
- generation's measured time (the trainer's own `generate`, in each variant asked for, alternating) as a
  multiple of that floor;
- the loss pass (log-probs forward + backward, micro-batches of 8 completions, LoRA: the base weights need no
  weight gradient, so ~4 x params FLOPs per token plus attention) as a multiple of its FLOP floor.

Variants: `adapters` (LoRA's three matmuls per adapted layer), `merged` (the adapters folded into the weights, as
evaluation generates; forge.model.merged_adapters(rounded=True)), and with `--backends` each generation_backend GRPOConfig knows.
The variants alternate in one process, each with the same sampling noise. `--skip-loss` leaves out the loss
pass; `--no-eos` makes EOS unreachable (bench/workloads.py), so that every row runs to max_new_tokens.
Writes bench/results/decode_floor[_TAG].json.

    python bench/decode_floor.py [--rounds 2] [--max-new-tokens 64] [--dtype auto]
        [--skip-loss] [--no-eos]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def measured_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second: the best of a full read (sum) and a copy (read + write) of a tensor bigger than caches."""
    source = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        best = max(best, source.numel() * 4 / (time.perf_counter() - start))
        start = time.perf_counter()
        target.copy_(source)
        best = max(best, 2 * source.numel() * 4 / (time.perf_counter() - start))
    return best


def measured_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a square matmul in `dtype` (the best of `repeats`)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


class Shape:
    """What one token costs the model: weights read, FLOPs, KV cache per position."""

    def __init__(self, model, dtype: torch.dtype):
        config = model.config
        self.layers, self.hidden = config.num_hidden_layers, config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.kv_heads = getattr(config, "num_key_value_heads", self.heads)
        self.vocab = config.vocab_size
        self.element = torch.tensor([], dtype=dtype).element_size()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        embedding = base.get_input_embeddings().weight.numel()
        tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight
        params = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
        self.matmul_params = params - embedding + (embedding if tied else 0)  # the output layer reads the table
        self.weight_bytes = self.matmul_params * self.element  # the embedding lookup reads a few rows only

    def kv_bytes_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element

    def decode_step(self, rows: int, context: int) -> tuple[float, float]:
        """(bytes, FLOPs) of one decode step of `rows` rows at context length `context`."""
        bytes_read = self.weight_bytes + rows * context * self.kv_bytes_per_position()
        flops = 2 * self.matmul_params * rows + 4 * self.layers * self.heads * self.head_dim * context * rows
        return bytes_read, flops

    def forward_flops(self, tokens: int, context: int) -> float:
        return 2 * self.matmul_params * tokens + 4 * self.layers * self.heads * self.head_dim * context * tokens


def generation_floor(shape: Shape, rollout, prefill_tokens: int, bandwidth: float, peak: float) -> dict:
    """The floor of one rollout's generation: its decode steps (rows that are still running) and its prefill."""
    lengths = rollout.completion_lengths  # (N,)
    prompt_length = int(rollout.prompt_mask.shape[1])
    decode = 0.0
    memory_bound_steps = 0
    for step in range(1, int(lengths.max())):  # step k feeds token k-1 of the rows longer than k
        rows = int((lengths > step).sum())
        bytes_read, flops = shape.decode_step(rows, prompt_length + step)
        decode += max(bytes_read / bandwidth, flops / peak)
        memory_bound_steps += bytes_read / bandwidth >= flops / peak
    prefill = shape.forward_flops(prefill_tokens, prompt_length) / peak
    return {"decode_s": decode, "prefill_s": prefill, "total_s": decode + prefill,
            "decode_steps": int(lengths.max()) - 1, "memory_bound_steps": int(memory_bound_steps),
            "generated_tokens": int(lengths.sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", default="adapters,merged")
    parser.add_argument("--backends", default="", help="generation_backend values to add (merged weights)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--skip-loss", action="store_true", help="time generation only")
    parser.add_argument("--no-eos", action="store_true", help="every row generates max_new_tokens tokens")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import cpu_model, suppress_eos

    from forge.core.logprobs import completion_logprobs
    from forge.core.rollout import tokenize_prompts
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.model import load_model, merged_adapters
    from forge.model.decode_plan import DecodePlan

    settings = DemoSettings(seed=0, dtype=args.dtype, max_new_tokens=args.max_new_tokens)
    base, tokenizer = load_model("default")
    if args.no_eos:
        suppress_eos(base, tokenizer)
    config = demo_config(settings, "/tmp/forge_decode_floor", eval_steps=0, preflight="off")
    trainer = GRPOTrainer(base, tokenizer, demo_rewards(), config)
    precision, model = trainer.precision, trainer.model
    with torch.no_grad():  # adapters as after some training (peft starts B at 0, which merges to nothing)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    rows = arithmetic_dataset(n=settings.prompts_per_step, seed=0, chat=True)
    prompts = [row["prompt"] for row in rows]
    shape = Shape(model, precision.compute)
    bandwidth, peak = measured_bandwidth(), measured_peak(precision.compute)
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s, {precision.compute} matmul peak {peak / 1e12:.2f} TFLOP/s",
          flush=True)

    variants = {name: {"merge_lora_for_generation": name != "adapters"} for name in args.variants.split(",") if name}
    for backend in (b for b in args.backends.split(",") if b):
        variants[backend] = {"generation_backend": backend}  # the adapter path, as training samples
    configs = {name: replace(config, **fields) for name, fields in variants.items()}
    plan = trainer.decode_plan
    with precision.autocast(model):  # the trainer decides how it decodes once; each variant its own plan
        plans = {name: DecodePlan.of(model, configs[name].generation_backend) for name in variants}
    timings = {name: [] for name in variants}
    rollouts = {}
    names = list(variants)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            trainer.config, trainer.decode_plan = configs[name], plans[name]
            trainer.sampling_rng = torch.Generator().manual_seed(0)  # the same noise for every variant
            # merged: the weights evaluation generates from (in bf16 training's sampling keeps the adapters)
            merge = merged_adapters(model, rounded=True) if name.startswith("merged") else contextlib.nullcontext()
            start = time.perf_counter()
            with merge:
                rollouts[name] = trainer.generate(prompts)
            timings[name].append(time.perf_counter() - start)
            print(r, name, round(timings[name][-1], 3), "s", flush=True)
    trainer.config, trainer.decode_plan = config, plan

    prompt_ids, _ = tokenize_prompts(tokenizer, prompts, 10**9)
    generation = {}
    for name, rollout in rollouts.items():
        floor = generation_floor(shape, rollout, prompt_ids.numel(), bandwidth, peak)
        best = min(timings[name])
        generation[name] = {"seconds": timings[name], "best_s": best, "floor": floor,
                            "times_floor": best / floor["total_s"],
                            "tokens_per_s": floor["generated_tokens"] / best}

    # the loss pass: forward + backward of the log-probs, micro-batches of micro_batch_size completions
    rollout = rollouts[names[0]]
    loss_times = []
    tokens = 0
    for _ in range(0 if args.skip_loss else args.rounds):
        start = time.perf_counter()
        tokens = 0
        for first in range(0, rollout.completion_ids.shape[0], config.micro_batch_size):
            index = torch.arange(first, min(first + config.micro_batch_size, rollout.completion_ids.shape[0]))
            length = int(rollout.completion_mask[index].sum(dim=1).max())
            with precision.autocast(model):
                logprobs = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask,
                                               rollout.completion_ids[index, :length], rollout.prompt_index[index],
                                               config.temperature)
            logprobs.sum().backward()
            tokens += len(index) * (rollout.prompt_ids.shape[1] + length)
        loss_times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    context = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
    loss_floor = 2 * shape.forward_flops(tokens, context) / peak  # forward + activation gradients (LoRA)
    loss = None if args.skip_loss else {"seconds": loss_times, "best_s": min(loss_times), "flop_floor_s": loss_floor,
                                        "times_floor": min(loss_times) / loss_floor, "tokens": tokens}

    result = {
        "what": "generation and the loss pass as multiples of their floors (bench/decode_floor.py docstring)",
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "load_average": list(os.getloadavg()),
        "model": "packaged SmolLM2-135M-Instruct, LoRA r=16 on q,k,v,o (demo)", "precision": str(precision.compute),
        "workload": {"prompts": settings.prompts_per_step, "group_size": settings.group_size,
                     "max_new_tokens": settings.max_new_tokens, "prompt_length": int(rollout.prompt_ids.shape[1]),
                     "eos_reachable": not args.no_eos},
        "measured": {"bandwidth_GBps": bandwidth / 1e9, "matmul_peak_TFLOPs": peak / 1e12},
        "per_step": {"weight_bytes": shape.weight_bytes, "kv_bytes_per_position_per_row": shape.kv_bytes_per_position(),
                     "matmul_params": shape.matmul_params},
        "generation": generation, "loss_pass": loss,
        "command": "python bench/decode_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"decode_floor{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"measured": result["measured"], "generation": {
        name: {k: v for k, v in g.items() if k in ("best_s", "times_floor", "tokens_per_s", "same_tokens",
                                                   "same_sampler_logprobs", "speedup_of_current")} | {
            "floor_s": g["floor"]["total_s"]} for name, g in generation.items()},
        "loss_pass": loss and {k: loss[k] for k in ("best_s", "flop_floor_s", "times_floor")}}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
