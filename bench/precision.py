"""What bf16 costs or gains on this machine, and what `dtype="auto"` picks here.

    python bench/precision.py [--threads 1] [--rounds 3] [--skip-model]

Side by side in one process, alternating fp32 and bf16 (A B A B ...), one torch thread by default:
- matmul throughput (GFLOP/s) of a 1024 x 1024 x 1024 product in float32 and in bfloat16;
- the packaged SmolLM2-135M-Instruct's forward on 8 x 160 tokens, fp32 weights, plain vs under
  torch.autocast("cpu", bfloat16) (what Forge's bf16 compute does over its fp32 master weights);
- a LoRA forward + backward of the same model and tokens (r 16 on the seven projections, as Forge trains it
  under bf16: base stored in bf16, adapters fp32), under bf16 autocast with PEFT's default of casting each LoRA
  layer's input to the adapters' fp32 vs with Forge's `lora_inputs_uncast` (the same bits, checked), and in fp32.
It prints the CPU (lscpu's model name and bf16-related flags), the ratios (bf16 time / fp32 time; > 1 means
bf16 is slower) and Forge's choice, and writes bench/results/precision_<amx|avx512_bf16|no_bf16_units>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def cpu_description() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "unknown").strip(),
            "bf16_flags": sorted(f for f in flags if "bf16" in f or f.startswith("amx")),
            "load_average": os.getloadavg()}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def machine_tag() -> str:
    from forge.model import cpu_has_bf16_units

    fast, what = cpu_has_bf16_units()
    return {"AMX tiles": "amx", "AVX512-BF16": "avx512_bf16"}.get(what, "no_bf16_units") if fast else "no_bf16_units"


def lora_model():
    """SmolLM2 with LoRA as Forge trains it in bf16: the frozen base stored in bf16, the adapters in fp32."""
    from forge.model import Precision, apply_lora, as_master_weights, load_model

    model, _ = load_model("default", dtype="float32")
    model = apply_lora(model, r=16, alpha=32, dropout=0.0,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return as_master_weights(model.eval(), Precision(torch.bfloat16, "cpu", "bench"), lora=True)


def lora_forward_backward(model, ids, mode: str) -> tuple:
    """One forward + backward; mode fp32 (base cast up, no autocast), bf16_peft_cast / peft, bf16_forge / forge.
    Returns the loss and the adapters' gradient norms, to check that the two bf16 modes agree bit for bit."""
    import contextlib

    from forge.model import lora_inputs_uncast

    model.zero_grad()
    if mode == "fp32":
        context = contextlib.nullcontext()
        for p in model.parameters():
            p.data = p.data.float()
    else:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.bfloat16()
        context = contextlib.ExitStack()
        context.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if mode.endswith("forge"):
            context.enter_context(lora_inputs_uncast(model))
    with context:
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    return float(loss), tuple(float(p.grad.norm()) for p in model.parameters() if p.requires_grad)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true", help="matmul only (no model load)")
    parser.add_argument("--skip-lora", action="store_true", help="no LoRA forward + backward")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE.parent))
    from forge.model import choose_precision

    n = 1024
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    times = {"matmul_fp32": [], "matmul_bf16": [], "forward_fp32": [], "forward_bf16_autocast": []}
    model = ids = None
    if not args.skip_model:
        from forge.model import load_model

        model, tokenizer = load_model("default", dtype="float32")
        model.eval()
        ids = torch.randint(100, len(tokenizer) - 1, (8, 160))
    lora = None if args.skip_model or args.skip_lora else lora_model()
    if lora is not None:
        same = lora_forward_backward(lora, ids, "peft") == lora_forward_backward(lora, ids, "forge")
        times |= {"lora_fb_fp32": [], "lora_fb_bf16_peft_cast": [], "lora_fb_bf16_forge": []}
    for _ in range(args.rounds):  # alternate, so a neighbour's load hits both alike
        times["matmul_fp32"].append(timed(lambda: a32 @ b32, 5))
        times["matmul_bf16"].append(timed(lambda: a16 @ b16, 5))
        if model is not None:
            with torch.no_grad():
                times["forward_fp32"].append(timed(lambda: model(input_ids=ids), 1))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    times["forward_bf16_autocast"].append(timed(lambda: model(input_ids=ids), 1))
        if lora is not None:
            for mode in ("fp32", "bf16_peft_cast", "bf16_forge"):
                times[f"lora_fb_{mode}"].append(timed(lambda m=mode: lora_forward_backward(lora, ids, m), 1))
    median = {k: statistics.median(v) for k, v in times.items() if v}
    chosen = choose_precision("auto", "cpu")
    result = {
        "cpu": cpu_description(), "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
        "median_seconds": median,
        "matmul_gflops": {k.removeprefix("matmul_"): 2 * n**3 / v / 1e9 for k, v in median.items()
                          if k.startswith("matmul")},
        "bf16_over_fp32_time": {"matmul": median["matmul_bf16"] / median["matmul_fp32"],
                                **({"forward": median["forward_bf16_autocast"] / median["forward_fp32"]}
                                   if "forward_fp32" in median else {}),
                                **({"lora_forward_backward_peft_cast": median["lora_fb_bf16_peft_cast"]
                                    / median["lora_fb_fp32"],
                                    "lora_forward_backward_forge": median["lora_fb_bf16_forge"] / median["lora_fb_fp32"]}
                                   if lora is not None else {})},
        **({"lora_inputs_uncast": {"time_ratio_vs_peft_cast": median["lora_fb_bf16_forge"]
                                   / median["lora_fb_bf16_peft_cast"], "same_loss_and_gradients": same}}
           if lora is not None else {}),
        "forge_auto": {"compute": str(chosen.compute).removeprefix("torch."), "reason": chosen.reason},
        "command": "python bench/precision.py " + " ".join(argv or sys.argv[1:]),
    }
    print(json.dumps(result, indent=2))
    out = HERE / "results" / f"precision_{machine_tag()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
