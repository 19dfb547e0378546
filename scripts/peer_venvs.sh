#!/usr/bin/env bash
# Creates the peers' environments for `python -m jaxflow.run --exp=bench_peers`, each in a venv of its
# own so that the peers' pins never move the main environment's:
#   $ROOT/torchrec  torch 2.13.0 (CPU wheel), torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0 (the CUDA fbgemm_gpu that
#                   torchrec pulls in is uninstalled: it does not load on a CPU-only host)
#   $ROOT/tunix     google-tunix 0.1.7 with jax 0.10.2 / flax 0.12.8 (the main environment's versions)
#   $ROOT/trl       trl 1.16.0 with torch 2.13.0 (CPU wheel)
# Usage: bash scripts/peer_venvs.sh [ROOT] [torchrec|tunix|trl ...]   (ROOT defaults to /work/.venv-peers,
#        or $JAXFLOW_PEER_VENVS). Network is needed while installing only; the arms run offline.
# Each venv is checked by importing its peer at the end; one failing venv does not stop the others.
set -u
ROOT="${1:-${JAXFLOW_PEER_VENVS:-/work/.venv-peers}}"
shift || true
WHICH=("$@")
[ ${#WHICH[@]} -eq 0 ] && WHICH=(torchrec tunix trl)
PYTHON="${PYTHON:-python3}"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
mkdir -p "$ROOT"
status=0

make_venv() {  # $1: name -> creates $ROOT/$1 and upgrades pip in it
  "$PYTHON" -m venv --clear "$ROOT/$1" && "$ROOT/$1/bin/python" -m pip install -q --upgrade pip
}

torch_cpu() {  # $1: venv name; torch 2.13.0 from the CPU index (PyPI's Linux wheel pulls in CUDA libraries);
  # where that index cannot be reached (offline mirrors), PyPI's wheel, whose CUDA libraries then stay unused
  "$ROOT/$1/bin/python" -m pip install -q --retries 0 --timeout 15 "torch==2.13.0" --index-url "$TORCH_CPU_INDEX" \
    || "$ROOT/$1/bin/python" -m pip install -q "torch==2.13.0"
}

install_torchrec() {
  make_venv torchrec && torch_cpu torchrec \
    && "$ROOT/torchrec/bin/python" -m pip install -q "torch==2.13.0" "torchrec==1.8.0" "fbgemm-gpu-cpu==1.8.0" \
          \
    && { "$ROOT/torchrec/bin/python" -m pip uninstall -y -q fbgemm_gpu fbgemm-gpu 2>/dev/null; \
         "$ROOT/torchrec/bin/python" -m pip install -q --force-reinstall --no-deps "fbgemm-gpu-cpu==1.8.0"; } \
    && "$ROOT/torchrec/bin/python" -c "import torch, fbgemm_gpu, torchrec; print('torchrec', torchrec.__version__, 'torch', torch.__version__)"
}

install_tunix() {
  make_venv tunix \
    && "$ROOT/tunix/bin/python" -m pip install -q "google-tunix==0.1.7" "jax==0.10.2" "jaxlib==0.10.2" "flax==0.12.8" \
    && "$ROOT/tunix/bin/python" -c "import jax, flax, tunix; print('tunix', getattr(tunix, '__version__', '0.1.7'), 'jax', jax.__version__, 'flax', flax.__version__)"
}

install_trl() {
  make_venv trl && torch_cpu trl \
    && "$ROOT/trl/bin/python" -m pip install -q "torch==2.13.0" "trl==1.16.0"  \
    && "$ROOT/trl/bin/python" -c "import torch, trl; print('trl', trl.__version__, 'torch', torch.__version__)"
}

for name in "${WHICH[@]}"; do
  case "$name" in
    torchrec|tunix|trl) ;;
    *) echo "unknown peer '$name'; valid: torchrec, tunix, trl" >&2; exit 2 ;;
  esac
  echo "== $name -> $ROOT/$name"
  if "install_$name"; then echo "== $name ok"; else echo "== $name FAILED" >&2; status=1; fi
done
exit $status
