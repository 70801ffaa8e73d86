"""tests/gpu/ncu_source_summary.py on a small ncu source page (the real ones come from the GPU)."""
import io

from gpu_script import load

ncu_source_summary = load("ncu_source_summary")

_PAGE = '''"Kernel Name","void k<1>(Params)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","      @!P0 ISETP.GE.AND P1, PT, R2, R3, PT","10","300","2","8","2"
"0x20","      ISETP.LE.AND P2, PT, R2, R4, P1","30","300","25","5","25"
"0x30","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","60","100","60","0","60"
'''


def test_opcodes_stalls_and_hot_spots():
  kernel, instructions = ncu_source_summary.read_source_page(io.StringIO(_PAGE))
  assert kernel == "void k<1>(Params)"
  assert [i.opcode for i in instructions] == ["ISETP", "ISETP", "HGMMA"]
  assert instructions[1].stalls == {"long_sb": 25.0, "wait": 5.0}  # not-issued columns left out
  text = ncu_source_summary.summarize(kernel, instructions, per=100.0, top=5)
  assert "executed warp instructions: 700 (7.0 per unit of 100)" in text
  assert "ISETP          85.7%         6.0    40.0%" in text
  assert "stall reasons: long_sb 87.0%, wait 13.0%" in text
  assert text.splitlines()[-1].startswith("      2  60.0%        1.00  HGMMA")
