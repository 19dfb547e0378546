#!/usr/bin/env bash
# The prepared accelerator check: one NVIDIA GPU with its own jax (0.11.2, Python 3.12), no
# network, 5 minutes in all. Installs jaxflow without touching the image's jax, runs each
# benchmark step under its own timeout (continuing past a failed one) and writes one JSON per
# step (rc, seconds, command, the run's summary.json, the log's tail) under $OUT if set, else
# experiments/device_results/.
#
#   bash experiments/device_check.sh --fetch-wheels   # here, with network: wheels the image lacks
#   bash experiments/device_check.sh                  # there, from the repository root
#   bash experiments/device_check.sh --dry-run        # resolve every step's config, run nothing
#
# The wheels go to experiments/wheels/ (git-ignored): carry that folder with the run.
# Steps are the `step NAME SECONDS ARGS...` lines below; tests/test_device_check.py parses
# every one with the runner, so a renamed experiment or config key fails CI, not the device.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
WHEELS="$ROOT/experiments/wheels"
# What the GPU image lacks of pyproject's dependencies (it has flax, optax, orbax-checkpoint,
# etils, tensorstore, numpy, tqdm, matplotlib, scikit-learn, safetensors, tokenizers; the
# steps below never import Levenshtein, which only the align / figa code needs).
WHEEL_PINS=(zstandard==0.25.0)
TOTAL_S="${DEVICE_CHECK_TOTAL_S:-300}"
RESULTS="${OUT:-$ROOT/experiments/device_results}"
RUNS="${TMPDIR:-/tmp}/jaxflow_device_runs"
MODE="${1:-run}"

fetch_wheels() {
  mkdir -p "$WHEELS"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${WHEEL_PINS[@]}"
}

install() {
  local site="${TMPDIR:-/tmp}/jaxflow_site"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" \
      --target "$site" "${WHEEL_PINS[@]}" || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # no build isolation: there is no network to fetch setuptools into an isolated build
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" || return 1
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
}

START=$(date +%s)
remaining() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

# step NAME SECONDS ARGS...: one runner command under min(SECONDS, time left) seconds.
step() {
  local name="$1" limit="$2"; shift 2
  if [ "$MODE" = "--dry-run" ]; then
    "$PY" -m jaxflow.run "$@" --dry-run >/dev/null ||
      { echo "dry-run failed: $name" >&2; FAILED=1; }
    return
  fi
  local left; left=$(remaining)
  [ "$left" -lt "$limit" ] && limit=$left
  local out="$RUNS/$name" log="$RUNS/$name.log" t0 rc
  rm -rf "$out"
  t0=$(date +%s)
  if [ "$limit" -le 5 ]; then
    rc=124; echo "skipped: the ${TOTAL_S}s budget is spent" >"$log"
  else
    echo "== $name (timeout ${limit}s): $*" | tee -a "$RESULTS/device_check.log"
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$PY" -m jaxflow.run "$@" --out "$out" >"$log" 2>&1
    rc=$?
    tail -n 40 "$log" >>"$RESULTS/device_check.log"
  fi
  "$PY" - "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$out" "$log" \
    "$RESULTS/$name.json" "$@" <<'EOF'
import json, os, sys
name, rc, secs, limit, out, log, dest, *argv = sys.argv[1:]
summary, partial = os.path.join(out, "summary.json"), os.path.join(out, "rows.json")
record = {"step": name, "rc": int(rc), "timed_out": rc in ("124", "137"), "seconds": int(secs),
          "timeout_s": int(limit), "command": ["python", "-m", "jaxflow.run", *argv],
          "summary": json.load(open(summary)) if os.path.exists(summary) else None,
          # rows written as they finish (bench_kernels), for a step stopped by its timeout
          "partial": (json.load(open(partial)) if os.path.exists(partial)
                      and not os.path.exists(summary) else None),
          "log_tail": open(log, errors="replace").read()[-4000:] if os.path.exists(log) else ""}
json.dump(record, open(dest, "w"), indent=1, default=str)
print(f"== {name}: rc {rc} in {secs}s -> {dest}")
EOF
}

environment() {
  "$PY" - "$RESULTS/device_check.json" "$1" <<'EOF'
import json, platform, subprocess, sys
info = {"python": platform.python_version(), "install_rc": int(sys.argv[2])}
try:
    import jax
    info.update(jax=jax.__version__, backend=jax.default_backend(),
                devices=[d.device_kind for d in jax.devices()])
except Exception as e:  # noqa: BLE001
    info["jax_error"] = repr(e)
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:  # noqa: BLE001
    info["nvidia_smi"] = repr(e)
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("== environment:", info)
EOF
}

steps() {
  step bench_kernels 130 --exp=bench_kernels --variant=full
  step flagship 75 --exp=flagship --variant=quick
  step bench_policy_loss 40 --exp=bench_policy_loss --variant=full
  step bench_sync_codec 40 --exp=bench_sync_codec --variant=default
  step bench_embedding 40 --exp=bench_embedding --variant=device --set num_tables=8 \
    --set capacity=0 --set pairs=10
}

case "$MODE" in
  --fetch-wheels) fetch_wheels; exit $? ;;
  --dry-run) export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"; FAILED=0; steps; exit $FAILED ;;
  run) ;;
  *) echo "usage: $0 [--fetch-wheels | --dry-run]" >&2; exit 2 ;;
esac

mkdir -p "$RESULTS" "$RUNS"
: >"$RESULTS/device_check.log"
install >>"$RESULTS/device_check.log" 2>&1
install_rc=$?
environment "$install_rc"
steps
echo "== done in $(( $(date +%s) - START ))s; results in $RESULTS"
