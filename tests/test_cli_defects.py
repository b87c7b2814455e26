"""`python -m pa_tile` defects from issue 15, one test each: exit codes, --traceback placement,
the --backend error, arch validation before compiling, the --json path checked before a run,
help with defaults and no "this checkout", --version, progress on a long check, and
`_export --check` where there are no notebooks."""

import argparse
import os
import subprocess
import sys

import pytest

import pa_tile
from pa_tile import _export, backend
from pa_tile import __main__ as cli
from pa_tile.__main__ import main
from pa_tile.backend import gpu_available
from pa_tile.emu.launch import EmuSetupError
from pa_tile.perf import adapters, tracing


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    backend.set_backend(None)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_emulator_setup_error_exits_2(capsys, monkeypatch):
    def no_compiler(self, x, y, out, arch):
        raise EmuSetupError("no C compiler was found ('gcc' is not on PATH)")

    monkeypatch.setattr(adapters.TinyKernel, "run", no_compiler)
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 2, out
    assert "no C compiler" in err and "FAIL" not in out


def test_missing_c_compiler_in_a_fresh_process_exits_2(tmp_path):
    # the real path: a first launch builds the emulator's shim, and CC names no compiler
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PA_TILE_CACHE_DIR": str(tmp_path / "cache"),
           "PA_TILE_BACKEND": "emu"}
    proc = subprocess.run([sys.executable, "-m", "pa_tile", "check", "--kernel", "tiny"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "C compiler" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_traceback_before_or_after_the_verb(where):
    argv = ["roofline", "--gpu", "H100"]
    argv = ["--traceback", *argv] if where == "before" else [*argv, "--traceback"]
    with pytest.raises(cli.CliError, match="H100"):
        main(argv)


def test_without_traceback_the_error_is_one_line(capsys):
    code, out, err = run(capsys, "roofline", "--gpu", "H100")
    assert code == 2 and err.startswith("pa_tile roofline: error:") and "Traceback" not in err


@pytest.mark.skipif(gpu_available(), reason="a ROCm GPU is present, so asking for it is not an error here")
def test_backend_gpu_error_names_the_flag(capsys):
    code, out, err = run(capsys, "check", "--kernel", "tiny", "--backend", "gpu")
    assert code == 2
    assert "--backend gpu asks for the GPU" in err and "set_backend()" not in err


def test_isa_diff_with_an_unsupported_arch_refuses_before_compiling(capsys, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(cli, "_isa_text", no_compile)
    code, out, err = run(capsys, "isa", "--kernel", "tiny", "--diff", "gfx1100")
    assert code == 2
    assert "gfx1100" in err and "gfx942" in err and "gfx950" in err and "unknown stage" not in err
    code, out, err = run(capsys, "isa", "--kernel", "tiny", "--diff", "s42")  # a bad stage, also up front
    assert code == 2 and "unknown stage 's42'" in err


def test_trace_json_path_is_checked_before_the_run(capsys, monkeypatch, tmp_path):
    def no_run(*a, **k):
        raise AssertionError("traced before checking the output path")

    monkeypatch.setattr(tracing, "trace_tiny", no_run)
    code, out, err = run(capsys, "trace", "--kernel", "tiny", "--json", "/nonexistent/x.json")
    assert code == 2 and "/nonexistent" in err and "does not exist" in err
    code, out, err = run(capsys, "trace", "--kernel", "tiny", "--json", str(tmp_path))
    assert code == 2 and "folder" in err


def test_trace_prints_the_report_even_if_writing_json_fails(capsys, monkeypatch, tmp_path):
    class Report:
        check = None

        def format(self):
            return "THE REPORT"

        def to_dict(self):
            return {}

    monkeypatch.setattr(tracing, "trace_tiny", lambda arch: Report())
    target = tmp_path / "x.json"
    monkeypatch.setattr(cli, "_check_writable", lambda path: None)  # the path goes bad during the run
    real_open = open

    def failing_open(path, *a, **k):
        if str(path) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", failing_open)
    if gpu_available():
        pytest.skip("trace would switch this process to the emulator")
    code, out, err = run(capsys, "trace", "--kernel", "tiny", "--json", str(target))
    assert "THE REPORT" in out and code == 2 and "Permission denied" in err


def _all_help_texts():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser.format_help(), **{name: p.format_help() for name, p in subs.choices.items()}}


def test_help_shows_defaults_and_never_says_this_checkout():
    texts = _all_help_texts()
    assert "(default: gfx942)" in texts["isa"]
    assert "(default: 64)" in texts["roofline"] and "(default: pa_tile_bench.json)" in texts["bench"]
    assert "(default: 0)" in texts["check"]  # --seed
    for name, text in texts.items():
        assert "checkout" not in text, name
        assert "default: None" not in text, name


def test_missing_stage_error_does_not_assume_a_checkout(capsys, monkeypatch):
    import pa_tile.stages as stages

    monkeypatch.setattr(stages, "available", lambda: list(stages.STAGES)[:-1])
    code, out, err = run(capsys, "isa", "--stage", list(stages.STAGES)[-1])
    assert code == 2 and "is not built" in err and "checkout" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pa_tile {pa_tile.__version__}"


def test_check_shows_the_shared_progress_bar_when_someone_watches(capsys, monkeypatch):
    if gpu_available():
        pytest.skip("the check runs on the GPU here, not in the emulator")
    import pa_tile.progress as progress

    real = progress.progress
    # watched (a terminal, or JupyterLab), and a launch long enough for the bar to appear
    monkeypatch.setenv(progress.ENV_VAR, "1")
    monkeypatch.setattr(progress, "progress", lambda *a, **k: real(*a, **{**k, "delay": 0.0}))
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 0, err
    assert "[emu] scale_add_kernel" in err and "wg" in err
    monkeypatch.setenv(progress.ENV_VAR, "0")
    code, out, err = run(capsys, "check", "--kernel", "tiny")
    assert code == 0 and "[emu]" not in err


def test_export_check_without_notebooks_refuses(capsys, monkeypatch, tmp_path):
    # an installed wheel: pa_tile/ is there, notebooks/ next to it is not
    monkeypatch.setattr(_export, "NOTEBOOKS", tmp_path / "notebooks")
    assert _export.main(["--check"]) == 2
    err = capsys.readouterr()
    assert "cannot run" in err.err and "notebooks" in err.err and "ok" not in err.out
    assert _export.main([]) == 2


def test_bench_exits_non_zero_when_a_check_fails(monkeypatch, tmp_path, capsys):
    """`pa_tile bench` used to exit 0 even when every correctness check failed."""
    from pa_tile.__main__ import main
    from pa_tile.perf import bench

    def fake_run(*a, **k):
        return {"results": [dict(impl="s6", status="ok", reason=None),
                            dict(impl="s5", status="check_failed", reason="max_rel 0.9 > 0.08")]}

    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "format_results", lambda r: "table")
    assert main(["bench", "--out", str(tmp_path / "b.json")]) == 1
    assert "1 of 2 runs failed" in capsys.readouterr().err
    monkeypatch.setattr(bench, "run", lambda *a, **k: {"results": [dict(impl="s6", status="ok")]})
    assert main(["bench", "--out", str(tmp_path / "b.json")]) == 0
