"""Where a kernel's instructions and stalls go, from ncu's per-instruction (SASS) source page.

  ncu --section SourceCounters --section WarpStateStats -o rep ...   (on the GPU machine)
  ncu -i rep.ncu-rep --page source --csv --print-source sass > kernel_sass.csv
  python3 tests/gpu/ncu_source_summary.py kernel_sass.csv [--per 131072] [--top 25]

Prints the executed instructions by opcode (with --per N, also per unit of work, e.g. N = the
backward's steps: 64 x 128 (query, key) blocks), the stall reasons' shares, and the hottest
instructions by stall samples with their two main reasons. Session 8 found the v3 backward's
per-score mask tests this way (ISETP at 12% of executed instructions, docs/perf-notes-v3.md).
"""
from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import re
import sys

_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclasses.dataclass
class Instruction:
  source: str     # the SASS text
  executed: float  # warp-level executions
  samples: float   # warp stall samples, all
  stalls: dict[str, float]  # reason -> samples

  @property
  def opcode(self) -> str:
    """The opcode without its modifiers or predicate ("ISETP" for "@P0 ISETP.GE.AND ...")."""
    text = _PREDICATE.sub("", self.source.strip())
    return text.split()[0].split(".")[0] if text else "?"


def _number(text: str) -> float:
  text = text.replace(",", "")
  return float(text) if text not in ("", "-") else 0.0


def read_source_page(lines) -> tuple[str, list[Instruction]]:
  """The kernel's name and its instructions from ncu's `--page source --csv` output."""
  rows = list(csv.reader(lines))
  kernel = rows[0][1] if rows and len(rows[0]) > 1 else "?"
  header = rows[1]
  column = {name: i for i, name in enumerate(header)}
  reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  instructions = [
      Instruction(source=row[column["Source"]],
                  executed=_number(row[column["Instructions Executed"]]),
                  samples=_number(row[column["Warp Stall Sampling (All Samples)"]]),
                  stalls={r[len("stall_"):]: _number(row[column[r]]) for r in reasons})
      for row in rows[2:] if len(row) == len(header)]
  return kernel, instructions


def summarize(kernel: str, instructions: list[Instruction], per: float | None,
              top: int) -> str:
  executed = sum(i.executed for i in instructions) or 1.0
  samples = sum(i.samples for i in instructions) or 1.0
  lines = [f"kernel: {kernel}",
           f"executed warp instructions: {executed:,.0f}"
           + (f" ({executed / per:,.1f} per unit of {per:,.0f})" if per else "")]
  by_opcode = collections.defaultdict(lambda: [0.0, 0.0])
  for i in instructions:
    by_opcode[i.opcode][0] += i.executed
    by_opcode[i.opcode][1] += i.samples
  lines.append("opcode        executed   " + ("per unit   " if per else "") + "stall samples")
  for opcode, (count, stalled) in sorted(by_opcode.items(), key=lambda kv: -kv[1][0])[:top]:
    unit = f"{count / per:9.1f}  " if per else ""
    lines.append(f"{opcode:<12} {100 * count / executed:6.1f}%   {unit}{100 * stalled / samples:6.1f}%")
  reasons = collections.Counter()
  for i in instructions:
    reasons.update(i.stalls)
  lines.append("stall reasons: " + ", ".join(
      f"{r} {100 * n / samples:.1f}%" for r, n in reasons.most_common() if n > 0))
  lines.append("hottest instructions (index, stall samples, executed" +
               (" per unit" if per else "") + ", source, main reasons):")
  hottest = sorted(range(len(instructions)), key=lambda k: -instructions[k].samples)[:top]
  for k in sorted(hottest):
    i = instructions[k]
    count = i.executed / per if per else i.executed
    main = sorted(i.stalls.items(), key=lambda kv: -kv[1])[:2]
    lines.append(f"  {k:5d} {100 * i.samples / samples:5.1f}%  {count:10.2f}  "
                 f"{i.source.strip()[:60]:<60}  " + ", ".join(f"{r} {n:.0f}" for r, n in main))
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
  parser.add_argument("--per", type=float, default=None,
                      help="divide executed counts by this many units of work")
  parser.add_argument("--top", type=int, default=25, help="opcodes and instructions listed")
  args = parser.parse_args()
  with open(args.csv, newline="") as f:
    kernel, instructions = read_source_page(f)
  print(summarize(kernel, instructions, args.per, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
