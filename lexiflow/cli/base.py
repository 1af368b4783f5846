"""The ``lexiflow`` typer app every command registers on: one-line errors (exit 2), help panels, --storage-options."""

from __future__ import annotations

import atexit
import json
import logging
import re
import signal
import sys
from importlib import metadata
from typing import Annotated, Optional

import click
import typer
import yaml
from pydantic import ValidationError
from typer.core import TyperGroup

from flows.logs import attach as attach_logs
from storage.artifacts import IntegrityError
from storage.options import configure, validate
from storage.urls import public_url

HELP = "lexiflow: Chinese wiki + Tencent lexicon -> LEBERT pipeline (Prefect)."
ALERT_EXIT = 3  # `label --fail-on-alert` / `monitor --fail-on-alert`: a monitoring alert (2: an error; 0: ok)


# ============================================================================= errors: one line, exit 2


class _Commands(TyperGroup):
    """Every command runs through here: a user mistake (see :func:`error_line`) ends as one ``error:`` line
    on stderr and exit code 2; ``--debug`` (or any other exception: a bug) shows the traceback. A run stopped by a
    signal (a training stage's checkpoint-and-stop, or SIGTERM/SIGINT elsewhere) ends with one line that says how
    to go on, exit code 128 + the signal's number. Either line is the last one printed (:func:`final_line`)."""

    def invoke(self, ctx: click.Context):
        attach_logs()  # progress and monitoring lines reach stderr (and a flow run's logs): idempotent
        debug = bool(ctx.params.get("debug"))
        loggers = [] if debug else [logging.getLogger(name) for name in RUN_LOGGERS]
        for lg in loggers:
            lg.addFilter(_quiet_user_errors)
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # usage errors and exits: click's own handling
        except KeyboardInterrupt:
            final_line(stop_line(Stopped(signal.SIGINT)))
            raise typer.Exit(128 + signal.SIGINT) from None
        except SystemExit as e:  # a training stage's Preempted, or Stopped (SIGTERM outside training)
            line = stop_line(e)
            if line is None:
                raise
            final_line(line)
            raise typer.Exit(e.code if isinstance(e.code, int) else 1) from None
        except Exception as e:
            line = error_line(e)
            if line is None or debug:
                raise
            final_line(f"error: {line}")
            raise typer.Exit(2) from None
        finally:
            for lg in loggers:
                lg.removeFilter(_quiet_user_errors)


# ============================================================================= the last line: ours


class Stopped(SystemExit):
    """A command stopped by SIGTERM or SIGINT outside a training stage (which stops at a step boundary on its own):
    exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum
        self.line = (f"stopped by {signal.Signals(signum).name}; run the same command again: committed stages are "
                     "reused (cache hits) and training resumes from its last checkpoint")


def stop_line(e: BaseException) -> str | None:
    """The one line for a run stopped by a signal (``e`` carries ``line`` and ``signum``: a training stage's
    ``Preempted``, or :class:`Stopped`); None for any other exit."""
    line, signum = getattr(e, "line", None), getattr(e, "signum", None)
    if not isinstance(line, str) or not isinstance(signum, int):
        return None
    if "run the same command again" in line:
        return line
    name = signal.Signals(signum).name  # e.g. torchrun's ranks stopped (rank 0 said where): say how to go on
    return f"{line} ({name}); run the same command again to resume from its last checkpoint"


_deferred: list[str] | None = None  # main() makes it a list: the final line then waits for the interpreter's exit


def final_line(text: str) -> None:
    """Print the command's last line on stderr: now, or, under :func:`defer_final_line` (the console script), when
    the process exits, after anything Prefect prints then."""
    if _deferred is None:
        typer.echo(text, err=True)
    else:
        _deferred.append(text)


def defer_final_line() -> None:
    """Make :func:`final_line` print at exit, after Prefect's own exit lines (its temporary server's "Stopping
    temporary server", a crash report): atexit handlers run last-registered first, and this one is registered
    before Prefect is imported, so before any handler of Prefect's. stdout is flushed first, so in a log file that
    takes both streams the line is last too."""
    global _deferred
    if _deferred is None:
        _deferred = []
        atexit.register(_print_deferred)


def _print_deferred() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    for text in _deferred or ():
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def stop_on_signals() -> None:
    """SIGTERM ends a command with :class:`Stopped` (its one line) instead of killing it on the spot, so Prefect's
    run states, our line and the clean-up all happen; a training stage replaces the handler while it trains (it
    stops after the current step). SIGINT already raises KeyboardInterrupt."""
    def stop(signum: int, frame) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)


# Prefect logs a failed flow or task run with its traceback on these loggers (and echoes it to stderr)
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def _quiet_user_errors(record: logging.LogRecord) -> bool:
    """A log filter: a flow/task run that failed on a user mistake is logged without its traceback (the
    CLI's ``error:`` line says it; ``--debug`` keeps it), and URLs without userinfo or query string; everything is
    still logged."""
    if record.exc_info and record.exc_info[1] is not None and error_line(record.exc_info[1]) is not None:
        record.exc_info, record.exc_text = None, None
    message = record.getMessage()
    if "://" in message:  # a failed run's message may quote an input URL: shown without its credential
        record.msg, record.args = _public(message), ()
    return True


def error_line(e: BaseException) -> str | None:
    """One line for a user mistake: a missing or unreadable file, a bad config (unknown key, bad value), a
    missing column, an artifact that is missing or fails its checksum; None for anything else. Notes added
    with ``add_note`` (e.g. the config file) lead the line."""
    expected = {FileNotFoundError: "expected an existing file", IsADirectoryError: "expected a file, not a directory",
                PermissionError: "expected a readable file", NotADirectoryError: "expected a directory on the path",
                FileExistsError: "expected a path that does not exist yet"}
    notes = getattr(e, "__notes__", [])
    unreachable = _unreachable(e) or _no_credentials(e)
    if unreachable is not None:
        text = unreachable
    elif isinstance(e, ValidationError):
        text = "; ".join(_validation_item(err) for err in e.errors()) or str(e)
    elif isinstance(e, UnicodeDecodeError):
        text = f"not UTF-8 text ({e.reason} at byte {e.start}); expected a UTF-8 file"
    elif isinstance(e, tuple(expected)) and e.filename:
        named = any(str(e.filename) in n for n in notes)  # e.g. "config x.yaml" already names the file
        text = ("" if named else f"{e.filename}: ") + f"{e.strerror} ({expected[type(e)]})"
    elif isinstance(e, (*expected, ValueError, IntegrityError, yaml.YAMLError)):
        text = str(e)
    else:
        return None
    return _public(" ".join(": ".join([*notes, text]).split()))


# a storage server that cannot be reached (connection refused, DNS, timeout): botocore, aiohttp, fsspec, the OS
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectTimeout", "ClientConnectorError",
                "ServerTimeoutError", "FSTimeoutError", "ConnectionError", "gaierror"}


# an object store's SDK found no usable credentials: botocore (s3://), google-auth (gs://), azure-identity
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError", "CredentialUnavailableError"}


def _no_credentials(e: BaseException) -> str | None:
    """One line when ``e`` (or what caused it) says the object store's SDK found no credentials, else None."""
    for cause in _chain(e):
        if {c.__name__ for c in type(cause).__mro__} & _NO_CREDENTIALS:
            return (f"no credentials for the object store ({type(cause).__name__}: {cause}); give them in "
                    "--storage-options or the profile's storage_options (e.g. key and secret for s3), or in the "
                    "provider's own variables (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...)")
    return None


def _chain(e: BaseException | None):
    """``e``, then what caused it, and so on (each once)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _unreachable(e: BaseException) -> str | None:
    """One line when ``e`` (or what caused it) says a storage server could not be reached, else None."""
    for cause in _chain(e):
        if {c.__name__ for c in type(cause).__mro__} & _UNREACHABLE:
            return (f"cannot reach the storage server ({type(cause).__name__}: {cause}); check the endpoint_url in "
                    "--storage-options (or FSSPEC_S3_ENDPOINT_URL), the network and the credentials")
    return None


def _public(line: str) -> str:
    """``line`` with every URL in it shown without userinfo or query string (``storage.urls.public_url``)."""
    url = r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*[^\s\"'<>:,;.)\]]"  # a trailing ":" or "," is the sentence's
    return re.sub(url, lambda m: public_url(m.group(0)), line)


def _validation_item(err: dict) -> str:
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    if err["type"] == "missing":
        return f"{loc}: required key missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = repr(err.get("input"))
    if err["type"] == "value_error":
        return msg if msg.startswith(loc) else f"{loc}: {msg}"
    return f"{loc}: {msg} (got {got[:60] + '…' if len(got) > 60 else got})"


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("lexiflow")
        except metadata.PackageNotFoundError:
            version = "unknown (not installed)"
        typer.echo(f"lexiflow {version}")
        raise typer.Exit()


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, help=HELP)

# `lexiflow --help` groups the commands by what a user is doing
PANEL_START = "Get started"
PANEL_BUILD = "Build and train"
PANEL_LABEL = "Label and explain"
PANEL_STORE = "Inspect and manage a store"


@app.callback()
def _global(
    debug: Annotated[bool, typer.Option("--debug", help="show the full traceback of an error")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print `lexiflow <version>` and exit")
    ] = False,
) -> None:
    """Global options: --debug (tracebacks) and --version."""


# every command that opens URIs takes --storage-options (fsspec's FSSPEC_S3_ENDPOINT_URL-style variables also work)
StorageOptions = Annotated[
    Optional[str],
    typer.Option(
        "--storage-options",
        help='fsspec options per protocol as JSON, e.g. \'{"s3": {"endpoint_url": "http://127.0.0.1:9000"}}\' '
        "(FSSPEC_S3_ENDPOINT_URL-style environment variables also work)",
    ),
]


def storage_options(raw: str | None, apply: bool = True) -> dict:
    """``--storage-options`` parsed and validated (and, with ``apply``, installed for every filesystem this
    process and its children open: ``storage.options.configure``); a bad value is one line naming no value, exit 2."""
    try:
        data = json.loads(raw) if raw else {}
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object {protocol: {option: value}}")
        options = validate(data)
    except ValueError as e:
        typer.echo(f"error: --storage-options: {e}", err=True)
        raise typer.Exit(2) from e
    if apply:
        configure(options)
    return options
