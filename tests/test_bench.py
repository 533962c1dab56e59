"""lipcheck.bench and experiments/throughput.py: multiply-add counts against torch's own FLOP counter,
memory measurement against an allocation of known size, out-of-memory and bad input handling, and
the report's ratios against hand-built results. Nothing here times anything."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lipcheck import bench
from lipcheck.mixers import DenseAttention, SSoG
from lipcheck.models.vit import ViT

from lipcheck.commands import bench as throughput  # noqa: E402


def counted_macs(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops() // 2  # one multiply-add = two flops


@pytest.mark.parametrize("H,W", [(4, 4), (3, 5)])
def test_mixer_macs_match_torch_flop_counter(H, W):
    C, h, M = 12, 3, 2
    x = torch.randn(1, H, W, C)
    att = DenseAttention(C, h, backend="math")
    assert counted_macs(lambda: att(x)) == bench.mixer_macs("attention", H, W, C)
    ssog = SSoG(C, h, M, backend="matmul")  # dense axis factors, the counted model
    assert counted_macs(lambda: ssog(x)) == bench.mixer_macs("ssog", H, W, C, M)


@pytest.mark.parametrize("mixer", ["ssog", "attention"])
def test_model_macs_match_torch_flop_counter(mixer):
    cfg = dict(img_size=32, patch_size=8, dim=24, depth=2, num_heads=3, num_classes=5, ssog_backend="matmul",
               attn_backend="math")
    model = ViT("discrete", mixer, **cfg)
    images = torch.randn(2, 3, 32, 32)
    expected = bench.model_macs(mixer, 32, dim=24, depth=2, patch_size=8, num_classes=5, batch=2)
    assert counted_macs(lambda: model(images)) == expected


def test_mac_ratios_of_the_issue():
    """The multiply-add ratios the targets are stated in, recomputed from the formulas' parts."""
    N, C, M = 4096, 384, 4
    att = 4 * N * C * C + 2 * N * N * C
    ssog = 2 * N * C * C + C * M * N * (64 + 64)
    assert bench.mixer_macs("sdpa", 64, 64, C, M) == att
    assert bench.mixer_macs("ssog", 64, 64, C, M) == ssog
    assert abs(att / ssog - 7.6) < 0.05  # 15.3 vs 2.0 GMAC
    for dim, ratio in ((192, 4.3), (384, 3.0), (768, 2.1)):
        r = bench.block_macs("attention", 64, 64, dim) / bench.block_macs("ssog", 64, 64, dim)
        assert abs(r - ratio) < 0.1


def test_fit_exponent_recovers_a_power_law():
    N = [196, 576, 1024, 2304, 4096]
    assert abs(bench.fit_exponent(N, [3e-7 * n**1.5 for n in N]) - 1.5) < 1e-12
    assert math.isnan(bench.fit_exponent([1], [1]))


def test_bad_resolution_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the patch size 16"):
        bench.check_resolution(1000, 16)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        throughput.main(["--resolutions", "225", "--docs", "/nonexistent"])
    with pytest.raises(ValueError, match="unknown SSoG backend 'nope'"):
        throughput.main(["--ssog-backend", "nope", "--docs", "/nonexistent"])
    with pytest.raises(ValueError, match="unknown width"):
        throughput.main(["--widths", "xl", "--docs", "/nonexistent"])


_PEAK_PROBE = """
import json, torch
from lipcheck import bench
size = 64 * 2**20

def step():
    t = torch.ones(size // 4)
    assert float(t[-1]) == 1.0

_, peak = bench.timed_step(step, torch.device("cpu"))
_, idle = bench.timed_step(lambda: None, torch.device("cpu"))
print(json.dumps(dict(peak=peak, idle=idle)))
"""


def test_peak_memory_is_what_the_step_adds():
    """A step that writes a 64 MiB tensor adds 64 MiB (plus interpreter noise) to the peak resident size. Measured in
    a fresh process: a test worker's heap, shaped by the tests before, may hold 64 MiB of resident free pages that
    malloc hands back without touching new ones."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    size = 64 * 2**20
    assert size - 2 * 2**20 <= r["peak"] <= size + 24 * 2**20, r  # other pages may be released meanwhile
    assert r["idle"] < 8 * 2**20, r


_ALLOCATOR_PROBE = """
import json, torch
from lipcheck import bench
size = 16 * 2**20  # below the caching threshold: kept by malloc once freed

def step():
    t = torch.ones(size // 4)
    assert float(t[-1]) == 1.0

for _ in range(10):  # glibc settles on reusing the block after a few rounds
    step()
_, cached = bench.timed_step(step, torch.device("cpu"))
released = bench._release_to_os()
_, fresh = bench.timed_step(step, torch.device("cpu"))
print(json.dumps(dict(cached=cached, fresh=fresh, released=released)))
"""


def test_memory_step_sees_what_the_caching_allocator_hides():
    """Under the timing allocator a repeated 16 MiB step adds nothing to the resident size (its block
    is reused); after the switch the same step adds its 16 MiB again."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, **bench.CACHING_MALLOC_ENV)
    out = subprocess.run([sys.executable, "-c", _ALLOCATOR_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if not r["released"]:
        pytest.skip("C library is not glibc")
    size = 16 * 2**20
    assert r["cached"] < 2 * 2**20, r
    assert size - 2 * 2**20 <= r["fresh"] <= size + 8 * 2**20, r


def test_sampler_fallback_sees_a_transient_allocation(monkeypatch):
    """A 48 MiB tensor that lives only between two samples is in the peak. It is freed only after the
    sampler thread has read the resident size at least once since it was made (counted, not slept for: a busy
    machine may not schedule the thread for a while)."""
    import threading
    import time
    real, calls = bench.rss_bytes, []
    monkeypatch.setattr(bench, "rss_bytes", lambda: calls.append(threading.get_ident()) or real())
    s = bench._RssSampler(interval=0.0005)
    s.start()
    t = torch.ones(48 * 2**20 // 4)
    base = real()
    seen = calls.count(s.ident)
    deadline = time.monotonic() + 120
    while calls.count(s.ident) < seen + 2 and time.monotonic() < deadline:  # one whole read after `base`
        time.sleep(0.001)
    assert calls.count(s.ident) >= seen + 2, "the sampler thread did not run within 120 s"
    del t
    peak = s.stop()
    assert peak >= base


def test_worker_ok_and_out_of_memory_are_reported():
    """One subprocess measures a small mixer; one whose N x N weights cannot fit the cap comes back as 'oom'."""
    ok = bench.run_config(dict(kind="mixer", mixer="ssog", mode="train", grid=6, dim=12, num_heads=3,
                               num_components=2, warmup=1, repeats=2, threads=1, ssog_backend="auto"), timeout=120)
    assert ok["status"] == "ok", ok
    assert ok["repeats"] == 2 and len(ok["times_s"]) == 2 and ok["median_s"] > 0
    assert ok["images_per_s"] == pytest.approx(1 / ok["median_s"])
    # explicit attention, 4096 tokens, batch 64: 64 * 3 * 4096^2 * 4 bytes = 12 GiB of weights
    oom = bench.run_config(dict(kind="mixer", mixer="math", grid=64, dim=12, num_heads=3, batch_size=64,
                                warmup=0, repeats=1, threads=1), timeout=120, mem_limit_gb=2.0)
    assert oom["status"] == "oom", oom


def test_other_load_from_two_readings_of_proc_stat(tmp_path):
    """The shares against hand-counted ticks: 4 CPUs for 2 s at 100 ticks/s = 800 ticks, of which 330 busy
    (user 100, nice 10, system 150, irq 20, softirq 50) and 40 stolen; 1.3 s of it our own, so 2.0 s others."""
    hz = __import__("os").sysconf("SC_CLK_TCK")
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("cpu  1000 0 500 8000 10 0 0 5 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    # deltas: user 100, nice 10, system 150, idle 420, iowait 10, irq 20, softirq 50, steal 40: 800 in all
    b.write_text("cpu  1100 10 650 8420 20 20 50 45 0 0\n")
    before, after = bench.cpu_times(str(a)), bench.cpu_times(str(b))
    assert after["total"] - before["total"] == pytest.approx(800 / hz)
    assert after["busy"] - before["busy"] == pytest.approx(330 / hz)
    got = bench.other_load(before, after, own_s=130 / hz)
    assert got["others"] == pytest.approx(200 / 800) and got["steal"] == pytest.approx(40 / 800)
    assert got["cpu_s"] == pytest.approx(800 / hz)
    assert bench.other_load(before, after, own_s=1e6)["others"] == 0.0  # more own time than busy time: clamped
    assert bench.other_load(after, before, own_s=0.0) is None  # time ran backwards
    assert bench.other_load(after, after, own_s=0.0) is None  # no time passed: no share to form
    assert bench.other_load(None, after, 0.0) is None and bench.cpu_times(str(tmp_path / "absent")) is None
    (tmp_path / "c").write_text("intr 1 2 3\n")
    assert bench.cpu_times(str(tmp_path / "c")) is None


def test_each_mixer_of_a_row_keeps_its_workers_machine_record():
    """A row worker's result holds both mixers; unpacked per mixer, each keeps the record of the process both ran in."""
    machine = dict(others=0.25, steal=0.05, cpu_s=40.0)
    worker = {"config": dict(kind="model", mixers=["ssog", "sdpa"]), "status": "ok", "wall_s": 20.0, "machine": machine,
              "results": [{"config": dict(kind="model", mixer=m), "status": "ok"} for m in ("ssog", "sdpa")]}
    out = throughput.flatten([worker])
    assert [r["config"]["mixer"] for r in out] == ["ssog", "sdpa"]
    assert all(r["machine"] == machine for r in out)
    assert throughput.other_share(out[0]["machine"]) == pytest.approx(0.30) and throughput.other_share(None) is None


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a running process (/proc/PID/stat, fields 14 and 15), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / __import__("os").sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")
def test_other_load_sees_a_process_that_is_not_the_benchmarks():
    """A spinning process counts as other work until it is waited for, and then as the benchmark's own. Checked
    against the spinner's own CPU time in the same interval, so whatever else the machine runs only adds to
    "others": the share holds at least the spinner's time, and once it is waited for, at most the rest."""
    import subprocess
    import time
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before, own0 = bench.cpu_times(), bench._own_cpu_s()
        s0 = _process_cpu_s(spin.pid)  # read inside the interval of the two /proc/stat readings
        deadline = time.monotonic() + 120
        while _process_cpu_s(spin.pid) - s0 < 0.5 and time.monotonic() < deadline:  # CPU time, not wall time
            time.sleep(0.05)
        s1 = _process_cpu_s(spin.pid)
        after, own_running = bench.cpu_times(), bench._own_cpu_s()
    finally:
        spin.kill()
        spin.wait()
    own_waited = bench._own_cpu_s()
    spun = s1 - s0
    assert spun >= 0.5, f"the spinner got {spun:.2f} CPU s in 120 s"
    running = bench.other_load(before, after, own_running - own0)
    total = running["cpu_s"]
    tol = 0.1  # /proc/stat and /proc/PID/stat count in ticks, each on its own
    assert running["others"] * total >= spun - tol
    assert own_waited - own_running >= spun - 0.02  # its whole CPU time, now the benchmark's own
    waited = bench.other_load(before, after, own_waited - own0)["others"] * total
    assert waited <= max(0.0, running["others"] * total - spun) + tol


def test_unknown_mixer_in_a_configuration_is_an_error_result():
    res = bench.measure(dict(kind="mixer", mixer="linear", grid=2, dim=4, num_heads=1))
    assert res["status"] == "error" and "unknown mixer" in res["error"]


def _fake(cfg, t, peak, nfe=None, status="ok"):
    r = {"config": cfg, "status": status}
    if status == "ok":
        r.update(median_s=t, spread=0.0, peak_bytes=peak, images_per_s=1 / t, ssog_backend_used="stacked")
        if nfe:
            r["nfe"] = nfe
    else:
        r["error"] = "DefaultCPUAllocator: can't allocate memory"
    return r


def test_report_ratios_and_oom_rows(tmp_path):
    """analyse/fits/render on hand-built results: speed-up = t_sdpa / t_ssog, fraction of the MAC ratio,
    memory ratios, fitted exponents, and an out-of-memory configuration shown as such."""
    rows = []
    for res in (512, 1024):
        n = (res // 16) ** 2
        for mixer, t, peak in (("ssog", 1e-6 * n**1.5, 10e6 * n / 1024), ("sdpa", 1e-6 * n**1.5 * (n / 64) ** 0.5, 9e6),
                               ("math", 2e-6 * n**1.5 * (n / 64) ** 0.5, 40e6 * (n / 1024) ** 2)):
            cfg = dict(kind="model", mixer=mixer, mode="inference", width="ti", resolution=res, variant="discrete",
                       batch_size=1)
            rows.append(_fake(cfg, t, peak, status="oom" if (mixer == "math" and res == 1024) else "ok"))
    table = throughput.analyse(rows)["rows"]
    r512 = next(r for r in table if r["resolution"] == 512)
    n = 1024
    assert r512["speedup_vs_sdpa"] == pytest.approx((n / 64) ** 0.5)
    macs = {m: bench.model_macs(m, 512, dim=192) for m in ("ssog", "sdpa")}
    assert r512["mac_ratio_vs_sdpa"] == pytest.approx(macs["sdpa"] / macs["ssog"])
    assert r512["speedup_fraction_of_mac_ratio"] == pytest.approx(r512["speedup_vs_sdpa"] / r512["mac_ratio_vs_sdpa"])
    assert r512["memory_ratio_vs_math"] == pytest.approx(10e6 / 40e6)
    r1024 = next(r for r in table if r["resolution"] == 1024)
    assert r1024["math"]["status"] == "oom" and r1024["memory_ratio_vs_math"] is None
    fit = throughput.fits(table)["ti/discrete"]
    assert fit["speedup_vs_sdpa_exponent"] == pytest.approx(0.5)
    assert fit["time_exponent_ssog"] == pytest.approx(1.5)
    assert fit["speedup_vs_sdpa_increasing"] is True
    args = throughput.parse(["--quick"])
    md, must = throughput.render([], "", table, throughput.fits(table), "cpu: test", args, 1, 60.0)
    assert "OOM" in md and "math" in md
    assert must["2_at_top_resolution"][0]["memory_holds"] is False  # no measurement: not claimed


def test_ode_row_measures_its_solver_and_the_ratios_without_it():
    """An ODE row in inference also times its fixed-step solver on a free vector field, over the model's own step grid
    (as many evaluations as the model takes); the report takes that time out of both models' times:
    speed-up without solver = (t_sdpa - t_solver) / (t_ssog - t_solver). Adaptive methods are refused."""
    cfg = dict(kind="model", width="tiny", resolution=32, variant="ode", method="rk4", rk4_steps=3, mode="inference",
               mixers=["ssog", "sdpa"], warmup=0, repeats=1, threads=1)
    row = bench.measure_row(cfg)
    assert row["status"] == "ok", row
    nfe = {r["config"]["mixer"]: r["nfe"] for r in row["results"]}
    assert row["solver"]["nfe"] == nfe["ssog"] == nfe["sdpa"] == 12
    assert row["solver"]["median_s"] > 0 and len(row["solver"]["times_s"]) == 1
    train = bench.measure_row(dict(cfg, mode="train"))
    assert "solver" not in train  # a training step's solver work is not measured
    flow = bench.build_module(dict(cfg, mixer="ssog", method="dopri5"), torch.device("cpu"), torch.float32).flow
    with pytest.raises(ValueError, match="fixed-step"):
        bench.solver_seconds(flow, torch.zeros(1, 4, 4, 48))

    # the report's arithmetic on hand-built results
    fake = []
    for mixer, t in (("ssog", 0.5), ("sdpa", 2.0)):
        c = dict(kind="model", mixer=mixer, mode="inference", width="ti", resolution=512, variant="ode",
                 method="rk4", batch_size=1)
        fake.append(dict(_fake(c, t, 1e6, nfe=12), solver=dict(median_s=0.1, nfe=12) if mixer == "ssog" else None))
    r = throughput.analyse(fake)["rows"][0]
    assert r["solver_s"] == 0.1 and r["speedup_vs_sdpa"] == pytest.approx(4.0)
    assert r["speedup_without_solver"] == pytest.approx(1.9 / 0.4)
    assert r["fraction_without_solver"] == pytest.approx(r["speedup_without_solver"] / r["mac_ratio_vs_sdpa"])
    must = {}
    md = "\n".join(throughput._solver_md([r], must))
    assert "| ti | 512 | rk4 |" in md and must["ode_solver"][0]["fraction_without_solver"] == r["fraction_without_solver"]


def test_mixer_rounds_are_pooled():
    """Interleaved rounds of one mixer-alone configuration become one row: all repeats, their median,
    the largest peak; a failed round marks the configuration as failed."""
    def mix(mixer, rnd, times, peak, status="ok"):
        cfg = dict(kind="mixer", mixer=mixer, ssog_backend="auto", grid=8, dim=12, num_components=4, batch_size=1,
                   round=rnd)
        r = {"config": cfg, "status": status}
        if status == "ok":
            r.update(times_s=times, median_s=sorted(times)[len(times) // 2], peak_bytes=peak)
        return r
    res = [mix("sdpa", 0, [4.0, 5.0], 10), mix("ssog", 0, [1.0, 3.0], 7), mix("sdpa", 1, [9.0, 1.0, 6.0], 12),
           mix("ssog", 1, [2.0], 5), mix("math", 0, [1.0], 1), mix("math", 1, None, None, status="oom")]
    pooled = {r["config"]["mixer"]: r for r in throughput.pool_rounds(res)}
    assert pooled["sdpa"]["times_s"] == [4.0, 5.0, 9.0, 1.0, 6.0] and pooled["sdpa"]["median_s"] == 5.0
    assert pooled["sdpa"]["peak_bytes"] == 12 and pooled["sdpa"]["rounds"] == 2
    assert pooled["ssog"]["median_s"] == 2.0 and "round" not in pooled["ssog"]["config"]
    assert pooled["math"]["status"] == "oom"
    rows, _ = throughput.mixer_table(res)
    by = {r["mixer"]: r for r in rows}
    assert by["ssog"]["speedup_vs_sdpa"] == pytest.approx(5.0 / 2.0)


def test_ratio_interval_resamples_whole_rounds():
    """bench.ratio_interval: exact for constant samples, scales with the numerator, None below three samples; rounds
    are resampled together, so a machine load that moves both mixers of a round alike leaves the ratio exact (an
    unpaired bootstrap of the same samples is wide); on independent noise the 95 % interval covers the true ratio
    of medians in most of 400 data sets."""
    assert bench.ratio_interval([2.0] * 7, [1.0] * 7) == pytest.approx((2.0, 2.0))
    assert bench.ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0]) is None
    rng = np.random.default_rng(5)
    load = rng.uniform(1.0, 3.0, 11)  # one factor per round
    lo, hi = bench.ratio_interval(list(2 * load), list(load))
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    lo_u, hi_u = bench.ratio_interval(list(2 * load), list(load[:10]))  # unequal lengths: unpaired
    assert lo_u < 1.8 and hi_u > 2.2
    a, b = rng.lognormal(0.0, 0.3, 9), rng.lognormal(0.0, 0.3, 9)
    base = bench.ratio_interval(list(a), list(b))
    assert bench.ratio_interval(list(3 * a), list(b)) == pytest.approx(tuple(3 * x for x in base))
    assert base[0] <= np.median(a) / np.median(b) <= base[1]
    # coverage: true medians 1.5 and 1 (lognormal median = exp(mu)); nominal 95 %, the percentile bootstrap of a
    # median from 15 samples covers somewhat less
    covered = sum(lo <= 1.5 <= hi for lo, hi in (
        bench.ratio_interval(list(1.5 * rng.lognormal(0.0, 0.2, 15)), list(rng.lognormal(0.0, 0.2, 15)), seed=k)
        for k in range(400)))
    assert 0.85 * 400 <= covered <= 400


def test_report_intervals_and_the_rows_on_the_line():
    """The fractions' intervals in the model rows and the mixer targets come from the timed samples (constant
    samples: the interval is the point), and the targets section names a row whose interval reaches below 0.9."""
    mr = bench.model_macs("sdpa", 224, dim=192) / bench.model_macs("ssog", 224, dim=192)
    rows = []
    for mode, ratio_times in (("inference", ([1.0] * 5, [0.95 * mr] * 5)),  # 0.95 every round
                              ("train", ([1.0, 1.0, 1.0, 1.0, 1.0], [0.8 * mr, 0.94 * mr, 0.95 * mr, 0.96 * mr, 1.1 * mr]))):
        for mixer, times in zip(("ssog", "sdpa"), ratio_times):
            cfg = dict(kind="model", mixer=mixer, mode=mode, width="ti", resolution=224, variant="discrete", batch_size=1)
            r = _fake(cfg, float(np.median(times)), 1e6)
            r["times_s"] = times
            r["throughput"] = dict(batch=4, median_s=4 * r["median_s"], times_s=[4 * t for t in times])
            rows.append(r)
    table = {r["mode"]: r for r in throughput.analyse(rows)["rows"]}
    assert table["inference"]["speedup_fraction_of_mac_ratio"] == pytest.approx(0.95)
    assert table["inference"]["fraction_ci"] == pytest.approx([0.95, 0.95])
    assert table["inference"]["tp_fraction_ci"] == pytest.approx([0.95, 0.95])
    lo, hi = table["train"]["fraction_ci"]
    assert table["train"]["speedup_fraction_of_mac_ratio"] == pytest.approx(0.95)
    assert lo < 0.9 and hi > 0.95
    md, must = throughput.render([], "", list(table.values()), throughput.fits(list(table.values())), "cpu: test",
                                 throughput.parse(["--quick"]), 1, 60.0)
    stats = must["model_fraction_target"]
    assert stats["rows"] == 4 and stats["missed"] == 0 and stats["clear"] == 2
    assert [x["row"] for x in stats["on_the_line"]] == ["ti 224 discrete train batch 1", "ti 224 discrete train batch 4"]
    assert "on the line: ti 224 discrete train batch 1 0.95 [" in md
    targets = throughput.target_rows([
        {"config": dict(part="mixer_target", kind="mixer", mixer=m, grid=14, dim=192, num_heads=3, threads=1,
                        batch_size=1), "status": "ok", "median_s": t, "times_s": [t] * 4,
         "throughput": dict(batch=8, median_s=8 * t, times_s=[8 * t] * 4)} for m, t in (("ssog", 1.0), ("sdpa", 2.0))])
    frac = 2.0 / (bench.mixer_macs("sdpa", 14, 14, 192) / bench.mixer_macs("ssog", 14, 14, 192))
    assert targets[0]["b1_fraction_ci"] == pytest.approx([frac, frac])
    assert targets[0]["tp_fraction_ci"] == pytest.approx([frac, frac])


def test_target_rows_combine_their_rounds():
    """A mixer-target row measured in rounds: each round's speed-up is formed from its own samples and the row's is
    their median (not the quotient of pooled medians, which mixes the machine's speeds of different rounds); each
    round's fraction is kept, the bootstrap resamples within rounds, a round skipped by the time budget is left
    out, a failed round fails the row."""
    mr = bench.mixer_macs("sdpa", 14, 14, 192) / bench.mixer_macs("ssog", 14, 14, 192)

    def result(mixer, rnd, times, status="ok"):
        cfg = dict(part="mixer_target", kind="mixer", mixer=mixer, grid=14, dim=192, num_heads=3, threads=0,
                   batch_size=1, round=rnd)
        if status != "ok":
            return {"config": cfg, "status": status}
        return {"config": cfg, "status": "ok", "median_s": float(np.median(times)), "times_s": times,
                "throughput": dict(batch=8, median_s=8 * float(np.median(times)), times_s=[8 * t for t in times]),
                "machine": machine[rnd]}
    machine = {0: dict(others=0.0, steal=0.0), 1: dict(others=0.3, steal=0.1), 2: dict(others=0.05, steal=0.0)}
    # Round speeds differ (the machine): SSoG 1, 4, 2 s and SDPA 2.2, 8.4, 3.2 s, so the single-round speed-ups are
    # 2.2, 2.1 and 1.6, their median 2.1 (their mean 1.97); the medians of the time columns (2 s, 3.2 s) give 1.6
    rounds = [(0, 1.0, 2.2), (1, 4.0, 8.4), (2, 2.0, 3.2)]
    jitter = [1.0, 1.1, 0.9]
    results = [result("ssog", r, [ts * j for j in jitter]) for r, ts, _ in rounds]
    results += [result("sdpa", r, [ta * j for j in jitter]) for r, _, ta in rounds]
    results += [result("ssog", 3, None, "skipped"), result("sdpa", 3, None, "skipped")]
    (row,) = throughput.target_rows(results[::-1])  # order of the results does not matter
    assert row["rounds"] == 3 and row["status"] == ("ok", "ok")
    assert row["b1_speedup"] == pytest.approx(2.1) and row["b1_fraction"] == pytest.approx(2.1 / mr)
    assert row["tp_speedup"] == pytest.approx(2.1)
    assert row["b1_ssog_ms"] == pytest.approx(2000.0) and row["b1_sdpa_ms"] == pytest.approx(3200.0)
    assert row["b1_round_fractions"] == pytest.approx([2.2 / mr, 2.1 / mr, 1.6 / mr])
    assert row["tp_round_fractions"] == pytest.approx([2.2 / mr, 2.1 / mr, 1.6 / mr])
    # the same jitter in both mixers of a round: every resample of a round pairs them, its ratio is exact
    assert row["b1_fraction_ci"] == pytest.approx([2.1 / mr, 2.1 / mr])
    assert throughput._rounds(row["b1_round_fractions"]) == f" {{{1.6 / mr:.2f}-{2.2 / mr:.2f}}}"
    md, must = throughput.render([], "", [], {}, "cpu: test", throughput.parse(["--quick"]), 1, 60.0, targets=[row])
    assert must["mixer_fraction_target"]["single_rounds"] == dict(rounds=6, below=2 * sum(
        f / mr < 0.8 for f in (2.2, 2.1, 1.6)))
    assert "3 round(s)" in md
    # what else ran in each round (bench.other_load): kept per round, beside the round that fell below 0.8
    assert row["round_other_load"] == pytest.approx([0.0, 0.4, 0.05])
    assert f"batch 1: {1.6 / mr:.2f} (other load 5 %)" in md
    assert must["other_load"] == dict(processes=3, median=pytest.approx(0.05), max=pytest.approx(0.4), above=1)
    assert "median 5 %, highest 40 %, above 10 % in 1 of 3 row processes" in md
    assert "row processes. A number measured beside other work says less about the code than one measured without; " \
           "each number below its line above carries its own." in md
    quiet = dict(row, round_other_load=[0.0, 0.4, 0.05], b1_round_fractions=[0.9] * 3, tp_round_fractions=[0.9] * 3)
    md, _ = throughput.render([], "", [], {}, "cpu: test", throughput.parse(["--quick"]), 1, 60.0, targets=[quiet])
    assert "(other load" not in md and "one measured without." in md  # nothing below its line: no such sentence
    failed = [r for r in results if r["config"].get("round") != 1] + [result("ssog", 1, None, "timeout"),
                                                                     result("sdpa", 1, [1.0] * 3)]
    (row,) = throughput.target_rows(failed)
    assert row["status"] == ("timeout", "ok") and row["b1_speedup"] is None and row["rounds"] == 0


def test_rounds_ratio_interval_resamples_within_rounds():
    """bench.rounds_ratio: the median of the runs' ratios of medians; its interval resamples inside each run (one
    run: the same as ratio_interval), covers the median run's ratio, and is None when a run has under three samples."""
    rng = np.random.default_rng(3)
    nums = [list(s * 2.0 * rng.lognormal(0, 0.1, 9)) for s in (1.0, 3.0, 0.5)]
    dens = [list(s * rng.lognormal(0, 0.1, 9)) for s in (1.0, 3.0, 0.5)]
    per = sorted(np.median(a) / np.median(b) for a, b in zip(nums, dens))
    assert bench.rounds_ratio(nums, dens) == pytest.approx(per[1])
    lo, hi = bench.rounds_ratio_interval(nums, dens)
    assert lo <= per[1] <= hi and lo > 1.5 and hi < 2.6
    assert bench.rounds_ratio_interval(nums[:1], dens[:1]) == bench.ratio_interval(nums[0], dens[0])
    assert bench.rounds_ratio_interval(nums + [[1.0, 2.0]], dens + [[1.0, 2.0]]) is None
    assert bench.rounds_ratio_interval(nums, dens[:2]) is None


def test_rounds_per_planned_row():
    """Every planned row with a throughput batch times it at least three times after at least two untimed steps
    (with two timed steps one slow spell decided a row's ratio), and batch 1 at least as often; below 1024 the
    cheap batch-1 steps get more rounds (31 at 224, 11 up to 768), except training above 512; the 64x64 backend
    table runs five interleaved rounds; --repeats and
    --warmup set every row."""
    args = throughput.parse([])
    plan = throughput.plan(args, "cpu")
    cfgs = [c for c in plan if c.get("throughput_batch", 0) > 1]
    assert cfgs and any(c["part"] == "mixer_target" for c in cfgs) and any(c["part"] == "model" for c in cfgs)
    for c in cfgs:
        assert c["repeats"] >= c["throughput_repeats"] >= 3, c
        assert c["throughput_warmup"] >= 2, c
    backends = [c for c in plan if c["part"] == "mixer"]  # the 64x64 backend table: five rounds of every backend
    assert backends and {c["round"] for c in backends} == set(range(5))
    # the mixer targets: three rounds of every row, the first before any model row, the others between model rows
    # (a model row before and after each), the float64 output check in the first only
    parts = [(c["part"], c.get("round")) for c in plan]
    targets = [c for c in plan if c["part"] == "mixer_target"]
    per_row = {}
    for c in targets:
        per_row.setdefault((c["grid"], c["dim"], throughput.load_of(c)), []).append(c["round"])
    assert len(per_row) == 18 and all(sorted(r) == [0, 1, 2] for r in per_row.values())
    assert max(i for i, p in enumerate(parts) if p == ("mixer_target", 0)) < parts.index(("model", None))
    for rnd in (1, 2):
        at = [i for i, p in enumerate(parts) if p == ("mixer_target", rnd)]
        assert parts[min(at) - 1][0] == "model" and parts[max(at) + 1][0] == "model", rnd
    assert all(c["check"] == (c["grid"] <= 28 and c["round"] == 0) for c in targets)
    models = [c for c in plan if c["part"] == "model"]
    for c in models:
        res, train = c["resolution"], c["mode"] == "train"
        want = 31 if res <= 224 else 11 if res <= 768 and not (train and res > 512) else 3 if res > 384 else 5
        assert c["repeats"] == want, c
    assert {c["resolution"] for c in models} >= {224, 384, 512, 768, 1024}
    explicit = throughput.plan(throughput.parse(["--repeats", "4", "--warmup", "0"]), "cpu")
    assert all(c.get("repeats", 4) == c.get("throughput_repeats", 4) == 4 and c.get("throughput_warmup", 0) == 0
               for c in explicit)


def test_short_steps_are_timed_in_blocks(monkeypatch):
    """A sample is the mean of as many consecutive steps as run in MIN_BLOCK_S after the warm-up (counted by running
    them); steps that long or longer (and rows without an untimed step) are timed one by one."""
    clock = {"t": 0.0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["t"])

    def ticking(dt):
        def step():
            clock["t"] += dt
        return step
    assert bench.steps_per_block(ticking(0.001), 0.5, min_block_s=0.02) == 1  # a slow first step: timed alone
    assert bench.steps_per_block(ticking(0.001), 0.005, min_block_s=0.02) == 20  # steady steps are counted
    assert bench.steps_per_block(ticking(0.0015), 0.005, min_block_s=0.02) == 14
    assert bench.steps_per_block(ticking(1e-9), 0.0, min_block_s=0.02) == 1000  # capped
    assert bench.steps_per_block(ticking(0.001), float("nan"), min_block_s=0.02) == 1
    calls = {"ssog": 0, "sdpa": 0}
    cost = {"ssog": 0.004, "sdpa": 0.025}  # seconds per step, on a fake clock
    real_make_step = bench.make_step

    def counting_step(module, mode, device, bf16=False):
        name = "ssog" if type(module).__name__ == "SSoG" else "sdpa"
        inner = real_make_step(module, mode, device, bf16)

        def step(x, labels):
            calls[name] += 1
            clock["t"] += cost[name]
            return inner(x, labels)
        return step

    monkeypatch.setattr(bench, "make_step", counting_step)
    cfg = dict(kind="mixer", mixers=["ssog", "sdpa"], mode="inference", grid=4, dim=8, num_heads=2,
               num_components=2, warmup=1, repeats=3, threads=1)
    row = bench.measure_row(cfg)
    res = {r["config"]["mixer"]: r for r in row["results"]}
    assert res["ssog"]["block_steps"] == {"x": 5} and res["sdpa"]["block_steps"] == {"x": 1}
    # warm-up, the count of a block (ssog only), the timed blocks, the memory step
    assert calls["ssog"] == 1 + 5 + 3 * 5 + 1 and calls["sdpa"] == 1 + 3 + 1
    assert res["ssog"]["times_s"] == pytest.approx([0.004] * 3) and res["sdpa"]["times_s"] == pytest.approx([0.025] * 3)
    assert res["ssog"]["images_per_s"] == pytest.approx(250.0)


def test_quick_benchmark_rows_present_and_outputs_correct(tmp_path):
    """The quick benchmark, narrowed to ti/discrete, one repeat and one warm-up step: every planned row is
    present and ran, at batch 1 and at the throughput batch, under each load; every model output checked in
    float64 against the reference paths agrees. Timings and targets are the report's business, not this test's."""
    import json
    out = tmp_path / "q.json"
    throughput.main(["--quick", "--widths", "ti", "--variants", "discrete", "--repeats", "1", "--warmup", "1",
                     "--throughput-batch", "2", "--docs", str(tmp_path), "--json", str(out)])
    data = json.loads(out.read_text())
    loads = set(throughput.LOADS)
    rows = [r for r in data["rows"] if r["resolution"] == 224 and r["width"] == "ti" and r["variant"] == "discrete"]
    assert {r["load"] for r in rows if r["mode"] == "inference"} == loads
    assert any(r["mode"] == "train" for r in rows)
    for r in rows:
        for m in ("ssog", "sdpa"):
            assert r[m]["status"] == "ok", (r["load"], r["mode"], m, r[m]["error"])
            assert r[m]["median_s"] > 0 and r[m]["tp_batch"] == 2 and r[m]["tp_median_s"] > 0
        assert r["speedup_vs_sdpa"] is not None and r["tp_speedup_vs_sdpa"] is not None
    checked = [r for r in rows if r["ssog"]["check"]]
    assert checked, "the pinned inference row carries the float64 output check"
    for r in checked:
        for m in ("ssog", "sdpa"):
            assert r[m]["check"]["finite"] and r[m]["check"]["ok"], r[m]["check"]
    targets = data["mixer_targets"]
    assert {(t["grid"], t["dim"], t["load"]) for t in targets} == {(64, 384, load) for load in loads}
    for t in targets:
        assert t["status"] == ["ok", "ok"] and t["b1_speedup"] and t["tp_batch"] == 2 and t["tp_speedup"]
    busy = [x for x in data["raw"] if x["config"].get("busy")]
    assert busy and all(x["config"]["threads"] == 0 for x in busy)
    md = (tmp_path / "throughput.md").read_text()
    assert "## 0. Targets, as measured" in md and "## 1a. Mixer alone" in md
