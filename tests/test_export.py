"""The package's exported modules and the notebooks never disagree."""

from pathlib import Path

import pytest

from pa_tile import _export


def test_package_matches_notebooks():
    assert _export.check() == []


def test_export_collects_tagged_cells_only(tmp_path):
    nb = tmp_path / "99_demo.py"
    nb.write_text(
        "# %% [markdown]\n# prose\n\n"
        '# %% tags=["export"]\nimport math\n\n'
        "# %%\nprint('not exported')\n\n"
        '# %% tags=["export"]\ndef f():\n    return math.pi\n'
    )
    src = _export.exported_source(nb)
    assert "import math" in src and "def f():" in src and "not exported" not in src
    assert src.startswith("# GENERATED from notebooks/99_demo.py")
    ns = {}
    exec(compile(src, "gen", "exec"), ns)
    assert ns["f"]() == pytest.approx(3.14159, abs=1e-4)


def test_notebook_without_export_cells_is_an_error(tmp_path):
    nb = tmp_path / "98_empty.py"
    nb.write_text("# %%\nx = 1\n")
    with pytest.raises(ValueError, match="export"):
        _export.exported_source(nb)


def test_stale_module_is_reported(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_tile_qk.py").write_text('# %% tags=["export"]\nX = 1\n')
    monkeypatch.setattr(_export, "ROOT", tmp_path)
    monkeypatch.setattr(_export, "NOTEBOOKS", tmp_path / "notebooks")
    (tmp_path / "pa_tile" / "stages").mkdir(parents=True)
    (tmp_path / _export.EXPORTS["01_tile_qk"]).write_text("X = 2\n")
    problems = _export.check()
    assert any("out of date" in p for p in problems)
    assert any("ipynb is missing" in p for p in problems)
    _export.export_all()
    assert not any("out of date" in p for p in _export.check())


def test_a_module_exported_from_several_notebooks_concatenates_them_in_order(tmp_path):
    first, second = tmp_path / "97_first.py", tmp_path / "appendix_second.py"
    first.write_text('# %% tags=["export"]\nA = 1\n')
    second.write_text('# %% tags=["export"]\nB = A + 1\n')
    src = _export.exported_source(first, second)
    assert src.startswith("# GENERATED from notebooks/97_first.py, notebooks/appendix_second.py ")
    assert src.index("A = 1") < src.index("B = A + 1")
    ns = {}
    exec(compile(src, "gen", "exec"), ns)
    assert ns["B"] == 2
    # the registry's stage 5 is taught over chapters 05 and 06, its baseline in an appendix
    stems = _export.SOURCES["pa_tile/stages/s5_phase_split_mtp.py"]
    assert stems == ("05_phase_split_mtp", "06_head_dim_split_pv", "appendix_register_resident_loop")
    assert {_export.EXPORTS[s] for s in stems} == {"pa_tile/stages/s5_phase_split_mtp.py"}
