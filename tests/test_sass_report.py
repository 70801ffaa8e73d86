"""tests/gpu/sass_report.py on small cuobjdump-style listings (real ones come from nvcc builds)."""
import pytest

from gpu_script import load

sass_report = load("sass_report")

_NS_A = "_GLOBAL__N__3d7c138a_14_v3_bwd_sm90_cu_b67aeebf"
_NS_B = "_GLOBAL__N__91a0f2c4_14_v3_bwd_sm90_cu_0c1d2e3f"


def _listing(namespace: str, loop_body: list[str], spill: bool) -> str:
  """One kernel: a prologue, a loop (body + back edge), an EXIT, then an mbarrier retry path that
  branches back into the code (which must not count as a loop), and a second kernel."""
  lines = [f"\t\tFunction : _ZN9jax_flash47{namespace}6kernelEv",
           "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
           "        /*0010*/                   NOP ;"]
  address = 0x20
  start = address
  for text in loop_body:
    lines.append(f"        /*{address:04x}*/                   {text} ;")
    address += 0x10
  lines.append(f"        /*{address:04x}*/                   @P0 BRA {start:#x} ;")
  address += 0x10
  if spill:
    lines.append(f"        /*{address:04x}*/                   STL [R1], R2 ;")
    address += 0x10
    lines.append(f"        /*{address:04x}*/                   LDL R2, [R1] ;")
    address += 0x10
  lines.append(f"        /*{address:04x}*/                   EXIT ;")
  retry = address + 0x10
  lines.append(f"        /*{retry:04x}*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, "
               "[R3], R4 ;")
  lines.append(f"        /*{retry + 0x10:04x}*/                   @!P0 BRA {retry:#x} ;")
  lines.append(f"        /*{retry + 0x20:04x}*/                   BRA 0x20 ;")
  lines += [f"\t\tFunction : _ZN9jax_flash47{namespace}5otherEv",
            "        /*0000*/                   EXIT ;"]
  return "\n".join(lines) + "\n"


_BODY = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "MUFU.EX2 R5, R6",
         "@!P1 FMNMX R7, R7, R8, !PT", "FMNMX R7, R7, R9, !PT"]


def test_parse_normalizes_the_namespace_and_drops_nops():
  kernels = sass_report.parse_sass(_listing(_NS_A, _BODY, spill=False))
  assert sorted(kernels) == ["_ZN9jax_flash47NS5otherEv", "_ZN9jax_flash47NS6kernelEv"]
  code = kernels["_ZN9jax_flash47NS6kernelEv"]
  assert code[0].text == "LDC R1, c[0x0][0x28]" and code[0].address == 0
  assert "NOP" not in [i.opcode for i in code]
  assert [i.opcode for i in code[1:5]] == ["HGMMA", "MUFU", "FMNMX", "FMNMX"]


def test_loops_are_back_edges_without_exit_and_innermost():
  code = sass_report.parse_sass(_listing(_NS_A, _BODY, spill=True))["_ZN9jax_flash47NS6kernelEv"]
  # The retry path's spin (TRYWAIT, BRA to itself) is a loop; its branch back into the code
  # (a body with the EXIT) is not.
  spans = [(l.start, l.end, len(l.body)) for l in sass_report.loops(code, min_body=2)]
  assert spans == [(0x20, 0x60, 5), (0xa0, 0xb0, 2)]
  found = sass_report.loops(code, min_body=3)
  assert [(l.start, l.end, len(l.body)) for l in found] == [(0x20, 0x60, 5)]
  assert found[0].top_opcodes(2) == [("FMNMX", 2), ("HGMMA", 1)]
  assert sass_report.loops(code, min_body=6) == []
  assert sass_report.local_memory(code) == (1, 1)


def test_report_against_a_base_build():
  base = sass_report.parse_sass(_listing(_NS_A, _BODY, spill=False))
  same = sass_report.parse_sass(_listing(_NS_B, _BODY, spill=False))
  grown = sass_report.parse_sass(_listing(_NS_B, _BODY + ["FADD R9, R9, R7"], spill=True))
  lines = sass_report.report(same, base, "kernel", min_loop=3)
  assert lines[0] == "_ZN9jax_flash47NS6kernelEv  (identical)"
  assert lines[1] == "  instructions 10 (=), STL 0 (=), LDL 0 (=)"
  lines = sass_report.report(grown, base, "kernel", min_loop=3)
  assert lines[0] == "_ZN9jax_flash47NS6kernelEv"
  assert lines[1] == "  instructions 10 -> 13, STL 0 -> 1, LDL 0 -> 1"
  assert lines[2].startswith("    loop 0x20..0x70: 5 -> 6 instructions (FMNMX 2")
  lines = sass_report.report(grown, {}, "kernel", min_loop=3)
  assert lines[:2] == ["_ZN9jax_flash47NS6kernelEv  (not in base)",
                       "  instructions 13, STL 1, LDL 1"]
  alone = sass_report.report(grown, None, "", min_loop=3)
  assert "_ZN9jax_flash47NS5otherEv" in alone
  assert "    loop 0x20..0x70: 6 instructions" in " ".join(alone)


def test_main_reads_listings_and_checks_its_arguments(tmp_path, capsys):
  new = tmp_path / "new.sass"
  new.write_text(_listing(_NS_B, _BODY, spill=False))
  base = tmp_path / "base.sass"
  base.write_text(_listing(_NS_A, _BODY, spill=False))
  assert sass_report.main([str(new), str(base), "--kernel", "kernel", "--min-loop", "3"]) == 0
  assert "(identical)" in capsys.readouterr().out
  assert sass_report.main([str(new), "--kernel", "no_such_kernel"]) == 1
  assert "no kernel name contains 'no_such_kernel'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sass_report.main([str(new), "--min-loop", "0"])
  assert "--min-loop must be at least 1" in capsys.readouterr().err
