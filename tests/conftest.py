"""Fixtures more than one test file uses."""

import pytest


@pytest.fixture
def nothing_built(monkeypatch):
    """Building either kernel of the finished call fails the test: for checks that must refuse an
    argument before anything is compiled or launched."""
    from pa_tile.stages import s5_phase_split_mtp as s5
    from pa_tile.stages import s6_split_k as s6

    monkeypatch.setattr(s5, "build_launcher", lambda *a, **k: pytest.fail("partial kernel built"))
    monkeypatch.setattr(s6, "build_reduce", lambda *a, **k: pytest.fail("reduce built"))
