"""What every command line offers a newcomer: `--version`, help on every option, and one line (no
traceback) for a bad option value, naming the values it takes."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from ftkit import __version__
from ftkit.runtime.cli import app as ft_run
from ftkit.runtime.console import printable
from ftkit.tools.bench.cli import app as ft_bench
from ftkit.tools.calibrate.cli import app as ft_calibrate
from ftkit.tools.convert.cli import app as ftw_convert
from ftkit.tools.diagnose.cli import app as ft_diagnose

APPS = {"ft-run": ft_run, "ft-bench": ft_bench, "ft-calibrate": ft_calibrate, "ftw-convert": ftw_convert,
        "ft-diagnose": ft_diagnose}


def commands(name: str, cmd):
    yield name, cmd
    if hasattr(cmd, "commands"):  # a group (typer's click, not necessarily the click package)
        for sub, child in cmd.commands.items():
            yield from commands(f"{name} {sub}", child)


@pytest.mark.parametrize("prog", APPS)
def test_version(prog: str) -> None:
    result = CliRunner().invoke(APPS[prog], ["--version"], prog_name=prog)
    assert (result.exit_code, result.stdout) == (0, f"{prog} {__version__}\n")


def test_every_option_and_command_has_help() -> None:
    missing = []
    for prog, app in APPS.items():
        for name, cmd in commands(prog, typer.main.get_command(app)):
            if not hasattr(cmd, "commands") and not (cmd.help or "").strip():
                missing.append(f"{name}: the command")
            for p in cmd.params:
                if p.param_type_name == "option" and not (p.help or "").strip():
                    missing.append(f"{name} {p.opts[0]}")
    assert not missing, "without help: " + ", ".join(missing)


def test_usage_lines_name_arguments_plainly() -> None:
    """`Usage: ftw-convert [OPTIONS] SRC`, not typer's `{SRC}` for a required argument."""
    braced = []
    for prog, app in APPS.items():
        for name, cmd in commands(prog, typer.main.get_command(app)):
            if not hasattr(cmd, "commands"):
                pieces = cmd.collect_usage_pieces(typer.Context(cmd, info_name=name))
                braced += [f"{name}: {p}" for p in pieces if "{" in p]
    assert not braced, braced
    result = CliRunner().invoke(ftw_convert, ["--help"], prog_name="ftw-convert")
    assert "Usage: ftw-convert [OPTIONS] SRC " in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--cache-bytes", "lots"], "--cache-bytes takes a byte size such as 8G, 512M or 4096, got 'lots'"),
    (["--gpu-budget", "abc"], "--gpu-budget takes a byte size such as 8G, 512M or 4096, got 'abc'"),
    (["--dtype", "int8"], "--dtype must be one of float32, float16, bfloat16, got 'int8'"),
    (["--cache-experts", "-5"], "--cache-experts must be at least 0, got -5"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--strategy", "fast"], "--strategy must be one of fused, offload, cpu, hybrid, auto, got 'fast'"),
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--bandwidth-ratio", "0"], "--bandwidth-ratio must be a positive number (B_P / B_H), got 0.0"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
])
def test_a_bad_option_value_is_one_line(tmp_path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(ft_run, ["generate", "-m", str(tmp_path / "none.ftw"), "--prompt", "hi", *args])
    assert result.exit_code == 1 and result.stderr == f"error: {message}\n", result.output


def test_serve_sizes_name_their_option(tmp_path) -> None:
    result = CliRunner().invoke(ft_run, ["serve", "-m", str(tmp_path), "--device-memory", "big", "--port", "0"])
    assert result.exit_code == 1
    assert result.stderr == "error: --device-memory takes a byte size such as 8G, 512M or 4096, got 'big'\n"


def test_generated_text_is_printed_without_control_bytes() -> None:
    assert printable("ok\n\tline\x1b[2J\r\x07 ü 漢") == "ok\n\tline\\x1b[2J\\r\\x07 ü 漢"


def test_serve_checks_its_port_before_reading_the_model(tmp_path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(ft_run, ["serve", "-m", str(tmp_path / "not-read.ftw"), "--port", str(port)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
                                    f"ft-run serve? `ft-run ctl stats --url http://127.0.0.1:{port}` asks it")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(("prog", "module"), [("ft-run", "ftkit.runtime.cli"), ("ft-bench", "ftkit.tools.bench.cli")])
def test_the_list_of_commands_gives_each_sentence_whole(prog: str, module: str) -> None:
    """Each command's line in `--help` is its help's first paragraph joined (typer keeps the
    docstring's line breaks there, which cut a sentence off mid-line)."""
    import inspect
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-c", f"from {module} import main; main()", "--help"], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    for name, cmd in typer.main.get_command(APPS[prog]).commands.items():
        first = " ".join(inspect.cleandoc(cmd.help or "").split("\n\n")[0].split())
        assert f"{name} " in out and first in out, (name, first)
