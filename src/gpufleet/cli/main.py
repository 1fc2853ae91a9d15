"""Entry point of the ``gpufleet`` CLI.

Every command module stays light at import time; heavy libraries load inside the command.
User errors (bad flags, bad config, bad input) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import typer

from gpufleet.core.errors import GpufleetError, SupervisorError, UsageError
from gpufleet.core.exitcodes import ExitCode

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


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        rv = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        fail("aborted", ExitCode.INTERRUPTED)
    except typer.TyperException as e:  # bad flags (Typer's usage errors): one line, exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # help was printed
            raise SystemExit(0) from None
        fail(e.format_message().replace("\n", " "), ExitCode.USAGE)
    except SupervisorError as e:
        print(f"gpufleet: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except UsageError as e:
        fail(str(e).replace("\n", " "), ExitCode.USAGE)
    except GpufleetError as e:
        fail(str(e).replace("\n", " "), ExitCode.FAILED)
    raise SystemExit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
