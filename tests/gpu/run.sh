#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark on a CUDA machine that has no kvpool install:
# installs the carried wheels into /tmp/site, builds an import tree for kvpool from this
# checkout, then writes logs and results under $OUT (default ./gpu-out).
#   tests/gpu/run.sh [env|tests|bench|all|pd|pd+bench|tests+pd|tp|probe] [extra bench args...]
# (pd: the two-GPU tests and bench/pd_handoff.py; pd+bench also runs bench/gpu_transfer.py;
#  tests+pd: every GPU test, then bench/pd_handoff.py; PD_ARGS: extra pd_handoff.py args;
#  policy: bench/store_policy.py --replay (eager vs lazy bytes per step); tests+policy: both;
#  tp: the cross-TP GPU tests, then bench/pd_handoff.py --mode cross;
#  probe: bench/investigations/gemm_probe.py, also run last by all; PROBE_ARGS: its extra args;
#  breakdown: bench/investigations/gemm_breakdown.py; BREAKDOWN_ARGS: its extra args;
#  scale: the many-GPU tests, then bench/host_scale.py on every GPU (one GPU: 1, 2 and 4
#  engines sharing it); SCALE_ARGS replaces its default arguments, extra args are appended;
#  diag: the host's NUMA and page facts, bench/investigations/copy_path.py (PROBE_ARGS), then
#  bench/gpu_transfer.py --reps 3 with py-spy sampling the daemon (extra args appended);
#  diag+tests: diag, then every GPU test; TRANSFER_RUNS: gpu_transfer runs in diag (default 1);
#  confirm: bench/gpu_transfer.py --reps 3 TRANSFER_RUNS times (default 3; TRANSFER_ARGS), then
#  bench/host_scale.py on every GPU (SCALE_ARGS), then the GPU tests in what is left of
#  CONFIRM_BUDGET_S (default 560 s); the daemons' event-loop gap lines are collected in gaps.log;
#  SCALE_PYSPY=1 samples host_scale's daemon with py-spy;
#  firsttouch: bench/investigations/first_touch.py (FT_ARGS): the first DMA into registered
#  pages against the next;
#  profile: where a big job's fixed cost goes: bench/investigations/launch_cost.py,
#  transport_floor.py back to back and after 40 ms idle, big_job_profile.py per layout without
#  and with py-spy (PROFILE_REPS, default 20);
#  ab-scale: bench/host_scale.py with the daemon and client of this tree and of $OLD's,
#  alternating (AB_KINDS, SCALE_ARGS; AB_NEW_ENV: VAR=value words for this tree's runs only;
#  with AB_NEW_ENV and no OLD, "old" is this tree without them: a setting against its
#  default; results in $OUT/ab-scale.log and ab-scale.tgz, which bench/ab_scale_json.py
#  turns into one results JSON);
#  ab-tp: bench/pd_handoff.py --mode cross, this tree's against $OLD's (each tree's own
#  script), alternating as ab-scale's (PD_ARGS; $OUT/ab-tp.log and ab-tp.tgz): two GPUs, or
#  one with every worker on it (an old tree's script is given that mapping: one_gpu_cross);
#  tp-trees: bench/pd_handoff.py --mode cross under each tree of TREES in turn (PD_ARGS): a
#  bisection of a hand-off's change, one call;
#  ab: the daemon and client of this tree against those of the tree at $OLD (a path: e.g. a
#  `git archive OLD_COMMIT | tar -x -C .old`), the same bench scripts: gpu_transfer --reps 3
#  new, old, new (AB_KINDS; "qos": the new tree with the CPUs held out of deep idle states by
#  bench/investigations/hold_cpu_latency.py), then big_job_profile new and old (AB_BJP, AB_REPS,
#  default 20); AB_FLOOR=1 adds transport_floor after 40 ms idle without and with that hold)
set -uo pipefail
what=${1:-all}; shift || true
ROOT=$PWD
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
WHL=${WHL:-$PWD/../../.whl}
[ -d "$WHL" ] || WHL=$PWD/.whl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl || exit 1
fi
rm -rf /tmp/pp && mkdir -p /tmp/pp/kvpool && cp kvpool/__init__.py /tmp/pp/kvpool/
for d in shared daemon client; do ln -s "$PWD/$d" /tmp/pp/kvpool/$d; done
export PYTHONPATH=/tmp/pp:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
# the compiled index probe and writer, as pip install builds them (else numpy reads the index
# and the daemon writes it in Python)
if command -v cc >/dev/null && python3 setup.py -q build_ext --inplace >/dev/null 2>&1; then
  rm -rf build
else
  echo "run.sh: the C extensions (setup.py) not built: the index is read with numpy, written in Python, the pool's records with numpy"
fi
# the benchmark's pools need room in /dev/shm (container defaults are often 64 MiB)
shm_kb=$(df -k --output=size /dev/shm | tail -1)
if [ "$shm_kb" -lt $((32 * 1024 * 1024)) ]; then mount -o remount,size=48G /dev/shm 2>/dev/null || true; fi

case "$what" in env|all|tests+policy|pd|pd+bench|tests+pd|tp|scale|diag|diag+tests|confirm) show_env=1;; *) show_env=0;; esac
if [ "$show_env" = 1 ]; then
  { nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    nvidia-smi topo -m 2>/dev/null | head -5
    df -h /dev/shm; ulimit -l; nproc; free -g | head -2
    (cd /tmp && python3 -c "import torch, triton, numpy, zmq, msgspec, posix_ipc; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
     python3 -c "from kvpool.daemon import cuda; d=cuda.driver(); print('driver', d.version, 'batch', cuda.has_memcpy_batch(), [cuda.device_uuid(i) for i in range(cuda.device_count())])")
    # NUMA: nodes, their CPUs and each NVIDIA function's node (bench/host_scale.py records it too)
    for n in /sys/devices/system/node/node[0-9]*; do echo "$(basename $n) cpus $(cat $n/cpulist)"; done
    for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor 2>/dev/null)" = 0x10de ] && echo "gpu $(basename $d) numa_node $(cat $d/numa_node)"; done
    echo "thp $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) shmem $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
    command -v py-spy nsys numactl 2>/dev/null
  } 2>&1 | tee "$OUT/env.txt"
fi
rc=0
# run from a copy inside /tmp/pp, the import tree built above: pytest puts the rootdir first on
# sys.path, and benchmarks run as modules (python3 -m bench.NAME) from it
cp -r tests bench pyproject.toml /tmp/pp/
REPO=/tmp/pp; cd /tmp
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = tests+pd ] || [ "$what" = tests+policy ]; then
  timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider -q -rs --timeout 180 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/daemon/test_copy_plan.py" "$REPO/tests/gpu" 2>&1 | tee "$OUT/tests.log" || rc=1
fi
if [ "$what" = pd ] || [ "$what" = pd+bench ]; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -q -rs --timeout 180 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/gpu/test_multi_gpu.py" \
    "$REPO/tests/gpu/test_cuda_engine.py::test_tp2_two_gpus_one_slot" 2>&1 | tee "$OUT/tests-pd.log" || rc=1
fi
if [ "$what" = pd ] || [ "$what" = pd+bench ] || [ "$what" = tests+pd ]; then
  timeout ${PD_TIMEOUT:-240} python3 -m bench.pd_handoff --out "$OUT" ${PD_ARGS:-} 2>&1 | tee "$OUT/pd.log" || rc=1
fi
if [ "$what" = tp ]; then
  timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider -q -rs --timeout 180 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/daemon/test_copy_plan.py" "$REPO/tests/gpu" \
    -k "tp_cross or tp2 or pitched or round_trip" 2>&1 | tee "$OUT/tests-tp.log" || rc=1
  timeout ${PD_TIMEOUT:-480} python3 -m bench.pd_handoff --mode cross --out "$OUT" ${PD_ARGS:-} 2>&1 | tee "$OUT/pd-tp.log" || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = pd+bench ]; then
  timeout ${BENCH_TIMEOUT:-480} python3 -m bench.gpu_transfer --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [ "$what" = policy ] || [ "$what" = tests+policy ]; then
  timeout ${POLICY_TIMEOUT:-300} python3 -m bench.store_policy --replay --out "$OUT" 2>&1 | tee "$OUT/policy.log" || rc=1
fi
if [ "$what" = probe ] || [ "$what" = all ]; then
  timeout ${PROBE_TIMEOUT:-240} python3 -m bench.investigations.gemm_probe --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" || rc=1
fi
if [ "$what" = breakdown ]; then
  timeout ${BREAKDOWN_TIMEOUT:-300} python3 -m bench.investigations.gemm_breakdown --out "$OUT" ${BREAKDOWN_ARGS:-} 2>&1 | tee "$OUT/breakdown.log" || rc=1
fi
if [ "$what" = scale ]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs --timeout 180 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/daemon/test_cuda.py" "$REPO/tests/gpu/test_many_gpus.py" \
    "$REPO/tests/gpu/test_multi_gpu.py" 2>&1 | tee "$OUT/tests-scale.log" || rc=1
  gpus=$(python3 -c "from kvpool.daemon import cuda; print(cuda.device_count())")
  # one GPU: engines share it (the daemon's one lane pair per GPU, N engines' jobs on it)
  default=""; [ "${gpus:-0}" -le 1 ] && default="--engines 1,2,4 --gpus 1 --seconds 2"
  timeout ${SCALE_TIMEOUT:-480} python3 -m bench.host_scale --out "$OUT" --tmp /tmp/kvpool-scale \
    ${SCALE_ARGS:-$default} "$@" 2>&1 | tee "$OUT/scale.log" || rc=1
fi
if [ "$what" = diag ] || [ "$what" = diag+tests ]; then
  timeout ${PROBE_TIMEOUT:-150} python3 -m bench.investigations.copy_path --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" || rc=1
  for k in $(seq 1 ${TRANSFER_RUNS:-1}); do
    KVPOOL_BENCH_PYSPY="$OUT/pyspy-run$k" timeout ${BENCH_TIMEOUT:-200} python3 -m bench.gpu_transfer --out "$OUT/run$k" --reps 3 "$@" 2>&1 | tee "$OUT/bench-run$k.log" || rc=1
  done
fi
if [ "$what" = confirm ]; then
  t_start=$SECONDS
  for k in $(seq 1 ${TRANSFER_RUNS:-3}); do
    timeout ${BENCH_TIMEOUT:-150} python3 -m bench.gpu_transfer --out "$OUT/run$k" --tmp /tmp/kvpool-bench-$k \
      --reps 3 ${TRANSFER_ARGS:-} 2>&1 | tee "$OUT/bench-run$k.log" | grep -v "^\[daemon\]" || rc=1
    grep -h "event-loop gap\|did not run" /tmp/kvpool-bench-$k/kvpoold.log >> "$OUT/gaps.log" 2>/dev/null
  done
  # SCALE_PYSPY=1: py-spy samples host_scale's daemon (not gpu_transfer's, whose ratios it
  # would touch) into $OUT/pyspy-scale*.txt
  ${SCALE_PYSPY:+env KVPOOL_BENCH_PYSPY=$OUT/pyspy-scale} timeout ${SCALE_TIMEOUT:-200} \
    python3 -m bench.host_scale --out "$OUT" --tmp /tmp/kvpool-scale \
    ${SCALE_ARGS:-} 2>&1 | tee "$OUT/scale.log" || rc=1
  grep -h "event-loop gap\|did not run\|numa placement" /tmp/kvpool-scale/kvpoold.log >> "$OUT/gaps.log" 2>/dev/null
  left=$(( ${CONFIRM_BUDGET_S:-560} - (SECONDS - t_start) ))
  if [ "$left" -gt 30 ]; then
    timeout $left python3 -m pytest -p no:cacheprovider -q -rs --timeout 120 -x \
      -c "$REPO/pyproject.toml" --rootdir "$REPO" ${CONFIRM_TESTS:-"$REPO/tests/gpu"} 2>&1 | tail -40 > "$OUT/tests.log" || rc=1
  fi
fi
# import_tree SRC DEST BENCH: an import tree for kvpool at DEST from the tree at SRC (its C
# extensions built where it has them), with BENCH's bench scripts and tests (BENCH: SRC for a
# tree's own, whose GPU workers speak its client's API)
import_tree() {
  local src=$1 dest=$2 bench=$3 d
  rm -rf "$dest" && mkdir -p "$dest/kvpool" && cp "$src/kvpool/__init__.py" "$dest/kvpool/"
  for d in shared daemon client; do ln -s "$src/$d" "$dest/kvpool/$d"; done
  if [ -f "$src/setup.py" ]; then
    (cd "$src" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1 && rm -rf build) \
      || echo "run.sh: $src's C extensions not built"
  fi
  cp -r "$bench/bench" "$bench/tests" "$dest/"; cp "$REPO/pyproject.toml" "$dest/"
  one_gpu_cross "$dest/bench/pd_handoff.py"
}
# one_gpu_cross FILE: a pd_handoff.py from before b74cae0 exits on one GPU; its --mode cross
# gets this tree's mapping (worker i on GPU i mod the GPUs), so an A/B or a bisection of the
# TP hand-off runs where one GPU is lent (the copy in the import tree; the old tree unchanged)
one_gpu_cross() {
  [ -f "$1" ] && ! grep -q "args.gpus" "$1" || return 0
  python3 - "$1" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
for old, new in [
        ("(lambda i: i)\n", "(lambda i: i % args.gpus)\n"),
        ('    elif torch.cuda.device_count() < 2:\n'
         '        raise SystemExit("pd_handoff needs two GPUs")',
         '    args.gpus = torch.cuda.device_count()\n'
         '    if not args.dry_run_cpu and args.gpus < (1 if args.mode == "cross" else 2):\n'
         '        raise SystemExit("pd_handoff needs two GPUs (--mode cross one)")'),
        ("one_way_s(1, nbytes", "one_way_s(1 % args.gpus, nbytes")]:
    if text.count(old) != 1:
        sys.exit(f"run.sh: {path} is not as one_gpu_cross expects; left as it is")
    text = text.replace(old, new)
open(path, "w").write(text)
EOF
}
if [ "$what" = ab-scale ] && [ -z "${OLD:-}" ]; then
  # no old tree: this tree's runs with AB_NEW_ENV against its runs without
  [ -n "${AB_NEW_ENV:-}" ] || { echo "run.sh ab-scale: OLD or AB_NEW_ENV must be set"; exit 2; }
  rm -rf /tmp/ppo && ln -s /tmp/pp /tmp/ppo
elif [ "$what" = ab ] || [ "$what" = ab-scale ] || [ "$what" = ab-tp ]; then
  # the old tree's import tree at /tmp/ppo: this tree's bench scripts, but ab-tp's
  old=$(cd "$ROOT" && cd "${OLD:-/nonexistent}" 2>/dev/null && pwd) \
    || { echo "run.sh $what: OLD must name an old tree"; exit 2; }
  bench=$REPO; [ "$what" = ab-tp ] && bench=$old
  import_tree "$old" /tmp/ppo "$bench"
fi
# run_in PP LABEL RUN NAME PATTERN SECONDS ENVS CMD...: CMD (a bench module's arguments, @RUN@
# for RUN, its output directory) with the import tree at PP and the VAR=value words ENVS, for
# SECONDS at most: its whole output in RUN/output.log (a run that fails says why), the lines
# matching PATTERN, after LABEL, in $OUT/NAME.log
run_in() {
  local pp=$1 label=$2 run=$3 name=$4 pattern=$5 limit=$6 envs=$7; shift 7
  mkdir -p $run
  (cd $pp && env $envs PYTHONPATH=$pp:/tmp/site timeout $limit python3 -m "${@//@RUN@/$run}" \
    2>&1 | tee $run/output.log | grep "$pattern" | sed "s/^/$label /" | tee -a "$OUT/$name.log") \
    || rc=1
}
# alternate NAME PATTERN SECONDS CMD...: run_in with this tree's daemon and client and the old
# tree's, in AB_KINDS order (default "new old new old"; AB_NEW_ENV's variables for this tree's
# runs); every run's files in one $OUT/NAME.tgz (a device call brings back 8 files at most)
alternate() {
  local name=$1 pattern=$2 limit=$3 k pp envs; shift 3
  rm -rf /tmp/$name     # (a warm machine keeps the last call's runs)
  for k in ${AB_KINDS:-new old new old}; do
    pp=/tmp/pp; [ $k = old ] && pp=/tmp/ppo
    envs=""; [ $k = new ] && envs="${AB_NEW_ENV:-}"
    run_in $pp $k /tmp/$name/$k-$SECONDS $name "$pattern" $limit "$envs" "$@"
  done
  tar czf "$OUT/$name.tgz" -C /tmp/$name --exclude "*.png" . || rc=1
}
if [ "$what" = ab-scale ]; then
  alternate ab-scale "block_outer:\|per_layer:\|summary" ${SCALE_TIMEOUT:-150} \
    bench.host_scale --out @RUN@ --tmp /tmp/kvpool-ab-scale \
    ${SCALE_ARGS:---engines 2 --gpus 1 --layouts block_outer}
fi
if [ "$what" = ab-tp ]; then
  # TP=2 -> TP=1 against TP=1 -> TP=1 and TP=2 -> TP=2, two GPUs
  alternate ab-tp "^\[tp\]\|summary" ${PD_TIMEOUT:-200} \
    bench.pd_handoff --mode cross --out @RUN@ --tmp /tmp/kvpool-ab-tp ${PD_ARGS:-}
fi
if [ "$what" = tp-trees ]; then
  # bench/pd_handoff.py --mode cross under each tree of TREES (paths, in order; each its own
  # bench scripts), to find the commit that changed a hand-off: $OUT/tp-trees.log, one
  # directory per run (its whole output, its JSON) in tp-trees.tgz
  n=0; rm -rf /tmp/tp-trees
  for t in ${TREES:?TREES must name trees}; do
    n=$((n + 1)); src=$(cd "$ROOT" && cd "$t" && pwd) || { rc=1; continue; }
    import_tree "$src" /tmp/ppt "$src"
    run_in /tmp/ppt "$(basename "$src")" /tmp/tp-trees/$n-$(basename "$src") tp-trees \
      "^\[tp\]\|summary" ${PD_TIMEOUT:-100} "" \
      bench.pd_handoff --mode cross --out @RUN@ --tmp /tmp/kvpool-tp-trees ${PD_ARGS:-}
  done
  tar czf "$OUT/tp-trees.tgz" -C /tmp/tp-trees . || rc=1
fi
if [ "$what" = ab ]; then
  for k in ${AB_KINDS:-new old new}; do
    pp=/tmp/pp; [ $k = old ] && pp=/tmp/ppo
    holder=""
    if [ $k = qos ]; then
      python3 -m bench.investigations.hold_cpu_latency --us 0 | tee -a "$OUT/ab.log" &
      holder=$!
    fi
    (cd $pp && PYTHONPATH=$pp:/tmp/site timeout ${BENCH_TIMEOUT:-170} python3 -m bench.gpu_transfer \
      --out "$OUT/ab-$k-$SECONDS" --tmp /tmp/kvpool-ab-$k --reps 3 2>&1 | grep "^\[summary\]" \
      | sed "s/^/$k /" | tee -a "$OUT/ab.log") || rc=1
    [ -n "$holder" ] && { pkill -f hold_cpu_latency; wait $holder; }
  done
  if [ -n "${AB_FLOOR:-}" ]; then
    # the transport's round trip after 40 ms idle, without and with the CPUs kept out of deep
    # idle states: how much of a job's fixed cost is waking threads
    timeout 100 python3 -m bench.investigations.transport_floor --reps 100 --idle-ms 40 \
      --out "$OUT/floor-plain" 2>&1 | grep round | sed "s/^/plain /" | tee -a "$OUT/ab.log"
    python3 -m bench.investigations.hold_cpu_latency --us 0 | tee -a "$OUT/ab.log" &
    timeout 100 python3 -m bench.investigations.transport_floor --reps 100 --idle-ms 40 \
      --out "$OUT/floor-qos" 2>&1 | grep round | sed "s/^/qos /" | tee -a "$OUT/ab.log"
    pkill -f hold_cpu_latency; wait
  fi
  for k in ${AB_BJP-new old}; do
    pp=/tmp/pp; [ $k = old ] && pp=/tmp/ppo
    (cd $pp && PYTHONPATH=$pp:/tmp/site timeout 200 python3 -m bench.investigations.big_job_profile \
      --out "$OUT/bjp-$k" --reps ${AB_REPS:-20} > "$OUT/bjp-$k.log" 2>&1) || rc=1
  done
fi
if [ "$what" = firsttouch ]; then
  timeout ${FT_TIMEOUT:-200} python3 -m bench.investigations.first_touch --out "$OUT" ${FT_ARGS:-} 2>&1 | tee "$OUT/first-touch.log" || rc=1
fi
if [ "$what" = profile ]; then
  timeout 120 python3 -m bench.investigations.launch_cost --out "$OUT" 2>&1 | tee "$OUT/launch.log" || rc=1
  timeout 120 python3 -m bench.investigations.transport_floor --reps 1000 --out "$OUT" 2>&1 | grep round | tee "$OUT/floor.log" || rc=1
  timeout 120 python3 -m bench.investigations.transport_floor --reps 100 --idle-ms 40 --out "$OUT" 2>&1 | grep round | tee -a "$OUT/floor.log" || rc=1
  for layout in block_outer per_layer; do
    for spy in "" --pyspy; do
      timeout 200 python3 -m bench.investigations.big_job_profile --out "$OUT/bjp-$layout$spy" \
        --layout $layout --reps ${PROFILE_REPS:-20} $spy 2>&1 | tail -60 > "$OUT/bjp-$layout$spy.log" || rc=1
    done
  done
fi
if [ "$what" = diag+tests ]; then
  timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider -q -rs --timeout 180 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/daemon/test_copy_plan.py" "$REPO/tests/gpu" 2>&1 | tee "$OUT/tests.log" || rc=1
fi
exit $rc
