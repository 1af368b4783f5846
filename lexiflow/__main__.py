"""``python -m lexiflow …``: the ``lexiflow`` command line (``flows.cli.main``, the typer app)."""

from flows.cli import main

if __name__ == "__main__":  # pragma: no branch
    main()
