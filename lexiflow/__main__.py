"""``python -m lexiflow …``: the ``lexiflow`` command line (``lexiflow.cli.main``, the typer app)."""

from lexiflow.cli import main

if __name__ == "__main__":  # pragma: no branch
    main()
