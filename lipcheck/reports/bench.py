"""The throughput report (`lipcheck bench`): the rows of a run (lipcheck.bench_results) as Markdown, section by
section, and its figures. Each section also records the verdict on the targets it states in `must` (the JSON's
must_show, which `verdict` reads), so that the text and the verdict come from one comparison."""
from __future__ import annotations

import itertools
import os
import statistics

from lipcheck import bench, report
from lipcheck.bench_results import LABEL, LOADS, MIXER_GRID, primary_load

# The paper (GPU, matched batch size, 1024x1024): SSoG against dense attention.
PAPER = {"ode": "up to +154% throughput, >60% lower peak memory",
         "discrete": ">30% higher throughput", "looped": ">30% higher throughput"}


def render(mixer_rows, mixer_md, rows, fit, device_str, args, threads, elapsed, targets=None,
           load_note="") -> tuple[str, dict]:
    """The report's Markdown and `must`, the verdicts on its targets. args: the run's options (bf16, batch_size,
    mem_limit_gb); threads: the pinned thread count; elapsed: seconds the run took."""
    must = {}
    md = _intro_md(device_str, args, threads, elapsed, load_note)
    md += _targets_md(targets or [], rows, must)
    md += _backend_table_md(mixer_rows, mixer_md, must)
    md += _models_md(rows, args, must)
    md += _top_resolution_md(rows, must)
    md += _backends_md(rows)
    md += _trend_md(fit, must)
    return "\n".join(md), must


def load_note(machine_load: dict | None) -> str:
    """The machine's load averages before and after the run (a sentence of the introduction); '' unrecorded."""
    if not machine_load:
        return ""
    return ("Machine load (1/5/15-minute load averages over " + str(os.cpu_count()) + " CPUs) before the run "
            + "/".join(f"{x:.1f}" for x in machine_load["loadavg_before"]) + ", after "
            + "/".join(f"{x:.1f}" for x in machine_load["loadavg_after"])
            + ": other processes shared the CPU whenever the load exceeds what the benchmark itself adds (one).")


def rerendered_note(source, now: dict) -> str:
    """The first line of a report rebuilt from an earlier run's JSON: the stamp below is the measuring run's."""
    return (f"_Re-rendered from that run's raw results (`{source}`) by `{now['command']}` at commit "
            f"`{now['commit']}`, {now['date']}: no new measurements._\n\n")


def _intro_md(device_str, args, threads, elapsed, load_note) -> list[str]:
    md = ["# Throughput and peak memory: SSoG against dense attention", ""]
    md += [f"Device: **{device_str}** (the torch default; the benchmark pinned {threads} thread(s) per configuration "
           "except in the rows marked with another load), float32"
           + (" with bfloat16 autocast" if args.bf16 else "") + f", batch size {args.batch_size} and a throughput batch "
           f"per row. Every row ran in its own process; the benchmark took {elapsed / 60:.1f} min. {load_note} "
           "Timings on a CPU shared with other work are noisy: within a row the mixers were timed alternately "
           "(SSoG, attention, SSoG, ...) in one process, so a slow spell lands on both, and ratios are of medians; a timed "
           f"sample is one step, or, for steps shorter than {bench.MIN_BLOCK_S * 1e3:.0f} ms, the mean of as many consecutive "
           "steps as run in that time after the warm-up (counted by running them: `bench.steps_per_block`), so that a step of half a "
           "millisecond is not timed with the caches the other model's step left behind. Peak memory is what the measured step adds: on CPU the peak resident "
           "size during the step minus the resident size just before it (model and input already in place); "
           "on CUDA `max_memory_allocated` after a reset. The CUDA path (CUDA events, `max_memory_allocated`, "
           "bf16 autocast) is written but was not run for this report unless the device above says cuda.", "",
           "CPU allocator: the timed steps run with glibc malloc keeping and reusing freed blocks up to 32 MB "
           "(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), as PyTorch's CUDA allocator does and as a "
           "tuned CPU deployment does with jemalloc or tcmalloc. With every large tensor a fresh mmap instead, "
           "the kernel zeroes each page on first touch, a cost per byte allocated rather than per multiply-add: "
           "it slowed the SSoG mixer at 64x64 by 1.7x and fused SDPA by 2%, so it would measure page faults, "
           "not mixing. Peak memory comes from one further step per configuration, after the allocator is "
           "switched to returning every block of 128 kB and more to the OS and its free pages are released "
           "(`lipcheck.bench`, module docstring).", ""]
    return md


def _targets_md(targets: list[dict], rows: list[dict], must: dict) -> list[str]:
    """Section 0 (every target of the benchmark with its measured number) and section 1a (the mixer rows)."""
    md = ["## 0. Targets, as measured", ""]
    lines = _mixer_target_lines(targets, must) + _busy_core_lines(targets, must) + _model_target_lines(rows, must)
    lines += _other_load_lines(targets, rows, "(other load" in "".join(lines), must)
    md += lines + [""] if lines else ["(no target rows in this run)", ""]
    return md + _mixer_rows_md(targets)


def _mixer_target_lines(targets: list[dict], must: dict) -> list[str]:
    """Mixer alone >= 0.8 of its MAC ratio, with the intervals and the single rounds; the output check."""
    lines = []
    t1 = [t for t in targets if t["b1_fraction"] is not None]
    if t1:
        fr = [(t, tag) for t in t1 for tag in ("b1", "tp") if t[f"{tag}_fraction"] is not None]
        miss = [(t, tag) for t, tag in fr if t[f"{tag}_fraction"] < 0.8]
        quiet = [(t, tag) for t, tag in fr if t["load"] != "default threads, busy core"]
        qmiss = [(t, tag) for t, tag in quiet if t[f"{tag}_fraction"] < 0.8]
        must["mixer_fraction_target"] = dict(rows=len(quiet), missed=len(qmiss),
                                             min_fraction=min((t[f"{tag}_fraction"] for t, tag in quiet), default=None))
        lines.append(f"- Mixer alone (14x14, 28x28, 64x64; C = 192, 384), measured speed-up over fused SDPA >= 0.8 of "
                     f"the multiply-add ratio, without a busy process: "
                     + ("holds in all " + str(len(quiet)) + " measurements" if not qmiss else
                        f"**missed in {len(qmiss)} of {len(quiet)}**: " + "; ".join(
                            f"{t['grid']}x{t['grid']} C={t['dim']} {t['load']} batch {t[tag + '_batch']}: "
                            f"{t[tag + '_fraction']:.2f}" + _other_pct(t.get("round_other_load"), "in its rounds")
                            for t, tag in qmiss))
                     + f" (lowest {must['mixer_fraction_target']['min_fraction']:.2f}). With the busy core: "
                     + f"{len(fr) - len(quiet) - len([m for m in miss if m[0]['load'] == 'default threads, busy core'])}"
                     + f" of {len(fr) - len(quiet)} at >= 0.8.")
        note, stats = _interval_note([(t[f"{tag}_fraction"], t.get(f"{tag}_fraction_ci"), (t, tag)) for t, tag in quiet],
                                     0.8, lambda x: f"{x[0]['grid']}x{x[0]['grid']} C={x[0]['dim']} {x[0]['load']} "
                                                    f"batch {x[0][x[1] + '_batch']}")
        lines[-1] += note
        must["mixer_fraction_target"].update(stats)
        single = [(t, tag, f, o) for t, tag in quiet  # each round's fraction with that round's other load
                  for f, o in zip(t.get(f"{tag}_round_fractions") or [], t.get("round_other_load") or itertools.repeat(None))]
        if single:  # the rows' single rounds, said plainly: a round can miss where the row does not
            low = [(t, tag, f, o) for t, tag, f, o in single if f < 0.8]
            must["mixer_fraction_target"]["single_rounds"] = dict(rounds=len(single), below=len(low))
            lines[-1] += (f" Single rounds (of the {len(quiet)} measurements): {len(single) - len(low)} of "
                          f"{len(single)} at >= 0.8" + ("; below: " + "; ".join(
                              f"{t['grid']}x{t['grid']} C={t['dim']} {t['load']} batch {t[tag + '_batch']}: {f:.2f}"
                              + _other_pct([o]) for t, tag, f, o in low) if low else "") + ".")
        if any(t["checked"] for t in targets):
            bad = [t for t in targets if t["checked"] and not t["check_ok"]]
            lines.append("- Mixer outputs (float64, against the einsum reference path and explicit softmax): "
                         + ("all agree to 1e-10 relative" if not bad else f"**{len(bad)} rows disagree**"))
    return lines


def _busy_core_lines(targets: list[dict], must: dict) -> list[str]:
    """The 64x64 mixer with a busy core keeps >= 0.5 of its default-thread speed-up."""
    lines = []
    busy = []
    for t in targets:
        if t["grid"] != 64 or t["load"] != "default threads, busy core":
            continue
        q = next((u for u in targets if u["grid"] == 64 and u["dim"] == t["dim"] and u["load"] == "default threads"), None)
        for tag in ("b1", "tp"):
            if q and q[f"{tag}_speedup"] and t[f"{tag}_speedup"]:
                busy.append(dict(dim=t["dim"], batch=t[f"{tag}_batch"], quiet=q[f"{tag}_speedup"],
                                 busy=t[f"{tag}_speedup"], kept=t[f"{tag}_speedup"] / q[f"{tag}_speedup"]))
    if busy:
        must["busy_core_64"] = busy
        lines.append("- With one core busy, the 64x64 mixer keeps >= 0.5 of its default-thread speed-up over fused SDPA: "
                     + "; ".join(f"C={b['dim']} batch {b['batch']}: {b['busy']:.2f}x busy / {b['quiet']:.2f}x default "
                                 f"= {b['kept']:.2f} ({'holds' if b['kept'] >= 0.5 else '**missed**'})" for b in busy))
    return lines


def _model_target_lines(rows: list[dict], must: dict) -> list[str]:
    """Whole models >= 0.9 of the MAC ratio (the primary load's rows); at 224, SSoG faster in every row."""
    lines = []
    prim = primary_load(rows)
    fr = [(r, tag) for r in rows for tag in ("", "tp_")
          if r.get("load", "-") == prim and r["method"] != "dopri5"
          and r.get(f"{tag}fraction_of_mac_ratio" if tag else "speedup_fraction_of_mac_ratio") is not None]
    val = lambda r, tag: r["tp_fraction_of_mac_ratio"] if tag else r["speedup_fraction_of_mac_ratio"]
    if fr:
        miss = [(r, tag) for r, tag in fr if val(r, tag) < 0.9]
        must["model_fraction_target"] = dict(load=prim, rows=len(fr), missed=len(miss),
                                             min_fraction=min(val(r, tag) for r, tag in fr))
        lines.append(f"- Whole models ({prim}; every measured width, variant, resolution and mode, batch 1 and the "
                     f"throughput batch): SSoG throughput >= 0.9 x (MAC ratio) x fused-SDPA throughput: "
                     + (f"holds in all {len(fr)}" if not miss else f"**missed in {len(miss)} of {len(fr)}**: " + "; ".join(
                         f"{r['width']} {r['resolution']} {r['variant']} {r['mode']} "
                         f"{'batch ' + str(r['throughput_batch']) if tag else 'batch 1'}: {val(r, tag):.2f}"
                         + (f" ({r['fraction_without_solver']:.2f} without the ODE solver's own work, section 2)"
                            if not tag and r.get("fraction_without_solver") else "") + _other_pct([r.get("other_load")])
                         for r, tag in miss))
                     + f" (lowest {must['model_fraction_target']['min_fraction']:.2f}).")
        ci = lambda r, tag: r.get("tp_fraction_ci") if tag else r.get("fraction_ci")
        note, stats = _interval_note([(val(r, tag), ci(r, tag), (r, tag)) for r, tag in fr], 0.9,
                                     lambda x: f"{x[0]['width']} {x[0]['resolution']} {x[0]['variant']} {x[0]['mode']} "
                                               f"{'batch ' + str(x[0]['throughput_batch']) if x[1] else 'batch 1'}")
        lines[-1] += note
        must["model_fraction_target"].update(stats)
        at224 = [(r, tag) for r, tag in fr if r["resolution"] == 224]
        if at224:
            sp = lambda r, tag: r["tp_speedup_vs_sdpa"] if tag else r["speedup_vs_sdpa"]
            slow = [(r, tag) for r, tag in at224 if sp(r, tag) <= 1.0]
            lines.append("- At 224, SSoG faster than fused SDPA in every row: "
                         + ("holds (" + ", ".join(f"{r['width']} {r['variant']} {r['mode']} "
                                                   f"{'B' + str(r['throughput_batch']) if tag else 'B1'} {sp(r, tag):.2f}x"
                                                   for r, tag in at224) + ")" if not slow else
                            "**missed** in " + ", ".join(f"{r['width']} {r['variant']} {r['mode']} "
                                                         f"{'B' + str(r['throughput_batch']) if tag else 'B1'} "
                                                         f"({sp(r, tag):.2f}x)" for r, tag in slow)))
    return lines


def _other_load_lines(targets: list[dict], rows: list[dict], annotated: bool, must: dict) -> list[str]:
    """What else the machine did while the rows ran (`bench.other_load`); `annotated`: a line above carries its own."""
    lines = []
    procs = [x for t in targets for x in t.get("round_other_load") or []] + [r.get("other_load") for r in rows]
    procs = [x for x in procs if x is not None]
    if procs:  # what else the machine did: the context of every number above
        hi = sum(x > OTHER_LOAD_NOTED for x in procs)
        must["other_load"] = dict(processes=len(procs), median=statistics.median(procs), max=max(procs), above=hi)
        lines.append(f"- Other work on the machine while the rows ran (CPU time of processes other than the benchmark's, "
                     f"plus time the hypervisor gave to other machines, as a share of all CPU time while a row's process "
                     f"ran; `bench.other_load`): median {100 * statistics.median(procs):.0f} %, highest "
                     f"{100 * max(procs):.0f} %, above {100 * OTHER_LOAD_NOTED:.0f} % in {hi} of {len(procs)} row "
                     "processes. A number measured beside other work says less about the code than one measured "
                     "without" + ("; each number below its line above carries its own." if annotated else "."))
    return lines


def _mixer_rows_md(targets: list[dict]) -> list[str]:
    """Section 1a: the mixer-target rows."""
    md = []
    if targets:
        md += ["## 1a. Mixer alone: SSoG (auto backend) against fused SDPA", "",
               "Forward with projections, 4 components, eval, no grad; both mixers timed alternately in one process, "
               "at batch 1 and at the throughput batch (with more than one thread after eight untimed steps per batch "
               "size, in which SSoG's thread policy times both thread counts). "
               f"Each row ran in {max(t['rounds'] for t in targets)} round(s), each in its own process, spread over "
               "the run (the first before the backend table, the others between the model rows), and its samples are "
               "combined: a slow spell of the machine lands on one round, not on the whole row. Each round's speed-up "
               "is formed from its own samples (SSoG and SDPA alternating), and `x vs SDPA` is the median over rounds "
               "of those speed-ups (the machine's speed differs between rounds minutes apart, so it is not the "
               "quotient of the time columns, which are medians over rounds of each round's median). "
               "`frac` = that speed-up / multiply-add ratio (target >= 0.8), with its bootstrap 95 % interval (samples "
               "resampled within each round) and, in braces, the lowest and highest fraction of a single round.",
               ""]
        trows = [[f"{t['grid']}x{t['grid']}", t["dim"], t["load"], _f(t["mac_ratio"]),
                  t["b1_batch"] or "-", _f(t["b1_ssog_ms"]), _f(t["b1_sdpa_ms"]), _f(t["b1_speedup"]),
                  _fci(t["b1_fraction"], t.get("b1_fraction_ci")) + _rounds(t.get("b1_round_fractions")),
                  t["tp_batch"] or "-", _f(t["tp_ssog_ms"]), _f(t["tp_sdpa_ms"]), _f(t["tp_speedup"]),
                  _fci(t["tp_fraction"], t.get("tp_fraction_ci")) + _rounds(t.get("tp_round_fractions")),
                  "ok" if t["check_ok"] and t["checked"] else ("-" if not t["checked"] else "FAILED")]
                 for t in sorted(targets, key=lambda t: (t["grid"], t["dim"], list(LOADS).index(t["load"])
                                                          if t["load"] in LOADS else 9))]
        md += [report.md_table(["grid", "C", "load", "MAC ratio", "B", "SSoG ms", "SDPA ms", "x vs SDPA", "frac",
                                "TB", "SSoG ms @TB", "SDPA ms @TB", "x vs SDPA @TB", "frac @TB", "output check"], trows), ""]
    return md


def _backend_table_md(mixer_rows: list[dict], mixer_md: str, must: dict) -> list[str]:
    """Section 1b: the SSoG backends against both attention backends at one grid (the 7.6x target)."""
    sd = next((x for x in mixer_rows if x["mixer"] == "sdpa"), None)
    best = max((x for x in mixer_rows if x["mixer"] == "ssog" and x["speedup_vs_sdpa"]),
               key=lambda x: x["speedup_vs_sdpa"], default=None)
    auto = next((x for x in mixer_rows if x["mixer"] == "ssog" and x["backend"] == "auto"), None)
    mac_ratio = (sd["gmac"] / auto["gmac"]) if sd and auto else None
    grid = mixer_rows[0]["grid"] if mixer_rows else MIXER_GRID
    md = [f"## 1b. SSoG backends, mixer alone: {grid}x{grid} grid, C=384, 6 heads, 4 components, forward, "
           "one configuration per process", "",
           f"Multiply-add ratio with dense axis factors: {_f(mac_ratio)}x "
           f"({_f(sd['gmac'] if sd else None)} vs {_f(auto['gmac'] if auto else None)} GMAC). "
           "The truncated and FFT backends do fewer multiply-adds than the GMAC column (which counts dense factors). "
           f"The whole set ran in {max((x['rounds'] for x in mixer_rows), default=1)} interleaved round(s), "
           "each mixer's timed repeats pooled over them (median, spread = (max - min) / median), so that a slow "
           "spell of the machine falls on every mixer alike.", "",
           mixer_md, ""]
    if auto and auto["speedup_vs_sdpa"]:
        measured = (f"Measured with `auto`: {auto['speedup_vs_sdpa']:.2f}x; best backend ({best['name']}): "
                    f"{best['speedup_vs_sdpa']:.2f}x")
        must["1_mixer_speedup_auto"] = auto["speedup_vs_sdpa"]
        must["1_mixer_speedup_best_backend"] = best["speedup_vs_sdpa"] if best else None
        if grid == 64:
            ok = auto["speedup_vs_sdpa"] >= 7.6
            must["1_holds"] = ok
            verdict = ("Holds." if ok else "Does not hold on this run; the GMAC/s column shows where the time goes.")
        else:  # the target is stated for 64x64 only
            must["1_holds"] = None
            verdict = (f"Quick run: a {grid}x{grid} grid, where the multiply-add ratio is {_f(mac_ratio)}x; "
                       "the 7.6x target is for 64x64 (the full run).")
        md += [f"**Target (64x64): SSoG at least 7.6x faster than fused SDPA.** {measured}. {verdict}", ""]
    return md


def mixer_md(rows: list[dict]) -> str:
    """The backend table of section 1b."""
    return report.md_table(
        ["mixer", "GMAC", "median ms", "spread", "GMAC/s", "peak MB", "speed-up vs fused SDPA", "status"],
        [[x["name"], x["gmac"], _f(x["median_s"], 1e3), _f(x["spread"]), _f(x["gmac_per_s"]), _f(x["peak_mb"]),
          _f(x["speedup_vs_sdpa"]), x["status"]] for x in rows])


def _models_md(rows: list[dict], args, must: dict) -> list[str]:
    """Section 2: the whole-model table, the ODE solver's share, the configurations that did not finish."""
    md = ["## 2. Whole models", "",
           "Images/s and the peak memory (MB) the step adds. `x vs SDPA` is SSoG's measured speed-up over fused "
           "SDPA, `MAC ratio` the analytic multiply-add ratio with dense SSoG axis factors (counted with each "
           "model's own NFE for the ODE), `frac` their quotient (target >= 0.9) with its bootstrap 95 % interval "
           "(whole rounds of the interleaved samples resampled, 4000 times: `bench.ratio_interval`), `mem/math` SSoG's peak over "
           "explicit attention's (target <= 0.4), `mem/SDPA` over fused SDPA's. ODE rk4 uses 3 steps "
           "(NFE 12 = depth, the discrete model's cost); dopri5 rtol = atol = 1e-3 with its NFE as counted. "
           "`TB` is the row's throughput batch (timed in the same process after batch 1, after at least two untimed "
           "steps; `@TB` columns), `rounds` the timed samples per mixer at batch 1 / at TB, "
           "`load` the thread setting (`1 thread` pinned; `default threads` torch's count; `busy core` with a "
           "spinning competing process started by the benchmark; rows with more than one thread start each batch "
           "size with eight untimed steps, in which SSoG's thread policy times both thread counts), "
           "`output check` the float64 comparison of the "
           "timed model against its reference paths (largest relative error). "
           "To fit the CPU budget the full run measures training steps at 224 (every variant), 512 and 1024 "
           "(discrete; s up to 512), the looped model (the discrete model's operations with one block's weights) "
           "at 224 and 1024, the ODE at 224, 512 and 1024, explicit attention at 1024 (discrete ti), "
           "dopri5 at 224; rows missing below were not planned, rows marked SKIPPED ran out of the time budget.", ""]
    md += _model_table(rows)
    md += _solver_md(rows, must)
    errs = [(r, m) for r in rows for m in ("ssog", "sdpa", "math") if r[m]["status"] not in ("ok", "missing")]
    if errs:
        md += ["Configurations that did not finish (out of memory under the per-configuration cap of "
               f"{args.mem_limit_gb:g} GB, timeout or error):", ""]
        md += [f"- {r['width']} {r['resolution']} {r['variant']} {r['mode']} {LABEL[m]}: {r[m]['status']} "
               f"({(r[m]['error'] or '')[:160]})" for r, m in errs]
        md += [""]
    return md


def _model_table(rows: list[dict]) -> list[str]:
    header = ["width", "res", "N", "variant", "mode", "load", "SSoG img/s", "SDPA img/s", "math img/s", "x vs SDPA",
              "MAC ratio", "frac", "rounds", "TB", "SSoG img/s @TB", "SDPA img/s @TB", "x vs SDPA @TB", "frac @TB",
              "x vs math", "SSoG MB", "SDPA MB", "math MB", "mem/math", "mem/SDPA", "NFE s/a", "SSoG backend", "output check"]
    table = []
    for r in rows:
        v = r["variant"] + (f" ({r['method']})" if r["method"] else "")
        nfe = f"{r['ssog']['nfe']}/{r['sdpa']['nfe']}" if r["ssog"]["nfe"] is not None else "-"
        tpi = lambda m: _f(r[m].get("tp_images_per_s")) if r.get("throughput_batch") else "-"
        table.append([r["width"], r["resolution"], r["tokens"], v, r["mode"], r.get("load", "-"), _ips(r["ssog"]),
                      _ips(r["sdpa"]), _ips(r["math"]), _f(r["speedup_vs_sdpa"]), _f(r["mac_ratio_vs_sdpa"]),
                      _fci(r["speedup_fraction_of_mac_ratio"], r.get("fraction_ci")),
                      "/".join(str(n) for n in r["rounds"] if n) if r.get("rounds") else "-", r.get("throughput_batch") or "-",
                      tpi("ssog"), tpi("sdpa"), _f(r.get("tp_speedup_vs_sdpa")),
                      _fci(r.get("tp_fraction_of_mac_ratio"), r.get("tp_fraction_ci")),
                      _f(r["speedup_vs_math"]), _mem(r["ssog"]),
                      _mem(r["sdpa"]), _mem(r["math"]), _f(r["memory_ratio_vs_math"]), _f(r["memory_ratio_vs_sdpa"]),
                      nfe, r["ssog"]["backend"] or "-", _check(r)])
    return [report.md_table(header, table), ""]


def _solver_md(rows: list[dict], must: dict) -> list[str]:
    """The ODE rows' solver work: time per forward of the fixed-step solver on a vector field that costs nothing
    (bench.solver_seconds), its share of each model's time, and the ratios with it taken out of both."""
    srows = [r for r in rows if r.get("solver_s") is not None]
    if not srows:
        return []
    must["ode_solver"] = [dict(width=r["width"], resolution=r["resolution"], method=r["method"], load=r.get("load"),
                               nfe=r.get("solver_nfe"), solver_s=r["solver_s"], ssog_s=r["ssog"]["median_s"],
                               sdpa_s=r["sdpa"]["median_s"], fraction=r["speedup_fraction_of_mac_ratio"],
                               fraction_without_solver=r["fraction_without_solver"]) for r in srows]
    share = lambda r, m: _f(100 * r["solver_s"] / r[m]["median_s"]) + " %" if r[m]["median_s"] else "-"
    table = [[r["width"], r["resolution"], r["method"], r.get("load", "-"), r.get("solver_nfe") or "-",
              _f(1e3 * r["solver_s"]), _f(1e3 * r["ssog"]["median_s"]) if r["ssog"]["median_s"] else "-",
              _f(1e3 * r["sdpa"]["median_s"]) if r["sdpa"]["median_s"] else "-", share(r, "ssog"), share(r, "sdpa"),
              _f(r["speedup_fraction_of_mac_ratio"]), _f(r["fraction_without_solver"])] for r in srows]
    return ["### The ODE solver's own work (batch 1, inference)", "",
            "The fixed-step solver's arithmetic on the state (torchdiffeq's stage combinations and copies of the "
            "solution, lipcheck's NFE and finiteness watch), timed in the row's process on the row's own embedded "
            "input and step grid with a vector field that costs nothing (`bench.solver_seconds`): it is the same "
            "for both mixers and no multiply-add count includes it, so it weighs on the faster model's ratio. "
            "`frac` is the table's; `frac w/o solver` the same quotient with the solver's time taken out of both "
            "models' times. The targets above are judged on `frac`.", "",
            report.md_table(["width", "res", "method", "load", "NFE", "solver ms", "SSoG ms", "SDPA ms",
                             "solver / SSoG", "solver / SDPA", "frac", "frac w/o solver"], table), ""]


def _top_resolution_md(rows: list[dict], must: dict) -> list[str]:
    """The throughput and memory targets at the largest resolution, beside the paper's numbers."""
    md = []
    top = max((r["resolution"] for r in rows), default=None)
    big = [r for r in rows if r["resolution"] == top and r["mode"] == "inference" and r["method"] != "dopri5"]
    if big:
        md += [f"## Targets at {top}x{top} (inference)", ""]
        trows, verdicts = [], []
        for r in big:
            frac, memr = r["speedup_fraction_of_mac_ratio"], r["memory_ratio_vs_math"]
            t_ok = frac is not None and frac >= 0.9
            m_ok = memr is not None and memr <= 0.4
            verdicts.append(dict(width=r["width"], variant=r["variant"], speedup_vs_sdpa=r["speedup_vs_sdpa"],
                                 mac_ratio=r["mac_ratio_vs_sdpa"], fraction=frac, throughput_holds=t_ok,
                                 memory_ratio_vs_math=memr, memory_holds=m_ok,
                                 memory_ratio_vs_sdpa=r["memory_ratio_vs_sdpa"]))
            gain = lambda x: f"{100 * (x - 1):+.0f}%" if x else "-"
            red = lambda x: "-" if x is None else (f"{100 * (1 - x):.0f}% lower" if x <= 1 else f"{100 * (x - 1):.0f}% higher")
            trows.append([r["width"], r["variant"], gain(r["speedup_vs_sdpa"]), gain(r["speedup_vs_math"]),
                          _f(r["mac_ratio_vs_sdpa"]), _f(frac), "yes" if t_ok else "NO", red(memr),
                          "yes" if m_ok else ("NO" if memr is not None else "not measured"), red(r["memory_ratio_vs_sdpa"]),
                          PAPER[r["variant"]]])
        md += [report.md_table(["width", "variant", "throughput vs SDPA", "vs math", "MAC ratio", "frac",
                                "frac >= 0.9", "memory vs math", "<= 0.4x", "memory vs SDPA", "paper (vs attention)"],
                               trows), ""]
        must["2_at_top_resolution"] = verdicts
        nt = sum(not v["throughput_holds"] for v in verdicts)
        nm = sum(not v["memory_holds"] for v in verdicts if v["memory_ratio_vs_math"] is not None)
        n_mem = sum(v["memory_ratio_vs_math"] is not None for v in verdicts)
        md += [f"Throughput target at this resolution (measured ratio >= 90% of the multiply-add ratio; every "
               f"resolution: section 0): {'holds in every row of this table' if nt == 0 else f'fails in {nt} of {len(verdicts)} rows'}. "
               f"Memory target (SSoG <= 0.4x explicit attention): "
               + (f"holds in every row where explicit attention was measured ({n_mem} of {len(verdicts)})"
                  if nm == 0 else f"fails in {nm} of the {n_mem} rows where explicit attention was measured")
               + ". Against fused SDPA, which never stores the N x N weights, the memory ratio is reported as measured. "
               "The paper's percentages are against its attention baseline on a GPU; ours are on the device above.", ""]
    return md


def _backends_md(rows: list[dict]) -> list[str]:
    """How the SSoG backends compute, and which one `auto` chose per resolution."""
    from lipcheck.mixers.backends.cost import COST_WEIGHTS
    from lipcheck.mixers.backends.stacked import FUSE_HEADS_TOKENS, TRANSPOSED_MAX_TOKENS, Y_COLUMN_BLOCKS
    from lipcheck.mixers.thread_policy import ThreadPolicy
    policy = ThreadPolicy()
    used = sorted({(r["resolution"], r["ssog"]["backend"]) for r in rows if r["ssog"]["backend"]})
    return ["## SSoG backends", "",
           "All backends live in one table (`lipcheck.mixers.ssog.BACKENDS`) and read the same taps "
           "g(k; mu, sigma) from `lipcheck.gaussian`; the tests check each against the dense operator to 1e-10 "
           "in float64, forward and backward (x, alpha, mu, sigma).", "",
           "- `matmul`: dense axis factors through `einsum` (the reference semantics).",
           "- `stacked`: dense axis factors as two GEMMs per head with the M components stacked: "
           "[G_W^1; ...; G_W^M] (MW x W) applied to every (W x d) slab in place, then [alpha_m G_H^m] with columns "
           "ordered (k, m) (H x HM), so the component sum happens inside the GEMM's contraction.",
           "- `truncated`: per component, depthwise convolutions along x and y with the taps cut at radius "
           "r = min(n - 1, ceil(max(|mu| + t sigma))), t = sqrt(2 ln(2 (1 + sigma/t0) / tol)), "
           "t0 = sqrt(2 ln(2/tol)). Bound: the dropped mass of each normalised 1-D factor is at most "
           "2 exp(-t^2/2) (1 + sigma/t) <= tol, so every output entry is off by at most "
           "sum_m |alpha_m| (2 tol + tol^2) max|v|; tol = eps(dtype)/4 (5.6e-17 in float64, 3.0e-8 in float32), "
           "below the rounding of the kept sum. A radius of n - 1 keeps every offset: exact.",
           "- `fft`: 2-D FFT of the summed kernel sum_m alpha_m g_y (x) g_x, zero-padded to the smallest "
           "2^a 3^b 5^c >= 2n - 1 per axis (linear, not circular, convolution); cost independent of M and sigma.",
           "- `auto` (used for every model above): the cheapest backend under a cost model, in GEMM multiply-add "
           f"units per channel: stacked M N (H + W) x {COST_WEIGHTS['stacked']:g}, truncated N sum_m (2 r_x,m + "
           f"2 r_y,m + 2) x {COST_WEIGHTS['truncated']:g}, fft L log2 L x {COST_WEIGHTS['fft']:g} "
           "(weights measured on this 2-core AVX2 CPU; a GPU would want its own).", "",
           "Backend chosen by `auto` per resolution (initial kernels: widths log-uniform in [0.5, 4], "
           "offsets in [-2, 2]): " + (", ".join(f"{r}: {b}" for r, b in used) or "-") + ". "
           "At these grids (14 to 64 tokens a side) the truncation radius for sigma near 4 is comparable to the "
           "grid, so the dense stacked GEMMs win; truncation pays on larger grids or narrower kernels.", "",
           "Around the products (`lipcheck.mixers.ssog.SSoG`): the prepared factors (normaliser, taps, the "
           "representability check, the backend choice) are cached per grid while alpha, mu, sigma keep their values "
           "(compared exactly; in training they are built once per parameter update with autograd and that graph "
           "serves every use); without autograd the stacked products run per head on strided slabs of the values "
           "(no copy in), with autograd head-major as one batched GEMM per axis; up to "
           f"{FUSE_HEADS_TOKENS} tokens (batch x grid) all heads go in one GEMM per axis, and with more than one "
           f"thread and no autograd, up to {TRANSPOSED_MAX_TOKENS} tokens the "
           "x coordinate goes outermost and at batch 1 above that the y axis runs as a batch of GEMMs over blocks of "
           f"whole x coordinates (at most {Y_COLUMN_BLOCKS}), layouts whose GEMMs split across the threads (these "
           "token thresholds and the block count were measured on a 2-core x86 CPU with MKL and torch 2.13 only; every "
           "layout computes the same numbers, so on another CPU a threshold can only cost speed, and would want "
           "measuring again); on a CPU "
           "each call runs at torch's "
           "thread count or on one thread, whichever the call's own timings show faster (the other setting "
           f"re-probed after {policy.probe_every} calls, the interval doubling up to {policy.max_period} calls while "
           "the choice holds), "
           "which is what keeps a shared machine from parking one thread of every small parallel region. "
           "The MLP's token slicing (a memory-traffic saving) runs only where the hidden activation exceeds 8 MiB.", ""]


def _trend_md(fit: dict, must: dict) -> list[str]:
    """Section 3: the fitted exponents against the token count, the figures, how to regenerate."""
    md = ["## 3. Trend with resolution", "",
           "Exponents p of least-squares fits t ~ N^p (seconds per image, inference) and of the speed-up "
           "ratio against N. Attention's mixing is O(N^2), SSoG's O(N^1.5) with dense factors; the MLP and "
           "projections (O(N)) dilute both at small N, so the fitted exponents over 224-1024 sit below 2 and 1.5.", ""]
    frows = []
    for k, e in fit.items():
        frows.append([k, _f(e["time_exponent_ssog"]), _f(e["time_exponent_sdpa"]), _f(e["time_exponent_math"]),
                      _f(e["speedup_vs_sdpa_exponent"]), _f(e["mac_ratio_vs_sdpa_exponent"]),
                      " ".join(_f(x) for x in e["speedup_vs_sdpa"]), "yes" if e["speedup_vs_sdpa_increasing"] else "no"])
    md += [report.md_table(["width/variant", "p SSoG", "p SDPA", "p math", "p speed-up", "p MAC ratio",
                            "speed-up vs SDPA by resolution", "increasing"], frows), ""]
    must["3_fits"] = fit
    md += ["![time](figures/throughput_time.png)", "", "![memory](figures/throughput_memory.png)", "",
           "![ratio](figures/throughput_ratio.png)", ""]
    md += ["## Regenerate", "", "    python experiments/bench.py          # full (about 20-25 min on a 2-core CPU)",
           "    python experiments/bench.py --quick  # the 224 rows and the 64x64 mixer rows, under 5 minutes",
           "    python experiments/bench.py --device cuda --bf16 --batch-size 8   # on a GPU", ""]
    return md


def _f(x, scale=1.0):
    return "-" if x is None else f"{x * scale:.3g}"


def _fci(x, ci):
    """A fraction with its 95 % interval: 0.91 [0.87, 0.93]."""
    return _f(x) if x is None or not ci else f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _rounds(fracs) -> str:
    """The lowest and highest single-round fraction of a target row: ' {0.84-0.95}'; '' for one round."""
    return f" {{{min(fracs):.2f}-{max(fracs):.2f}}}" if fracs else ""


OTHER_LOAD_NOTED = 0.1  # a row process beside more than this share of other work is counted in section 0


def _other_pct(shares, where: str = "") -> str:
    """' (other load 12 %)' or ' (other load in its rounds 3/40/2 %)'; '' where nothing was recorded."""
    shares = [x for x in shares or [] if x is not None]
    if not shares:
        return ""
    return f" (other load{' ' + where if where else ''} " + "/".join(f"{100 * x:.0f}" for x in shares) + " %)"


def _interval_note(items, target: float, label) -> tuple[str, dict]:
    """How many of the (value, interval, item) that meet `target` keep their whole 95 % interval at or above it, and
    which are on the line (the point meets it, the interval reaches below)."""
    met = [(v, ci, it) for v, ci, it in items if v >= target]
    line = [(v, ci, it) for v, ci, it in met if ci and ci[0] < target]
    clear = [x for x in met if x[1] and x[1][0] >= target]
    text = (f" Bootstrap 95 % intervals of the fraction (rounds of the interleaved samples resampled): "
            f"{len(clear)} of the {len(met)} that meet it keep the whole interval at or above {target:g}"
            + ("; on the line: " + "; ".join(f"{label(it)} {_fci(v, ci)}" for v, ci, it in line) if line else "")
            + (f"; {len(met) - len(clear) - len(line)} without an interval (fewer than 3 samples)"
               if len(met) - len(clear) - len(line) else "") + ".")
    return text, dict(clear=len(clear), on_the_line=[dict(row=label(it), fraction=v, interval=ci) for v, ci, it in line])


def _mem(r):
    if r["status"] == "missing":  # not planned for this row
        return "-"
    if r["status"] != "ok":
        return r["status"].upper()
    return f"{r['peak_bytes'] / 2**20:.0f}"


def _check(row) -> str:
    checks = [row[m].get("check") for m in ("ssog", "sdpa", "math") if row[m].get("check")]
    if not checks:
        return "-"
    worst = max(c["max_rel_err"] for c in checks)
    return ("ok " if all(c["ok"] for c in checks) else "FAILED ") + f"{worst:.1e}"


def _ips(r):
    if r["status"] == "missing":
        return "-"
    return f"{r['images_per_s']:.3g}" if r["status"] == "ok" else r["status"].upper()
