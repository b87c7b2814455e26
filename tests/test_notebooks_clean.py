"""A re-run of the walkthrough leaves git clean: the committed notebooks are in the normalized
form `./run.sh walkthrough` writes (scripts/normalize_notebooks.py), which is stable, carries a
kernelspec and no execution timestamps or progress-bar frames. Nothing here executes a notebook."""

import copy
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

_spec = importlib.util.spec_from_file_location("normalize_notebooks", ROOT / "scripts" / "normalize_notebooks.py")
norm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(norm)

FRAMES = (
    "\remulate gfx942:   0%|          | 0/8 [00:00<?, ?it/s]"
    "\remulate gfx942:  12%|█▎        | 1/8 [00:01<00:08,  1.20s/it]"
    "\remulate gfx942: 100%|██████████| 8/8 [00:09<00:00,  1.13s/it]\n"
)


def executed_notebook():
    """What nbclient writes for a two-cell notebook: timestamps, a patch version, tqdm frames."""
    stamp = {"iopub.execute_input": "2026-11-30T05:43:35.288577Z", "iopub.status.busy": "2026-11-30T05:43:35.2Z",
             "iopub.status.idle": "2026-11-30T05:43:36.8Z", "shell.execute_reply": "2026-11-30T05:43:36.8Z"}
    return {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"jupytext": {"formats": "ipynb,py:percent"},
                     "language_info": {"name": "python", "version": "3.11.7", "pygments_lexer": "ipython3"}},
        "cells": [
            {"cell_type": "markdown", "id": "a98bba42", "metadata": {}, "source": ["# title"]},
            {"cell_type": "code", "id": "3413234d", "execution_count": 1, "metadata": {"execution": stamp, "tags": ["x"]},
             "source": ["for c in tqdm(CONFIGS): ..."],
             "outputs": [{"name": "stderr", "output_type": "stream", "text": [FRAMES]},
                         {"name": "stdout", "output_type": "stream", "text": ["done\n", "\n", "8 configs\n"]},
                         {"name": "stderr", "output_type": "stream",
                          "text": ["UserWarning: kept\n", "\rcompile: 3it [00:02,  1.5it/s]\rcompile: 4it [00:03,  1.4it/s]\n"]}]},
            {"cell_type": "code", "id": "3413234d", "execution_count": 2, "metadata": {}, "source": ["x"], "outputs": []},
        ],
    }


def test_normalize_strips_volatile_parts_and_keeps_the_rest():
    nb = norm.normalize(executed_notebook())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "version" not in nb["metadata"]["language_info"] and nb["metadata"]["jupytext"]
    code = nb["cells"][1]
    assert code["metadata"] == {"tags": ["x"]} and code["id"] == "3413234d"
    assert code["outputs"] == [
        {"name": "stdout", "output_type": "stream", "text": ["done\n", "\n", "8 configs\n"]},
        {"name": "stderr", "output_type": "stream", "text": ["UserWarning: kept\n"]},
    ]
    # a repeated id is replaced deterministically, never by a random one
    dup = nb["cells"][2]["id"]
    assert dup != "3413234d" and dup == norm.normalize(executed_notebook())["cells"][2]["id"]


def test_a_stream_flushed_in_pieces_is_one_output():
    """The kernel splits stdout wherever a flush falls; the split must not reach the committed file."""
    cell = dict(cell_type="code", id="a1", metadata={}, source="print()", execution_count=1, outputs=[
        dict(output_type="stream", name="stdout", text=["table\n", "row 1"]),
        dict(output_type="stream", name="stdout", text=["\n"]),
        dict(output_type="stream", name="stderr", text=["warning\n"]),
        dict(output_type="stream", name="stdout", text=["after\n"]),
    ])
    nb = dict(nbformat=4, nbformat_minor=5, metadata={}, cells=[cell])
    outs = norm.normalize(nb)["cells"][0]["outputs"]
    assert [(o["name"], "".join(o["text"])) for o in outs] == [
        ("stdout", "table\nrow 1\n"), ("stderr", "warning\n"), ("stdout", "after\n")]


def test_normalize_is_idempotent_to_the_byte(tmp_path):
    p = tmp_path / "nb.ipynb"
    p.write_text(json.dumps(executed_notebook(), indent=2))
    assert norm.normalize_file(p) is True
    once = p.read_bytes()
    assert norm.normalize_file(p) is False
    assert p.read_bytes() == once
    assert norm.main(["--check", str(p)]) == 0


def test_normalized_notebook_is_valid_nbformat():
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.from_dict(norm.normalize(executed_notebook())))


def test_nbval_sanitizer_and_normalizer_agree_on_what_a_frame_is():
    cfg = (ROOT / "notebooks" / "nbval_sanitize.cfg").read_text()
    (pattern,) = re.findall(r"^regex: (.*)$", cfg, flags=re.MULTILINE)
    for frame in [f for f in FRAMES.split("\r") if f.strip()] + ["compile: 4it [00:03,  1.4it/s]"]:
        assert norm.TQDM_FRAME.match(frame.rstrip("\n")), frame
        assert re.sub(pattern, "<bar>", frame).strip() == "<bar>", frame


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_normalized(path):
    # Fails when a notebook was executed without scripts/normalize_notebooks.py (./run.sh
    # walkthrough runs it): the next walkthrough would then rewrite the file.
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", "no kernelspec"
    stamped = [i for i, c in enumerate(nb["cells"]) if "execution" in c.get("metadata", {})]
    assert not stamped, f"cells {stamped[:5]}... carry execution timestamps"
    frames = [i for i, c in enumerate(nb["cells"]) for o in c.get("outputs", [])
              if o.get("output_type") == "stream" and norm.strip_progress("".join(o["text"])) != "".join(o["text"])]
    assert not frames, f"cells {frames[:5]} carry progress-bar frames"
    assert norm.dumps(norm.normalize(copy.deepcopy(nb))) == text, "not in normalized form"


def test_walkthrough_keeps_ids_and_normalizes():
    # How run.sh executes a chapter: into the committed .ipynb (ids kept), outputs cleared,
    # no timing metadata, then the normalizer; headless runs draw no bars.
    sh = (ROOT / "run.sh").read_text()
    walk = sh[sh.index("  walkthrough)"):sh.index("  lab)")]
    assert "--update --to ipynb" in walk and "ClearOutputPreprocessor.enabled=True" in walk
    assert "record_timing=False" in walk and "scripts/normalize_notebooks.py" in walk and "headless" in walk
    assert "PA_TILE_PROGRESS=0" in sh


def test_jupytext_update_keeps_cell_ids(tmp_path):
    # The id-keeping half of the walkthrough, on a copy of a real chapter: converting its .py
    # into the committed .ipynb must not touch a byte (no new ids, outputs kept for nbconvert to clear).
    src = NOTEBOOKS[0]
    for suffix in (".py", ".ipynb"):
        (tmp_path / src.with_suffix(suffix).name).write_bytes(src.with_suffix(suffix).read_bytes())
    (tmp_path / "jupytext.toml").write_bytes((ROOT / "jupytext.toml").read_bytes())
    jupytext = Path(__import__("sys").executable).with_name("jupytext")
    before = (tmp_path / src.name).read_bytes()
    subprocess.run([str(jupytext), "--quiet", "--update", "--to", "ipynb", str(tmp_path / src.with_suffix(".py").name)],
                   check=True, cwd=tmp_path, timeout=120)
    after = json.loads((tmp_path / src.name).read_text())
    assert [c.get("id") for c in after["cells"]] == [c.get("id") for c in json.loads(before)["cells"]]
