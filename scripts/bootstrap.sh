# Sourced by scripts/up.sh and scripts/test.sh: make .venv with everything installed, and make sure
# redis-server and a C++ compiler (for the CPU kernels, compiled on first use) exist. Safe to run again: it reinstalls only when pyproject.toml or requirements change.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  echo ">> apt-get install $*"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo ">> creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv 2>/dev/null || { rm -rf .venv; apt_install python3-venv; "$PYTHON" -m venv .venv; }
fi

STAMP=.venv/.andromeda-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements-cpu.txt -nt "$STAMP" ] \
   || [ constraints-cpu.txt -nt "$STAMP" ]; then
  echo ">> installing Python packages into .venv (first run: a few minutes)"
  .venv/bin/python -m pip install --progress-bar on pip==26.3  # pinned too: today's pip is no more tested than any package
  TORCH_PIN=$(sed -n 's/^torch==//p' requirements-cpu.txt)
  if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN')" 2>/dev/null; then
    # PyPI's Linux torch is the CUDA build (GBs of nvidia-* packages): take the CPU build from PyTorch's index where
    # it answers (its 2.13.0+cpu ranks above PyPI's 2.13.0); else whatever pip's own index or wheel folder holds
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
    INDEX=()
    if .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$TORCH_INDEX/torch/', timeout=5)" 2>/dev/null; then
      INDEX=(--extra-index-url "$TORCH_INDEX")
    fi
    .venv/bin/python -m pip install --progress-bar on "${INDEX[@]}" -r requirements-cpu.txt
  fi
  .venv/bin/python -m pip install --progress-bar on -c constraints-cpu.txt -e '.[dev,bench]'
  touch "$STAMP"
fi

if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null; then
  apt_install redis-server
fi
if ! command -v "${CXX:-g++}" >/dev/null; then
  apt_install g++
fi
