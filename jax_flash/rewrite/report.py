"""What `explain` returns: one `SiteReport` per candidate attention site, and a printable Report."""
from __future__ import annotations

import dataclasses
import math

from jax_flash.rewrite.patterns import Site, kv_head_group, window_params


@dataclasses.dataclass
class SiteReport:
  location: str                 # where in the program (top level, or inside scan / cond / ...)
  fused: bool
  reason: str | None = None     # why not fused (one sentence), None when fused
  form: dict = dataclasses.field(default_factory=dict)   # what was recognized
  schedule: str | None = None   # the kernel schedule serving a fused site
  notes: list = dataclasses.field(default_factory=list)  # semantic differences, if any

  def __str__(self) -> str:
    head = f"{self.location}: " + (f"FUSED (schedule {self.schedule})" if self.fused
                                   else f"not fused: {self.reason}")
    lines = [head] + [f"    {k:<8} {v}" for k, v in self.form.items()]
    lines += [f"    note     {n}" for n in self.notes]
    return "\n".join(lines)


@dataclasses.dataclass
class Report:
  sites: list

  @property
  def fused(self) -> list:
    return [s for s in self.sites if s.fused]

  @property
  def not_fused(self) -> list:
    return [s for s in self.sites if not s.fused]

  def __str__(self) -> str:
    title = (f"jax_flash.explain: {len(self.sites)} attention candidate(s), "
             f"{len(self.fused)} fused, {len(self.not_fused)} not fused")
    return "\n".join([title] + [f"  [{i}] {s}" for i, s in enumerate(self.sites)])

  def print(self):
    print(self)


def _letters(site: Site, labels, heads_letter: str) -> str:
  """The layout of an operand: B T S N K G H letters, 1 for a dim of size one."""
  letters = []
  for label in labels:
    if label is None:
      letters.append("1")
    elif label in site.batch_group:
      letters.append("B")
    elif label == site.query:
      letters.append("T")
    elif label == site.key:
      letters.append("S")
    elif label in (site.head, site.value_head):
      letters.append("H")
    elif label in site.group_heads:
      letters.append("G")
    elif site.repeat is not None and label in site.repeat:
      letters.append("N" if label == site.repeat[0] else "K")
    else:
      letters.append(heads_letter)
  return "".join(letters)


def describe(site: Site) -> dict:
  """The recognized form of a site, as short human-readable strings."""
  sizes = site.sizes
  num_heads = math.prod(sizes[l] for l in site.kv_heads + site.group_heads)
  kv = math.prod(sizes[l] for l in kv_head_group(site))
  heads = f"N={num_heads}"
  if kv < num_heads:
    how = "repeat of K/V heads" if site.repeat else "broadcast of K/V"
    heads += f" query heads over K={kv} kv heads (GQA via {how})"
  form = {
      "layout": (f"q {_letters(site, site.q.labels, 'K' if site.group_heads else 'N')}, "
                 f"k {_letters(site, site.k.labels, 'K')}"
                 f", v {_letters(site, site.v.labels, 'K')} -> kernel BTNH"),
      "heads": heads,
      "scale": f"{site.scale:.6g}",
      "mask": ", ".join(_mask_kinds(site)) or "none",
  }
  if site.biases:
    form["bias"] = ", ".join(
        f"{'-' if b.scale < 0 else ''}[{','.join(map(str, b.source.shape))}]"
        for b in site.biases)
  if site.softcap:
    form["softcap"] = f"{site.softcap:g}"
  form["dtype"] = str(site.dtype)
  return form


def _mask_kinds(site: Site) -> list[str]:
  keep = site.keep
  t_size = site.sizes[site.query] if site.query else 1
  is_causal, window = window_params(keep, t_size, site.sizes[site.key])
  kinds = []
  if is_causal:
    kinds.append("causal")
  if window is not None:
    kinds.append(f"sliding window (left {window[0]}, right {window[1]})")
  if keep.kv_lengths:
    kinds.append("key padding from sequence lengths")
  if keep.q_lengths:
    kinds.append("query padding from sequence lengths")
  if math.isfinite(keep.kv_bound) and keep.kv_bound < site.sizes[site.key]:
    kinds.append(f"first {int(keep.kv_bound)} keys")
  if math.isfinite(keep.q_bound) and keep.q_bound < t_size:
    kinds.append(f"first {int(keep.q_bound)} queries")
  for tensor in keep.tensors:
    shape = ",".join(map(str, tensor.tensor.value.shape))
    kinds.append(f"{'negated ' if tensor.negated else ''}boolean tensor [{shape}]")
  fills = sorted({f"{s.fill:g}" for s in site.mask_sources})
  if fills:
    kinds.append(f"fill {'/'.join(fills)}")
  return kinds
