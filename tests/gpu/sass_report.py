"""What ptxas made of a kernel, from its SASS: instructions, local-memory traffic, loop bodies.

  python3 tests/gpu/sass_report.py NEW.o [BASE.o] [--kernel SUBSTR] [--min-loop 300]

NEW / BASE: a cubin-carrying object or executable (cuobjdump -sass reads both), or a text file
cuobjdump -sass already wrote. Per kernel (names with the anonymous namespace's per-build token
normalized, so that two builds' kernels pair up): static instructions without NOPs, STL / LDL
(spill stores / loads; local arrays would count too), and the innermost loops whose bodies (a
backward branch's target .. the branch) have at least --min-loop instructions, with their most
frequent opcodes (the key-block loops, the producer's loop). With BASE, each
figure reads base -> new and the kernel is marked "identical" when its instructions are, byte for
byte after the normalization. The question a kernel change raises first is whether the hot loop
moved: sessions 9-11 answered it with one-off scripts each time (docs/perf-notes-v3.md).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

# The anonymous namespace of a translation unit, e.g. _GLOBAL__N__3d7c138a_14_v3_bwd_sm90_cu_b67aeebf:
# its hashes differ between builds of the same source.
_ANONYMOUS_NAMESPACE = re.compile(r"_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}")
_FUNCTION = re.compile(r"^\s+Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_HEX = re.compile(r"0x[0-9a-f]+")


@dataclasses.dataclass(frozen=True)
class Instruction:
  address: int
  text: str  # without the trailing ';'

  @property
  def opcode(self) -> str:
    """The opcode without predicate or modifiers ("ISETP" for "@P0 ISETP.GE.AND P0, ...")."""
    return _PREDICATE.sub("", self.text).split()[0].split(".")[0]


@dataclasses.dataclass(frozen=True)
class Loop:
  start: int  # the branch target's address
  end: int    # the backward branch's address
  body: tuple[Instruction, ...]

  def top_opcodes(self, n: int = 8) -> list[tuple[str, int]]:
    return collections.Counter(i.opcode for i in self.body).most_common(n)


def normalize(name: str) -> str:
  return _ANONYMOUS_NAMESPACE.sub("NS", name)


def parse_sass(text: str) -> dict[str, list[Instruction]]:
  """Kernel name (normalized) -> its instructions in address order, NOPs left out."""
  kernels: dict[str, list[Instruction]] = {}
  current = None
  for line in text.splitlines():
    if m := _FUNCTION.match(line):
      current = kernels.setdefault(normalize(m.group(1)), [])
      continue
    if current is not None and (m := _INSTRUCTION.match(line)):
      instruction = Instruction(int(m.group(1), 16), m.group(2))
      if instruction.opcode != "NOP":
        current.append(instruction)
  return kernels


def loops(instructions: list[Instruction], min_body: int) -> list[Loop]:
  """The innermost of the loops whose body (a backward branch's target .. the branch) holds at
  least min_body instructions, in address order: the hot loops, which outer loops contain. A
  body holding an EXIT is not a loop: ptxas puts the retry paths of mbarrier waits after the
  code and branches back from there."""
  found = []
  for branch in instructions:
    targets = _HEX.findall(branch.text) if branch.opcode == "BRA" else []
    if not targets:
      continue
    target = int(targets[-1], 16)
    if target >= branch.address:
      continue
    body = tuple(i for i in instructions if target <= i.address <= branch.address)
    if len(body) >= min_body and not any(i.opcode == "EXIT" for i in body):
      found.append(Loop(target, branch.address, body))
  return sorted((l for l in found if not any(
      o is not l and l.start <= o.start and o.end <= l.end for o in found)),
                key=lambda l: l.start)


def local_memory(instructions: list[Instruction]) -> tuple[int, int]:
  """(STL, LDL) instruction counts: ptxas's spill stores and loads."""
  ops = collections.Counter(i.opcode for i in instructions)
  return ops["STL"], ops["LDL"]


def cuobjdump() -> str:
  """cuobjdump from $CUOBJDUMP, PATH, or the nvidia-cuda wheels of this Python."""
  if path := os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"):
    return path
  import site  # pylint: disable=import-outside-toplevel
  for root in site.getsitepackages():
    for candidate in sorted(pathlib.Path(root, "nvidia").glob("cu*/bin/cuobjdump")):
      return str(candidate)
  raise FileNotFoundError("cuobjdump not found: set CUOBJDUMP or put it on PATH")


def read_sass(path: str) -> dict[str, list[Instruction]]:
  data = pathlib.Path(path).read_bytes()
  if b"Function : " in data[:1 << 20] and data.isascii():
    return parse_sass(data.decode())
  result = subprocess.run([cuobjdump(), "-sass", path], check=True, capture_output=True,
                          text=True)
  return parse_sass(result.stdout)


def _pair(base: object, new: object) -> str:
  """"new" without a base, "new (=)" when unchanged, else "base -> new"."""
  if base is None:
    return str(new)
  return f"{new} (=)" if base == new else f"{base} -> {new}"


def _loop_line(base: Loop | None, new: Loop) -> str:
  ops = " ".join(f"{op} {n}" for op, n in new.top_opcodes())
  old_count = None if base is None else len(base.body)
  return (f"    loop {new.start:#x}..{new.end:#x}: {_pair(old_count, len(new.body))}"
          f" instructions ({ops})")


def report(new: dict[str, list[Instruction]], base: dict[str, list[Instruction]] | None,
           kernel_filter: str, min_loop: int) -> list[str]:
  lines = []
  for name, instructions in sorted(new.items()):
    if kernel_filter not in name:
      continue
    old = base.get(name) if base is not None else None
    old_loops = loops(old, min_loop) if old is not None else []
    same = old is not None and [i.text for i in old] == [i.text for i in instructions]
    stl, ldl = local_memory(instructions)
    old_stl, old_ldl = local_memory(old) if old is not None else (None, None)
    note = "  (identical)" if same else "  (not in base)" if base is not None and old is None else ""
    lines.append(f"{name}{note}")
    lines.append(f"  instructions {_pair(None if old is None else len(old), len(instructions))}, "
                 f"STL {_pair(old_stl, stl)}, LDL {_pair(old_ldl, ldl)}")
    new_loops = loops(instructions, min_loop)
    # Innermost loops pair up by position: a change rarely adds or removes a hot loop.
    for k, loop in enumerate(new_loops):
      lines.append(_loop_line(old_loops[k] if k < len(old_loops) and not same else None, loop))
    if old is not None and len(old_loops) != len(new_loops):
      lines.append(f"    innermost loops with >= {min_loop} instructions: {len(old_loops)} -> "
                   f"{len(new_loops)} (paired by position above)")
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("new", help="object, executable or cuobjdump -sass text")
  parser.add_argument("base", nargs="?", help="the same, built from the code before the change")
  parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
  parser.add_argument("--min-loop", type=int, default=300,
                      help="smallest loop body (instructions) to list (default 300)")
  args = parser.parse_args(argv)
  if args.min_loop < 1:
    parser.error("--min-loop must be at least 1")
  new = read_sass(args.new)
  base = read_sass(args.base) if args.base else None
  lines = report(new, base, args.kernel, args.min_loop)
  if not lines:
    print(f"no kernel name contains {args.kernel!r}", file=sys.stderr)
    return 1
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
