"""bf16 full fine-tuning before and after fp32 master weights: the share of weights that never moved and the
update's norm, bf16 vs fp32 (tiny Llama, Forge's default lr 5e-6, 3 steps; the setup of tests/units/test_precision.py).

    python bench/bf16_masters.py

"before" trains the bf16 weights directly (as Forge did before master weights), "after" is today's path."""
import sys
import tempfile

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests" / "units"))
from test_precision import ROWS, config, moved, text_length

from forge import GRPOTrainer
from forge.model import policy
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(1)
tok = build_tiny_tokenizer()
for label, patch in (("before (bf16 weights)", True), ("after (fp32 masters)", False)):
    real = policy.as_master_weights
    if patch:
        policy.as_master_weights = lambda model, precision, lora: model
    res = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = build_tiny_model(tok, seed=0)
        model = model.to(getattr(torch, dtype))
        before = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        t = GRPOTrainer(model, tok, text_length, config(__import__("pathlib").Path(tempfile.mkdtemp()), dtype, dtype=dtype))
        t.train(ROWS)
        res[dtype] = moved(before, {k: v.detach().float() for k, v in t.model.named_parameters()})
    policy.as_master_weights = real
    (u32, n32), (u16, n16) = res["float32"], res["bfloat16"]
    print(f"{label}: unchanged fp32 {u32:.1%} bf16 {u16:.1%} (+{u16-u32:.1%}); update norm bf16/fp32 {n16/n32:.2f}x")
