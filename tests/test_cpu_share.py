"""Scheduling pools are sized to the CPUs the process may use (affinity, cgroup quota); torch's intra-op threads,
which enter the numerics and the version, stay as configured."""

import os
import subprocess
import sys

import pytest

from models import numerics


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_cgroup_or_an_ancestor_the_smallest_wins(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kube/pod1/ctr\n")
    _write(tmp_path / "fs/kube/pod1/ctr/cpu.max", "max 100000\n")
    _write(tmp_path / "fs/kube/pod1/cpu.max", "150000 100000\n")
    _write(tmp_path / "fs/kube/cpu.max", "400000 100000\n")
    assert numerics.cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 1.5


def test_cgroup_v1_cfs_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/job\n")
    _write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    assert numerics.cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 0.5
    _write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_quota_us", "-1\n")  # v1's "no quota"
    assert numerics.cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) is None
    assert numerics.cgroup_cpu_limit(str(tmp_path / "fs"), str(tmp_path / "missing")) is None


def test_scheduling_threads_never_exceed_the_configured_count_nor_the_cpus():
    cpus = numerics.available_cpus()
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
    assert numerics.scheduling_threads(1) == 1
    assert numerics.scheduling_threads(cpus + 5) == cpus


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_one_cpu_process_sizes_its_pools_to_one_but_keeps_the_configured_torch_threads():
    """A process pinned to one CPU: numba's pool and torch's inter-op pool get one thread, torch's intra-op
    threads (part of the numerics record and so of every torch stage's version) stay as configured."""
    code = ("import os\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "import models\nimport torch\nfrom tasks.inference.runtime import numerics_config\n"
            "rec = numerics_config(2, 'cpu')\n"
            "print(os.environ['NUMBA_NUM_THREADS'], torch.get_num_interop_threads(), rec['threads'])")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "2"]


def test_a_caller_numba_thread_count_is_kept():
    env = dict(os.environ) | {"NUMBA_NUM_THREADS": "7"}
    out = subprocess.run([sys.executable, "-c", "import os, lexiflow; print(os.environ['NUMBA_NUM_THREADS'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "7"
