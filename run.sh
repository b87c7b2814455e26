#!/usr/bin/env bash
# pa_tile: set up and run.
#
# usage: ./run.sh COMMAND [ARGS...]
#   setup        create .venv and install pa_tile with its notebook and test tools (scripts/setup.sh)
#   walkthrough  execute every chapter in order, then the appendices, headless, on the best
#                backend present (ROCm GPU if there is one, otherwise the CPU emulator); outputs are written into
#                notebooks/*.ipynb, normalized so that an unchanged chapter leaves git clean
#   lab [ARGS]   open the notebooks in JupyterLab (the .py chapters open as notebooks)
#   book         build the walkthrough as a static site from the committed notebooks (nothing is
#                executed) into book/_build/html; open book/_build/html/index.html, no network needed
#   test [ARGS]  the whole test suite: export check, unit tests, emulator tests, nbval over the
#                notebooks (plus the `rocm`-marked tests on a ROCm machine); ARGS go to pytest
#   help         this text
#
# PA_TILE_VENV picks another virtual environment folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${PA_TILE_VENV:-.venv}"
PY="$VENV/bin/python"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# Setup runs again only when what it installs from changed (or the venv is new), so that
# `./run.sh lab` or `test` after the first run starts at once.
STAMP="$VENV/.pa_tile-setup"
setup_key() { cksum pyproject.toml scripts/setup.sh; }
setup() {
  if [ -x "$PY" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$(setup_key)" ]; then return; fi
  force_setup
}
force_setup() {
  bash scripts/setup.sh "$VENV"
  setup_key > "$STAMP"
}

# Recorded runs are not watched: no progress bars into the notebooks (pa_tile's own bars and
# any plain tqdm in a cell).
headless() { export PA_TILE_PROGRESS=0 TQDM_DISABLE=1; }

case "${1:-}" in
  setup)
    force_setup ;;
  walkthrough)
    setup
    headless
    # the chapters in reading order, then the appendices they link to
    shopt -s nullglob
    for nb in notebooks/[0-9][0-9]_*.py notebooks/appendix_*.py; do
      ipynb="${nb%.py}.ipynb"
      echo "=== running $nb"
      # Inputs from the .py source into the committed .ipynb, keeping its cell ids (--update);
      # every output is cleared before the run, so none is carried over.
      if [ -f "$ipynb" ]; then
        "$VENV/bin/jupytext" --quiet --update --to ipynb "$nb"
      else
        "$VENV/bin/jupytext" --quiet --to ipynb "$nb"
      fi
      "$VENV/bin/jupyter" nbconvert --to notebook --execute --inplace --log-level=WARN \
        --ClearOutputPreprocessor.enabled=True --ExecutePreprocessor.record_timing=False \
        --ExecutePreprocessor.kernel_name=python3 "$ipynb"
      "$PY" scripts/normalize_notebooks.py "$ipynb"
    done ;;
  lab)
    setup
    # The project's Jupyter settings (.jupyter/: jupytext's notebook view as the default for .py
    # files) come first in Jupyter's config path; the user's own settings still apply after them.
    export JUPYTER_CONFIG_PATH="$PWD/.jupyter${JUPYTER_CONFIG_PATH:+:$JUPYTER_CONFIG_PATH}"
    extra=()
    if [ "$(id -u)" = 0 ]; then extra+=(--allow-root); fi  # Jupyter refuses root without it
    exec "$VENV/bin/jupyter" lab ${extra[@]+"${extra[@]}"} "${@:2}" notebooks/ ;;
  test)
    setup
    headless
    "$PY" -m pa_tile._export --check
    # one worker per core (PA_TILE_TEST_WORKERS=0 runs in this process); a file's tests (a notebook's
    # cells) stay together on one worker
    "$PY" -m pytest tests --nbval notebooks/ --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider \
      -n "${PA_TILE_TEST_WORKERS:-2}" --dist loadfile "${@:2}" ;;
  book)
    setup
    # the book's tools are an extra of their own, installed the first time (and after pyproject.toml
    # or setup.sh change) like setup's
    if [ "$(cat "$VENV/.pa_tile-book" 2>/dev/null)" != "$(setup_key)" ]; then
      echo "[book] installing the book extra: pip install -e .[book]"
      "$PY" -m pip install -q -e ".[book]"
      setup_key > "$VENV/.pa_tile-book"
    fi
    "$PY" scripts/build_book.py "${@:2}" ;;
  help|-h|--help)
    usage ;;
  *)
    if [ -n "${1:-}" ]; then echo "run.sh: unknown command '$1'" >&2; else echo "run.sh: no command given" >&2; fi
    usage >&2
    exit 2 ;;
esac
