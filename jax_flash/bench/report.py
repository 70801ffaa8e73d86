"""The bench's outputs: the printed tables, the JSON with everything, the PNG plot."""
from __future__ import annotations

import json
import math

CELL = 11


def _unit(mode: str) -> tuple[str, str]:
  """(row key, unit) of a mode's headline rate."""
  return ("tbps", "TB/s") if mode == "decode" else ("tflops", "TFLOP/s")


def _impl_order(cases: list[dict]) -> list[str]:
  names = []
  for case in cases:
    for row in case["rows"]:
      if row["impl"] not in names:
        names.append(row["impl"])
  return names


def _rate(case: dict, row: dict, key: str, source: str) -> float:
  """A row's rate: from its timed median ("median"), or from its kernels' device time in the
  profiler trace ("trace"; nan when the trace gave none)."""
  if source == "median":
    return row[key]
  per_call = row.get("trace_ms_per_call")
  if not per_call:
    return math.nan
  amount = case["kv_bytes"] if key == "tbps" else case["flops"]
  return amount / (per_call * 1e-3) / 1e12


def _cell(row: dict | None, value: float, best: float) -> str:
  if row is None:
    return ""
  status = row["status"]
  if status == "same_kernel":
    return "=" + row["same_kernel_as"]
  if status in ("unsupported", "skipped"):
    return "-"
  if status == "failed":
    return "ERR"
  if not math.isfinite(value):
    return "?"
  text = f"{value:.3g}" if value < 10 else f"{value:.0f}"
  if row["check"]["passed"] is False:
    text += "!"
  if value == best:
    text += "*"
  return text


def _best(rates: dict[str, float], rows: dict[str, dict], ours: bool | None = None) -> float:
  finite = [rate for impl, rate in rates.items()
            if math.isfinite(rate) and (ours is None or rows[impl]["ours"] == ours)]
  return max(finite) if finite else math.nan


_SOURCES = {"median": "median of {repeats} repeats (host-timed loop)",
            "trace": "device time of the kernels in the profiler trace"}


def mode_table(mode: str, cases: list[dict], repeats: int, source: str = "median") -> str:
  key, unit = _unit(mode)
  impls = _impl_order(cases)
  label_width = max(len(c["label"]) for c in cases) + 2
  lines = [f"== {mode}: {unit}, {_SOURCES[source].format(repeats=repeats)}  (* best of row, "
           "=X same kernel as X, ! failed the float64 check, - unsupported/skipped, ERR failed, "
           "? no trace or one that lost events; ours/peer = best jax_flash over best peer)",
           " " * label_width + "".join(f"{name:>{CELL}}" for name in impls) + f"{'ours/peer':>{CELL}}"]
  ratios = []
  for case in cases:
    by_impl = {row["impl"]: row for row in case["rows"]}
    rates = {impl: _rate(case, row, key, source) for impl, row in by_impl.items()
             if row["status"] == "ok"}
    best = _best(rates, by_impl)
    cells = "".join(f"{_cell(by_impl.get(name), rates.get(name, math.nan), best):>{CELL}}"
                    for name in impls)
    ratio = _best(rates, by_impl, ours=True) / _best(rates, by_impl, ours=False)
    if math.isfinite(ratio):
      ratios.append(ratio)
      cells += f"{ratio:>{CELL}.2f}"
    else:
      cells += f"{'':>{CELL}}"
    lines.append(f"{case['label']:<{label_width}}{cells}")
  if ratios:  # the form the issues' bars take: a geometric mean and the worst row, to four
    # decimals so that a bar such as >= 1.05 is read off unrounded (1.0495 would print 1.050)
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    lines.append(f"ours/peer over {len(ratios)} rows: geometric mean {geomean:.4f}, lowest "
                 f"{min(ratios):.4f}, highest {max(ratios):.2f}")
  return "\n".join(lines)


def _detail_line(row: dict, mode: str) -> str:
  name = f"   {row['impl']:<13}"
  kernels = f"kernels: {row.get('kernel_summary', '?')}"
  status = row["status"]
  if status == "same_kernel":
    return f"{name}same kernel as {row['same_kernel_as']} (not timed twice)   {kernels}"
  if status != "ok":
    return f"{name}{status}: {row.get('error', '')}"
  key, unit = _unit(mode)
  check = row["check"]
  verdict = "ok" if check["passed"] else f"FAILED (tolerance {check['tolerance_rel_l2']:.0e})"
  shared = (f"  [same kernels as {row['shares_kernels_with']}]"
            if "shares_kernels_with" in row else "")
  trace = (f", trace {row['trace_ms_per_call']:.3f}" if "trace_ms_per_call" in row else
           f", trace lost events of {', '.join(row['trace_lost_events'])}"
           if "trace_lost_events" in row else "")
  return (f"{name}{1e3 * row['seconds']:9.3f} ms (best {1e3 * row['seconds_best']:.3f}{trace})"
          f"  {row[key]:8.3f} {unit}  max_abs {check['max_abs']:.2e}  rel_l2 {check['rel_l2']:.2e}"
          f" {verdict}   {kernels}{shared}")


def case_details(case: dict) -> str:
  amount = (f"{case['kv_bytes'] / 1e9:.3f} GB of KV read" if case["mode"] == "decode"
            else f"{case['flops'] / 1e9:.3f} GFLOP")
  head = (f"-- {case['mode']} {case['label']}: {amount} per call, {case['input_sets']} input "
          f"set(s) rotated; float64 check on {case['check_slice']['description']} "
          f"(reference {case['reference_seconds']:.1f} s)")
  failure = [f"   CASE FAILED: {case['error']}"] if case.get("error") else []
  return "\n".join([head] + failure + [_detail_line(row, case["mode"]) for row in case["rows"]])


def ceilings_text(ceilings: dict) -> str:
  if not ceilings:
    return "ceilings: not measured"
  if "error" in ceilings:
    return f"ceilings: failed ({ceilings['error']})"
  m, c = ceilings["matmul"], ceilings["copy"]
  return (f"ceilings (same run): {m['dtype']} {m['n']}^3 matmul {m['tflops']:.3f} TFLOP/s; "
          f"copy {c['bytes_moved'] / 2**30:.2f} GiB moved (read+write) {c['tbps']:.3f} TB/s")


def render(payload: dict) -> str:
  meta = payload["meta"]
  parts = [f"jax_flash bench on {meta['device']} ({meta['backend']}), jax {meta['jax']}, "
           f"jaxlib {meta['jaxlib']}, torch {meta.get('torch') or 'absent'}",
           ceilings_text(payload.get("ceilings", {}))]
  parts += [f"note: {note}" for note in payload.get("notes", [])]
  cases = payload["cases"]
  for mode in ("fwd", "fwdbwd", "decode"):
    of_mode = [c for c in cases if c["mode"] == mode]
    if of_mode:
      parts += ["", mode_table(mode, of_mode, meta["repeats"]), ""]
      if any("trace_ms_per_call" in row for case in of_mode for row in case["rows"]):
        # decode kernels (~40 us) can be shorter than a host dispatch: device time too
        parts += [mode_table(mode, of_mode, meta["repeats"], source="trace"), ""]
      parts += [case_details(c) for c in of_mode]
  if payload.get("cpu_bar"):
    parts += ["", payload["cpu_bar"]["text"]]
  return "\n".join(parts)


def write_json(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)


def _plot_label(case: dict) -> str:
  c = case["case"]
  if case["mode"] == "decode":
    return f"B{c['batch']} S{c['kv_len']}\nN{c['num_heads']} K{c['num_kv_heads']}"
  return f"H{c['head_dim']} T{c['q_len']}\n{'causal' if c['causal'] else 'full'}"


def plot(path: str, payload: dict) -> None:
  """Grouped bars: one group per case, one bar per timed implementation, one panel per mode
  (an implementation that ran another's kernel has no bar of its own)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  modes = [m for m in ("fwd", "fwdbwd", "decode") if any(c["mode"] == m for c in payload["cases"])]
  fig, axes = plt.subplots(len(modes), 1, figsize=(14, 4.5 * max(1, len(modes))), squeeze=False)
  ceilings = payload.get("ceilings") or {}
  for ax, mode in zip(axes[:, 0], modes):
    cases = [c for c in payload["cases"] if c["mode"] == mode]
    key, unit = _unit(mode)
    impls = [name for name in _impl_order(cases)
             if any(r["impl"] == name and r["status"] == "ok" for c in cases for r in c["rows"])]
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
      values = []
      for case in cases:
        row = next((r for r in case["rows"] if r["impl"] == impl), None)
        values.append(row[key] if row and row["status"] == "ok" else 0.0)
      ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(cases))], values, width,
             label=impl)
    ceiling = (ceilings.get("copy", {}).get("tbps") if mode == "decode"
               else ceilings.get("matmul", {}).get("tflops"))
    if ceiling:
      ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1,
                 label="copy ceiling" if mode == "decode" else "matmul ceiling")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([_plot_label(c) for c in cases], fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(f"{mode} ({payload['meta']['device']}, {cases[0]['case']['dtype']})")
    if impls or ceiling:
      ax.legend(fontsize=8, ncol=min(6, len(impls) + 1))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
