"""Every entry point sets OpenMP's waiting policy before torch (and its OpenMP runtime) loads."""

import os
import subprocess
import sys

import pytest

ENTRY_IMPORTS = ["models", "tasks", "flows", "lexiflow"]


def _env_without_policy() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    return env


@pytest.mark.parametrize("module", ENTRY_IMPORTS)
def test_import_sets_passive_wait_before_torch(module):
    code = (f"import sys, os\nimport {module}\n"
            "assert 'torch' not in sys.modules, 'torch loaded before the policy could take effect'\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=_env_without_policy(), capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "PASSIVE"


def test_caller_policy_is_kept():
    env = _env_without_policy() | {"OMP_WAIT_POLICY": "ACTIVE"}
    out = subprocess.run([sys.executable, "-c", "import os, lexiflow; print(os.environ['OMP_WAIT_POLICY'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "ACTIVE"


def test_native_mode_sets_it_too():
    env = _env_without_policy() | {"LEXIFLOW_NUMERICS": "native"}
    out = subprocess.run([sys.executable, "-c", "import os, models; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "PASSIVE"

