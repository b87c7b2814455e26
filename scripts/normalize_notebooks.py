#!/usr/bin/env python3
"""Make executed notebooks byte-identical from run to run, so an unchanged chapter leaves git clean.

    python scripts/normalize_notebooks.py notebooks/*.ipynb          # rewrite in place
    python scripts/normalize_notebooks.py --check notebooks/*.ipynb  # exit 1 if any would change

What an execution adds that says nothing about the chapter, and what is done with it:

* per-cell ``execution`` timestamps (nbclient) and ``ExecuteTime`` (a Lab extension): removed;
* the Python patch version in ``language_info``: removed (it differs between readers' machines);
* progress-bar frames (tqdm writes one per update, separated by ``\\r``) in stream outputs:
  removed, and a stream left empty is dropped;
* consecutive outputs of one stream (the kernel flushes stdout in pieces, wherever a timer
  falls): merged into one, so the split never shows in a diff;
* no ``kernelspec``: the standard ``python3`` one is written, so JupyterLab does not ask for a
  kernel or mark the tab as changed on open.

Cell ids are kept as they are (``jupytext --update`` carries them over from the committed
notebook); a missing or repeated id is replaced by one derived from the cell's position and
source, so the result never depends on a random number. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime")
VOLATILE_NOTEBOOK_METADATA = ("widgets",)

# One tqdm frame: "desc:  40%|####      | 4/10 [00:01<00:02,  2.9it/s]" or, without a total,
# "desc: 12it [00:03,  3.9it/s]". The elapsed-time bracket is what every frame has.
TQDM_FRAME = re.compile(r"^.*\[\d+:\d\d(?::\d\d)?(?:<[^,\]]*)?,[^\]]*\]\s*$")
_ID_OK = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def strip_progress(text: str) -> str:
    """*text* without tqdm frames; the lines around them are kept as they are."""
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        if "\r" not in body and not TQDM_FRAME.match(body):
            out.append(line)
            continue
        pieces = [p for p in body.split("\r") if p.strip() and not TQDM_FRAME.match(p)]
        if not pieces:
            continue  # a line of frames only (or the blank a finished bar leaves)
        out.append("\r".join(pieces) + ("\n" if line.endswith("\n") else ""))
    return "".join(out)


def _lines(text: str) -> list:
    return text.splitlines(keepends=True)


def _join(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def normalize(nb: dict) -> dict:
    meta = nb.setdefault("metadata", {})
    for key in VOLATILE_NOTEBOOK_METADATA:
        meta.pop(key, None)
    meta["kernelspec"] = dict(KERNELSPEC)
    if isinstance(meta.get("language_info"), dict):
        meta["language_info"].pop("version", None)
    seen = set()
    for i, cell in enumerate(nb.get("cells", [])):
        cmeta = cell.setdefault("metadata", {})
        for key in VOLATILE_CELL_METADATA:
            cmeta.pop(key, None)
        cid = cell.get("id")
        if nb.get("nbformat", 4) == 4 and nb.get("nbformat_minor", 0) >= 5:
            if not isinstance(cid, str) or not _ID_OK.match(cid) or cid in seen:
                digest = hashlib.sha1(f"{i}\0{cell.get('cell_type')}\0{_join(cell.get('source', ''))}".encode())
                cid = f"c{i:03d}-{digest.hexdigest()[:8]}"
                cell["id"] = cid
            seen.add(cid)
        if cell.get("cell_type") != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = strip_progress(_join(out.get("text", "")))
                if not text:
                    continue
                prev = outputs[-1] if outputs else None
                if prev is not None and prev.get("output_type") == "stream" and prev.get("name") == out.get("name"):
                    # the kernel flushes a stream in pieces as it pleases: one run of text is one output
                    prev["text"] = _lines(_join(prev["text"]) + text)
                    continue
                out["text"] = _lines(text)
            outputs.append(out)
        cell["outputs"] = outputs
    return nb


def dumps(nb: dict) -> str:
    """The text ``nbformat.write`` produces (sorted keys, one-space indent, trailing newline)."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def normalize_file(path: Path, check: bool = False) -> bool:
    """Normalize *path* (in place unless *check*); True if it was not already normalized."""
    before = path.read_text(encoding="utf-8")
    after = dumps(normalize(json.loads(before)))
    if after != before and not check:
        path.write_text(after, encoding="utf-8")
    return after != before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is not normalized")
    args = ap.parse_args(argv)
    changed = [p for p in args.notebooks if normalize_file(p, check=args.check)]
    for p in changed:
        print(f"{'not normalized' if args.check else 'normalized'}: {p}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
