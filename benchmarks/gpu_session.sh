#!/usr/bin/env bash
# One prepared GPU run (the `device` tool's machine: jax + CUDA plugin installed, no internet).
# Checks every kernel against the reference on the GPU, then times decode and prefill, then the engine step,
# then the projected decode rows (gpu_projection.py --measure).
# Usage (repo root): bash benchmarks/gpu_session.sh [OUTDIR]   (OUTDIR defaults to $OUT or /tmp)
set -euo pipefail
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$out/gpu.txt"
python -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
python benchmarks/attention_gpu.py --mode decode --batch 1,8,64,256 --context 1024,4096,32768 \
  --page 16,64 --repeats 10 --json > "$out/attention_decode.json" 2> >(tee "$out/attention_decode.log" >&2)
python benchmarks/attention_gpu.py --mode prefill --batch 1,8 --context 4096,32768 --page 16 \
  --repeats 5 --json > "$out/attention_prefill.json" 2> >(tee "$out/attention_prefill.log" >&2)
python examples/bench_engine_gpu.py --requests 48 2>&1 | tee "$out/engine_steps.log"
# The engine step split into allocator and model share, on the GPU (the vectorised path; figures in us).
python benchmarks/engine_step.py --models full32,gemma3 --batch 64,256 --paths new --repeats 2 --json \
  > "$out/engine_step.json" 2> >(tee "$out/engine_step.log" >&2)
# The decode programs' projected rows (gpu_projection.py: bytes per step at HBM peak), served and timed here:
# measured against projected milliseconds, and the bytes per step over the measured time against the peak.
python benchmarks/gpu_projection.py --configs gemma-3-270m,llama-3.1-8b-like --devices h200 --batches 1,64 \
  --contexts 4096 --programs decode_steps --measure --json > "$out/projection.json" 2> >(tee "$out/projection.log" >&2)
