"""The v3 forward's barrier protocol (Q buffers, K / V stages, the pingpong ring, fused tile
boundaries, output stores staged in a Q buffer or a K / V stage, and the K / V multicast of a
cluster of two CTAs) as a CPU model, tests/gpu/v3_fwd_protocol_model.py: random tile sequences
under random interleavings, alone and in clusters, must neither deadlock nor overwrite a buffer in
use; two staged Q buffers must still deadlock where the kernel relies on the third, and each
mutation of the cluster's release exchange, "full" barriers, lone loads, passed stage uses and
K / V staging must show the error it causes."""
import pathlib
import subprocess
import sys

MODEL = pathlib.Path(__file__).resolve().parent / "gpu" / "v3_fwd_protocol_model.py"


def test_v3_forward_protocol_model():
  result = subprocess.run([sys.executable, str(MODEL), "3000"], capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stdout[-2000:]
  assert "trials with errors: 0" in result.stdout
