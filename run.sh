#!/usr/bin/env bash
# pa_tile: set up and run.   ./run.sh walkthrough  |  ./run.sh test  |  ./run.sh setup
#   walkthrough: execute every notebook in order, headless, on the best backend present
#                (ROCm GPU if there is one, otherwise the CPU emulator); outputs are written
#                into notebooks/*.ipynb.
#   test:        the whole test suite: export check, unit tests, emulator tests, nbval over the
#                notebooks (plus the `rocm`-marked tests on a ROCm machine).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${PA_TILE_VENV:-.venv}"
PY="$VENV/bin/python"

setup() {
  bash scripts/setup.sh "$VENV"
}

case "${1:-}" in
  setup)
    setup ;;
  walkthrough)
    setup
    for nb in notebooks/[0-9][0-9]_*.py; do
      echo "=== running $nb"
      # fresh .ipynb from the .py source, then execute it in place (outputs are never carried over)
      "$VENV/bin/jupytext" --quiet --to ipynb "$nb"
      "$VENV/bin/jupyter" nbconvert --to notebook --execute --inplace "${nb%.py}.ipynb"
    done ;;
  test)
    setup
    "$PY" -m pa_tile._export --check
    "$PY" -m pytest tests --nbval notebooks/ --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider "${@:2}" ;;
  *)
    sed -n '2,8p' "$0"; exit 2 ;;
esac
