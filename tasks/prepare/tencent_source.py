"""Byte sources for the Tencent reader: newline-aligned blocks from a memory map, a stream or a tar member.

Plain local files are memory-mapped; anything else (compressed, remote, ``memory://``, a member of a tar archive
named by ``tar://<member>::<archive>``) is read as a stream. Each source hands out the header line, then blocks of
whole lines in file order.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import tarfile

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

_HEADER_MAX_BYTES = 1 << 16  # a longer first line is no header
_RELEASE_BYTES = 64 << 20  # drop mapped input pages from the resident set in steps of this


class StreamSource:
    """Newline-aligned blocks read from a file object into fresh numpy buffers."""

    def __init__(self, f):
        self.f = f
        self.carry = b""
        self.eof = False
        self._readinto = getattr(f, "readinto", None)

    @property
    def exhausted(self) -> bool:
        """Whether the whole file was read and handed out."""
        return self.eof and not self.carry

    def header(self) -> bytes:
        """The first line; what was read past it becomes the start of the first block
        (plain ``read``: not every decompressing reader has ``readline``)."""
        data = b""
        while b"\n" not in data and len(data) < _HEADER_MAX_BYTES:
            chunk = self.f.read(4096)
            if not chunk:
                self.eof = True
                break
            data += chunk
        cut = data.find(b"\n")
        cut = min(len(data), _HEADER_MAX_BYTES) if cut < 0 else cut + 1
        self.carry = data[cut:]
        return data[:cut]

    def release(self, block: np.ndarray) -> None:
        """Nothing to release: each block is a fresh buffer."""

    def close(self) -> None:
        """Nothing to close: the caller owns the file object."""

    def _fill(self, buf: np.ndarray, start: int) -> int:
        """Fill ``buf[start:]`` as far as the file allows; returns the end offset."""
        pos = start
        end = buf.size
        while pos < end:
            if self._readinto is not None:
                try:
                    n = self._readinto(memoryview(buf[pos:]))
                except (io.UnsupportedOperation, NotImplementedError, AttributeError):
                    self._readinto = None
                    continue
            else:
                chunk = self.f.read(end - pos)
                n = len(chunk)
                buf[pos : pos + n] = np.frombuffer(chunk, dtype=np.uint8)
            if not n:
                self.eof = True
                break
            pos += n
        return pos

    def next_block(self, size: int):
        """``(block, n_bytes_read)``: a uint8 array of whole lines, or None at the end."""
        size = max(int(size), 1)
        got = 0
        while True:
            if self.eof:
                if not self.carry:
                    return None
                data, self.carry = self.carry, b""
                return np.frombuffer(data, dtype=np.uint8), got
            c = len(self.carry)
            buf = np.empty(c + size, dtype=np.uint8)
            if c:
                buf[:c] = np.frombuffer(self.carry, dtype=np.uint8)
            end = self._fill(buf, c)
            got += end - c
            if self.eof:
                self.carry = b""
                if end == 0:
                    return None
                return buf[:end], got
            cut = _rfind_newline(buf, end)
            if cut < 0:  # one line longer than the block: keep reading
                self.carry = buf[:end].tobytes()
                size *= 2
                continue
            self.carry = buf[cut + 1 : end].tobytes()
            return buf[: cut + 1], got


def _rfind_newline(buf: np.ndarray, end: int) -> int:
    window = 1 << 16
    hi = end
    while hi > 0:
        lo = max(0, hi - window)
        k = buf[lo:hi].tobytes().rfind(b"\n")
        if k >= 0:
            return lo + k
        hi = lo
        window *= 4
    return -1


class MmapSource:
    """Newline-aligned blocks as views of a memory-mapped local file (no copies)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(self.mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.size = len(self.mm)
        self.pos = 0
        self.released = 0
        self.base = self.arr.ctypes.data

    @property
    def exhausted(self) -> bool:
        """Whether the whole file was handed out."""
        return self.pos >= self.size

    def header(self) -> bytes:
        """The first line (at most ``_HEADER_MAX_BYTES``); blocks start after it."""
        end = self.mm.find(b"\n", 0, _HEADER_MAX_BYTES)
        end = min(self.size, _HEADER_MAX_BYTES) if end < 0 else end + 1
        self.pos = end
        return self.mm[:end]

    def next_block(self, size: int):
        """``(block, n_bytes)``: a view of about ``size`` bytes of whole lines, or None at the end."""
        if self.pos >= self.size:
            return None
        start = self.pos
        end = min(self.size, start + max(int(size), 1))
        if end < self.size:
            cut = self.mm.rfind(b"\n", start, end)
            if cut < 0:  # one line longer than the block
                cut = self.mm.find(b"\n", end)
            end = self.size if cut < 0 else cut + 1
        self.pos = end
        return self.arr[start:end], end - start

    def release(self, block: np.ndarray) -> None:
        """Drop the pages of everything up to the end of ``block`` (merged, in file
        order) from this process's resident set; the page cache keeps them."""
        end = block.ctypes.data + block.size - self.base
        if not (0 <= end <= self.size) or not hasattr(self.mm, "madvise"):
            return  # not a view of this map (the last line's copy)
        end -= end % mmap.PAGESIZE
        if end - self.released >= _RELEASE_BYTES:  # batched: each call costs TLB flushes
            try:
                self.mm.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            except (OSError, ValueError, AttributeError):
                pass
            self.released = end

    def close(self) -> None:
        """Unmap the file (left to the GC while a block view is alive)."""
        self.arr = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


@contextlib.contextmanager
def open_blocks(uri: str):
    """``(source, total bytes or None)`` for any fsspec URL: a tar chain's member, a memory map or a stream."""
    with contextlib.ExitStack() as stack:
        chain = tar_member(uri)
        if chain is not None:
            f, total = stack.enter_context(open_tar_member(*chain))
            src = StreamSource(f)
        else:
            of = fsspec.open(uri, "rb", compression="infer")
            total = None if of.compression else size_of(of)
            src, f = open_source(of)
            if f is not None:
                stack.callback(f.close)
        stack.callback(src.close)
        yield src, total


def open_source(of):
    """A memory map for plain local files, else a stream (compressed, remote, memory)."""
    if isinstance(of.fs, LocalFileSystem) and not of.compression:
        try:
            if os.path.getsize(of.path) > 0:
                return MmapSource(of.path), None
        except (OSError, ValueError):
            pass
    f = of.open()
    return StreamSource(f), f


def tar_member(uri: str) -> tuple[str, str] | None:
    """``(member, archive URL)`` for an fsspec chain ``tar://<member>::<archive URL>``, else None."""
    head, sep, target = uri.partition("::")
    if not sep or not head.startswith("tar://"):
        return None
    return head[len("tar://"):].strip("/"), target


@contextlib.contextmanager
def open_tar_member(member: str, archive: str):
    """``(file, size)``: ``member`` of a tar archive (``.tar``, ``.tar.gz``, ``.tar.bz2``, ``.tar.xz``; any fsspec
    URL), read in one forward pass. fsspec's own ``tar://`` file system indexes the archive first, which for a
    compressed one means decompressing all of it, then decompresses it again from the start to reach the member;
    here ``tarfile``'s stream mode stops at the member and hands it over as a stream, never extracted to disk nor
    read whole."""
    with fsspec.open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tf:
        for ti in tf:
            name = ti.name.strip("/")
            if name.startswith("./"):
                name = name[2:]
            if name != member:
                continue
            if not ti.isfile():
                raise ValueError(f"{archive}: member {member!r} is not a regular file")
            with tf.extractfile(ti) as f:
                yield f, ti.size
            return
    raise FileNotFoundError(f"{archive}: the archive has no member {member!r}")


def size_of(of) -> int | None:
    """The size in bytes of an fsspec ``OpenFile``'s target, or None where its file system cannot tell."""
    try:
        size = of.fs.size(of.path)
        return int(size) if size is not None else None
    except Exception:
        return None

