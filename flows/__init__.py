"""Prefect flows (order and wiring only) and the typer CLI."""
