#!/usr/bin/env bash
# One command, under 5 minutes, on a bare GPU machine (written for one H200):
#   bash scripts/gpu_check.sh
# 1. makes sure python has CUDA torch, triton, numpy, pytest, hypothesis (pip from PyPI only if missing;
#    an offline machine must already have them or get them as carried wheels),
# 2. runs the digest bit-exactness tests on the GPU (Triton and torch CUDA vs the numpy reference) and the
#    canary stamp tests,
# 3. runs the digest benchmark on the GPU (Triton and torch vs copy and gather of the same bytes),
# 4. runs the guards' hot-path steps on CUDA tensors (scripts/gpu_hooks_check.py: canary stamps, the commit gate,
#    the digest, the page ledger's learning, the free path's decision) under torch.cuda.set_sync_debug_mode("error")
#    while torch.cuda._sleep keeps the stream busy as a forward would: host microseconds per step, no sync allowed,
# and writes everything to $OUT (default: ./out/gpu_check): summary.txt, env.txt, pytest.log, junit.xml,
# bench.json, bench.txt, hooks.json. Exit status: 0 only if the tests passed, the benchmark ran and every hook step
# ran without a host synchronisation.
#   bash scripts/gpu_check.sh --cpu-dry-run
# runs the same steps on the CPU with small sizes and installs nothing: CI uses it to keep the script working
# on machines without a GPU. Its figures are CPU figures and say so.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
case "${1:-}" in
    "") ;;
    --cpu-dry-run) DRY_RUN=1 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/out/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
say() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }
status=0

if [ $DRY_RUN = 1 ]; then
    say "dry run on the CPU (no GPU figures): tests that need CUDA skip, the benchmark runs small on the CPU"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__)' \
        2>&1 | tee "$OUT/env.txt"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit.xml" \
        tests/unit/test_digest_spec.py tests/unit/test_digest_gpu.py >"$OUT/pytest.log" 2>&1
    rc=$?
    tail -1 "$OUT/pytest.log" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || { say "FAIL: tests (rc=$rc)"; status=1; }
    if timeout 100 "$PY" scripts/bench_digest.py --device cpu --layers 2 --tokens 256 --reps 3 --page-sizes 16 \
            --json >"$OUT/bench.json" 2>"$OUT/bench.err"; then
        say "benchmark ran (CPU, small: not a GPU figure)"
    else
        say "FAIL: benchmark"; tail -20 "$OUT/bench.err" | tee -a "$OUT/summary.txt"; status=1
    fi
    if timeout 120 "$PY" scripts/gpu_hooks_check.py --cpu-dry-run --reps 2 --json "$OUT/hooks.json" \
            >"$OUT/hooks.log" 2>&1; then
        say "hook steps: no host sync by sglang-harden under the CUDA simulator (CPU figures)"
    else
        say "FAIL: hook steps"; tail -20 "$OUT/hooks.log" | tee -a "$OUT/summary.txt"; status=1
    fi
    say "done, status=$status"
    exit $status
fi

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = [m for m in ("torch", "triton", "numpy", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if "torch" not in need:
    import torch
    if not torch.cuda.is_available():
        need.append("torch")
print(" ".join(need))
PYEOF
)
if [ -n "$missing" ]; then
    say "installing from PyPI: $missing"
    # PyPI's default Linux torch wheel is the CUDA build; it pins a matching triton
    timeout 200 "$PY" -m pip install -q --upgrade $missing 2>&1 | tail -5 | tee -a "$OUT/summary.txt" || say "pip failed"
fi

{ nvidia-smi -L 2>&1; "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("triton", triton.__version__); print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1; } | tee "$OUT/env.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "FAIL: no CUDA device visible to torch"
    exit 2
fi

say "tests: digest bit-exactness (Triton + torch on CUDA vs numpy), canary stamps"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit.xml" \
    tests/unit/test_digest.py tests/unit/test_digest_spec.py tests/unit/test_canary.py \
    tests/unit/test_checksum.py tests/unit/test_digest_gpu.py >"$OUT/pytest.log" 2>&1
rc=$?
tail -3 "$OUT/pytest.log" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || { say "FAIL: tests (rc=$rc)"; status=1; }

say "benchmark: digest vs copy on the GPU"
if timeout 100 "$PY" scripts/bench_digest.py --device cuda --json >"$OUT/bench.json" 2>"$OUT/bench.err"; then
    "$PY" - "$OUT/bench.json" <<'PYEOF' | tee "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
import json, sys
sys.path.insert(0, "scripts")
from bench_digest import print_table
print_table(json.load(open(sys.argv[1])))
PYEOF
else
    say "FAIL: benchmark"; tail -20 "$OUT/bench.err" | tee -a "$OUT/summary.txt"; status=1
fi

say "hook steps on CUDA tensors, sync debug mode 'error', a busy stream"
if timeout 200 "$PY" scripts/gpu_hooks_check.py --json "$OUT/hooks.json" >"$OUT/hooks.log" 2>&1; then
    say "hook steps: no host synchronisation"; grep -E '"(stamp|gate|digest|learn|release)"|host_us' "$OUT/hooks.json" \
        | tr -d ' \n' | tee -a "$OUT/summary.txt"; echo | tee -a "$OUT/summary.txt"
else
    say "FAIL: hook steps"; tail -30 "$OUT/hooks.log" | tee -a "$OUT/summary.txt"; status=1
fi
say "done, status=$status"
exit $status
