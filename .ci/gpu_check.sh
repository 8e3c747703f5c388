#!/usr/bin/env bash
# The one script a session runs when the device tool lends it a GPU (issues 56 and 57), 7 minutes at most on an
# H200 (2026-11-30: 415 s in all, 188 s of it the tests, before the kernel tables and four engine runs were added;
# the parts' limits add up to more than the script's budget, so the least needed parts come last):
# tests/test_cuda.py, python -m toolkit.bench.gpu on Llama-3.2-1B's shape with the invariant mode and async scheduling
# beside, the invariant matmul's candidate tilings and weight orders (alone and in the engine), the host's share of a
# step on its CPU alone (toolkit.bench.host_step), then the benchmark on Qwen3-0.6B's and SmolLM2's shapes: what a
# run cut short loses. Every output under $OUT (at most 8 files). The GPU machine reaches no package index: prepare
# .gpu/ here first, then pass it as `carry`:
#
#   bash .ci/gpu_check.sh prepare                  # on this machine: the wheels and SmolLM2's tokenizer into .gpu/
#   bash .ci/gpu_check.sh                          # on the GPU machine (device tool: run, carry [".gpu"])
#   GPU_CHECK_SECONDS=200 bash .ci/gpu_check.sh    # a rerun in what the device's 15 minutes leave
#
# Each part has its own time limit, so one that hangs leaves the others their time, and the script as a whole has
# GPU_CHECK_SECONDS (420 unless set): a part gets what is left of them at most, and one that would start with under
# 20 s left is skipped, named, so the device's 15 minutes keep room for a rerun (GPU_CHECK_SECONDS=200 for a short
# one). The exit status is the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  bash ../shared/gpu/prepare.sh >/dev/null
  # a tiny model of vocabulary 49152 reads SmolLM2's tokenizer from TOOLKIT_CACHE (the weights stay here: 98 MB)
  src=$(.venv/bin/python -c 'from toolkit.models.loading import smollm2_dir; print(smollm2_dir())')
  dst=.gpu/tkc/smollm2-135m-instruct-q4_1
  mkdir -p "$dst" && cp "$src"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$dst"/
  : >"$dst"/model.safetensors
  du -sh .gpu
  exit 0
fi
OUT=${OUT:-/tmp/gpu_out}
BUDGET=${GPU_CHECK_SECONDS:-420}
part() {  # part LIMIT COMMAND...: COMMAND under timeout, LIMIT seconds or what is left of the budget, if 20 s are
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then echo "skipped (the script's ${BUDGET} s are spent): ${*:2}"; return 124; fi
  timeout "$(( $1 < left ? $1 : left ))" "${@:2}"
}
mkdir -p "$OUT"
rm -f /tmp/kernels_llama1b.json /tmp/kernels_smollm2.json  # a warm machine's from an earlier call: never read again
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  || { echo "the .gpu wheels did not install: run 'bash .ci/gpu_check.sh prepare' before carrying .gpu"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TOOLKIT_CACHE=$PWD/.gpu/tkc PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  2>&1 | tee "$OUT/device.txt"
part 240 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
status=${PIPESTATUS[0]}
# issue 56's unmet goal (the busy share at batch 32 on Llama-3.2-1B's shape) and 57's cost there, first
part 80 python3 -m toolkit.bench.gpu --shape llama1b --dtypes bfloat16 --batches 1 32 --batch-invariant --async-scheduling \
  --json "$OUT/bench_llama1b.json" --host-profile "$OUT/host_profile.txt" 2>&1 | tee "$OUT/bench.txt"
# issue 57's cost: every decode product's kernel alone (CUDA events), in the engine's (K, N) weights and stored
# (N, K), each followed by the tilings whose bits are not the own tiling's; then in the engine, beside the default,
# each product in its fastest tiling there (--dot-blocks-from), a longer K slice four stages deep, and the own tiling
# over weights stored (N, K). The best goes into gpu_matmul.DOT_BLOCKS(_BY_SHAPE) (and a faster (N, K) into how a GPU
# model keeps its weights); then fp32's the same way on SmolLM2's shape
part 100 python3 -m toolkit.bench.gpu --shape llama1b --dtypes bfloat16 --batches 1 32 --kernels \
  --json /tmp/kernels_llama1b.json 2>&1 | tee "$OUT/tilings.txt"
for tiling in "--dot-blocks-from /tmp/kernels_llama1b.json" "--dot-blocks 64,16,256,4" "--dot-blocks 64,16,64 --weights-nk"; do
  part 35 python3 -m toolkit.bench.gpu --shape llama1b --dtypes bfloat16 --batches 1 32 --batch-invariant \
    --hf-tokens 0 $tiling 2>&1 | tee -a "$OUT/tilings.txt"
done
part 60 python3 -m toolkit.bench.gpu --shape smollm2 --dtypes float32 --batches 1 32 --kernels \
  --json /tmp/kernels_smollm2.json 2>&1 | tee -a "$OUT/tilings.txt"
part 35 python3 -m toolkit.bench.gpu --shape smollm2 --dtypes float32 --batches 1 32 --batch-invariant \
  --hf-tokens 0 --dot-blocks-from /tmp/kernels_smollm2.json 2>&1 | tee -a "$OUT/tilings.txt"
# the host code a GPU's steps run, timed on this machine's CPU alone (issue 56: the H200's host was slower than the
# CPUs where it is cut); the native CPU kernels off, so nothing compiles
{ grep -m1 'model name' /proc/cpuinfo; TOOLKIT_NATIVE=0 part 30 python3 -m toolkit.bench.host_step --batches 32 \
  --repeats 3 --route device; } 2>&1 | tee "$OUT/host_step.txt"
# Qwen3-0.6B's shape (HF's random init of its config: q/k norms, heads of 128), never timed on a GPU before
part 80 python3 -m toolkit.bench.gpu --shape qwen3-0.6b --dtypes bfloat16 --batches 1 32 --batch-invariant \
  --async-scheduling 2>&1 | tee -a "$OUT/bench.txt"
# last, as what a run cut short by the device's limit (600 s) loses: SmolLM2's shape, whose goals were met before
part 100 python3 -m toolkit.bench.gpu --shape smollm2 --batches 1 32 --batch-invariant --async-scheduling \
  --json "$OUT/bench_smollm2.json" --host-profile "$OUT/host_profile.txt" 2>&1 | tee -a "$OUT/bench.txt"
echo "tests/test_cuda.py exited $status"
exit "$status"
