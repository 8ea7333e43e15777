#!/usr/bin/env bash
# The tokenizer peers of benchmarks/full_encode.py and cold_start.py in their own venv (never in CI):
# gigatoken and fastokens from PyPI by name, pinned, plus numpy (the peer worker reads and writes .npy files).
#   bash benchmarks/peers/build_tokenizer_peers.sh [VENV]     (default /tmp/tokenplane-peers)
# then: python benchmarks/full_encode.py --peer-python VENV/bin/python ...
set -euo pipefail
VENV="${1:-/tmp/tokenplane-peers}"
PY="${PYTHON:-python3}"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "gigatoken==0.10.0" "fastokens==0.3.5" numpy
"$VENV/bin/python" -c "import importlib.metadata as m; print('gigatoken', m.version('gigatoken'), 'fastokens', m.version('fastokens'))"
