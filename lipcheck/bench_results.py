"""A benchmark run's raw results (one per configuration and mixer, `lipcheck.bench.run_config`) as the rows of
its report: model rows with SSoG's speed-up over both attention backends beside the multiply-add ratio
(`analyse`), the mixer-target rows combined over their rounds (`target_rows`), the backend table's rows
(`mixer_rows`) and the trend with resolution (`fits`). Numbers only; lipcheck.reports.bench writes them out."""
from __future__ import annotations

import statistics

from lipcheck import bench
from lipcheck.models.vit import PRESETS


# Machine loads a configuration can run under: torch's thread count (0 = its default) and a busy competing process.
LOADS = {"1 thread": dict(threads=1), "default threads": dict(threads=0),
         "default threads, busy core": dict(threads=0, busy=True)}
LABEL = {"ssog": "SSoG", "sdpa": "attention (fused SDPA)", "math": "attention (explicit)"}
MIXER_GRID = 64  # the grid of the backend table (mixer alone)
PRESETS_DEPTH = 12  # every ti/s/b preset has depth 12


def load_of(cfg: dict) -> str:
    """The machine-load label of a configuration (LOADS), '-' where it names none."""
    t, busy = cfg.get("threads"), bool(cfg.get("busy"))
    for name, spec in LOADS.items():
        if spec.get("threads") == t and bool(spec.get("busy")) == busy:
            return name
    return f"{t} threads" if t else "-"


def flatten(results: list[dict]) -> list[dict]:
    """One result per (configuration, mixer): a row worker's results are unpacked, the others kept."""
    out = []
    for r in results:
        if "results" in r:
            for sub in r["results"]:
                out.append(dict(sub, wall_s=r.get("wall_s"), threads_used=r.get("threads_used"),
                                solver=r.get("solver"), machine=r.get("machine")))
        elif "mixers" in r["config"]:  # the row worker itself failed (timeout, killed): every mixer failed
            for m in r["config"]["mixers"]:
                cfg = {k: v for k, v in r["config"].items() if k != "mixers"}
                out.append(dict(r, config=dict(cfg, mixer=m)))
        else:
            out.append(r)
    return out


def _macs(cfg: dict, res: dict) -> int:
    if cfg["kind"] == "mixer":
        return bench.mixer_macs(cfg["mixer"], cfg["grid"], cfg["grid"], cfg["dim"], cfg["num_components"],
                                batch=cfg["batch_size"])
    dim = PRESETS[cfg["width"]]["dim"]
    evals = res.get("nfe") if cfg["variant"] == "ode" else None
    return bench.model_macs(cfg["mixer"], cfg["resolution"], dim=dim, depth=PRESETS_DEPTH, evaluations=evals,
                            batch=cfg["batch_size"])


def _key(cfg):
    return (cfg["kind"], cfg.get("width"), cfg.get("resolution"), cfg.get("variant"), cfg.get("method"), cfg["mode"],
            load_of(cfg))


def analyse(results: list[dict]) -> dict:
    """Group by setting; ratios of SSoG to both attention backends, next to the multiply-add ratio."""
    groups: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg["kind"] == "mixer":
            continue
        r["macs"] = _macs(cfg, r) if r.get("status") == "ok" or cfg["variant"] != "ode" else None
        groups.setdefault(_key(cfg), {})[cfg["mixer"]] = r
    rows = []
    for key, by in groups.items():
        _, width, res, variant, method, mode, load = key
        row = dict(width=width, resolution=res, tokens=(res // 16) ** 2, variant=variant, method=method, mode=mode,
                   load=load)
        for m in ("ssog", "sdpa", "math"):
            r = by.get(m, {})
            tp = r.get("throughput") or {}
            row[m] = dict(status=r.get("status", "missing"), images_per_s=r.get("images_per_s"),
                          median_s=r.get("median_s"), spread=r.get("spread"), peak_bytes=r.get("peak_bytes"),
                          nfe=r.get("nfe"), macs=r.get("macs"), error=r.get("error"),
                          backend=r.get("ssog_backend_used"), check=r.get("check"),
                          tp_batch=tp.get("batch"), tp_median_s=tp.get("median_s"),
                          tp_images_per_s=tp.get("images_per_s"), tp_spread=tp.get("spread"))
        s = row["ssog"]
        for base in ("sdpa", "math"):
            b = row[base]
            ok = s["status"] == "ok" and b["status"] == "ok"
            row[f"speedup_vs_{base}"] = b["median_s"] / s["median_s"] if ok else None
            row[f"mac_ratio_vs_{base}"] = b["macs"] / s["macs"] if ok and b["macs"] and s["macs"] else None
            row[f"memory_ratio_vs_{base}"] = (s["peak_bytes"] / b["peak_bytes"]
                                              if ok and b["peak_bytes"] else None)
        sp, mr = row["speedup_vs_sdpa"], row["mac_ratio_vs_sdpa"]
        row["speedup_fraction_of_mac_ratio"] = sp / mr if sp and mr else None
        b = row["sdpa"]
        tp_ok = s["tp_median_s"] and b["tp_median_s"] and s["tp_batch"] == b["tp_batch"]
        row["throughput_batch"] = s["tp_batch"] if tp_ok else None
        row["tp_speedup_vs_sdpa"] = b["tp_median_s"] / s["tp_median_s"] if tp_ok else None
        row["tp_fraction_of_mac_ratio"] = row["tp_speedup_vs_sdpa"] / mr if tp_ok and mr else None
        rs, ra = by.get("ssog", {}), by.get("sdpa", {})
        row["fraction_ci"] = _fraction_ci(ra.get("times_s"), rs.get("times_s"), mr) if sp else None
        row["tp_fraction_ci"] = _fraction_ci(_tp_times(ra), _tp_times(rs), mr) if tp_ok else None
        row["rounds"] = [len(rs.get("times_s") or []), len(_tp_times(rs) or [])]  # timed samples per mixer
        row["other_load"] = other_share(rs.get("machine"))
        solver = (by.get("ssog") or {}).get("solver") or {}
        row["solver_s"] = solver.get("median_s") if solver.get("status", "ok") == "ok" else None
        row["solver_nfe"] = solver.get("nfe")
        # the same ratios with the solver's own work (the same for both mixers, no multiply-adds) taken out of both
        st = row["solver_s"]
        ok = st is not None and s["status"] == "ok" and b["status"] == "ok" and s["median_s"] > st
        row["speedup_without_solver"] = (b["median_s"] - st) / (s["median_s"] - st) if ok else None
        row["fraction_without_solver"] = row["speedup_without_solver"] / mr if ok and mr else None
        rows.append(row)
    return {"rows": rows}


def other_share(machine: dict | None) -> float | None:
    """The share of the machine's CPU time that went to other processes or to the hypervisor (steal) while a
    row's worker ran (`bench.other_load`); None where it was not recorded."""
    return None if not machine else machine["others"] + machine["steal"]


def _tp_times(r: dict) -> list[float] | None:
    return (r.get("throughput") or {}).get("times_s")


def _fraction_ci(base_times, ssog_times, mac_ratio) -> list[float] | None:
    """95 % interval of (speed-up over the base / MAC ratio) from a row's interleaved samples (bench.ratio_interval)."""
    iv = bench.ratio_interval(base_times or [], ssog_times or []) if mac_ratio else None
    return [iv[0] / mac_ratio, iv[1] / mac_ratio] if iv else None


def pool_target_rounds(rounds: list[dict]) -> dict:
    """One mixer's results of a target row over its rounds (in round order) as one result, each round's timed
    samples kept apart (`round_times_s`, batch 1 and the throughput batch), so that a speed-up is formed within a
    round; median_s is the median of the rounds' medians. A round skipped by the time budget is left out, any
    other failure is the pooled result's status; the output check from the round that made one."""
    done = [r for r in rounds if r.get("status") != "skipped"]
    if not done:
        return rounds[0] if rounds else {}
    bad = next((r for r in done if r.get("status") != "ok"), None)
    if bad is not None:
        return bad
    out = dict(done[0], rounds=len(done), round_times_s=[r["times_s"] for r in done],
               round_machine=[r.get("machine") for r in done],
               median_s=statistics.median(r["median_s"] for r in done))
    if all(r.get("throughput") for r in done):
        out["throughput"] = dict(done[0]["throughput"], round_times_s=[r["throughput"]["times_s"] for r in done],
                                 median_s=statistics.median(r["throughput"]["median_s"] for r in done))
    else:
        out.pop("throughput", None)
    check = next((r["check"] for r in done if "check" in r), None)
    if check is not None:
        out["check"] = check
    return out


def target_rows(results: list[dict]) -> list[dict]:
    """Mixer-alone targets: SSoG against fused SDPA per grid, width and load, at batch 1 and at the
    throughput batch, with the multiply-add ratio and their quotient. A row measured in rounds
    (pool_target_rounds): its speed-up is the median over rounds of each round's speed-up (bench.rounds_ratio),
    every round's fraction kept beside it; the times shown are medians over rounds of each round's median."""
    groups: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg.get("part") != "mixer_target":
            continue
        groups.setdefault((cfg["grid"], cfg["dim"], cfg["num_heads"], load_of(cfg)), {}).setdefault(
            cfg["mixer"], []).append(r)
    rows = []
    for (g, dim, heads, load), by_rounds in groups.items():
        by = {m: pool_target_rounds(sorted(rs, key=lambda r: r["config"].get("round", 0)))
              for m, rs in by_rounds.items()}
        s, a = by.get("ssog", {}), by.get("sdpa", {})
        mr = bench.mixer_macs("sdpa", g, g, dim) / bench.mixer_macs("ssog", g, g, dim)
        ok = s.get("status") == "ok" and a.get("status") == "ok"
        row = dict(grid=g, dim=dim, heads=heads, load=load, mac_ratio=mr, status=(s.get("status"), a.get("status")),
                   check_ok=all((x.get("check") or {}).get("ok", True) for x in (s, a)),
                   checked=any("check" in x for x in (s, a)), rounds=s.get("rounds", 0) if ok else 0,
                   round_other_load=[other_share(m) for m in s.get("round_machine", [])] if ok else [])
        for tag in ("b1", "tp"):
            rs_, ra_ = (s, a) if tag == "b1" else (s.get("throughput") or {}, a.get("throughput") or {})
            runs_s, runs_a = rs_.get("round_times_s"), ra_.get("round_times_s")
            have = ok and bool(runs_s) and bool(runs_a) and len(runs_s) == len(runs_a)
            row[f"{tag}_batch"] = (s["config"].get("batch_size", 1) if tag == "b1" else rs_.get("batch")) if ok else None
            row[f"{tag}_ssog_ms"] = rs_["median_s"] * 1e3 if have else None
            row[f"{tag}_sdpa_ms"] = ra_["median_s"] * 1e3 if have else None
            row[f"{tag}_speedup"] = bench.rounds_ratio(runs_a, runs_s) if have else None
            row[f"{tag}_fraction"] = row[f"{tag}_speedup"] / mr if have else None
            iv = bench.rounds_ratio_interval(runs_a, runs_s) if have else None
            row[f"{tag}_fraction_ci"] = [iv[0] / mr, iv[1] / mr] if iv else None
            row[f"{tag}_round_fractions"] = [x / mr for x in bench.run_ratios(runs_a, runs_s)] \
                if have and len(runs_s) > 1 else None
        rows.append(row)
    return rows


def pool_rounds(results: list[dict]) -> list[dict]:
    """One result per mixer-alone configuration, its rounds pooled: every timed repeat, median and
    spread over all of them, the largest peak; a configuration that failed in any round keeps that status."""
    pooled: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg["kind"] != "mixer" or cfg.get("part") == "mixer_target":
            continue
        key = (cfg["mixer"], cfg.get("ssog_backend"))
        if key not in pooled:
            pooled[key] = dict(r, config={k: v for k, v in cfg.items() if k != "round"}, rounds=0, times_s=[])
        p = pooled[key]
        p["rounds"] += 1
        if r.get("status") != "ok":
            p.update(status=r.get("status"), error=r.get("error"))
        elif p.get("status") == "ok":
            p["times_s"] = p["times_s"] + r["times_s"]
            p["peak_bytes"] = max(p["peak_bytes"], r["peak_bytes"])
    for p in pooled.values():
        if p.get("status") == "ok":
            p.update(bench.summarize(p["times_s"]))
    return list(pooled.values())


def mixer_rows(results: list[dict]) -> list[dict]:
    """The backend table: one row per mixer-alone configuration (rounds pooled), its multiply-adds, time, peak
    memory and speed-up over fused SDPA."""
    rows = []
    results = pool_rounds(results)
    ref = next((r for r in results if r["config"]["mixer"] == "sdpa"), None)
    for r in results:
        cfg = r["config"]
        macs = bench.mixer_macs(cfg["mixer"], cfg["grid"], cfg["grid"], cfg["dim"], cfg["num_components"],
                                batch=cfg["batch_size"])
        name = LABEL[cfg["mixer"]] + (f" [{cfg['ssog_backend']}]" if cfg["mixer"] == "ssog" else "")
        ok = r.get("status") == "ok"
        speed = (ref["median_s"] / r["median_s"]) if ok and ref and ref.get("status") == "ok" else None
        rows.append(dict(name=name, mixer=cfg["mixer"], grid=cfg["grid"],
                         backend=cfg["ssog_backend"] if cfg["mixer"] == "ssog" else None,
                         status=r.get("status"), median_s=r.get("median_s"), spread=r.get("spread"),
                         rounds=r.get("rounds", 1), gmac=macs / 1e9,
                         gmac_per_s=(macs / 1e9 / r["median_s"]) if ok else None,
                         peak_mb=(r["peak_bytes"] / 2**20) if ok else None, speedup_vs_sdpa=speed, error=r.get("error")))
    return rows


def primary_load(rows) -> str | None:
    """The load most rows were measured under (the pinned one); figures and fits use those rows."""
    loads = [r.get("load", "-") for r in rows]
    return max(set(loads), key=loads.count) if loads else None


def fits(rows: list[dict]) -> dict:
    """Fitted exponents against the token count N: time per image of each mixer (inference) and the
    measured SSoG speed-up, per width and variant; the multiply-add ratio's exponent beside them.
    Only the rows of the primary load (the pinned thread count) enter."""
    out = {}
    prim = primary_load(rows)
    rows = [r for r in rows if r.get("load", "-") == prim]
    for r0 in rows:
        if r0["mode"] != "inference" or r0["method"] == "dopri5":
            continue
        key = f"{r0['width']}/{r0['variant']}"
        if key in out:
            continue
        sel = sorted([r for r in rows if r["width"] == r0["width"] and r["variant"] == r0["variant"]
                      and r["mode"] == "inference" and r["method"] != "dopri5"], key=lambda r: r["tokens"])
        N = [r["tokens"] for r in sel]
        ent = {"tokens": N}
        for m in ("ssog", "sdpa", "math"):
            pts = [(r["tokens"], r[m]["median_s"]) for r in sel if r[m]["status"] == "ok"]
            ent[f"time_exponent_{m}"] = bench.fit_exponent(*zip(*pts)) if len(pts) >= 2 else None
        for name in ("speedup_vs_sdpa", "mac_ratio_vs_sdpa", "speedup_vs_math"):
            pts = [(r["tokens"], r[name]) for r in sel if r[name]]
            ent[f"{name}_exponent"] = bench.fit_exponent(*zip(*pts)) if len(pts) >= 2 else None
            ent[name] = [r[name] for r in sel]
        # Monotone growth of the measured ratio with resolution.
        sp = [r["speedup_vs_sdpa"] for r in sel if r["speedup_vs_sdpa"]]
        ent["speedup_vs_sdpa_increasing"] = all(b >= a for a, b in zip(sp, sp[1:])) if len(sp) >= 2 else None
        out[key] = ent
    return out
