"""``python -m flows.cli``: the ``lexiflow`` command line under its old module name (it lives in :mod:`lexiflow.cli`).

Kept for scripts that run ``python -m flows.cli`` and for installs whose ``lexiflow`` script still names
``flows.cli:app``; the one import from ``flows`` up to ``lexiflow`` (ignored by the import contract, by name).
"""

from lexiflow.cli import app, main  # noqa: F401  (app: the console script of installs made before the move)

if __name__ == "__main__":  # pragma: no cover
    main()
