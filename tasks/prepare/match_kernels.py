"""Numba kernels of the lexicon matcher: trie nodes from sorted words, the trie walk, top-k ranks, FMM spans.

Each kernel is plain Python code wrapped by :func:`kernel`: a call whose size argument is small runs that
code as Python (a one-row ``lexiflow label`` then never imports numba nor loads its compiled code, about
0.9 s); a larger call compiles it with numba on first use, cached on disk (``cache=True``), ``nogil`` so
threads run it in parallel. Both run the same source, so they give the same arrays
(``tests/test_lexicon.py`` checks both paths). :mod:`tasks.prepare.matcher` holds the typed wrappers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SMALL = 2048  # work (see Kernel.size) at or under which a kernel runs as Python (``LEXIFLOW_JIT=1``: never)


class Kernel:
    """A matcher kernel: ``py_func`` as Python for small inputs, numba-compiled (lazily, once) otherwise."""

    def __init__(self, fn: Callable, size_args: tuple[int, ...]):
        self.py_func, self.size_args, self._jit = fn, size_args, None
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def jitted(self) -> Callable:
        if self._jit is None:
            import numba  # imported here: small inputs never pay for it

            self._jit = numba.njit(cache=True, nogil=True)(self.py_func)
        return self._jit

    def size(self, args: tuple) -> int:
        """The work of a call: the sum over the size arguments of an int's value or an array's element count."""
        return sum(int(a) if isinstance(a, int | np.integer) else int(np.size(a)) for a in map(args.__getitem__,
                                                                                           self.size_args))

    def __call__(self, *args):
        if _force_jit() or self.size(args) > SMALL:
            return self.jitted()(*args)
        return self.py_func(*args)


def _force_jit() -> bool:
    import os

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
            # the child of ``node`` for ``c`` (inlined by hand: ~10% faster than a call here)
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
