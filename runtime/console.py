"""What every command shares: one-line errors instead of tracebacks, byte sizes for humans."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Annotated, NoReturn

import typer
import typer.core
from rich.console import Console

from ftkit import __version__
from ftkit.errors import InputError, one_line

err_console = Console(stderr=True)
# Bad input files (InputError: every reader's), outputs that exist, and bad option values.
USER_ERRORS = (InputError, FileExistsError, FileNotFoundError, ValueError)
USAGE = 2  # the exit code of a bad command line (click's too)


def printable(text: str) -> str:
    """Generated text as a terminal should get it: control characters (an escape sequence, a
    carriage return, a bell) written as escapes; newlines and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


def guarded(fn: Callable[[], object]) -> None:
    """Run a command body; a known user-facing error becomes one line and exit code 1."""
    try:
        fn()
    except USER_ERRORS as e:
        fail(one_line(str(e).splitlines()[0]) if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        fail("interrupted", 130)


def _print_version(ctx: typer.Context, value: bool) -> None:
    if value:
        print(f"{ctx.find_root().info_name} {__version__}")
        raise typer.Exit()


# `--version` for every command: printed before any other option is read (or any module loaded).
Version = Annotated[bool, typer.Option("--version", is_eager=True, expose_value=False, callback=_print_version,
                                       help="print the version and exit")]


class PlainUsage(typer.core.TyperCommand):
    """A command whose usage line names its arguments as click does (`SRC`), not in the braces
    typer puts around a required one (`{SRC}`), which read as literal characters to type."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


def listed(app: typer.Typer) -> typer.Typer:
    """`app` with each command's line in the list of commands the first paragraph of its help
    joined into one line: typer's listing keeps the docstring's line breaks, which cut a wrapped
    sentence off mid-line there."""
    for info in app.registered_commands:
        text = info.help or (info.callback.__doc__ if info.callback else None)
        if info.short_help is None and text:
            info.short_help = " ".join(inspect.cleandoc(text).split("\n\n")[0].split())
    return app


def parse_bytes(text: str, flag: str = "a size") -> int:
    """'8G', '512M', '1.5GiB', '4096' -> bytes (binary multiples); `flag` names the option."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"{flag} takes a byte size such as 8G, 512M or 4096, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)
