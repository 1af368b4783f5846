"""fsspec defaults: storage options set in this process and exported to the environment its children inherit."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import fsspec.config

_PROTOCOL = re.compile(r"^[a-z][a-z0-9]*$")  # FSSPEC_<PROTOCOL>_<KEY> splits on the first two "_"
_KEY = re.compile(r"^[a-z][a-z0-9_]*$")  # fsspec lower-cases keys read from the environment


def validate(options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``options`` as plain dicts, or ValueError naming the bad protocol/key (never a value)."""
    out: dict[str, dict[str, Any]] = {}
    for protocol, opts in (options or {}).items():
        if not isinstance(protocol, str) or not _PROTOCOL.match(protocol):
            raise ValueError(f"storage_options: protocol {protocol!r} must be lowercase letters/digits, e.g. 's3'")
        if not isinstance(opts, Mapping):
            raise ValueError(f"storage_options.{protocol}: expected a mapping of fsspec keyword arguments")
        for key, value in opts.items():
            if not isinstance(key, str) or not _KEY.match(key):
                raise ValueError(f"storage_options.{protocol}: key {key!r} must be a lowercase identifier")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ValueError(f"storage_options.{protocol}.{key}: value is not JSON-serialisable") from None
        out[protocol] = dict(opts)
    return out


def env_name(protocol: str, key: str) -> str:
    """The environment variable fsspec reads ``key`` of ``protocol`` from."""
    return f"FSSPEC_{protocol.upper()}_{key.upper()}"


def install(options: Mapping[str, Mapping[str, Any]]) -> None:
    """Set ``options`` as fsspec defaults in this process and in the environment its children inherit."""
    for protocol, opts in validate(options).items():
        fsspec.config.conf.setdefault(protocol, {}).update(opts)
        for key, value in opts.items():
            os.environ[env_name(protocol, key)] = json.dumps(value)
