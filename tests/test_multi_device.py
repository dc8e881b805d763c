"""Multi-device checks (sharded jit, ring attention) on a forced 4-device CPU.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts, so
the checks in ``tests/multi_device/`` run in their own pytest process with the
flag set; each file here is one test of this suite (CI runs them under
``pytest -n 2`` like the rest).
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = sorted(p.name for p in (ROOT / "tests" / "multi_device").glob(
    "*_checks.py"))


@pytest.mark.slow
@pytest.mark.parametrize("checks", CHECKS)
def test_on_four_cpu_devices(checks):
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       "-p", "no:xdist", f"tests/multi_device/{checks}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  report = proc.stdout[-6000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, report
  assert " passed" in proc.stdout and " failed" not in proc.stdout, report
