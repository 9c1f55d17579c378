#!/usr/bin/env bash
# One device call: GPU tests, then the forward variant sweep, then the user-facing benchmark.
# Usage (on the GPU machine, from the repo root): bash benchmarks/gpu_check.sh [tests|tests1|tests2|tests3|safety|sweep|sweep84|sweepbwd|probe|pixels|host|thread|fastlaunch|graphs|ab|fma|crossover|nchw84|ncu84|ncu84bwd|ncularge|native|nativepath|outliers|clsmall|blocks|savecache|models|ddp|backward|bench|bench84|cl|suite|all]...
# Logs go to $OUT (or ./out) so they come back from the device tool.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$OUT/env.txt"
steps=${*:-all}
# A Triton cache, if carried (.tcache, ignored by git; name .tcache in the call's carry):
# benchmarks/device_triton_cache.py compiles it on the CPU machine for this one's Triton (session
# 22; its --pack writes .tcache/triton_cache.tar.xz), or the step `savecache` brings one back.
# Compiles took 140-200 s of a suite or probe call.
cache_dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# Every carried archive is restored (.tcache/triton_cache*.tar.xz: one a suite or a session's kernels)
for archive in .tcache/triton_cache*.tar.xz; do
  [ -f "$archive" ] || continue
  mkdir -p "$cache_dir" && tar -xJf "$archive" -C "$cache_dir" && echo "Triton cache $archive restored: $(ls "$cache_dir" | wc -l) entries"
done
cached_entries=$(ls "$cache_dir" 2>/dev/null | wc -l)
cache_marker=$(mktemp)  # (the restored entries keep their archived times: older than this file)
# How many kernels this call compiled itself (those the carried cache lacked), and their names in
# $OUT/new_kernels.txt (session 23: 33-61 kernels a suite call, not all traced to their calls)
new_kernels() {
  echo "Triton cache: $(( $(ls "$cache_dir" 2>/dev/null | wc -l) - cached_entries )) new entries (compiled in this call)"
  find "$cache_dir" -newer "$cache_marker" -name "*.json" ! -name "__grp__*" -print0 2>/dev/null \
    | xargs -0 -r python3 -c 'import json, sys
for f in sys.argv[1:]:
    m = json.load(open(f)); print(m.get("name"), "warps", m.get("num_warps"), "shared", m.get("shared"))' \
    | sort | uniq -c > "$OUT/new_kernels.txt"
}
trap new_kernels EXIT
# 8 workers where pytest-xdist is installed (the GPU image has it, and 16 cores): the tests are compile-bound
xdist=$(python3 -c 'import xdist' 2>/dev/null && printf -- '-n 8')
# -v: each result is logged with its name as it finishes, so a call cut by its time limit still
# names its failures (session 13 lost one to -q's dots); the summary lines go to the terminal
tests_summary() { grep -E "FAILED|ERROR|passed|failed" "$1" | tail -25; }
for step in $steps; do
  case $step in
    tests|all) python3 -m pytest -v -rf $xdist tests -p no:cacheprovider \
                 >"$OUT/tests.log" 2>&1; tests_summary "$OUT/tests.log" ;;&
    # the suite takes over 10 minutes on a fresh GPU machine (every shape compiles): three calls
    # (session 13: test_forward + test_large_kernels 160 s with 8 workers; the rest over 400 s)
    tests1) python3 -m pytest -v -rf $xdist tests/test_backward.py -p no:cacheprovider >"$OUT/tests1.log" 2>&1
            tests_summary "$OUT/tests1.log" ;;
    tests2) python3 -m pytest -v -rf $xdist tests/test_forward.py tests/test_large_kernels.py -p no:cacheprovider \
              >"$OUT/tests2.log" 2>&1; tests_summary "$OUT/tests2.log" ;;
    tests3) python3 -m pytest -v -rf $xdist tests --ignore tests/test_backward.py --ignore tests/test_forward.py \
              --ignore tests/test_large_kernels.py -p no:cacheprovider >"$OUT/tests3.log" 2>&1; tests_summary "$OUT/tests3.log" ;;
    sweep|all) python3 benchmarks/sweep_forward.py --csv "$OUT/sweep.csv" 2>&1 | tee "$OUT/sweep.log" ;;&
    sweep84) python3 benchmarks/sweep_forward.py --quick --csv "$OUT/sweep.csv" 2>&1 | tee "$OUT/sweep.log" ;;
    sweepbwd) python3 benchmarks/sweep_backward.py --csv "$OUT/sweep_backward.csv" 2>&1 | tee "$OUT/sweep_backward.log" ;;
    probe) python3 benchmarks/probe_odd_out.py 2>&1 | tee "$OUT/probe.log" ;;
    # session 7's channels_last kernel with unrolled columns against the band kernel, then the real-model check (#5)
    pixels) (cd benchmarks && python3 probe_nhwc.py --pixels 4 8 64 1 --pixels 2 8 128 1 --pixels 4 8 128 2 \
               --pixels 4 4 64 1) 2>&1 | tee "$OUT/probe_nhwc.log"
            python3 -m pytest -q -rf tests/test_integration.py -k "real_models or opcheck" -p no:cacheprovider \
              >"$OUT/real_models.log" 2>&1; tail -5 "$OUT/real_models.log" ;;
    host) python3 benchmarks/host_overhead_gpu.py 2>&1 | tee "$OUT/host.log" ;;
    # where the backward on the autograd device thread loses host time (session 10)
    thread) python3 benchmarks/probe_device_thread.py 2>&1 | tee "$OUT/device_thread.log" ;;
    # session 9's launch fast path: its GPU tests, then host time without and with it
    fastlaunch) DWCONV_FAST_LAUNCH=1 python3 -m pytest -q -rf $xdist tests/test_launch.py tests/test_backward.py \
                  -k "launch or channels_last" -p no:cacheprovider >"$OUT/fastlaunch_tests.log" 2>&1
                tail -3 "$OUT/fastlaunch_tests.log"
                for fast in 0 1; do
                  DWCONV_FAST_LAUNCH=$fast python3 benchmarks/host_overhead_gpu.py 2>&1 | grep -v "^ " | tee "$OUT/host_fast$fast.log"
                  (cd benchmarks && DWCONV_FAST_LAUNCH=$fast python3 probe_fwd_bwd_host.py) 2>&1 | grep " us" \
                    | tee "$OUT/fwd_bwd_host_fast$fast.log"
                done ;;
    # the kernels' own times (each call replayed from a CUDA graph), one dtype
    graphs) python3 -m dwconv bench --suite models --dtype "${SUITE_DTYPE:-bfloat16}" --cuda-graphs \
              --csv "$OUT/suite_graphs_${SUITE_DTYPE:-bfloat16}.csv" 2>&1 | tee "$OUT/suite_graphs.log" ;;
    # A/B of trees unpacked here (carried), e.g. rm -rf .ab_old && mkdir .ab_old && git archive REV src | tar -x -C .ab_old
    # AB_TREES (default ".ab_old/src src"), AB_PROBE (a command run in benchmarks/, default the
    # channels_last forward of #84 in bfloat16): each tree's kernels compile in parallel first, then
    # the timed runs alone, twice each, alternating
    ab) trees=${AB_TREES:-.ab_old/src src}; probe=${AB_PROBE:-python3 probe_nhwc.py --layers 0 --dtype bfloat16}
        for tree in $trees; do (cd benchmarks && PYTHONPATH=../$tree timeout 300 $probe >/dev/null 2>&1) & done; wait
        for i in 1 2; do for tree in $trees; do
          echo "$tree"; (cd benchmarks && PYTHONPATH=../$tree $probe)
        done; done 2>&1 | tee -a "$OUT/ab.log" ;;
    # session 12's float32 CUDA-core large kernels against the Toeplitz products (compiles first, then timed)
    fma) (cd benchmarks && timeout 300 python3 probe_large.py --fma >/dev/null 2>&1; python3 probe_large.py --fma) 2>&1 \
           | tee "$OUT/probe_large_fma.log" ;;
    # session 13's crossover of large_fma against the default kernels by layer (one process a layer
    # compiles in parallel, then the timed run); CROSSOVER_LAYERS: indices (e.g. "18 19 20 21 22 23
    # 24", session 14's stride-2 layers), CROSSOVER_DTYPES (default all three)
    crossover) (cd benchmarks && n=$(python3 -c "from probe_fma_crossover import LAYERS; print(len(LAYERS))")
                layers=${CROSSOVER_LAYERS:-$(seq 0 $((n - 1)))}; dtypes=${CROSSOVER_DTYPES:-float32 bfloat16 float16}
                for i in $layers; do timeout 300 python3 probe_fma_crossover.py --layers $i --dtype $dtypes >/dev/null 2>&1 & done; wait
                python3 probe_fma_crossover.py --layers $layers --dtype $dtypes) 2>&1 | tee "$OUT/probe_fma_crossover.log" ;;
    # issue #2's last percents on #84: whole-row nchw_pixels tiles by height and warps, both dtypes
    nchw84) (cd benchmarks && python3 probe_nchw_pixels.py --layers 0 --dtype float32 bfloat16 --blocks 8 512 4 \
               --blocks 16 512 4 --blocks 8 512 8 --blocks 4 512 2 --blocks 16 512 8) 2>&1 | tee "$OUT/probe_nchw84.log" ;;
    # session 11's Toeplitz blocks and switches: one process a layer compiles in parallel, then the timed run
    blocks) (cd benchmarks && for i in 0 1 2 3 4 5; do timeout 400 python3 probe_large_blocks.py --runs $i >/dev/null 2>&1 & done; wait
             python3 probe_large_blocks.py) 2>&1 | tee "$OUT/probe_large_blocks.log" ;;
    # the Triton cache for the next call (files back are limited to 16 MiB each: skipped if larger)
    # ncu of #84's forward beside a copy of its input (where the last percents to the copy's rate go)
    ncu84) for d in ${NCU_DTYPES:-float32 bfloat16}; do python3 benchmarks/ncu_84.py $d --time; done 2>&1 | tee "$OUT/ncu84_times.log"
           for d in ${NCU_DTYPES:-float32 bfloat16}; do
             ncu --clock-control none --kernel-name regex:"depthwise|elementwise_kernel" --launch-count 8 --section SpeedOfLight \
               --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
               --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,smsp__inst_executed.sum \
               python3 benchmarks/ncu_84.py $d 2>&1 | tee "$OUT/ncu84_$d.log"
           done ;;
    # the same for #84's fused backward, NCHW against channels_last (session 25: 92% / 82% of copy)
    ncu84bwd) for d in ${NCU_DTYPES:-bfloat16}; do python3 benchmarks/ncu_84.py $d --backward --time; done 2>&1 | tee "$OUT/ncu84bwd_times.log"
              for d in ${NCU_DTYPES:-bfloat16}; do
                ncu --clock-control none --kernel-name regex:"depthwise|elementwise_kernel" --launch-count 12 --section SpeedOfLight \
                  --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
                  --section SchedulerStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
                  python3 benchmarks/ncu_84.py $d --backward 2>&1 | tee "$OUT/ncu84bwd_$d.log"
              done ;;
    # ncu of issue #6's k31 float32 forward and weight gradient on large_fma (never profiled so far)
    ncularge) for what in fma_forward fma_grad_weight; do
                ncu --clock-control none --kernel-name regex:large_fma --launch-skip 1 --launch-count 1 \
                  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                  --section WarpStateStats --section Occupancy --section InstructionStats --section SourceCounters \
                  python3 benchmarks/ncu_large.py k31 float32 $what 2>&1 | tee "$OUT/ncu_large_$what.log"
                # the stall reasons a cycle (an instruction-fetch stall would show as no_instruction:
                # k31's kernel-row loop is ~16 KB of sm_90 code); a separate run, so a metric name
                # this ncu lacks costs only this table
                ncu --clock-control none --kernel-name regex:large_fma --launch-skip 1 --launch-count 1 --metrics \
                  $(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard \
                    short_scoreboard no_instruction math_pipe_throttle wait not_selected selected mio_throttle \
                    lg_throttle dispatch_stall branch_resolving barrier imc_miss drain | sed 's/,$//') \
                  python3 benchmarks/ncu_large.py k31 float32 $what 2>&1 | tee "$OUT/ncu_large_stalls_$what.log"
              done ;;
    # host time of a forward launched from a C++ op (cuLaunchKernel on Triton's cubin) against dwconv's
    # Python path and cuDNN (session 18; compiles a small extension first, ~1 min)
    native) python3 benchmarks/probe_native_launch.py 2>&1 | tee "$OUT/probe_native.log" ;;
    # the C++ eager path (ops/native.py; the default since session 20, forced here): its tests and
    # the gradient tests through it, then host time against the Python Function on small layers
    # the eager path under PyTorch's other features (hooks, double backward, threads, streams, a
    # randomized differential test), then the eager host time of the tree against .ab_old's (carried)
    safety) (PYTHONPATH=.ab_old/src python3 -c 'from dwconv.ops import native; native.prepare()' >/dev/null 2>&1 &)
            timeout ${SAFETY_TESTS_S:-380} python3 -m pytest -v -rf $xdist tests/test_autograd_safety.py tests/test_differential.py \
              tests/test_native.py -p no:cacheprovider >"$OUT/safety_tests.log" 2>&1
            tests_summary "$OUT/safety_tests.log"
            for round in 1 2; do
              for tree in ${AB_TREES:-.ab_old/src src}; do
                echo "tree $tree" | tee -a "$OUT/safety_host.log"
                PYTHONPATH=$tree timeout 120 python3 benchmarks/probe_native_host.py 2>&1 | tail -2 | tee -a "$OUT/safety_host.log"
              done
            done ;;
    nativepath) DWCONV_NATIVE=1 python3 -m pytest -v -rf $xdist tests/test_native.py tests/test_backward.py \
                  -k "native or gradient_grid or gradient_dtypes or partial_requires or mixed_layouts or expanded or network or deterministic or through_autograd" \
                  -p no:cacheprovider >"$OUT/native_tests.log" 2>&1
                tests_summary "$OUT/native_tests.log"
                for layer in "64 144 56 56 --kernel 3" "64 384 14 14 --kernel 7 --dtype bfloat16" \
                             "64 960 7 7 --kernel 3 --dtype bfloat16" "32 256 28 28 --kernel 13"; do
                  python3 benchmarks/probe_native_host.py --shape $layer
                done 2>&1 | grep -v Warn | tee "$OUT/native_host.log" ;;
    # the spread of a small layer's forward+backward under the bench's protocol, each path's GPU and
    # CPU time by kernel and a Chrome trace (session 21: channels_last measured 2x NCHW, unexplained)
    # (OUTLIER_ARGS: another layer, e.g. "--shape 64 1152 7 7 --kernel 3 --dtype bfloat16")
    outliers) python3 benchmarks/probe_outliers.py ${OUTLIER_ARGS:---shape 64 384 14 14 --kernel 3 --dtype bfloat16} \
                --iters 200 --profile "$OUT/traces" 2>&1 | grep -v Warn | tee "$OUT/outliers.log" ;;
    # session 22's channels_last backward rule on the layers and dtypes it was not measured on
    # (GPU time, CUDA graphs): float32 takes 2 x 4 tiles by default, the sweep ran 4 x 4; the 7x7
    # rows run two kernels (FUSED_NHWC_TAPS = 9)
    clsmall) (cd benchmarks && for d in float32 float16; do
                timeout 280 python3 probe_nhwc_backward.py --graphs --dtype $d --shape 64 384 14 14 3 1 \
                  --shape 64 1152 7 7 3 1 --shape 64 192 28 28 3 1 --shape 64 32 112 112 3 1 \
                  --fused 4 4 32 1 32 --fused 4 4 32 1 64 --fused 2 4 32 1 64 --fused 2 4 32 1 128
              done) 2>&1 | grep -v Warn | tee "$OUT/clsmall.log" ;;
    savecache) tar -cJf "$OUT/triton_cache.tar.xz" -C "$cache_dir" . && ls -l "$OUT/triton_cache.tar.xz"
               [ "$(stat -c %s "$OUT/triton_cache.tar.xz")" -lt 16000000 ] || { echo "cache too large to bring back"; rm -f "$OUT/triton_cache.tar.xz"; } ;;
    models) python3 -m dwconv bench --model mobilenet_v2 --model efficientnet_b0 --model convnext_tiny --csv "$OUT/models.csv" 2>&1 | tee "$OUT/models.log" ;;
    ddp) torchrun --nproc_per_node=2 examples/train_ddp.py --steps 5 --check 2>&1 | tee "$OUT/ddp.log" ;;
    backward|all) python3 -m dwconv bench --suite forward --backward --csv "$OUT/bench_backward.csv" 2>&1 | tee "$OUT/bench_backward.log" ;;&
    bench|all) python3 -m dwconv bench --suite forward --csv "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log" ;;&
    # issue #4's suite, one dtype a call (each compiles its kernels): SUITE_DTYPE=float32|float16|bfloat16
    # (compiles first: each row alone in a process, 8 at a time, to fill the Triton cache; then the timed run)
    # SUITE=large: issue #6's large kernels instead of the models (files suite_large_<dtype>.*)
    suite) d=${SUITE_DTYPE:-bfloat16}; s=${SUITE:-models}; f=suite_$d; [ "$s" = models ] || f=suite_${s}_$d
           rows=$(python3 -c "from dwconv.bench import SUITES; print(sum(c.dtype == '$d' for c in SUITES['$s']))")
           start=$SECONDS; seq 0 $((rows - 1)) | timeout "${WARM_S:-300}" xargs -P 8 -I{} python3 -m dwconv bench \
             --suite "$s" --dtype "$d" --cases {} --iters 1 --warmup 1 >/dev/null 2>>"$OUT/warm.log"
           echo "suite compiles: $((SECONDS - start)) s"
           # a CSV of an earlier call, carried in .tcache: only its missing rows are timed (--resume)
           [ -f ".tcache/$f.csv" ] && cp ".tcache/$f.csv" "$OUT/$f.csv"
           python3 -m dwconv bench --suite "$s" --dtype "$d" --csv "$OUT/$f.csv" --resume \
             --plot "$OUT/$f.png" 2>&1 | tee -a "$OUT/$f.log" ;;
    cl) python3 -m dwconv bench --suite forward --channels-last --csv "$OUT/bench_cl.csv" 2>&1 | tee "$OUT/bench_cl.log"
        python3 -m dwconv bench --suite forward --channels-last --backward --csv "$OUT/bench_cl_backward.csv" 2>&1 | tee "$OUT/bench_cl_backward.log" ;;
    bench|all|bench84) python3 -m dwconv bench --dtype all --compile --csv "$OUT/bench84.csv" 2>&1 | tee "$OUT/bench84.log" ;;
  esac
done
