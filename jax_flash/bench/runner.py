"""One case, every peer: prepare, name the kernels, time, check. Failures stay in their row."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import traceback

from jax_flash.bench import accuracy, inputs, kernels
from jax_flash.bench.configs import Case
from jax_flash.bench.peers import Peer
from jax_flash.bench.steps import Prepared, failure_status, prepare
from jax_flash.bench.timing import Timing, TimingOptions, time_interleaved, warm_up


@dataclasses.dataclass(frozen=True)
class RunOptions:
  backend: str
  timing: TimingOptions
  check_rows: int = 256
  xla_max_seqlen: int = 0         # 0: no limit
  seed: int = 0
  deadline: float = float("inf")  # time.monotonic() after which nothing new starts


def _error_text(error: BaseException) -> str:
  text = f"{type(error).__name__}: {error}".strip()
  return text if len(text) <= 600 else text[:600] + " ..."


def _row(peer: Peer, status: str, **fields) -> dict:
  return {"impl": peer.name, "framework": peer.framework, "description": peer.description,
          "ours": peer.ours, "status": status, **fields}


def _skip_reason(peer: Peer, case: Case, options: RunOptions) -> str | None:
  if time.monotonic() > options.deadline:
    return "time budget (--max-seconds) spent"
  if peer.name == "xla" and options.xla_max_seqlen and case.q_len > options.xla_max_seqlen:
    return (f"T={case.q_len} > --xla-max-seqlen {options.xla_max_seqlen}: the unfused score "
            "matrix is too large to be worth timing")
  return None


def _prepare_one(peer: Peer, case: Case, sets, check_set) -> tuple[Prepared | None, dict | None]:
  try:
    return prepare(peer, case, sets, check_set), None
  except Exception as e:  # pylint: disable=broad-except  (one peer must not end the run)
    row = _row(peer, failure_status(e), error=_error_text(e))
    if row["status"] == "failed":
      row["traceback"] = traceback.format_exc(limit=8)
    return None, row


def _prepare_all(peers, case, sets, check_set, options):
  """Compile and warm every peer: JAX peers concurrently (XLA compiles in parallel and the GPU
  run is mostly compile time), torch peers after them on this thread."""
  prepared: dict[str, Prepared] = {}
  rows: dict[str, dict] = {}
  runnable = []
  for peer in peers:
    reason = _skip_reason(peer, case, options)
    if reason:
      rows[peer.name] = _row(peer, "skipped", error=reason)
    else:
      runnable.append(peer)
  jax_peers = [p for p in runnable if p.framework == "jax"]
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jax_peers))) as pool:
    futures = {p.name: pool.submit(_prepare_one, p, case, sets, check_set) for p in jax_peers}
    results = {name: future.result() for name, future in futures.items()}
  results.update({p.name: _prepare_one(p, case, sets, check_set)
                  for p in runnable if p.framework != "jax"})
  for peer in runnable:  # back in the order of `peers`: it decides who represents a kernel
    ready, row = results[peer.name]
    if ready is not None:
      prepared[peer.name] = ready
    else:
      rows[peer.name] = row
  return prepared, rows


def name_kernels(prepared: dict[str, Prepared], backend: str) -> dict[str, kernels.KernelReport]:
  """The kernels each prepared implementation executes (see kernels.py for how)."""
  runs = {name: p.run_once for name, p in prepared.items()}
  try:
    reports = kernels.trace_kernels(runs, backend)
  except Exception as e:  # pylint: disable=broad-except
    reports = {name: kernels.error_report(kernels.device_source(backend),
                                          f"trace failed: {_error_text(e)}") for name in runs}
  for name, p in prepared.items():
    if p.peer.framework == "torch" and reports[name].error:
      try:
        reports[name] = kernels.torch_profiler_kernels(p.run_once)
      except Exception as e:  # pylint: disable=broad-except
        reports[name].error += f"; torch.profiler failed: {_error_text(e)}"
    elif backend == "cpu" and p.hlo_text is not None and not reports[name].error:
      reports[name] = kernels.resolve_cpu_names(reports[name], p.hlo_text())
  return reports


def _check(p: Prepared, case: Case, where: accuracy.CheckSlice, expected: dict) -> dict:
  indices = accuracy.output_indices(case, where)
  outputs = dict(zip(indices, p.check()))
  return accuracy.compare({name: p.to_numpy(outputs[name], index) for name, index in indices.items()},
                          expected, case.dtype)


def _rates(case: Case, seconds: float) -> dict:
  rates = {"tflops": case.flops() / seconds / 1e12}
  if case.mode == "decode":
    rates["tbps"] = case.kv_bytes() / seconds / 1e12
  return rates


def _measured_row(p: Prepared, case: Case, timing: Timing, where, expected) -> dict:
  row = _row(p.peer, "ok", timing=timing.to_json(), seconds=timing.median_s,
             seconds_best=timing.best_s, **_rates(case, timing.median_s),
             best=_rates(case, timing.best_s))
  row["check"] = _check(p, case, where, expected)
  return row


def _failed_row(p: Prepared, error: BaseException) -> dict:
  return _row(p.peer, "failed", error=_error_text(error), traceback=traceback.format_exc(limit=8))


def _measure_all(timed: dict[str, Prepared], case: Case, where, expected,
                 options: RunOptions) -> dict[str, dict]:
  """Warms each implementation up, times them all with interleaved repeats, checks each."""
  rows, targets = {}, {}
  for name, p in timed.items():
    try:
      targets[name] = (p.call, p.wait, warm_up(p.call, p.wait, options.timing))
    except Exception as e:  # pylint: disable=broad-except
      rows[name] = _failed_row(p, e)
  try:
    timings = time_interleaved(targets, options.timing)
  except Exception:  # pylint: disable=broad-except  (find the failing one: time them one by one)
    timings = {}
    for name, target in targets.items():
      try:
        timings.update(time_interleaved({name: target}, options.timing))
      except Exception as e:  # pylint: disable=broad-except
        rows[name] = _failed_row(timed[name], e)
  for name, timing in timings.items():
    try:
      rows[name] = _measured_row(timed[name], case, timing, where, expected)
    except Exception as e:  # pylint: disable=broad-except
      rows[name] = _failed_row(timed[name], e)
  return rows


def _timed(function, *args):
  started = time.monotonic()
  return function(*args), time.monotonic() - started


def _case_record(case: Case, **fields) -> dict:
  return {"case": case.to_json(), "label": case.label, "mode": case.mode, "flops": case.flops(),
          "kv_bytes": case.kv_bytes(), "error": "", **fields}


def run_case(case: Case, peers: list[Peer], options: RunOptions) -> dict:
  """Everything measured about one case: {"case", ..., "rows": [one per peer]}; a failure outside
  any one peer (inputs, reference) is recorded in "error" with no rows."""
  started = time.monotonic()
  try:
    return _run_case(case, peers, options, started)
  except Exception as e:  # pylint: disable=broad-except  (the other cases still run)
    return _case_record(case, error=_error_text(e), traceback=traceback.format_exc(limit=8),
                        input_sets=0, check_slice={"description": "-"}, reference_seconds=0.0,
                        seconds=time.monotonic() - started, rows=[])


def _run_case(case: Case, peers: list[Peer], options: RunOptions, started: float) -> dict:
  sets = inputs.make_sets(case, options.seed)
  where = accuracy.check_slice(case, options.check_rows)
  check_set = inputs.with_rows_of_dout(sets[0], where.rows) if case.mode == "fwdbwd" else sets[0]
  host = accuracy.reference_inputs(case, check_set, where)
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    # The float64 reference runs on the host while the peers compile; its inputs were copied
    # above, so that the worker issues no device work (see reference_inputs).
    expected_future = pool.submit(_timed, accuracy.reference_outputs, case, host, where)
    prepared, rows = _prepare_all(peers, case, sets, check_set, options)
    reports = name_kernels(prepared, options.backend) if prepared else {}
    expected, reference_s = expected_future.result()
  frameworks = {name: p.peer.framework for name, p in prepared.items()}
  aliases = kernels.same_kernel_groups(reports, frameworks)
  shared = kernels.cross_framework_matches(reports, frameworks)
  timed = {}
  for name, p in prepared.items():
    skip = _skip_reason(p.peer, case, options)
    if name in aliases:
      rows[name] = _row(p.peer, "same_kernel", same_kernel_as=aliases[name])
    elif skip:
      rows[name] = _row(p.peer, "skipped", error=skip)
    else:
      timed[name] = p
  rows.update(_measure_all(timed, case, where, expected, options))
  for name in prepared:
    report = reports[name]
    rows[name]["kernels"] = report.to_json()
    if options.backend == "gpu" and not report.error:
      # Device time per call while the trace ran a few isolated calls: against the timed
      # median of back-to-back calls it tells idle gaps or clock drops from kernel speed.
      per_call = report.ms_per_call(kernels.RUNS_PER_IMPL)
      if per_call is None:  # the tables show "?" rather than an undercount
        rows[name]["trace_lost_events"] = [
            kernels.short_name(n) for n in report.lost_events(kernels.RUNS_PER_IMPL)]
      else:
        rows[name]["trace_ms_per_call"] = per_call
    rows[name]["kernel_summary"] = report.summary()
    if name in shared:
      rows[name]["shares_kernels_with"] = shared[name]
  return _case_record(case, input_sets=len(sets), check_slice=where.to_json(case),
                      reference_seconds=reference_s, seconds=time.monotonic() - started,
                      rows=[rows[p.name] for p in peers if p.name in rows])
