"""tests/gpu/train_profile.py's report of a trace that lost events (the script runs on the GPU)."""
from jax_flash.bench import kernels

from gpu_script import load

train_profile = load("train_profile")


def _report(*calls):
  return kernels.KernelReport(
      kernels=[kernels.Kernel(f"kernel_{i}", 10.0, c, 0.1) for i, c in enumerate(calls)],
      source="test")


def test_incomplete_trace_is_reported(capsys):
  train_profile.print_report("cudnn", _report(6, 4), steps=6, top=5)
  out = capsys.readouterr().out
  assert "INCOMPLETE TRACE: 1 kernel(s)" in out and "kernel_1" in out


def test_complete_trace_is_not_flagged(capsys):
  train_profile.print_report("v3", _report(6, 12), steps=6, top=5)
  assert "INCOMPLETE" not in capsys.readouterr().out
