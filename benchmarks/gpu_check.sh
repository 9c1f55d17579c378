#!/usr/bin/env bash
# One device call's work on the GPU machine, from the repository root; logs and results go to $OUT.
#   bash benchmarks/gpu_check.sh STEP [STEP ...]
# Steps:
#   tests      the test suite on the GPU (WORKERS processes, default 16; -v so that a call cut by its time limit
#              names what passed and failed), or only the node ids listed in TESTS_FILE (one a line: the
#              rest of a run that the time limit cut)
#   bench      the models and large suites (SUITES, DTYPES) into fixed-schema CSVs (docs/data, docs/performance.md)
#   coldstart  first training steps of whole models in fresh processes, empty Triton cache (MODELS, PRECISION:
#              bench --model --cold-start only): stock, dwconv, dwconv after dwconv.warmup, a warmed second process;
#              COLDSTART_IMAGE=1: also a container image's build without the GPU and a first step from its cache
#   models     whole models' steady state, stock against converted (MODELS, PRECISION, MODEL_BATCH,
#              MODEL_COMPILE no|default|reduce-overhead|all, MODEL_EAGER yes|no: no for the compiled paths alone,
#              MODEL_ITERS steps a path, default 100: fewer for the large-kernel net, whose stock step is 0.4 s;
#              MODEL_FUSE=1: also the model converted with fuse=True; MODEL_UNFUSED=no with it: stock's and
#              the fused model's paths alone; INDUCTOR_PACK=1: Inductor's caches packed for a later call to carry)
#   profile    where whole models' steps go, stock against converted (benchmarks/model_profile.py; MODELS,
#              PRECISION, MODEL_BATCH, PROFILE_MODE train|inference, MODEL_FUSE=1: also the model converted with fuse=True)
#   overlap    a training step from an idle GPU against overlapping steps, stock and fused (benchmarks/
#              step_overlap.py; MODELS, MODEL_BATCH default 256)
#   pointwise  a model's trained 1x1 convolutions' forward and backward, cuDNN's against the matrix product
#              (benchmarks/pointwise_ab.py; MODELS, MODEL_BATCH default 256)
#   compiled   where compiled models' steps go, stock against converted (benchmarks/compiled_profile.py,
#              torch.compile default; MODELS, PROFILE_MODE train|inference, MODEL_BATCH, MODEL_FUSE=1: converted
#              with fuse=True), and Inductor's generated code for both (output_code_MODEL_MODE.txt.xz)
#   blocks     the models suite's layers as blocks (conv, BatchNorm2d, activation: BLOCK_ACTIVATIONS, DTYPES) in
#              eval mode and in a training step, stock's kernels and torch.compile of them against dwconv's
#              (bench --block, replayed from CUDA graphs: the kernels' time, not the host's; BLOCK_COMPILE=no:
#              without torch.compile's paths)
#   kernels    the depthwise block's training step kernel by kernel, stock against dwconv (benchmarks/block_kernels.py;
#              DTYPES' first, BLOCK_ACTIVATIONS' first)
#   fold       a convolution, an eval-mode BatchNorm and its activation computed each way the folding could
#              (benchmarks/fold_ab.py: stock, folded into cuDNN's convolution, a 1x1 one as a matrix product)
#   ab         bitwise A/B of .ab_old/src against src (benchmarks/ab_trees.sh)
#   host       host time per eager call, .ab_old/src against src (benchmarks/host_time.py)
#   hostcall   one eager call's host time piece by piece, stock beside dwconv (benchmarks/host_python.py --cuda)
#   hostmodel  a whole model's eager eval forward's host time, stock and fused, each fused block op's call and
#              the fused forward's Python by function (benchmarks/host_model.py --cuda --block-ops; MODELS, MODEL_BATCH;
#              HOST_TRAIN=1: a training step's instead, at MODEL_BATCH 16 unless set, without the block ops)
#   tuning     AB_ARGS passed to benchmarks/ab_tuning.py (an A/B of tuning-table overrides)
#   sweep      the forward and backward block sweeps (benchmarks/sweep_forward.py, sweep_backward.py)
#   sweepblocks a fused model's largest depthwise blocks (eval, input BatchNorm and activations) on other
#              channels_last tiles beside the dispatcher's (benchmarks/sweep_blocks.py; MODELS, MODEL_BATCH)
#   ncu        Nsight Compute counters of KernelBench 84's forward beside a copy (benchmarks/ncu.py)
# A Triton cache compiled on the CPU machine (benchmarks/device_triton_cache.py --pack) is restored
# from .tcache/ when the call carries it: compiles otherwise take minutes of a fresh machine.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
cache_dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
for archive in .tcache/triton_cache*.tar.xz; do
  [ -f "$archive" ] && mkdir -p "$cache_dir" && tar -xJf "$archive" -C "$cache_dir"
done
# (result files named in letters, digits, '.', '_' and '-' only: files of other names are not fetched back)
commit=$(printf %s "${DWCONV_COMMIT:-unknown}" | tr -c 'A-Za-z0-9._-' '-')
# (a run under tuning changes names them in its files: DWCONV_TUNING=fast_launch=False -> ..._fast_launch-False.csv)
[ -n "${DWCONV_TUNING:-}" ] && commit="${commit}_$(printf %s "$DWCONV_TUNING" | tr -c 'A-Za-z0-9._-' '-')"
xdist=$(python3 -c 'import xdist' 2>/dev/null && printf -- '-n %s' "${WORKERS:-16}")
tests=(tests); [ -n "${TESTS_FILE:-}" ] && mapfile -t tests <"$TESTS_FILE"
for step in "$@"; do
  case $step in
    tests) timeout "${TESTS_S:-540}" python3 -m pytest -v -rf --durations=30 $xdist -p no:cacheprovider "${tests[@]}" \
             >"$OUT/tests.log" 2>&1
           grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -25 ;;
    bench) for suite in ${SUITES:-models large}; do
             for dtype in ${DTYPES:-float32 bfloat16 float16}; do
               iters=100; [ "$suite" = large ] && iters=40
               python3 -m dwconv bench --suite "$suite" --dtype "$dtype" --iters $iters \
                 --csv "$OUT/${suite}_${dtype}_$(date +%F)_$commit.csv" 2>&1 | tail -40
             done
           done ;;
    blocks) for activation in ${BLOCK_ACTIVATIONS:-relu6 silu hardswish}; do
             for dtype in ${DTYPES:-bfloat16 float32}; do
               compile=(--compile); [ "${BLOCK_COMPILE:-yes}" = no ] && compile=()
               python3 -m dwconv bench --suite models --dtype "$dtype" --block "$activation" ${compile[@]+"${compile[@]}"} --iters 100 --cuda-graphs \
                 --csv "$OUT/blocks_${activation}_${dtype}_$(date +%F)_$commit.csv" 2>&1 | tail -30
             done
           done ;;
    kernels) dtypes=(${DTYPES:-bfloat16}); activations=(${BLOCK_ACTIVATIONS:-relu6})
             python3 benchmarks/block_kernels.py --dtype "${dtypes[0]}" --activation "${activations[0]}" \
               --out "$OUT/block_kernels_${dtypes[0]}_$(date +%F)_$commit.txt" 2>&1 | grep -v -i warn ;;
    fold)  python3 benchmarks/fold_ab.py --out "$OUT/fold_ab_$(date +%F)_$commit.txt" 2>&1 | grep -v -i warn ;;
    coldstart|models)
           mode=only; [ "$step" = models ] && mode=no
           image=(); [ "$step" = coldstart ] && [ -n "${COLDSTART_IMAGE:-}" ] && image=(--cold-start-image)
           for model in ${MODELS:-mobilenet_v2}; do
             # (steady state only: Inductor's caches restored from .tcache/inductor_MODEL_BATCH.tar.xz where a
             # call carries one, and packed into $OUT with INDUCTOR_PACK=1 for the next call to carry)
             inductor=(); archive=.tcache/inductor_${model}_${MODEL_BATCH:-64}.tar.xz
             if [ "$step" = models ]; then
               inductor=(env TORCHINDUCTOR_CACHE_DIR="/tmp/inductor_$model")
               [ -f "$archive" ] && mkdir -p "/tmp/inductor_$model" && tar -xJf "$archive" -C "/tmp/inductor_$model"
             fi
             ${inductor[@]+"${inductor[@]}"} python3 -m dwconv bench --model "$model" \
               --model-precision "${PRECISION:-bf16}" --cold-start $mode \
               --model-batch "${MODEL_BATCH:-64}" --model-compile "${MODEL_COMPILE:-default}" \
               --model-eager "${MODEL_EAGER:-yes}" --model-unfused "${MODEL_UNFUSED:-yes}" \
               --iters "${MODEL_ITERS:-100}" ${image[@]+"${image[@]}"} \
               ${MODEL_FUSE:+--fuse} --csv "$OUT/${step}_${model}_$(date +%F)_$commit.csv" 2>&1
             if [ "$step" = models ] && [ -n "${INDUCTOR_PACK:-}" ]; then
               tar -cJf "$OUT/${archive#.tcache/}" -C "/tmp/inductor_$model" . && ls -la "$OUT/${archive#.tcache/}"
             fi
           done ;;
    profile) for model in ${MODELS:-mobilenet_v2}; do
               python3 benchmarks/model_profile.py --model "$model" --precision "${PRECISION:-bf16}" \
                 --batch "${MODEL_BATCH:-64}" --mode "${PROFILE_MODE:-train}" ${MODEL_FUSE:+--fuse} --out "$OUT" 2>&1
             done ;;
    overlap) for model in ${MODELS:-mobilenet_v2}; do
               python3 benchmarks/step_overlap.py --model "$model" --batch "${MODEL_BATCH:-256}" \
                 --csv "$OUT/model_overlap_bf16_$(date +%F)_${commit}_${model}_b${MODEL_BATCH:-256}.csv" 2>&1 \
                 | grep -v -i warn | tee "$OUT/step_overlap_${model}_$(date +%F)_$commit.txt"
             done ;;
    pointwise) for model in ${MODELS:-mobilenet_v2}; do
                 python3 benchmarks/pointwise_ab.py --model "$model" --batch "${MODEL_BATCH:-256}" 2>&1 | grep -v -i warn \
                   | tee "$OUT/pointwise_ab_${model}_$(date +%F)_$commit.txt"
               done ;;
    compiled) for model in ${MODELS:-mobilenet_v2}; do
                mode=${PROFILE_MODE:-inference}; train=(); [ "$mode" = train ] && train=(--train)
                TORCH_LOGS=output_code python3 benchmarks/compiled_profile.py --model "$model" \
                  --batch "${MODEL_BATCH:-64}" ${train[@]+"${train[@]}"} ${MODEL_FUSE:+--fuse} \
                  >"$OUT/compiled_profile_${model}_${mode}.txt" 2>"$OUT/output_code_${model}_${mode}.txt"
                xz -f "$OUT/output_code_${model}_${mode}.txt"
                grep -E "^===|Self CUDA time total" "$OUT/compiled_profile_${model}_${mode}.txt"
              done ;;
    ab) bash benchmarks/ab_trees.sh ;;
    host) python3 benchmarks/host_time.py .ab_old/src src | tee "$OUT/host_time.txt" ;;
    hostcall) python3 benchmarks/host_python.py --cuda 2>&1 | grep -v -i warn | tee "$OUT/host_python_$(date +%F)_$commit.txt" ;;
    hostmodel) for model in ${MODELS:-mobilenet_v2}; do
                 train=(--block-ops --batch "${MODEL_BATCH:-256}"); mode=eval
                 [ -n "${HOST_TRAIN:-}" ] && train=(--train --batch "${MODEL_BATCH:-16}") && mode=train
                 python3 benchmarks/host_model.py --cuda --model "$model" "${train[@]}" \
                   --rows 40 2>&1 | grep -v -i warn >"$OUT/host_model_${model}_${mode}_$(date +%F)_$commit.txt"
                 grep -E "host time" -A12 "$OUT/host_model_${model}_${mode}_$(date +%F)_$commit.txt" | head -20
               done ;;
    tuning) python3 benchmarks/ab_tuning.py ${AB_ARGS:-} | tee "$OUT/ab_tuning.txt" ;;
    sweepblocks) for model in ${MODELS:-mobilenet_v2}; do
                   python3 benchmarks/sweep_blocks.py --model "$model" --batch "${MODEL_BATCH:-256}" \
                     --csv "$OUT/sweep_blocks_${model}_$(date +%F)_$commit.csv" 2>&1 | grep -v -i warn
                 done ;;
    sweep) python3 benchmarks/sweep_forward.py --csv "$OUT/sweep_forward.csv" 2>&1 | tee "$OUT/sweep_forward.log"
           python3 benchmarks/sweep_backward.py --csv "$OUT/sweep_backward.csv" 2>&1 | tee "$OUT/sweep_backward.log" ;;
    ncu) for dtype in ${NCU_DTYPES:-float32 bfloat16}; do
           ncu --clock-control none --kernel-name regex:"depthwise|elementwise_kernel" --launch-count 8 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis python3 benchmarks/ncu.py "$dtype" \
             2>&1 | tee "$OUT/ncu_$dtype.log"
         done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
