"""Entry point of the ``gpufleet`` CLI.

Every command module stays light at import time; heavy libraries load inside the command.
:func:`main` is the CLI's one error boundary: an error from the tree in gpufleet.core.errors becomes one
line on stderr and that error's ``exit_code`` (2 for bad flags, config or input; 1 for a failure at run
time). An ``OSError`` that no command turned into such an error becomes one line naming its path, exit 1.
Commands raise; they do not print their own errors or exit.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from gpufleet.core.errors import GpufleetError, SupervisorError
from gpufleet.core.exitcodes import ExitCode

if TYPE_CHECKING:
    import click

app = typer.Typer(
    name="gpufleet",
    help="Keep every GPU in a fleet doing useful work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("gpufleet")
        except PackageNotFoundError:  # running from a source tree that was never installed
            from gpufleet import __version__ as v
        print(f"gpufleet {v}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_show_version, help="Print the version and exit."
    ),
) -> None:
    """Keep every GPU in a fleet doing useful work."""


def _register() -> None:
    # Imported here so `gpufleet --help` costs only Typer; each module imports torch lazily.
    from gpufleet.cli import ckpt, demo, report, run

    run.register(app)
    report.register(app)
    demo.register(app)
    app.add_typer(ckpt.app, name="ckpt")
    # Pillars added later register here, one line each (their modules must import lightly).
    from gpufleet.cli import health as health_cli, nodes as nodes_cli  # noqa: I001

    app.add_typer(health_cli.app, name="health")
    nodes_cli.register(app)  # noqa: E702
    from gpufleet.cli import serve as serve_cli

    app.add_typer(serve_cli.app, name="serve")  # noqa: E702, I001
    from gpufleet.cli import fleet as fleet_cli

    app.add_typer(fleet_cli.app, name="fleet")  # noqa: E702, I001
    from gpufleet.cli import compress as compress_cli

    app.add_typer(compress_cli.app, name="compress")  # noqa: E702, I001
    from gpufleet.cli import observe as observe_cli

    observe_cli.register(app)  # noqa: E702, I001


def fail(message: str, code: int = ExitCode.USAGE) -> None:
    """Print one line to stderr and exit."""
    print(f"gpufleet: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _os_message(e: OSError) -> str:
    """``PATH: reason`` for an OSError (both paths of a rename or link)."""
    reason = e.strerror or _one_line(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


_built: tuple[typer.Typer, click.Command] | None = None


def _command() -> click.Command:
    """The click command of :data:`app` with every command module registered, built once: Typer
    rebuilds it on each call, and registering twice would add each command group again."""
    global _built
    if _built is None or _built[0] is not app:
        _register()
        _built = (app, typer.main.get_command(app))
    return _built[1]


def main(argv: list[str] | None = None) -> None:
    try:
        rv = _command().main(args=argv, prog_name="gpufleet", standalone_mode=False)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except (typer.Abort, KeyboardInterrupt):
        fail("aborted", ExitCode.INTERRUPTED)
    except typer.TyperException as e:  # bad flags (Typer's usage errors): one line, exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # help was printed
            raise SystemExit(0) from None
        fail(_one_line(e.format_message()), ExitCode.USAGE)
    except SupervisorError as e:
        print(f"gpufleet: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except GpufleetError as e:
        fail(_one_line(e), e.exit_code)
    except OSError as e:  # an I/O failure at run time that no command named more precisely
        fail(_os_message(e), ExitCode.FAILED)
    except UnicodeDecodeError as e:  # input that is not text, read where no path was known
        fail(f"input is not UTF-8 text ({_one_line(e.reason)} at byte {e.start})", ExitCode.USAGE)
    raise SystemExit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
