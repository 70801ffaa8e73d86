"""tests/gpu/train_profile.py's trace bookkeeping (the script itself runs on the GPU machine)."""
import importlib.util
import pathlib

from jax_flash.bench import kernels

_PATH = pathlib.Path(__file__).parent / "gpu" / "train_profile.py"
_spec = importlib.util.spec_from_file_location("train_profile", _PATH)
train_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_profile)


def _report(*calls):
  return kernels.KernelReport(
      kernels=[kernels.Kernel(f"kernel_{i}", 10.0, c, 0.1) for i, c in enumerate(calls)],
      source="test")


def test_kernels_with_lost_events_are_named():
  # 6 steps traced: a kernel run once or twice per step is complete; 4 or 0 calls are not.
  assert train_profile.dropped_kernels(_report(6, 12, 4), steps=6) == ["kernel_2"]
  assert train_profile.dropped_kernels(_report(6, 12), steps=6) == []


def test_incomplete_trace_is_reported(capsys):
  train_profile.print_report("cudnn", _report(6, 4), steps=6, top=5)
  out = capsys.readouterr().out
  assert "INCOMPLETE TRACE: 1 kernel(s)" in out and "kernel_1" in out
