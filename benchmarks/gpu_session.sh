#!/usr/bin/env bash
# One prepared GPU run (the `device` tool's machine: jax + CUDA plugin installed, no internet), in two parts
# that each fit one device call of 10 minutes: part 1, about 7 minutes on an H200 with the compiles (its steps'
# limits add up to 10), then part 2 on the still warm machine, 4 to 9. Each step runs under its own
# `timeout` and writes its rows as it goes, so a step cut short keeps what it measured and the next one runs:
#   part 1:
#   1. attention, decode (bf16, then fp8 pages at 32k) then prefill: every kernel checked against the reference
#      on this GPU, then timed (ours, the Mosaic GPU kernel with and without its context split, the portable one,
#      XLA, JAX's own; for prefill the Mosaic GPU kernel with one and with two warpgroups a program). Where the
#      two-warpgroup form timed nothing (it failed its check, or hung), the later steps run with one
#      (HKV_MOSAIC_WARPGROUPS=1, written to fallback.txt; set it for part 2 too);
#   2. the engine's parity workload on this GPU's kernels against the dense model;
#   3. decode_profile: a Gemma 3 270M decode step (B=1, 1k): wall, GPU busy time, kernels a step, top kernels;
#      run twice over a compilation cache of their own (empty at first: the steps before leave programs the
#      profile would load), the second with what the first put there: the start, cold and warm; the first dumps
#      its optimised decode program, and gpu_hlo.py counts its kernels a step (to set against the trace);
#      a third run puts the step's loops and conditionals into XLA's CUDA graphs (wall time only);
#   4. host_copy: the host tier's in-step page copies down and up, GB/s;
#   part 2:
#   5. gpu_projection --measure: the Llama-3.1-8B-like decode step at B=64, 4k (two compiles of a 32-layer
#      model, 64 prefills of 4k tokens), timed against its projected time;
#   6. attention, decode under a 512-token sliding window at 32k: the Mosaic GPU kernel's runs bounded by the
#      window (as auto splits it) against runs bounded by the table (last: a long step 5 may leave it no time).
# Then gpu_results.py writes OUTDIR/results/<device>-<date>.json from what the steps wrote; for both parts'
# rows in one file, or after a run cut short: python benchmarks/gpu_results.py PART1_OUTDIR PART2_OUTDIR.
# Usage (repo root): bash benchmarks/gpu_session.sh [OUTDIR [PART]]   (OUTDIR: $OUT or /tmp/gpu_session;
# PART: 1, 2 or all, the default)
# SMOKE=1 runs part 1's steps at their smallest (CPU, interpret mode) to check the script before a GPU is lent.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu_session}}
part=${2:-all}
case $part in 1|2|all) ;; *) echo "PART must be 1, 2 or all, got '$part'" >&2; exit 2;; esac
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR="$out/jax_cache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0  # every program, as hkv's commands keep them
smoke=${SMOKE:-}
dump="--xla_dump_to=$out/hlo --xla_dump_hlo_module_re=decode_steps"  # the decode program's modules only
graphs="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"  # no predicate read by the host (gpu_hlo.py)
start="JAX_COMPILATION_CACHE_DIR=$out/start_cache"  # the cold and the warm start's own cache
step() {  # step NAME SECONDS COMMAND...: stdout to $out/NAME, stderr to $out/NAME.log and the terminal
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name" 2> >(tee "$out/$name.log" >&2)
  echo "# $name: exit $? after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/steps.txt" >&2
}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null || echo "no nvidia-smi"
  python -c "import jax; print(jax.__version__, jax.devices())"; git rev-parse --short HEAD 2>/dev/null; } \
  | tee "$out/gpu.txt"
if [ -n "$smoke" ]; then
  step attention_decode.jsonl 300 python benchmarks/attention_gpu.py --smoke --mode decode --json
  step parity.jsonl 120 python benchmarks/gpu_parity.py --smoke
  step decode_profile_cold.json 120 env "$start" XLA_FLAGS="${XLA_FLAGS:-} $dump" python benchmarks/decode_profile.py \
    --smoke --json
  # Untraced, as the graphs step below runs (which the smoke leaves out: XLA:CPU has no CUDA graphs, and the
  # flag would only cost the compile that this step loads from the cache).
  step decode_profile_warm.json 120 env "$start" python benchmarks/decode_profile.py --smoke --traced-calls 0 --json
  step hlo_kernels.json 30 python benchmarks/gpu_hlo.py --module "$out/hlo" --config tiny-gptoss --json
  step host_copy.jsonl 60 python benchmarks/host_copy.py --model tiny-gemma3 --blocks 2 --pool-blocks 8 \
    --host-blocks 8 --repeats 1 --json
elif [ "$part" != 2 ]; then
  step attention_decode.jsonl 120 python benchmarks/attention_gpu.py --mode decode --batch 1,64,256 \
    --context 4096,32768 --page 16 --repeats 10 --json
  step attention_decode_fp8.jsonl 60 python benchmarks/attention_gpu.py --mode decode --batch 1,64 \
    --context 32768 --page 16 --repeats 10 --kv-dtype fp8 --json
  step attention_prefill.jsonl 60 python benchmarks/attention_gpu.py --mode prefill --batch 1,8 \
    --context 4096,32768 --page 16 --repeats 5 --json
  if ! grep -q '"impl": "mosaic_gpu_2wg"' "$out/attention_prefill.jsonl"; then  # failed its check, or hung
    export HKV_MOSAIC_WARPGROUPS=1
    echo "# two warpgroups a program timed nothing: HKV_MOSAIC_WARPGROUPS=1 from here on" | tee "$out/fallback.txt" >&2
  fi
  step parity.jsonl 95 python benchmarks/gpu_parity.py --cases tiny-gemma3:vllm,tiny-jamba:min-waste
  step decode_profile_cold.json 80 env "$start" XLA_FLAGS="${XLA_FLAGS:-} $dump" python benchmarks/decode_profile.py \
    --config gemma-3-270m --batch 1 --context 1024 --json
  step decode_profile_warm.json 45 env "$start" python benchmarks/decode_profile.py --config gemma-3-270m --batch 1 \
    --context 1024 --calls 4 --json
  step hlo_kernels.json 30 python benchmarks/gpu_hlo.py --module "$out/hlo" --config gemma-3-270m --batch 1 \
    --context 1024 --json
  step decode_profile_graphs.json 70 env XLA_FLAGS="${XLA_FLAGS:-} $graphs" python benchmarks/decode_profile.py \
    --config gemma-3-270m --batch 1 --context 1024 --calls 6 --traced-calls 0 --json
  step host_copy.jsonl 40 python benchmarks/host_copy.py --blocks 8,64,512 --repeats 10 --json
fi
if [ -z "$smoke" ] && [ "$part" != 1 ]; then
  # f32 weights and bf16 pages: about 65 GB, more than JAX's default 75% of an H100's memory.
  step projection.json 540 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/gpu_projection.py \
    --configs llama-3.1-8b-like --devices h200 --batches 64 --contexts 4096 --programs decode_steps --measure \
    --repeats 8 --json
  step window_decode.jsonl 40 python benchmarks/attention_gpu.py --mode decode --batch 1 --context 32768 \
    --page 16 --window 512 --impls ours,mosaic_gpu,mosaic_gpu_table_splits --repeats 10 --json
fi
python benchmarks/gpu_results.py "$out" --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --into "$out/results"
