"""Our Triton kernels on CPU under Triton's interpreter, against the references.

The interpreter is switched on by TRITON_INTERPRET=1, read when triton is imported; so the
checks run in one subprocess with that variable set, and each is reported here as a test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus.ops._device import triton_installed

import triton_checks

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreter_results():
    root = str(Path(__file__).resolve().parents[3])  # the script imports tests.helpers
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    script = Path(__file__).with_name("triton_checks.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", list(triton_checks.CHECKS))
def test_triton_kernel_under_interpreter(interpreter_results, check):
    assert interpreter_results[check] == "ok", interpreter_results[check]
