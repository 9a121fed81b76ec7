"""A/B in one process: the demo's loss pass with one group per micro-batch (8, the demo's) against all of a step's
carrying rows in one micro-batch (0, which computes the prompts' shared template once but pads every row to
the step's longest completion). Same model, recipe, rows and sampling seed on both sides, steps alternating
A B / B A, process CPU seconds per step.

    python bench/micro_batching.py [THREADS] [STEPS]       # e.g. 1 8
"""
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
from forge.demo import DemoSettings, demo_config, demo_rewards
from forge.core.policy import load_model
from forge.core.trainer import GRPOTrainer
from forge.data.arithmetic import arithmetic_dataset
s = DemoSettings(seed=0)
rows = arithmetic_dataset(n=60 * 4, seed=0, chat=True)
base, tok = load_model("default")
trainers = {}
for mb in (8, 0):
    cfg = demo_config(s, f"/tmp/forge_micro_batching_{mb}", micro_batch_size=mb, eval_steps=0)
    trainers[mb] = GRPOTrainer(copy.deepcopy(base), tok, demo_rewards(), cfg)
    from forge.core.optim import make_scheduler
    trainers[mb].scheduler = make_scheduler(trainers[mb].optimizer, "constant", 0.0, 60)
res = {8: [], 0: []}
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
    batch = rows[4 * i: 4 * i + 4]
    for mb in ((8, 0) if i % 2 == 0 else (0, 8)):
        t = trainers[mb]
        torch.manual_seed(1000 + i)
        c0 = time.process_time(); w0 = time.perf_counter()
        m = t.step(batch)
        res[mb].append({"cpu": time.process_time() - c0, "wall": time.perf_counter() - w0, "gen": m.get("generation_share"),
                        "loss": m["loss"], "kept": 1 - m.get("frac_zero_std_groups", 0)})
    print(i, {mb: {k: round(v, 4) if isinstance(v, float) else v for k, v in res[mb][-1].items()} for mb in res}, flush=True)
cpu = {mb: sum(r["cpu"] for r in res[mb]) for mb in res}
for mb in res:
    print(f"micro_batch_size={mb}: {cpu[mb]:.1f} CPU s, {sum(r['wall'] for r in res[mb]):.1f} s wall")
print(f"ratio (0 / 8) on CPU time: {cpu[0] / cpu[8]:.2f}x")
