"""Entry point of the ``gpufleet`` CLI.

Every command module stays light at import time; heavy libraries load inside the command.
User errors (bad flags, bad config, bad input) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import click
import typer

from gpufleet.core.errors import GpufleetError, SupervisorError, UsageError

app = typer.Typer(
    name="gpufleet",
    help="Keep every GPU in a fleet doing useful work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    # Imported here so `gpufleet --help` costs only Typer; each module imports torch lazily.
    from gpufleet.cli import ckpt, demo, report, run

    run.register(app)
    report.register(app)
    demo.register(app)
    app.add_typer(ckpt.app, name="ckpt")


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit."""
    print(f"gpufleet: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        rv = app(args=argv, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError:
        raise SystemExit(0) from None
    except click.ClickException as e:  # bad flags: Click's usage errors, one line, exit 2
        fail(e.format_message().replace("\n", " "), 2)
    except click.exceptions.Abort:
        fail("aborted", 130)
    except SupervisorError as e:
        print(f"gpufleet: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except UsageError as e:
        fail(str(e).replace("\n", " "), 2)
    except GpufleetError as e:
        fail(str(e).replace("\n", " "), 1)
    raise SystemExit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
