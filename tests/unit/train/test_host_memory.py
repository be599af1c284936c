"""The trainer keeps freed host memory for reuse (optimus/train/host_memory.py): a large tensor made again after
one was freed comes from the heap, not from fresh kernel pages. Read from glibc's own accounting (mallinfo2's
bytes in mmapped blocks), not from timings, in a fresh interpreter so no earlier test has set the thresholds."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, torch
from optimus.train.host_memory import reuse_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mapped_while_held(nbytes):
    held = torch.zeros(nbytes // 4)
    mapped = libc.mallinfo2().hblkhd
    del held
    return mapped

size = 64 * 2 ** 20
print(mapped_while_held(size) >= size, reuse_freed_host_memory(), mapped_while_held(size) < size)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_freed_large_block_is_reused_instead_of_mapped_afresh():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    # glibc's default maps the 64 MiB tensor from the kernel; once the thresholds are fixed, the heap serves it
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr


def test_elsewhere_it_declines_without_error(monkeypatch):
    from optimus.train import host_memory

    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    assert host_memory.reuse_freed_host_memory() is False


@pytest.mark.parametrize("reuse", [True, False])
def test_the_trainer_keeps_freed_memory_on_the_cpu_unless_told_not_to(tmp_path, small_token_dir, monkeypatch, reuse):
    import optimus.train.trainer as trainer
    from optimus.config import build_config
    from tests.helpers.runs import tiny_run_config

    calls = []
    monkeypatch.setattr(trainer, "reuse_freed_host_memory", lambda: calls.append("reuse") or True)
    config = build_config(tiny_run_config(tmp_path, small_token_dir, train=dict(max_steps=1, reuse_host_memory=reuse)))
    trainer.Trainer(config, callbacks=[])
    assert calls == (["reuse"] if reuse else [])
