"""Members of archives read through fsspec chains (``tar://<member>::<archive URL>``)."""

from __future__ import annotations

from typing import Any


def check_regular_member(fs: Any, path: str, shown: str) -> None:
    """ValueError naming ``shown`` when ``path`` is a link inside a tar archive (a symbolic or hard link: reading
    it would follow the link to another member, or fail on one that points outside the archive); a plain
    file, or any file outside an archive, passes."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol != "tar":
        return
    target = fs.info(path).get("linkname")
    if target:
        raise ValueError(f"{shown}: archive member {path!r} is a link (to {target!r}); expected a regular file")
