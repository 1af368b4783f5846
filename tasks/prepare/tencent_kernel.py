"""The fast Tencent block parser: a numba kernel for the common line shape, the careful parser for the rest.

The kernel handles a word without spaces followed by ``D`` plain decimals such as ``-0.123456`` or ``1e-05`` and
hands every other line to :func:`tasks.prepare.tencent_careful.parse_line`. Its numbers are bit-identical to
``np.float32(float(text))``: ``D.DDDDDD`` values (the Tencent layout) are checked and converted 8 bytes at a time;
other decimals ``m * 10**e`` with ``m <= 2**53`` and ``|e| <= 22`` take Clinger's fast path (exact operands, one
IEEE rounding, so the same double as ``float()``; ``m / 10**k`` is computed as ``m * 10**-k`` unless that lands
within 8 ulps of a float32 rounding midpoint), then are rounded to float32 as numpy does; anything else goes to the
careful parser. The kernel releases the GIL, so blocks parse in parallel threads.
"""

from __future__ import annotations

import threading

import numpy as np

from tasks.common.rejects import UNDECODABLE
from tasks.prepare.tencent_careful import Block, parse_block_careful, parse_lines, reject_text_at

_POW10 = np.array([10.0**i for i in range(23)], dtype=np.float64)
_INV10 = np.array([float(f"1e-{i}") for i in range(23)], dtype=np.float64)
_TWO53 = 1 << 53
_LO = 1.0 - 2.0**-49
_HI = 1.0 + 2.0**-49
_E6 = float("1e-6")
_u = np.uint64  # index with unsigned ints: numba then skips negative-index wraparound
# SWAR constants for the 8-byte "D.DDDDDD" fast path
_SW_ZEROS = np.uint64(0x3030303030303030)
_SW_NOT_DOT = np.uint64(0xFFFFFFFFFFFF00FF)
_SW_ADD = np.uint64(0x7676767676767676)
_SW_HIGH = np.uint64(0x8080808080808080)
_SW_M = np.uint64(0x000000FF000000FF)
_SW_MUL1 = np.uint64(0x000F424000000064)  # 100 + (1000000 << 32)
_SW_MUL2 = np.uint64(0x0000271000000001)  # 1 + (10000 << 32)


def _kernel_py(buf, dim, out):  # pragma: no cover - compiled by numba
    """Parse a block of whole lines; ``buf`` must be empty or end with ``\\n``; ``out``
    (float32, C order) needs at least ``min(lines, buf.size // (2 * dim) + 1)`` rows.

    Returns ``(n_lines, n_ok, ok_line, ok_start, words, words_len, bad_line,
    bad_start, bad_end, n_bad)``: ``out[:n_ok]`` holds the vectors of the lines the
    kernel accepted, ``words[:words_len]`` their words, each followed by ``\\n``;
    ``bad_*[:n_bad]`` the lines it leaves to the careful parser.  Every line ends
    with ``\\n``, which no scanning loop below goes past, so they need no bounds
    checks.

    A value is either the common ``D.DDDDDD`` (checked and converted 8 bytes at a
    time: float32(m * 1e-6) equals float32(m / 1e6) for every m < 10**7, checked
    exhaustively) or parsed digit by digit into ``m * 10**ex`` (Clinger's fast path,
    see the module docstring); anything else sends the line to the careful parser.
    """
    n = buf.size
    n_lines = 0
    for i in range(n):
        if buf[_u(i)] == 10:
            n_lines += 1
    # A line the kernel accepts has at least 2*dim bytes including its newline.
    max_ok = min(n_lines, n // (2 * dim) + 1)
    if out.shape[0] < max_ok or out.shape[1] != dim:
        raise ValueError("kernel: out has too few rows or the wrong width")
    ok_line = np.empty(max_ok, dtype=np.int64)
    ok_start = np.empty(max_ok, dtype=np.int64)
    bad_line = np.empty(n_lines, dtype=np.int64)
    bad_start = np.empty(n_lines, dtype=np.int64)
    bad_end = np.empty(n_lines, dtype=np.int64)
    words = np.empty(n + 1, dtype=np.uint8)
    n_ok = 0
    n_bad = 0
    wpos = 0
    pos = 0
    line = 0
    last = dim - 1
    while pos < n:
        ls = pos
        p = pos
        while buf[_u(p)] != 32 and buf[_u(p)] != 10:
            p += 1
        wend = p
        ok = buf[_u(p)] == 32
        if ok:
            p += 1
            for j in range(dim):
                c = buf[_u(p)]
                neg = c == 45  # '-'
                p += np.int64(neg or c == 43)  # '+'
                fast = False
                f = np.float32(0.0)
                if p + 9 <= n:
                    q = _u(p)
                    x = (
                        _u(buf[q])
                        | (_u(buf[q + _u(1)]) << _u(8))
                        | (_u(buf[q + _u(2)]) << _u(16))
                        | (_u(buf[q + _u(3)]) << _u(24))
                        | (_u(buf[q + _u(4)]) << _u(32))
                        | (_u(buf[q + _u(5)]) << _u(40))
                        | (_u(buf[q + _u(6)]) << _u(48))
                        | (_u(buf[q + _u(7)]) << _u(56))
                    )
                    c8 = buf[q + _u(8)]
                    y = (x ^ _SW_ZEROS) & _SW_NOT_DOT  # digits -> 0..9, the '.' -> 0
                    if (
                        ((y + _SW_ADD) | y) & _SW_HIGH == _u(0)  # 7 digits around ...
                        and (x >> _u(8)) & _u(0xFF) == _u(46)  # ... a '.' at byte 1
                        and (c8 == 32 or c8 == 10)
                    ):
                        v8 = y * _u(10) + (y >> _u(8))
                        v8 = (((v8 & _SW_M) * _SW_MUL1) + (((v8 >> _u(16)) & _SW_M) * _SW_MUL2)) >> _u(32)
                        # v8 is the value of "d0 0 dddddd"; m is that of "d0 dddddd"
                        m = np.int64(v8) - np.int64(y & _u(0xFF)) * 9000000
                        f = np.float32(float(m) * _E6)
                        p += 8
                        fast = True
                if not fast:
                    m = 0
                    q = p
                    while True:
                        d = np.int64(buf[_u(p)]) - 48
                        if d < 0 or d > 9:
                            break
                        m = m * 10 + d
                        p += 1
                    nd = p - q
                    fr = 0
                    if buf[_u(p)] == 46:  # '.'
                        p += 1
                        q = p
                        while True:
                            d = np.int64(buf[_u(p)]) - 48
                            if d < 0 or d > 9:
                                break
                            m = m * 10 + d
                            p += 1
                        fr = p - q
                        nd += fr
                    if nd == 0 or (nd > 15 and (nd > 18 or m > _TWO53)):
                        ok = False
                        break
                    ex = -fr
                    c = buf[_u(p)]
                    if c == 101 or c == 69:  # 'e' / 'E'
                        p += 1
                        c = buf[_u(p)]
                        eneg = c == 45
                        if eneg or c == 43:
                            p += 1
                        ev = 0
                        q = p
                        while True:
                            d = np.int64(buf[_u(p)]) - 48
                            if d < 0 or d > 9:
                                break
                            if ev < 100000:
                                ev = ev * 10 + d
                            p += 1
                        if p == q:
                            ok = False
                            break
                        ex += -ev if eneg else ev
                    x64 = float(m)
                    if ex == 0:
                        f = np.float32(x64)
                    elif 0 < ex <= 22:
                        f = np.float32(x64 * _POW10[ex])  # exact operands, one rounding
                    elif -22 <= ex < 0:
                        # x64 / 10**k is the correctly rounded double that float() gives;
                        # x64 * 10**-k is within 3 ulps of it and rounds to the same
                        # float32 unless a float32 midpoint lies within 8 ulps.
                        v = x64 * _INV10[-ex]
                        f = np.float32(v * _LO)
                        if f != np.float32(v * _HI):
                            f = np.float32(x64 / _POW10[-ex])
                    else:
                        ok = False
                        break
                # a value ends at a single space; the last one at the end of the line
                c = buf[_u(p)]
                if j != last:
                    if c != 32:
                        ok = False
                        break
                    p += 1
                else:
                    # trailing ASCII whitespace is stripped, like str.rstrip()
                    while c == 32 or c == 9 or c == 13 or c == 11 or c == 12:
                        p += 1
                        c = buf[_u(p)]
                    if c != 10:
                        ok = False
                        break
                out[_u(n_ok), _u(j)] = -f if neg else f
        # every loop above stops at the line's newline at the latest
        while buf[_u(p)] != 10:
            p += 1
        if ok:
            ok_line[n_ok] = line
            ok_start[n_ok] = ls
            n_ok += 1
            for k in range(ls, wend):
                words[wpos] = buf[_u(k)]
                wpos += 1
            words[wpos] = 10
            wpos += 1
        else:
            bad_line[n_bad] = line
            bad_start[n_bad] = ls
            bad_end[n_bad] = p
            n_bad += 1
        line += 1
        pos = p + 1
    return (n_lines, n_ok, ok_line, ok_start, words, wpos, bad_line, bad_start, bad_end, n_bad)


_kernel = None
_kernel_lock = threading.Lock()


def _get_kernel():
    """The block kernel, compiled by numba on first use (and cached on disk by numba);
    None when numba cannot be imported (everything then takes the careful path)."""
    global _kernel
    if _kernel is None:
        with _kernel_lock:
            if _kernel is None:
                try:
                    import numba  # noqa: PLC0415 - importing numba takes ~0.4 s; loading cached embeddings needs none
                except Exception:  # pragma: no cover - only on broken installs
                    _kernel = False
                else:
                    _kernel = numba.njit(nogil=True, cache=True, boundscheck=False)(_kernel_py)
    return _kernel or None


def kernel_available() -> bool:
    """Whether the numba kernel can be compiled here (else every block takes the careful parser)."""
    return _get_kernel() is not None


def rows_needed(nbytes: int, dim: int) -> int:
    """Upper bound on the lines the kernel accepts in ``nbytes`` bytes."""
    return nbytes // (2 * dim) + 1


def parse_block_fast(data, dim: int, out: np.ndarray | None = None) -> Block:
    """Parse a block of whole lines (bytes-like) with the kernel; odd lines go careful.

    ``out`` (float32 ``[>= rows_needed(len(data), dim), dim]``) receives the vectors;
    the returned block's ``vectors`` may be a view of it."""
    kernel = _get_kernel()
    if kernel is None:
        return parse_block_careful(data, dim)
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size and buf[-1] != 10:  # the file's last line has no newline
        buf = np.frombuffer(buf.tobytes() + b"\n", dtype=np.uint8)
    if buf.flags.writeable:  # one array type for numba: one compiled specialisation
        buf = buf.view()
        buf.flags.writeable = False
    if out is None:
        out = np.empty((rows_needed(buf.size, dim), dim), dtype=np.float32)
    (n_lines, n_ok, ok_line, ok_s, wbuf, wpos, bad_line, bad_s, bad_e, n_bad) = kernel(
        buf, dim, out
    )
    vectors = out[:n_ok]
    word_lines = ok_line[:n_ok]
    word_starts = ok_s[:n_ok]
    wbytes = wbuf[:wpos].tobytes()
    rejects: list[tuple[int, str, str]] = []
    try:
        words = wbytes.decode("utf-8").split("\n")
        words.pop()  # after the final separator
    except UnicodeDecodeError:  # rare: find the undecodable words one by one
        words, keep = [], []
        for i, w in enumerate(wbytes.split(b"\n")[:-1]):
            try:
                words.append(w.decode("utf-8"))
                keep.append(i)
            except UnicodeDecodeError:
                rejects.append((int(word_lines[i]), UNDECODABLE, reject_text_at(buf, int(word_starts[i]))))
        vectors, word_lines, word_starts = vectors[keep], word_lines[keep], word_starts[keep]
    if n_bad:
        bad = ((int(bad_line[k]), int(bad_s[k]), buf[bad_s[k] : bad_e[k]].tobytes()) for k in range(n_bad))
        extra_words, extra_rows, extra_lines, extra_starts, extra_rejects = parse_lines(bad, dim)
        rejects.extend(extra_rejects)
        if extra_words:
            all_lines = np.concatenate([word_lines, np.array(extra_lines, dtype=np.int64)])
            order = np.argsort(all_lines, kind="stable")
            vectors = np.concatenate(
                [vectors, np.array(extra_rows, dtype=np.float32).reshape(-1, dim)]
            )[order]
            merged = words + extra_words
            words = [merged[i] for i in order.tolist()]
            word_lines = all_lines[order]
            word_starts = np.concatenate(
                [word_starts, np.array(extra_starts, dtype=np.int64)]
            )[order]
    if rejects:
        rejects.sort(key=lambda r: r[0])
    return Block(int(n_lines), words, vectors, word_lines, word_starts, buf, rejects)

