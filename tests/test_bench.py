"""python -m jax_flash.bench on tiny CPU cases: outputs written, numbers sane, garbage caught."""
import io
import json
import math
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.bench import accuracy, cli, configs, kernels, peers, runner
from jax_flash.bench.timing import TimingOptions

CPU_AVAILABLE = any(s.name == "cpu" and s.available for s in jax_flash.schedules())
FAST = TimingOptions(repeats=2, min_repeat_s=0.0, warmup=1, wait_each_call=True)


def _options(check_rows=256):
  return runner.RunOptions(backend=jax.default_backend(), timing=FAST, check_rows=check_rows)


def _rows(case_result):
  return {row["impl"]: row for row in case_result["rows"]}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  # B=2 N=2 T=S=128 H=32 causal, forward and forward+backward; a 48-row check slice so the
  # sliced reference (the last rows for causal, dout zeroed elsewhere) is exercised.
  status = cli.main(["--quick", "--mode", "fwd,fwdbwd", "--heads", "32", "--seqlens", "128",
                     "--tokens", "256", "--width", "64", "--causal", "1", "--repeats", "2",
                     "--min-repeat-s", "0.01", "--check-rows", "48", "--out", str(out)])
  backend = jax.default_backend()
  with open(out / f"bench_{backend}.json") as f:
    return status, json.load(f), out, backend


def test_outputs_written(quick_run):
  status, payload, out, backend = quick_run
  assert status == 0
  png = (out / f"bench_{backend}.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  text = (out / f"bench_{backend}.txt").read_text()
  # the device-time table only where the trace gave device times (the GPU)
  has_trace = any("trace_ms_per_call" in row for case in payload["cases"] for row in case["rows"])
  assert text.count("== fwd:") == (2 if has_trace else 1)
  assert payload["ceilings"]["matmul"]["tflops"] > 0
  assert payload["ceilings"]["copy"]["tbps"] > 0
  assert [c["mode"] for c in payload["cases"]] == ["fwd", "fwdbwd"]


def test_rerender_from_json(quick_run, tmp_path):
  _, payload, out, backend = quick_run
  assert cli.main(["--from-json", str(out / f"bench_{backend}.json"), "--out", str(tmp_path)]) == 0
  assert (tmp_path / f"bench_{backend}.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / f"bench_{backend}.txt").read_text() == (out / f"bench_{backend}.txt").read_text()


def test_rows_are_timed_counted_and_checked(quick_run):
  _, payload, _, _ = quick_run
  for case_result in payload["cases"]:
    c = configs.Case(**case_result["case"])
    flops = 4 * c.batch * c.num_heads * c.q_len * c.kv_len * c.head_dim
    flops = flops / (2 if c.causal else 1) * (3.5 if c.mode == "fwdbwd" else 1)
    assert case_result["flops"] == flops
    expected_slice = (c.q_len - 48, c.q_len) if c.causal else (0, 48)
    assert tuple(case_result["check_slice"]["rows"]) == expected_slice
    timed = [r for r in case_result["rows"] if r["status"] == "ok"]
    assert {"xla"} <= {r["impl"] for r in timed}
    for row in timed:
      check = row["check"]
      assert math.isfinite(check["max_abs"]) and math.isfinite(check["rel_l2"])
      assert check["passed"] and check["rel_l2"] < 1e-4, (row["impl"], check)
      assert row["seconds"] > 0
      assert row["tflops"] == pytest.approx(flops / row["seconds"] / 1e12)
      names = {"dq", "dk", "dv"} if c.mode == "fwdbwd" else {"out"}
      assert set(check["per_tensor"]) == names


def test_kernels_named_from_the_trace(quick_run):
  _, payload, _, _ = quick_run
  for case_result in payload["cases"]:
    rows = _rows(case_result)
    xla_kernels = {k["name"] for k in rows["xla"]["kernels"]["kernels"]}
    assert xla_kernels and not any("jax_flash" in k for k in xla_kernels)
    if not CPU_AVAILABLE:
      continue
    want = {"jax_flash_cpu_fwd"} | ({"jax_flash_cpu_bwd"} if case_result["mode"] == "fwdbwd"
                                    else set())
    ran = rows["cpu"]["kernels"]["kernels"]
    assert {k["name"] for k in ran if k["name"].startswith("jax_flash")} == want
    assert sum(k["share"] for k in ran if k["name"] in want) > 0.5  # beside e.g. a seqlens fill
    # schedule="auto" runs the cpu kernel: one kernel, one row.
    assert rows["auto"]["status"] == "same_kernel" and rows["auto"]["same_kernel_as"] == "cpu"


def _garbage(q, k, v, case):
  del k, case
  return jnp.flip(v, axis=1)[:, :q.shape[1]] * 1.5


def _nan(q, k, v, case):
  return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal) * jnp.nan


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_garbage_fails_the_check(mode):
  case = configs.Case(mode, 1, 64, 64, 2, 2, 16, False, "float32")
  bad = [peers.Peer("garbage", "jax", "flipped V", _garbage),
         peers.Peer("nan", "jax", "NaN output", _nan)]
  result = runner.run_case(case, bad, _options())
  for row in result["rows"]:
    assert row["status"] == "ok"
    assert not row["check"]["passed"], row
  assert _rows(result)["nan"]["check"]["rel_l2"] == math.inf


def test_gqa_slice_matches_reference():
  # Non-causal: the first 17 rows are checked (the quick run above covers the causal slice).
  case = configs.Case("fwdbwd", 2, 97, 97, 4, 2, 16, False, "float32")
  available, _ = peers.all_peers(jax.default_backend())
  chosen = [p for p in available if p.name in ("xla", "cpu")]
  result = runner.run_case(case, chosen, _options(check_rows=17))
  assert result["check_slice"]["rows"] == [0, 17]
  assert result["check_slice"]["heads"] == 2 and result["check_slice"]["kv_heads"] == 1
  for row in result["rows"]:
    assert row["status"] == "ok" and row["check"]["passed"], row


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_reference_thread_issues_no_device_work(mode, monkeypatch):
  # The float64 reference runs beside the peers' compilation; device work issued from its thread
  # (the slice copies) broke XLA's cuDNN graph capture on the H200 and read garbage inputs, so
  # every copy must be taken on the calling thread.
  main_thread = threading.get_ident()
  copy = accuracy.jax_to_numpy

  def copy_on_main_thread_only(x, index):
    assert threading.get_ident() == main_thread, "device copy from the reference thread"
    return copy(x, index)

  monkeypatch.setattr(accuracy, "jax_to_numpy", copy_on_main_thread_only)
  case = configs.Case(mode, 1, 33, 33, 2, 2, 16, True, "float32")
  available, _ = peers.all_peers(jax.default_backend())
  result = runner.run_case(case, [p for p in available if p.name == "xla"], _options(check_rows=9))
  (row,) = result["rows"]
  assert row["status"] == "ok" and row["check"]["passed"], row


def test_unsupported_peer_is_recorded_not_fatal():
  case = configs.Case("fwd", 1, 32, 32, 2, 2, 16, False, "float32")

  def refuses(q, k, v, case):
    raise ValueError("schedule cannot serve this call")

  result = runner.run_case(case, [peers.Peer("refuses", "jax", "", refuses)], _options())
  row = result["rows"][0]
  assert row["status"] == "unsupported" and "cannot serve" in row["error"]


def _gpu_trace():
  """A perfetto trace shaped like the GPU one: stream lines, derived lines, two windows."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0 (H200)"}},
          {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
           "args": {"name": "Stream #7(Compute)"}},
          {"ph": "M", "pid": 2, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}}]
  prefix = kernels.ANNOTATION_PREFIX

  def x(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}

  events = [x(1, 1, 0, 1000, prefix + "v3"), x(1, 1, 11000, 1000, prefix + "auto"),
            x(1, 1, 22000, 1000, prefix + "cudnn"),
            x(2, 7, 100, 600, "void fwd_kernel<128, 64>(Params)"), x(2, 7, 800, 50, "memset"),
            x(2, 99, 100, 600, "custom-call.1"),  # derived line: must not count
            x(2, 7, 11100, 600, "void fwd_kernel<128, 64>(Params)"),
            x(2, 7, 11800, 50, "memset"),
            x(2, 7, 22100, 700, "cudnn_generated_sdpa_kernel"), x(5, 5, 5, 5, "stray")]
  return {"traceEvents": meta + events}


def test_gpu_trace_attribution_and_same_kernel():
  reports = kernels.attribute(_gpu_trace(), ["v3", "auto", "cudnn"], "gpu")
  v3 = reports["v3"]
  assert [k.name for k in v3.kernels] == ["void fwd_kernel<128, 64>(Params)", "memset"]
  assert v3.kernels[0].time_us == 600 and v3.kernels[0].share == pytest.approx(600 / 650)
  assert kernels.short_name(v3.kernels[0].name) == "fwd_kernel"
  assert reports["cudnn"].signature() == {"cudnn_generated_sdpa_kernel"}
  aliases = kernels.same_kernel_groups(reports, {"v3": "jax", "auto": "jax", "cudnn": "jax"})
  assert aliases == {"auto": "v3"}


def test_trace_that_lost_events_gives_no_device_time():
  # Two identical calls traced: a kernel recorded once lost an event (an XLA decode fusion on
  # the H200 did, and the row's device time read above the HBM peak).
  def report(*calls):
    return kernels.KernelReport(
        kernels=[kernels.Kernel(f"k{i}", 100.0, c, 0.5) for i, c in enumerate(calls)],
        source="test")
  assert report(2, 4).lost_events(2) == []
  assert report(2, 4).ms_per_call(2) == pytest.approx(0.1)
  assert report(2, 1).lost_events(2) == ["k1"]
  assert report(2, 1).ms_per_call(2) is None
  assert kernels.error_report("trace", "no events").ms_per_call(2) is None


def test_detail_line_names_the_kernels_whose_events_were_lost():
  from jax_flash.bench import report
  row = {"impl": "xla", "status": "ok", "ours": False, "tflops": 1.0, "seconds": 1e-3,
         "seconds_best": 1e-3, "trace_lost_events": ["input_reduce_fusion"],
         "check": {"passed": True, "max_abs": 0.0, "rel_l2": 0.0}, "kernel_summary": "x"}
  assert "trace lost events of input_reduce_fusion" in report._detail_line(row, "fwd")


def test_gpu_grid_is_the_benchmark_grid():
  cases = configs.attention_grid("fwd", **configs.GPU_GRID)
  assert len(cases) == 18
  assert all(c.batch * c.q_len == 16384 and c.num_heads * c.head_dim == 2048 for c in cases)
  decode = configs.decode_grid(configs.GPU_DECODE_GRID, "bfloat16")
  assert decode[0].kv_bytes() == 2 * 1 * 32768 * 8 * 128 * 2


def test_mode_table_summarizes_ours_over_peer_like_the_bars():
  from jax_flash.bench import report

  def case(label, ours, peer):
    row = lambda impl, rate, is_ours: {"impl": impl, "status": "ok", "ours": is_ours,
                                       "tflops": rate, "check": {"passed": True}}
    return {"label": label, "rows": [row("v3", ours, True), row("cudnn", peer, False)]}

  table = report.mode_table("fwd", [case("a", 200.0, 100.0), case("b", 100.0, 200.0),
                                    case("c", 300.0, 300.0)], repeats=3)
  assert table.splitlines()[-1] == ("ours/peer over 3 rows: geometric mean 1.0000, lowest "
                                    "0.5000, highest 2.00")
  # A bar's edge is not rounded over: 1.0495 is under 1.05.
  edge = report.mode_table("fwd", [case("a", 104.95, 100.0)], repeats=3)
  assert "geometric mean 1.0495, lowest 1.0495" in edge.splitlines()[-1]


def test_mode_table_from_trace_uses_the_kernels_device_time():
  from jax_flash.bench import report
  # 1 GB of KV read: 0.5 ms of device time is 2 TB/s, whatever the host-timed rate says.
  rows = [{"impl": "flash_decode", "status": "ok", "ours": True, "tbps": 1.0,
           "trace_ms_per_call": 0.5, "check": {"passed": True}},
          {"impl": "cudnn", "status": "ok", "ours": False, "tbps": 0.5,
           "trace_ms_per_call": 0.25, "check": {"passed": True}},
          {"impl": "xla", "status": "ok", "ours": False, "tbps": 0.9,
           "check": {"passed": True}}]
  case = {"label": "d", "kv_bytes": 1e9, "flops": 0.0, "rows": rows}
  median = report.mode_table("decode", [case], repeats=3).splitlines()
  trace = report.mode_table("decode", [case], repeats=3, source="trace").splitlines()
  assert median[-1].startswith("ours/peer over 1 rows: geometric mean 1.111")
  assert "device time" in trace[0]
  assert trace[2].split()[1:] == ["2", "4*", "?", "0.50"]


def test_each_timed_repeat_is_preceded_by_untimed_calls_of_its_own_target():
  from jax_flash.bench.timing import time_interleaved
  log = []
  targets = {name: (lambda i, name=name: log.append(name), lambda out: None, 2)
             for name in ("a", "b")}
  options = TimingOptions(repeats=2, min_repeat_s=0.05, settle_s=0.1)
  timings = time_interleaved(targets, options)
  # per repeat and target: 4 settling calls (2 iters x 0.1 / 0.05), then the 2 timed ones
  assert "".join(log) == ("a" * 6 + "b" * 6) * 2
  assert len(timings["a"].samples_s) == 2


def test_gpu_repeats_last_long_enough_to_amortize_the_host_latency_around_each_loop():
  # 0.3-0.4 ms per loop on the H200 (docs/perf-notes.md session 37): 0.2 s repeats, 50 ms --quick
  full = cli.timing_options(cli.parse_args([]), "gpu")
  quick = cli.timing_options(cli.parse_args(["--quick"]), "gpu")
  chosen = cli.timing_options(cli.parse_args(["--min-repeat-s", "0.5", "--settle-s", "0"]), "gpu")
  assert (full.min_repeat_s, full.settle_s, full.repeats) == (0.2, 0.2, 5)
  assert (quick.min_repeat_s, quick.settle_s) == (0.05, 0.0)
  assert (chosen.min_repeat_s, chosen.settle_s) == (0.5, 0.0)


def test_stall_dump_prints_every_threads_stack_while_a_case_stalls(capfd):
  def stalled_case():
    time.sleep(0.55)

  with cli.stall_dump(0.2):
    stalled_case()
  err = capfd.readouterr().err
  assert "stalled_case" in err and err.count("Timeout (") >= 2  # repeated while it stalls
  with cli.stall_dump(0.2):
    pass  # a case that finishes in time prints nothing, and the dump is cancelled after it
  time.sleep(0.4)
  with cli.stall_dump(0.0):  # off
    time.sleep(0.3)
  assert capfd.readouterr().err == ""


def test_stall_dump_with_a_stderr_that_has_no_file_descriptor(monkeypatch):
  monkeypatch.setattr(sys, "stderr", io.StringIO())  # as in a notebook
  with cli.stall_dump(5.0):
    pass


def test_negative_stall_dump_is_refused():
  with pytest.raises(SystemExit):
    cli.parse_args(["--stall-dump-s", "-1"])
