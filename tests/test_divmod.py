"""The v3 forward decodes its tiles with a multiply-shift division (cuda/divmod.h, DivMod) whose
multipliers the host prepares. It is host and device code, so its exactness is checked here, on
any machine with nvcc: tests/gpu/divmod_check.cu compares it with 64-bit division on edge and
random divisors, on every dividend below 2^31 for six divisors, and on the decode of every unit of
the benchmark grid's launches; it also holds the tile rule of head dim 64's non-causal rows
(cuda/v3_fwd_tiles.h) to the choice measured best on each shape it was measured on."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _nvcc():
  return os.environ.get("CUDACXX") or shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (the check is host code built by it)")
def test_divmod_is_exact(tmp_path):
  binary = tmp_path / "divmod_check"
  subprocess.run([_nvcc(), "-O2", "-std=c++17", str(ROOT / "tests/gpu/divmod_check.cu"), "-o",
                  str(binary)], check=True, capture_output=True, text=True)
  result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-2000:]
  assert "ALL PASSED" in result.stdout
