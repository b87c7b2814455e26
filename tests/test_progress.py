"""Progress bars: drawn for a person at a terminal or in JupyterLab, never into recorded output."""

import io
from pathlib import Path

import pytest

from pa_tile import progress as P

ROOT = Path(__file__).resolve().parent.parent


class Tty(io.StringIO):
    def isatty(self):
        return True


def _kernel_stream():
    # ipykernel's OutStream stands for sys.stderr inside a notebook kernel; only its module matters
    return type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(P.ENV_VAR, raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)


def test_terminal_on_pipe_off():
    assert P.progress_enabled(Tty()) is True
    assert P.progress_enabled(io.StringIO()) is False


def test_notebook_kernel_on_only_when_a_jupyter_server_started_it(monkeypatch):
    # nbconvert --execute and nbval start their kernels without JPY_SESSION_NAME
    assert P.progress_enabled(_kernel_stream()) is False
    monkeypatch.setenv("JPY_SESSION_NAME", "notebooks/05_phase_split_mtp.ipynb")
    assert P.progress_enabled(_kernel_stream()) is True


@pytest.mark.parametrize("value, want", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_environment_forces_it(monkeypatch, value, want):
    monkeypatch.setenv(P.ENV_VAR, value)
    assert P.progress_enabled(Tty()) is want and P.progress_enabled(io.StringIO()) is want


def test_bar_draws_nothing_when_off_and_passes_items_through(capsys):
    assert list(P.progress(range(4), desc="emulate")) == [0, 1, 2, 3]
    assert capsys.readouterr().err == ""


def test_inner_bar_stays_off_inside_a_drawn_one(capsys):
    with P.progress(total=2, desc="outer", enabled=True) as outer:
        inner = P.progress(total=3, desc="inner", enabled=True, nested=False)
        assert inner.disable and not outer.disable
        inner.close()
    assert P.progress(total=3, desc="alone", enabled=True, nested=False).disable is False


def test_every_bar_in_the_package_goes_through_the_helper():
    users = [p.relative_to(ROOT) for p in (ROOT / "pa_tile").rglob("*.py")
             if p.name != "progress.py" and ("from tqdm" in p.read_text() or "import tqdm" in p.read_text())]
    assert users == []


def test_stage_metrics_json_mode_runs(capsys):
    # its --json loop used an undefined `tqdm` / `progress` (NameError before any stage ran)
    from pa_tile.perf import stage_metrics

    assert stage_metrics._main(["--json", "--stages", "s404", "--archs", "gfx942"]) == 0
    out = capsys.readouterr().out
    assert '"part": "trace"' in out and "s404" in out


def test_emulator_launch_bar_by_default_only_for_a_watcher_and_only_when_long(monkeypatch):
    from pa_tile.emu import machine

    bar = machine._progress_bar("k", 10, None)
    assert bar.disable  # under pytest stderr is captured: nobody watches
    bar.close()
    monkeypatch.setenv(P.ENV_VAR, "1")
    bar = machine._progress_bar("k", 10, None)
    assert not bar.disable and bar.delay >= 3  # short launches stay silent
    bar.close()
    monkeypatch.setenv(P.ENV_VAR, "0")
    bar = machine._progress_bar("k", 10, True)  # asked for explicitly: drawn anyway
    assert not bar.disable and bar.leave
    bar.close()
