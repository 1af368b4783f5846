"""Numba kernels of the lexicon matcher: trie nodes from sorted words, the trie walk, top-k ranks, FMM spans, and
the lexicon stage's shard kernels (UTF-8 token codepoints, whole-word groups, the per-token slot columns).

Each kernel is plain Python code wrapped by :func:`kernel`: a call whose size argument is small runs that
code as Python (a one-row ``lexiflow label`` then never imports numba nor loads its compiled code, about
0.9 s); a larger call compiles it with numba on first use, cached on disk (``cache=True``), ``nogil`` so
threads run it in parallel. Both run the same source, so they give the same arrays
(``tests/test_lexicon.py`` checks both paths). :mod:`tasks.text.matcher` holds the typed wrappers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

SMALL = 2048  # work (see Kernel.size) at or under which a kernel runs as Python (``LEXIFLOW_JIT=1``: never)


class Kernel:
    """A matcher kernel: ``py_func`` as Python for small inputs, numba-compiled (lazily, once) otherwise."""

    def __init__(self, fn: Callable, size_args: tuple[int, ...]):
        self.py_func, self.size_args, self._jit = fn, size_args, None
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def jitted(self) -> Callable:
        """The numba-compiled kernel, compiled (or loaded from numba's disk cache) on first use."""
        if self._jit is None:
            import numba  # noqa: PLC0415 - small inputs never pay its import and load (module doc)

            self._jit = numba.njit(cache=True, nogil=True)(self.py_func)
        return self._jit

    def size(self, args: tuple) -> int:
        """The work of a call: the sum over the size arguments of an int's value or an array's element count."""
        return sum(int(a) if isinstance(a, int | np.integer) else int(np.size(a)) for a in map(args.__getitem__,
                                                                                           self.size_args))

    def __call__(self, *args):
        """Run the kernel: as Python for a small call, compiled otherwise (always compiled with LEXIFLOW_JIT=1)."""
        if _force_jit() or self.size(args) > SMALL:
            return self.jitted()(*args)
        return self.py_func(*args)


def _force_jit() -> bool:
    return os.environ.get("LEXIFLOW_JIT") == "1"


def kernel(*size_args: int) -> Callable[[Callable], Kernel]:
    """Decorator: ``size_args`` are the indices of the arguments whose sizes decide Python or numba."""
    return lambda fn: Kernel(fn, size_args)


@kernel(0)
def build_nodes(cps, offs, ranks, max_len):
    """Pre-order trie nodes of lexicographically sorted words."""
    nw = offs.shape[0] - 1
    total = cps.shape[0] + 1
    parent = np.empty(total, np.int32)
    code = np.empty(total, np.int32)
    depth = np.empty(total, np.int32)
    term = np.full(total, -1, np.int32)
    parent[0] = -1
    code[0] = -1
    depth[0] = 0
    path = np.zeros(max_len + 1, np.int32)
    n_nodes = 1
    ps = 0
    pl = 0
    for w in range(nw):
        s = offs[w]
        L = offs[w + 1] - s
        lcp = 0
        m = min(L, pl)
        while lcp < m and cps[s + lcp] == cps[ps + lcp]:
            lcp += 1
        for d in range(lcp, L):
            parent[n_nodes] = path[d]
            code[n_nodes] = cps[s + d]
            depth[n_nodes] = d + 1
            path[d + 1] = n_nodes
            n_nodes += 1
        term[path[L]] = ranks[w]
        ps = s
        pl = L
    return (
        parent[:n_nodes].copy(),
        code[:n_nodes].copy(),
        depth[:n_nodes].copy(),
        term[:n_nodes].copy(),
    )


@kernel(0)
def walk(cps, root, rows, max_depth, min_len):
    """Every trie word (at least ``min_len`` long) starting at each codepoint: (starts, lengths, ranks)."""
    n = cps.shape[0]
    cap = max(1024, n + (n >> 1), 2 * max_depth)
    out_s = np.empty(cap, np.int64)
    out_l = np.empty(cap, np.int32)
    out_r = np.empty(cap, np.int32)
    m = 0
    nroot = root.shape[0]
    for i in range(n):
        c = cps[i]
        if c < nroot:
            node = root[c]
            if node < 0:
                continue
            depth = 1
        else:  # past the dense root table: the search below starts at the root row, depth 0
            node = 0
            depth = 0
        if m + max_depth > cap:  # at most max_depth matches start at i
            cap = 2 * cap
            ns = np.empty(cap, np.int64)
            nl = np.empty(cap, np.int32)
            nr = np.empty(cap, np.int32)
            ns[:m] = out_s[:m]
            nl[:m] = out_l[:m]
            nr[:m] = out_r[:m]
            out_s = ns
            out_l = nl
            out_r = nr
        while True:  # min_len >= 1, so depth 0 never records
            if depth >= min_len:
                r = rows[node, 1]
                if r >= 0:
                    out_s[m] = i
                    out_l[m] = depth
                    out_r[m] = r
                    m += 1
            j = i + depth
            if j >= n:
                break
            c = cps[j]
            # the child of ``node`` for ``c``, inlined: a call in this innermost loop costs measurably
            lo = rows[node, 2]
            hi = rows[node, 3]
            node = -1
            if hi - lo <= 8:
                for q in range(lo, hi):
                    v = rows[q, 0]
                    if v >= c:
                        if v == c:
                            node = q
                        break
            else:
                while lo < hi:
                    mid = (lo + hi) >> 1
                    v = rows[mid, 0]
                    if v < c:
                        lo = mid + 1
                    elif v > c:
                        hi = mid
                    else:
                        node = mid
                        break
            if node < 0:
                break
            depth += 1
    return out_s[:m].copy(), out_l[:m].copy(), out_r[:m].copy()


@kernel(0, 1)
def top_k(n, starts, lengths, ranks, k):
    """Per position of an ``n``-long text: the ``k`` lowest word ranks among matches covering it, -1 padded."""
    out = np.full((n, k), -1, np.int32)
    if k <= 0:
        return out
    for e in range(starts.shape[0]):
        r = ranks[e]
        s = starts[e]
        for p in range(s, s + lengths[e]):
            row = out[p]
            # row is sorted ascending with -1 padding at the end
            last = row[k - 1]
            if last != -1 and last <= r:
                continue  # full and no better (or already present as last)
            dup = False
            q = 0
            while q < k:
                v = row[q]
                if v == -1 or v > r:
                    break
                if v == r:
                    dup = True
                    break
                q += 1
            if dup:
                continue
            t = k - 1
            while t > q:
                row[t] = row[t - 1]
                t -= 1
            row[q] = r
    return out


@kernel(0, 1)
def fmm_spans(n, starts, lengths):
    """Forward maximum matching: from left to right, the longest match (>= 2) at each position, as [m, 2] spans."""
    best = np.zeros(n, np.int64)
    for e in range(starts.shape[0]):
        s = starts[e]
        L = lengths[e]
        if L >= 2 and 0 <= s < n and s + L <= n and L > best[s]:
            best[s] = L
    out = np.empty((n // 2 + 1, 2), np.int64)
    m = 0
    i = 0
    while i < n:
        L = best[i]
        if L >= 2:
            out[m, 0] = i
            out[m, 1] = i + L
            m += 1
            i += L
        else:
            i += 1
    return out[:m].copy()


@kernel(0, 1)
def top_k_spans(top, starts, lengths, ranks):
    """Per slot of ``top`` ([n, k] ranks from :func:`top_k`): the span ``[start, end)`` of the
    occurrences of that slot's word covering that position (their union when several do);
    empty slots get ``[0, 0)``."""
    n = top.shape[0]
    k = top.shape[1]
    ws = np.full((n, k), n + 1, np.int64)
    we = np.full((n, k), -1, np.int64)
    for e in range(starts.shape[0]):
        r = ranks[e]
        s = starts[e]
        t = s + lengths[e]
        for p in range(s, t):
            for q in range(k):
                if top[p, q] == r:
                    if s < ws[p, q]:
                        ws[p, q] = s
                    if t > we[p, q]:
                        we[p, q] = t
                    break
    for p in range(n):
        for q in range(k):
            if top[p, q] < 0:
                ws[p, q] = 0
                we[p, q] = 0
    return ws, we


@kernel(0)
def utf8_token_codepoints(data, offs):
    """Arrow string buffers (UTF-8 ``data``, int64 ``offs`` of ``n + 1`` row bounds) -> the rows' token
    strings as codepoints joined by the separator 0, each ``#NUM#`` one ``U+E000`` (as ``str.replace``
    does it: left to right, not overlapping). Returns ``(cps int32, row_start int64, row_len int64, bad)``;
    ``bad`` is the first row that is not strict UTF-8 (as Python's decoder judges it), else -1."""
    n = offs.shape[0] - 1
    out = np.empty(max(0, offs[n] - offs[0]) + max(0, n - 1), np.int32)
    row_start = np.empty(max(n, 0), np.int64)
    row_len = np.empty(max(n, 0), np.int64)
    m = 0
    for r in range(n):
        if r > 0:
            out[m] = 0
            m += 1
        row_start[r] = m
        i = offs[r]
        end = offs[r + 1]
        while i < end:
            b = np.int32(data[i])  # int32 arithmetic below, in Python as in numba (uint8 would wrap)
            if b < 0x80:
                if (b == 0x23 and i + 4 < end and data[i + 1] == 0x4E and data[i + 2] == 0x55
                        and data[i + 3] == 0x4D and data[i + 4] == 0x23):
                    out[m] = 0xE000
                    i += 5
                else:
                    out[m] = b
                    i += 1
                m += 1
                continue
            if 0xC2 <= b <= 0xDF:
                need = 1
                cp = b & 0x1F
                lo = 0x80
                hi = 0xBF
            elif 0xE0 <= b <= 0xEF:
                need = 2
                cp = b & 0x0F
                lo = 0xA0 if b == 0xE0 else 0x80  # no overlong forms
                hi = 0x9F if b == 0xED else 0xBF  # no surrogates
            elif 0xF0 <= b <= 0xF4:
                need = 3
                cp = b & 0x07
                lo = 0x90 if b == 0xF0 else 0x80
                hi = 0x8F if b == 0xF4 else 0xBF  # nothing past U+10FFFF
            else:
                return out[:0].copy(), row_start, row_len, r
            if i + need >= end:  # truncated sequence
                return out[:0].copy(), row_start, row_len, r
            c = np.int32(data[i + 1])
            if c < lo or c > hi:
                return out[:0].copy(), row_start, row_len, r
            cp = (cp << 6) | (c & 0x3F)
            for t in range(2, need + 1):
                c = np.int32(data[i + t])
                if c < 0x80 or c > 0xBF:
                    return out[:0].copy(), row_start, row_len, r
                cp = (cp << 6) | (c & 0x3F)
            out[m] = cp
            m += 1
            i += need + 1
        row_len[r] = m - row_start[r]
    return out[:m].copy(), row_start, row_len, -1


@kernel(0)
def word_groups(cps, row_start, row_len, en_s, en_e, en_off, fmm, num_cp):
    """Whole-word masking units of every row, as ``tasks.prepare.lexicon.whole_word_groups`` builds them:
    the row's English spans and ``#NUM#`` tokens (``num_cp``), then the FMM spans (``fmm`` ``[m, 2]``, absolute
    in ``cps``, ordered) that overlap nothing taken yet; sorted by (start, end). English spans must satisfy
    ``0 <= start`` and ``0 <= end <= row_len`` (the caller checks). Returns flat int32 starts and ends (row
    coordinates) and int64 row offsets ``[n_rows + 1]``."""
    n_rows = row_start.shape[0]
    cap = en_s.shape[0] + cps.shape[0] + fmm.shape[0]
    gs = np.empty(cap, np.int32)
    ge = np.empty(cap, np.int32)
    goff = np.zeros(n_rows + 1, np.int64)
    longest = 0
    for r in range(n_rows):
        longest = max(longest, row_len[r])
    taken = np.zeros(longest + 1, np.bool_)
    ts = np.empty(longest + en_s.shape[0] + 1, np.int64)
    te = np.empty(longest + en_s.shape[0] + 1, np.int64)
    m = 0
    q = 0
    n_fmm = fmm.shape[0]
    for r in range(n_rows):
        off = row_start[r]
        n = row_len[r]
        for p in range(n + 1):
            taken[p] = False
        g = 0
        for j in range(en_off[r], en_off[r + 1]):
            s = en_s[j]
            e = en_e[j]
            ts[g] = s
            te[g] = e
            g += 1
            for p in range(s, e):
                taken[p] = True
        for p in range(n):
            if cps[off + p] == num_cp:
                ts[g] = p
                te[g] = p + 1
                g += 1
                taken[p] = True
        while q < n_fmm and fmm[q, 0] < off + n:
            s = fmm[q, 0] - off
            e = fmm[q, 1] - off
            q += 1
            free = True
            for p in range(s, e):
                if taken[p]:
                    free = False
                    break
            if free:
                ts[g] = s
                te[g] = e
                g += 1
                for p in range(s, e):
                    taken[p] = True
        key = np.empty(g, np.int64)
        for j in range(g):
            key[j] = ts[j] * (n + 2) + te[j]
        order = np.argsort(key)
        for j in range(g):
            gs[m] = ts[order[j]]
            ge[m] = te[order[j]]
            m += 1
        goff[r + 1] = m
    return gs[:m].copy(), ge[:m].copy(), goff


@kernel(0)
def shard_slots(cps, top, ws, we, row_start, row_len, id_of_rank, char_of_cp, unk):
    """The flat per-token columns of a shard, separators between rows dropped: char ids (``char_of_cp`` per
    codepoint, ``unk`` past its end), word ids (``id_of_rank[rank]``, ``[PAD]`` = 0; with an empty
    ``id_of_rank`` the ranks themselves, ``[PAD]`` = -1), and each slot's word span relative to its row
    (``[0, 0)`` for ``[PAD]``). Returns ``(char_ids, words, starts, ends, covered)``: int32 arrays of
    ``T`` and ``T * k`` values, and how many tokens have a word."""
    k = top.shape[1]
    total = 0
    for r in range(row_start.shape[0]):
        total += row_len[r]
    chars = np.empty(total, np.int32)
    words = np.empty(total * k, np.int32)
    starts = np.empty(total * k, np.int32)
    ends = np.empty(total * k, np.int32)
    n_char = char_of_cp.shape[0]
    ids = id_of_rank.shape[0] > 0
    covered = 0
    t = 0
    for r in range(row_start.shape[0]):
        off = row_start[r]
        for p in range(off, off + row_len[r]):
            c = cps[p]
            chars[t] = char_of_cp[c] if c < n_char else unk
            if k > 0 and top[p, 0] >= 0:
                covered += 1
            for q in range(k):
                rank = top[p, q]
                j = t * k + q
                if rank >= 0:
                    words[j] = id_of_rank[rank] if ids else rank
                    starts[j] = ws[p, q] - off
                    ends[j] = we[p, q] - off
                else:
                    words[j] = 0 if ids else rank
                    starts[j] = 0
                    ends[j] = 0
            t += 1
    return chars, words, starts, ends, covered
