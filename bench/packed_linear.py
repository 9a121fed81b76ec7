"""Linear layers on weights packed once for oneDNN (forge/model/packed_linear.py) against F.linear, on this CPU.

For each linear layer shape of SmolLM2-135M's decode step (q/o 576x576, k/v 192x576, MLP 1536x576 and 576x1536,
the tied output layer 49152x576) at the decode batch's row counts (32 and 8 rows), in bf16 and fp32: the CPU time
of the packed call as a multiple of F.linear's (alternating, the first of six rounds dropped) and whether the two
give the same bits. forge/model/packed_linear.py packs where the time is lower and the bits are the same
(PACKED_LINEAR_MEASURED names the CPU kind and this measurement).

    python bench/packed_linear.py [--threads 1]

Writes bench/results/packed_linear_<bf16 units>_<threads>t.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
SHAPES = {
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def cpu_seconds(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return time.process_time() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from workloads import machine_info

    from forge.model.precision import _bf16_units

    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (32, 8):
            for name, (out, inp) in SHAPES.items():
                generator = torch.Generator().manual_seed(0)
                weight = torch.randn(out, inp, generator=generator).to(dtype)
                x = torch.randn(rows, inp, generator=generator).to(dtype)
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                except RuntimeError as error:  # oneDNN's bf16 needs AVX512 or AVX-NE-CONVERT
                    results.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "layer": name,
                                    "shape": [out, inp], "unsupported": str(error)})
                    print(f"{results[-1]['dtype']:8s} {rows:2d} rows {name:14s} not packed here: {error}")
                    continue

                def plain(x=x, weight=weight):
                    return F.linear(x, weight)

                def pointwise(x=x, packed=packed):
                    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")

                times = {"packed": 0.0, "plain": 0.0}
                for r in range(6):
                    for label, fn in (("plain", plain), ("packed", pointwise)):
                        seconds = cpu_seconds(fn, args.calls)
                        times[label] += seconds if r else 0.0
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "layer": name,
                    "shape": [out, inp],
                    "ratio_packed_to_plain": times["packed"] / times["plain"],
                    "plain_ms": times["plain"] / (5 * args.calls) * 1e3,
                    "same_bits": bool(torch.equal(plain(), pointwise())),
                }
                results.append(row)
                print(
                    f"{row['dtype']:8s} {rows:2d} rows {name:14s} packed {row['ratio_packed_to_plain']:.2f}x "
                    f"F.linear ({row['plain_ms']:.3f} ms), same bits: {row['same_bits']}",
                    flush=True,
                )
    units = _bf16_units()
    out = {
        "what": "CPU time of packed oneDNN linear / F.linear per decode-step layer shape; same bits or not",
        "bf16_units": units,
        "results": results,
        "machine": machine_info(args.threads),
        "command": "python bench/packed_linear.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    tag = units.replace(" ", "_").replace("-", "_").lower()
    (HERE / "results" / f"packed_linear_{tag}_{args.threads}t.json").write_text(
        json.dumps(out, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
