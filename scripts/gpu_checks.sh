#!/usr/bin/env bash
# The GPU checks, in one call on a machine with a CUDA GPU and no Hub: the GPU tests, then the overhead benchmark's
# GPU preset (a random model of SmolLM2-1.7B's shape with SmolLM2's tokenizer, transformers' generate, 64 completions
# of 64 tokens a step; nothing from the Hub). Logs and tables go to OUT (default benchmarks/results/gpu), named with the
# machine, so that they can be committed as they are.
#
#     bash scripts/gpu_checks.sh [OUT]                   # 2 repeats × 3 timed steps of 4 variants (not yet timed)
#     REPEATS=6 bash scripts/gpu_checks.sh OUT            # the 6 paired repeats a committed table asks for
# A lent GPU has 15 minutes of device time in all: run this once with a timeout that leaves room to run it again.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
device=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')")
echo "device: $device" | tee "$out/gpu_checks.log"
python -m pytest tests/test_gpu.py -rs -q -p no:cacheprovider 2>&1 | tee -a "$out/gpu_checks.log"
python benchmarks/overhead.py --preset gpu --variants grpo oblrpo oblrpo-no-trust exact \
    --repeats "${REPEATS:-2}" --steps "${STEPS:-3}" --name overhead_gpu --output_dir "$out" 2>&1 \
    | grep -v "it/s]" | tee -a "$out/gpu_checks.log"
