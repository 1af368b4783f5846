"""Pinned CPU numerics: one kernel choice on every x86-64 machine with AVX2, recorded for versions.

Float results on CPU depend on which kernels run: ATen's vectorised kernels (AVX2 or AVX-512), oneDNN's JIT ISA,
MKL's code branch, OpenBLAS's kernel set and NumPy's SIMD loops, and the number of threads a reduction is split
over. :func:`pin_cpu_numerics` fixes them through the environment variables each library reads once, when it
loads or first computes (:data:`PINS`); it must run before torch computes anything and before NumPy is imported
(``import models``, ``import tasks``, ``import flows`` and ``import lexiflow`` call it and import nothing heavy
first, so every CLI, worker, Dask worker and torchrun rank is pinned; child processes inherit the environment).
:func:`numerics_record` checks that the pins took effect (refusing a process where torch computed before them)
and returns what the process runs; torch stages record it in their manifest and hash it into their version, and
the labeller refuses to resume an output under other numerics.

What this does not reach: MKL accepts its conditional-numerical-reproducibility branches (``MKL_CBWR=AVX2``) only on
Intel CPUs; on AMD it falls back to ``AUTO`` and picks its code path from the CPU. The record then says so
(``mkl_cbwr: AUTO`` plus ``mkl_cpu``, the vendor and widest vector ISA), so an Intel and an AMD machine, or an
AVX2-only and an AVX-512 AMD machine, get different versions rather than silently different bytes under one.
A process that imported NumPy before lexiflow keeps NumPy's own SIMD level (recorded as ``numpy_simd``).

``LEXIFLOW_NUMERICS=native`` opts out (machine-default kernels); it is recorded and versioned like any setting.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from typing import Any

PIN_ENV = "LEXIFLOW_NUMERICS"  # "avx2" (default) or "native"
PINS = {  # read by torch (ATen), oneDNN and MKL at their first use, by OpenBLAS and NumPy when they load
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    # STRICT: without it MKL's AVX2 branch is reproducible only for aligned arrays, and a row block multiplied in
    # place (a view at any offset) got other bits than the same block in a fresh, aligned buffer (Intel AVX-512)
    "MKL_CBWR": "AVX2,STRICT",
    # NumPy/SciPy's OpenBLAS (scikit-learn's baselines, gensim's sample vectors): AVX2 kernels and one thread
    # (threads also enforced at run time, threadpoolctl); NumPy's own SIMD loops: AVX2 (x86-64-v3), never AVX-512
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}
# How OpenMP threads wait at the end of a parallel region: "PASSIVE" sleeps instead of spinning. Spinning threads
# fight every other process for the cores, and a descheduled thread stalls each of torch's many small parallel
# regions, so a busy machine slows labelling many times over (figures: docs/notes/decisions.md). Scheduling only:
# results are the same bits either way. A value the caller set is kept (OMP_WAIT_POLICY=ACTIVE opts back in to
# spinning, for a machine the job owns alone).
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
# fbgemm (int8) is left free: models.rowwise's int8 products accumulate exactly in int32 and every float op after
# them is per element, so its AVX2, AVX-512 and VNNI kernels give the same bits (tests/test_numerics.py), and
# pinning it to AVX2 slows int8 linears on a VNNI CPU (docs/notes/decisions.md)
# mkl_cbwr.h branch codes; MKL_CBWR_STRICT (0x10000) is a flag on top
_MKL_BRANCHES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1",
                 8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1",
                 14: "AVX512_E1"}


class NumericsError(RuntimeError):
    """torch computed before the CPU kernels were pinned, or a resume would mix numerics."""


def mode() -> str:
    """The numerics mode from ``LEXIFLOW_NUMERICS``: 'avx2' (pinned, the default) or 'native'."""
    value = os.environ.get(PIN_ENV, "avx2").strip().lower() or "avx2"
    if value not in ("avx2", "native"):
        raise NumericsError(f"{PIN_ENV}={value!r}: expected 'avx2' (pinned, the default) or 'native'")
    return value


NUMPY_KEYS = ("numpy_simd", "blas")  # the record's NumPy part: what only NumPy/SciPy computations depend on


# Scheduling-side thread pools, sized to the CPUs this process may use (available_cpus): they change how work is
# spread, never the arithmetic. torch's intra-op threads are not among them: a float reduction (a training step's
# gradients, measured) gives other bits split over another number of threads, so they stay the configured count
# and enter the version; with passive waiting, more threads than CPUs costs little.
NUMBA_THREADS_ENV = "NUMBA_NUM_THREADS"  # numba's parallel pool (its kernels here run serially, in nogil threads)


def pin_cpu_numerics() -> None:
    """Set the kernel-choice environment variables (mode ``avx2``, on a CPU with AVX2 and FMA), overriding what the
    caller's environment had. Cheap and idempotent; imports nothing. Under ``native``, or on a CPU without AVX2 (where
    these kernels cannot run; the record then says what runs), it leaves the kernel choice alone. In every mode it
    sets OpenMP's waiting policy (:data:`WAIT_POLICY`) unless the caller set one: it must be set before torch (and
    its OpenMP runtime) loads, and it changes scheduling, never results."""
    for key, value in WAIT_POLICY.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault(NUMBA_THREADS_ENV, str(available_cpus()))
    if mode() == "avx2" and _cpu_has_avx2():
        os.environ.update(PINS)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs (the smallest; None: no quota or no
    cgroup). cgroup v2: ``cpu.max`` (``<quota> <period>`` or ``max``); v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` in the ``cpu`` controller's hierarchy. Paths come from ``proc_cgroup``; where the
    container's namespace shows its own cgroup as ``/``, the files at ``root`` itself are read."""
    try:
        with open(proc_cgroup, encoding="ascii", errors="replace") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None
    limits: list[float] = []

    def read(path: str) -> str | None:
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip()
        except OSError:
            return None

    def ancestors(base: str, rel: str) -> list[str]:
        parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
        return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]

    for _, controllers, rel in lines:
        if controllers == "":  # v2 unified hierarchy
            for d in ancestors(root, rel):
                quota = (read(os.path.join(d, "cpu.max")) or "").split()
                if len(quota) == 2 and quota[0] != "max":
                    limits.append(int(quota[0]) / int(quota[1]))
        elif "cpu" in controllers.split(","):
            for base in (os.path.join(root, controllers), os.path.join(root, "cpu")):
                for d in ancestors(base, rel):
                    q, p = read(os.path.join(d, "cpu.cfs_quota_us")), read(os.path.join(d, "cpu.cfs_period_us"))
                    if q and p and int(q) > 0 and int(p) > 0:
                        limits.append(int(q) / int(p))
    return min(limits) if limits else None


def available_cpus() -> int:
    """How many CPUs this process may keep busy at once: its affinity mask (``os.sched_getaffinity``; the machine's
    count where that does not exist), capped by a cgroup CPU quota (:func:`cgroup_cpu_limit`, rounded up); at
    least 1. Pools that only schedule work (never the arithmetic) are sized by it."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def scheduling_threads(configured: int) -> int:
    """``configured`` capped by :func:`available_cpus`: for a scheduling-side pool (Dask workers, a loader),
    never more than configured."""
    return max(1, min(int(configured), available_cpus()))


_INTEROP = {"set": False}


def cap_interop_threads() -> None:
    """torch's inter-op pool (which runs ``torch.jit.fork`` work, not a kernel's arithmetic) sized to
    :func:`available_cpus` instead of the machine's cores, once per process; where torch already started
    inter-op work (the size can then no longer change) it is left as it is."""
    if _INTEROP["set"]:
        return
    import torch  # noqa: PLC0415 - torch must load after pin_cpu_numerics set its environment

    _INTEROP["set"] = True
    n = available_cpus()
    if torch.get_num_interop_threads() > n:
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(n)


def _cpuinfo() -> tuple[str, list[str]]:
    """(vendor, flags) of the first CPU (Linux: /proc/cpuinfo); ("", []) elsewhere."""
    vendor, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:
        pass
    return vendor, flags


def _cpu_has_avx2() -> bool:
    """Whether this CPU has AVX2 and FMA; False where unknown (then nothing is refused)."""
    flags = _cpuinfo()[1]
    return "avx2" in flags and "fma" in flags


def cpu_class() -> str:
    """Vendor and widest vector ISA, e.g. ``AuthenticAMD avx512``: what MKL's ``AUTO`` branch dispatches on."""
    vendor, flags = _cpuinfo()
    return f"{vendor or 'unknown'} {'avx512' if 'avx512f' in flags else 'avx2' if 'avx2' in flags else 'other'}"


def _mkl_branch() -> str | None:
    """MKL's effective CBWR branch as MKL reports it (``mkl_serv_cbwr_get``), None where torch has no MKL."""
    import torch  # noqa: PLC0415 - torch must load after pin_cpu_numerics set its environment

    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):  # another platform or an MKL build that hides the symbol
        return "unknown"
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    code = get(-1)  # MKL_CBWR_ALL
    name = _MKL_BRANCHES.get(code & 0xFFFF, str(code & 0xFFFF))
    return f"{name},STRICT" if code & 0x10000 else name


def numerics_record() -> dict[str, Any]:
    """What this process computes with on CPU: the mode, ATen's capability, MKL's branch (and, where MKL follows
    the CPU, the CPU's class), oneDNN's ISA cap, the torch thread count (set it first) and the torch version. Raises
    :class:`NumericsError` when the pins did not take effect (torch ran a kernel before they were set)."""
    import torch  # noqa: PLC0415 - torch must load after pin_cpu_numerics set its environment

    m = mode()
    cap_interop_threads()
    capability = torch.backends.cpu.get_cpu_capability()  # fixed at torch's first dispatched kernel
    mkl = _mkl_branch()
    if m == "avx2":
        pinned_late = []
        if capability != "AVX2" and _cpu_has_avx2():
            pinned_late.append(f"ATen runs {capability}, not AVX2")
        if mkl in ("OFF", "BRANCH_OFF"):
            pinned_late.append("MKL initialised without MKL_CBWR")
        if pinned_late:
            raise NumericsError(
                "torch computed before lexiflow pinned its CPU kernels (" + "; ".join(pinned_late) + "): import "
                "lexiflow (or models/tasks/flows) before running any torch op, or start the process with "
                + " ".join(f"{k}={v}" for k, v in PINS.items()))
    record = {
        "mode": m,
        "cpu_capability": capability,
        "mkl_cbwr": mkl,
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if mkl is not None and not mkl.startswith(("AVX2", "COMPATIBLE")):  # MKL follows the CPU: name its class
        record["mkl_cpu"] = cpu_class()
    record.update(_numpy_numerics(m))
    return record


def _numpy_numerics(m: str) -> dict[str, Any]:
    """NumPy's widest enabled SIMD level and its BLAS (OpenBLAS kernel set and threads; the threads are set to
    one here when pinned, whenever NumPy was imported). The kernel set and SIMD level are fixed when NumPy loads:
    a process that imported NumPy before lexiflow records the machine's own, and so gets its own versions."""
    try:
        import threadpoolctl  # noqa: PLC0415 - NumPy (which it loads) must load after the pins
        from numpy._core._multiarray_umath import __cpu_features__  # noqa: PLC0415 - as above
    except ImportError:  # pragma: no cover - NumPy 1.x layout or no threadpoolctl (scikit-learn brings it)
        return {}
    if m == "avx2":
        threadpoolctl.threadpool_limits(limits=1, user_api="blas")
    blas = sorted({f"{i.get('internal_api')} {i.get('architecture')} x{i.get('num_threads')}"
                   for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"})
    simd = next((k for k in ("AVX512_SPR", "AVX512_ICL", "X86_V4", "X86_V3") if __cpu_features__.get(k)), "X86_V2")
    return {"numpy_simd": simd, "blas": blas}


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with torch's CPU thread count at ``n`` (None: as it is), restored afterwards."""
    import torch  # noqa: PLC0415 - torch must load after pin_cpu_numerics set its environment

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def numerics_difference(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """``key: old -> new`` for every setting that differs (empty when equal): for refusal messages."""
    old = old or {}
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))
