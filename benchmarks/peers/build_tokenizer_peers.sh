#!/usr/bin/env bash
# The tokenizer peers of benchmarks/full_encode.py, cold_start.py and session_repair.py in their own venv (never in CI):
# gigatoken and fastokens from PyPI by name, pinned, plus numpy (the peer worker reads and writes .npy files).
#   bash benchmarks/peers/build_tokenizer_peers.sh [VENV]                 (default /tmp/tokenplane-peers)
#   then: python benchmarks/full_encode.py --peer-python VENV/bin/python ...
# With --system-site-packages the venv also sees this interpreter's packages (tokenplane installed editable), so
# benchmarks/session_repair.py can time the peers in its own process, interleaved with Session.sync:
#   bash benchmarks/peers/build_tokenizer_peers.sh /work/peers/tokpeers-sys --system-site-packages
#   /work/peers/tokpeers-sys/bin/python benchmarks/session_repair.py --engines gigatoken,fastokens ...
set -euo pipefail
VENV="${1:-/tmp/tokenplane-peers}"
SITE="${2:-}"
PY="${PYTHON:-python3}"
if [ "$SITE" = "--system-site-packages" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
else
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "gigatoken==0.10.0" "fastokens==0.3.5" numpy
"$VENV/bin/python" -c "import importlib.metadata as m; print('gigatoken', m.version('gigatoken'), 'fastokens', m.version('fastokens'))"
