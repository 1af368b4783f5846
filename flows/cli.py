"""``python -m flows.cli``: the ``lexiflow`` command line under its old module name (it lives in :mod:`lexiflow.cli`).

Kept for scripts that run ``python -m flows.cli`` and for installs whose ``lexiflow`` script still names
``flows.cli:app`` (made before the move): ``app`` here is :func:`lexiflow.cli.main`, so such a script behaves as
``python -m lexiflow`` does (its environment defaults, its last line). The one import from ``flows`` up to
``lexiflow`` (ignored by the import contract, by name).
"""

from lexiflow.cli import main

app = main  # the console script of installs made before the move: `sys.exit(app())`

if __name__ == "__main__":  # pragma: no cover
    main()
