"""Throughput and peak memory of SSoG against dense attention: multiply-add counts and measurement.

Two halves:
- analytic multiply-add (MAC) counts of the mixers and of whole ViTs (`mixer_macs`, `block_macs`,
  `model_macs`), with the SSoG axis factors dense (the O(N^1.5) count of SPEC section 1);
- measurement (`measure`, `measure_row`, `run_config`): one configuration per subprocess. `measure`
  times one module; `measure_row` times the mixers of one report row (SSoG and attention built from
  the same seed) alternately in one process, at batch 1 and at a throughput batch, so that their ratio
  is measured under the same machine load, then takes one memory step each (and, for a fixed-step ODE
  row in inference, times the solver's own work: `solver_seconds`). A configuration may ask
  for torch's default thread count (threads = 0) and for a competing busy process (busy = true). A step is one forward (inference) or forward + backward + SGD update
  (training). After warm-up, every repeat is timed (CUDA events on GPU); in `measure_row` a repeat of a
  step shorter than MIN_BLOCK_S is a block of consecutive steps (`steps_per_block`), timed as their mean; a ratio of
  two mixers' medians comes with a bootstrap interval over the rounds (`ratio_interval`). Peak memory is what a
  step adds: on GPU `torch.cuda.max_memory_allocated` after a reset minus the allocation before,
  read from the timed steps; on CPU the OS's peak resident size during one extra step minus the
  resident size just before it (peak reset through /proc/self/clear_refs, or a sampling thread
  where that is not writable).

  CPU allocator. The timed steps run with glibc malloc as a caching allocator (blocks up to 32 MB
  are kept and reused, nothing is trimmed back to the OS), as PyTorch's own CUDA allocator does and
  as a tuned CPU deployment does with jemalloc or tcmalloc: otherwise every tensor of a step is a
  fresh mmap whose pages the kernel zeroes on first touch, a cost per byte allocated rather than per
  multiply-add that penalises the mixer with less arithmetic (at 64x64 it slowed SSoG 1.7x and fused
  SDPA by 2%). The memory step comes after the timed ones: the allocator is switched to
  returning every block of 128 kB and more straight to the OS and its free pages are released, so
  that the resident-size delta is the step's own.

  Out of memory (an allocation failing under the memory cap, a CUDA OOM, or the process being
  killed) comes back as status "oom", not as an exception.

  The subprocess driver (`run_config`, the busy process, the machine's other load) is lipcheck.bench_process,
  the statistics of the timings (`summarize`, `ratio_interval`, `rounds_ratio`, `fit_exponent`)
  lipcheck.bench_stats; both are reachable from here as before.

    python -m lipcheck.bench '<json config>'   # the worker; prints one JSON line
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch

from .bench_process import (CACHING_MALLOC_ENV, RESULT_TAG, BusyProcess, _is_oom, _own_cpu_s,  # noqa: F401
                            cpu_times, other_load, run_config, spinners)
from .bench_stats import (fit_exponent, ratio_interval, rounds_ratio, rounds_ratio_interval,  # noqa: F401
                          run_ratios, summarize)

MIXER_KINDS = ("ssog", "sdpa", "math")  # SSoG, fused attention, explicit attention
MODES = ("inference", "train")


# ---------------------------------------------------------------------------------------------
# Multiply-add counts.

def mixer_macs(mixer: str, H: int, W: int, dim: int, num_components: int = 4, *, batch: int = 1) -> int:
    """Multiply-adds of one mixer call on an H x W grid with `dim` channels, projections included.

    attention: q, k, v, o projections 4 N C^2, scores and weighted sum 2 N^2 C;
    ssog: v, o projections 2 N C^2, dense axis factors C M (H^2 W + H W^2) = C M N (H + W).
    """
    N, C = H * W, dim
    if mixer in ("attention", "sdpa", "math"):
        return batch * (4 * N * C * C + 2 * N * N * C)
    if mixer == "ssog":
        return batch * (2 * N * C * C + C * num_components * N * (H + W))
    raise ValueError(f"unknown mixer {mixer!r}; choose 'ssog', 'attention', 'sdpa' or 'math'")


def block_macs(mixer: str, H: int, W: int, dim: int, *, mlp_ratio: float = 4.0, num_components: int = 4,
               batch: int = 1) -> int:
    """One block (or one vector-field evaluation): mixer + MLP 2 N C (r C); norms are O(N C), left out."""
    N = H * W
    hidden = int(dim * mlp_ratio)
    return mixer_macs(mixer, H, W, dim, num_components, batch=batch) + batch * 2 * N * dim * hidden


def model_macs(mixer: str, img_size: int, *, dim: int, depth: int = 12, patch_size: int = 16,
               in_chans: int = 3, num_classes: int = 100, mlp_ratio: float = 4.0, num_components: int = 4,
               evaluations: int | None = None, batch: int = 1) -> int:
    """Forward multiply-adds of a ViT: patch embedding + `evaluations` blocks (default depth) + head."""
    check_resolution(img_size, patch_size)
    g = img_size // patch_size
    n_eval = depth if evaluations is None else evaluations
    embed = g * g * dim * in_chans * patch_size * patch_size
    return batch * (embed + dim * num_classes) + n_eval * block_macs(
        mixer, g, g, dim, mlp_ratio=mlp_ratio, num_components=num_components, batch=batch)


def check_resolution(img_size: int, patch_size: int = 16) -> None:
    if not (isinstance(img_size, int) and img_size > 0):
        raise ValueError(f"resolution must be a positive integer, got {img_size!r}")
    if img_size % patch_size:
        raise ValueError(f"resolution {img_size} is not a multiple of the patch size {patch_size}; "
                         f"use a multiple of {patch_size} (e.g. {patch_size * max(1, round(img_size / patch_size))})")


# ---------------------------------------------------------------------------------------------
# Memory and time helpers.

def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc)."""
    return _proc_status_kb("VmRSS") * 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM); False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _RssSampler(threading.Thread):
    """Fallback peak tracker: samples VmRSS every `interval` s while the step runs."""

    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_evt = interval, rss_bytes(), threading.Event()

    def run(self):
        while not self._stop_evt.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_evt.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


# glibc mallopt parameters (malloc.h) and the values for the two phases of a CPU measurement.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MEMORY_MMAP_THRESHOLD = 128 * 2**10


def _release_to_os() -> bool:
    """Switch glibc malloc to mmap every block >= 128 kB (freed straight back to the OS), and return
    the pages of free heap blocks (malloc_trim). False where the C library is not glibc."""
    import ctypes
    import gc

    from .mixers import ssog
    ssog.clear_workspace()  # the mixer's reused inference buffers: a step's memory counts them, as it did before
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MEMORY_MMAP_THRESHOLD) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, _MEMORY_MMAP_THRESHOLD) == 1
        gc.collect()
        libc.malloc_trim(0)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def timed_step(step, device: torch.device) -> tuple[float, int]:
    """Run step() once; return (seconds, bytes the step added at its peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device) - before
    before = rss_bytes()
    sampler = None
    if not _reset_peak_rss():
        sampler = _RssSampler()
        sampler.start()
    t0 = time.perf_counter()
    step()
    dt = time.perf_counter() - t0
    peak = sampler.stop() if sampler else _proc_status_kb("VmHWM") * 1024
    return dt, max(0, peak - before)


MIN_BLOCK_S = 0.02


def steps_per_block(step, step_s: float, sync=lambda: None, min_block_s: float = MIN_BLOCK_S) -> int:
    """Consecutive steps timed as one sample (their mean): as many as run in `min_block_s`, counted by running
    them (untimed) after a warm-up step that took `step_s`; 1 when that step took `min_block_s` or longer.

    Mixers are timed alternately so that a slow spell lands on all of them; a step of half a
    millisecond timed alone right after another model's step measures that model's cache footprint
    (the first layer's weights and the input reloaded from L3 or memory) and the timer as much as its
    own work, and repeated use of one model, which is what throughput means, keeps them warm. The count
    comes from steady steps, not from the first step of a process (which builds kernels and faults in
    buffers and can take ten times as long)."""
    if not step_s < min_block_s:  # NaN included
        return 1
    n, t0 = 0, time.perf_counter()
    while n < 1000:
        step()
        sync()
        n += 1
        if time.perf_counter() - t0 >= min_block_s:
            break
    return n


# ---------------------------------------------------------------------------------------------
# One configuration (runs inside the worker subprocess).

def build(cfg: dict, device: torch.device, dtype: torch.dtype):
    """(module, input, labels) for a configuration dict (see run_config); labels None for a mixer."""
    module = build_module(cfg, device, dtype)
    return (module, *make_inputs(cfg, module, int(cfg.get("batch_size", 1)), device, dtype))


def build_module(cfg: dict, device: torch.device, dtype: torch.dtype):
    from .mixers import DenseAttention, SSoG
    from .models.vit import PRESETS, vit_from_preset
    kind, mixer = cfg.get("kind", "model"), cfg["mixer"]
    if mixer not in MIXER_KINDS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {MIXER_KINDS}")
    backend = cfg.get("ssog_backend", "auto")
    if kind == "mixer":
        C, h, M = cfg["dim"], cfg["num_heads"], cfg.get("num_components", 4)
        return (SSoG(C, h, M, backend=backend, device=device, dtype=dtype) if mixer == "ssog"
                else DenseAttention(C, h, backend=mixer, device=device, dtype=dtype))
    if cfg["width"] not in PRESETS:
        raise ValueError(f"unknown width preset {cfg['width']!r}; choose one of {sorted(PRESETS)}")
    check_resolution(cfg["resolution"], PRESETS[cfg["width"]].get("patch_size", 16))
    variant, extra = cfg["variant"], {}
    if variant == "ode":
        method = cfg.get("method", "rk4")
        extra = dict(method=method, rtol=cfg.get("rtol", 1e-3), atol=cfg.get("atol", 1e-3))
        if method == "rk4":
            steps = int(cfg.get("rk4_steps", 3))
            # An explicit grid: step_size = t1/steps can round to one step more.
            extra["options"] = {"grid_constructor": lambda f, y0, t: torch.linspace(
                float(t[0]), float(t[-1]), steps + 1, dtype=t.dtype, device=t.device)}
    return vit_from_preset(cfg["width"], variant, "ssog" if mixer == "ssog" else "attention",
                           img_size=cfg["resolution"], ssog_backend=backend,
                           attn_backend="sdpa" if mixer == "ssog" else mixer,
                           device=device, dtype=dtype, **extra)


def make_inputs(cfg: dict, module, batch: int, device: torch.device, dtype: torch.dtype):
    """(input, labels) of batch size `batch` for a module built from cfg."""
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    if cfg.get("kind", "model") == "mixer":
        g = cfg["grid"]
        return torch.randn(batch, g, g, cfg["dim"], device=device, dtype=dtype), None
    images = torch.randn(batch, 3, cfg["resolution"], cfg["resolution"], device=device, dtype=dtype)
    labels = torch.randint(0, module.config.num_classes, (batch,), device=device)
    return images, labels


def make_step(module, mode: str, device: torch.device, bf16: bool = False):
    """step(x, labels): one forward (inference) or forward + backward + SGD update (train)."""
    amp = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16
           else torch.autocast(device_type=device.type, enabled=False))
    params = [p for p in module.parameters() if p.requires_grad]
    lr = 1e-4

    def step(x, labels):
        if mode == "inference":
            with torch.inference_mode(), amp:
                module(x)
            return
        with amp:
            y = module(x)
        loss = torch.nn.functional.cross_entropy(y.float(), labels) if labels is not None else y.float().square().mean()
        loss.backward()
        with torch.no_grad():
            for p in params:  # plain SGD: no optimiser state to blur the memory comparison
                p.add_(p.grad, alpha=-lr)
                p.grad = None
    return step


def measure(cfg: dict) -> dict:
    """Measure one configuration in this process; returns a JSON-able dict (status ok / oom / error).

    cfg keys: kind ("model" | "mixer"), mixer (ssog | sdpa | math), mode (inference | train), device,
    dtype, bf16, batch_size, warmup, repeats, ssog_backend; model: width, resolution, variant, method,
    rk4_steps; mixer: dim, num_heads, num_components, grid.
    """
    device = torch.device(cfg.get("device", "cpu"))
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    mode = cfg.get("mode", "inference")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    torch.manual_seed(int(cfg.get("seed", 0)))
    if int(cfg.get("threads", 0)) > 0:
        torch.set_num_threads(int(cfg["threads"]))
    out = {"config": cfg}
    try:
        module, x, labels = build(cfg, device, dtype)
        run_step = make_step(module, mode, device, bool(cfg.get("bf16")))

        def step():
            run_step(x, labels)

        for _ in range(int(cfg.get("warmup", 1))):
            step()
        times, peaks = [], []
        for _ in range(int(cfg.get("repeats", 3))):
            dt, peak = timed_step(step, device)
            times.append(dt)
            peaks.append(peak)
        if device.type == "cuda":
            method = "cuda.max_memory_allocated"
        else:  # one more step, for memory only (module docstring: CPU allocator)
            released = _release_to_os()
            mem_time, peak = timed_step(step, device)
            peaks = [peak]
            out["memory_step_s"] = mem_time
            method = ("VmHWM after clear_refs" if _reset_peak_rss() else "sampled VmRSS") + \
                     ("" if released else ", allocator not switched (not glibc)")
        B = int(cfg.get("batch_size", 1))
        out.update(status="ok", **summarize(times), times_s=times, peak_bytes=max(peaks), peaks_bytes=peaks,
                   images_per_s=B / statistics.median(times), peak_method=method)
        flow = getattr(module, "flow", None)
        if flow is not None:
            out["nfe"] = int(flow.last_nfe)
        if isinstance(module, torch.nn.Module) and cfg.get("kind", "model") == "model" and cfg["mixer"] == "ssog":
            from .mixers.ssog import choose_backend
            blk = module.vector_field.block if hasattr(module, "vector_field") else module.blocks[0]
            g = cfg["resolution"] // module.config.patch_size
            out["ssog_backend_used"] = (choose_backend(g, g, *blk.mixer.gaussian_params())
                                        if blk.mixer.backend == "auto" else blk.mixer.backend)
    except Exception as e:  # noqa: BLE001 - reported, not raised: one configuration must not stop the run
        if _is_oom(e):
            out.update(status="oom", error=str(e).splitlines()[0][:300])
        else:
            out.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return out


class _FreeBlock(torch.nn.Module):
    """A block whose vector field costs nothing: it returns one fixed tensor of the state's shape."""

    def __init__(self, f: torch.Tensor):
        super().__init__()
        self.f = f

    def vector_field(self, x):
        return self.f


def solver_seconds(flow, x0: torch.Tensor, *, warmup: int = 1, repeats: int = 3) -> dict:
    """The ODE solver's own work per forward: `flow`'s method, grid and t1 on x0 with a vector field that costs
    nothing (a fixed small tensor), so that what is timed is torchdiffeq's arithmetic on the state (the stage
    combinations, the solution's copies) and lipcheck's NFE and finiteness watch: the part of an ODE model's time
    that is the same for every mixer and that no multiply-add count includes. Fixed-step methods only (an adaptive
    one would take other steps on another field)."""
    from .models.ode import FIXED_STEP, ODEFlow, VectorField
    if flow.method not in FIXED_STEP:
        raise ValueError(f"solver_seconds needs a fixed-step method ({FIXED_STEP}), got {flow.method!r}")
    gen = torch.Generator(device=x0.device).manual_seed(0)
    f = 1e-3 * torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
    free = ODEFlow(VectorField(_FreeBlock(f)), t1=flow.t1, method=flow.method, rtol=flow.rtol, atol=flow.atol,
                   options=flow.options)
    times = []
    with torch.inference_mode():
        for rep in range(warmup + repeats):
            t0 = time.perf_counter()
            free(x0)
            if x0.device.type == "cuda":
                torch.cuda.synchronize(x0.device)
            if rep >= warmup:
                times.append(time.perf_counter() - t0)
    return dict(**summarize(times), times_s=times, nfe=int(free.last_nfe))


def _failure(e: BaseException) -> dict:
    if _is_oom(e):
        return dict(status="oom", error=str(e).splitlines()[0][:300])
    return dict(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def _backend_used(module, cfg) -> str | None:
    from .mixers import SSoG
    from .mixers.ssog import choose_backend
    mix = next((m for m in module.modules() if isinstance(m, SSoG)), None)
    if mix is None:
        return None
    g = cfg["grid"] if cfg.get("kind", "model") == "mixer" else cfg["resolution"] // module.config.patch_size
    return choose_backend(g, g, *mix.gaussian_params()) if mix.backend == "auto" else mix.backend


def check_outputs(cfg: dict, module, x: torch.Tensor) -> dict:
    """Correctness of what is timed: the module's output in float64 against the same weights with
    every mixer on its reference path (SSoG: the einsum `matmul` backend; attention: the explicit
    softmax), one sample. Returns the largest error relative to the largest output entry."""
    import copy
    from .mixers import DenseAttention, SSoG
    fast = copy.deepcopy(module).double().eval()
    ref = copy.deepcopy(fast)
    for m in ref.modules():
        if isinstance(m, SSoG):
            m.backend = "matmul"
        elif isinstance(m, DenseAttention):
            m.backend = "math"
    x64 = x[:1].double()
    with torch.no_grad():
        a, b = fast(x64), ref(x64)
    finite = bool(torch.isfinite(a).all())
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if finite else float("inf")
    return {"max_rel_err": err, "finite": finite, "ok": finite and err <= 1e-10, "reference": "float64, reference paths"}


def measure_row(cfg: dict) -> dict:
    """One row of the report in this process: every mixer in cfg["mixers"] built from the same seed,
    timed alternately (A, B, A, B, ...) so that a slow spell of a shared machine lands on all of them
    alike, at batch size `batch_size` and then at `throughput_batch`; then one memory step each at
    `batch_size` (as in `measure`) and, with cfg["check"], the float64 correctness check.

    Returns {"config", "status", "threads_used", "results": [one measure-like dict per mixer]}.
    """
    device = torch.device(cfg.get("device", "cpu"))
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    mode = cfg.get("mode", "inference")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    if int(cfg.get("threads", 0)) > 0:
        torch.set_num_threads(int(cfg["threads"]))
    B, TB = int(cfg.get("batch_size", 1)), int(cfg.get("throughput_batch", 0) or 0)
    res, live = _build_row(cfg, device, dtype, mode, B)
    times = _rotate(live, res, ("x", "labels"), int(cfg.get("warmup", 1)), int(cfg.get("repeats", 3)), device)
    for m, t in times.items():
        if m in live:
            res[m].update(status="ok", **summarize(t), times_s=t, images_per_s=B / statistics.median(t))
    solver = _row_solver(cfg, mode, live)
    if TB > B and live:
        for m, L in live.items():
            L["xt"], L["lt"] = make_inputs(res[m]["config"], L["module"], TB, device, dtype)
        tt = _rotate(live, res, ("xt", "lt"), int(cfg.get("throughput_warmup", 1)),
                     int(cfg.get("throughput_repeats", 2)), device)
        for m, t in tt.items():
            if m in live and t:
                res[m]["throughput"] = dict(batch=TB, **summarize(t), times_s=t, images_per_s=TB / statistics.median(t))
        for L in live.values():
            L.pop("xt"), L.pop("lt")
    for m, L in list(live.items()):
        try:
            _memory_and_check(cfg, res[m], L, device)
        except Exception as e:  # noqa: BLE001
            res[m].update(_failure(e))
    status = "ok" if all(r.get("status") == "ok" for r in res.values()) else "partial"
    out = {"config": cfg, "status": status, "threads_used": torch.get_num_threads(), "results": list(res.values())}
    if solver is not None:
        out["solver"] = solver
    return out


def _build_row(cfg: dict, device, dtype, mode: str, batch: int) -> tuple[dict, dict]:
    """(res, live): per mixer its result so far ({"config": ...}, a failure's status) and, for the mixers built,
    the module, its step and its input at `batch`; each built after torch.manual_seed(seed)."""
    res, live = {}, {}
    for m in cfg["mixers"]:
        sub = {k: v for k, v in cfg.items() if k != "mixers"}
        sub["mixer"] = m
        res[m] = {"config": sub}
        try:
            torch.manual_seed(int(cfg.get("seed", 0)))
            module = build_module(sub, device, dtype)
            if mode == "inference":
                module.eval()
            x, labels = make_inputs(sub, module, batch, device, dtype)
            live[m] = dict(module=module, step=make_step(module, mode, device, bool(cfg.get("bf16"))), x=x, labels=labels)
        except Exception as e:  # noqa: BLE001 - one mixer failing must not stop the row
            res[m].update(_failure(e))
    return res, live


def _rotate(live: dict, res: dict, batch_key, warmup: int, repeats: int, device) -> dict:
    """The mixers' steps in turn, `warmup` untimed rounds then `repeats` timed ones; a timed sample of a short
    step is a block of `steps_per_block` steps, sized after the last untimed round. A mixer that fails leaves
    `live` with its failure in `res`. Returns {mixer: [seconds per step, one per timed round]}."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, block = {m: [] for m in live}, {m: 1 for m in live}
    for rep in range(warmup + repeats):
        for m in list(live):
            L = live[m]
            n = block[m] if rep >= warmup else 1
            try:
                t0 = time.perf_counter()
                for _ in range(n):
                    L["step"](L[batch_key[0]], L[batch_key[1]])
                sync()
                dt = (time.perf_counter() - t0) / n
            except Exception as e:  # noqa: BLE001
                res[m].update(_failure(e))
                del live[m]
                continue
            if rep >= warmup:
                times[m].append(dt)
            elif rep == warmup - 1:  # after the last untimed step: size the blocks
                block[m] = steps_per_block(lambda: L["step"](L[batch_key[0]], L[batch_key[1]]), dt, sync)
    for m in times:
        res[m].setdefault("block_steps", {})[batch_key[0]] = block[m]
    return times


def _row_solver(cfg: dict, mode: str, live: dict) -> dict | None:
    """A fixed-step ODE row in inference: its solver's own work (`solver_seconds`) at batch 1, on the row's own
    flow settings and embedded input; None for other rows."""
    from .models.ode import FIXED_STEP
    first = next(iter(live.values()), None)
    flow = getattr(first["module"], "flow", None) if first else None
    if not (mode == "inference" and flow is not None and flow.method in FIXED_STEP):
        return None
    try:
        with torch.inference_mode():
            x0 = first["module"].embed(first["x"])
        return solver_seconds(flow, x0, warmup=int(cfg.get("warmup", 1)), repeats=int(cfg.get("repeats", 3)))
    except Exception as e:  # noqa: BLE001 - an extra measurement; the row stands without it
        return _failure(e)


def _memory_and_check(cfg: dict, r: dict, L: dict, device) -> None:
    """Into one mixer's result r: its memory step at batch size (as in `measure`), its NFE and backend, and with
    cfg["check"] the float64 correctness check."""
    if device.type == "cuda":
        _, peak = timed_step(lambda: L["step"](L["x"], L["labels"]), device)
        method = "cuda.max_memory_allocated"
    else:
        released = _release_to_os()
        _, peak = timed_step(lambda: L["step"](L["x"], L["labels"]), device)
        method = ("VmHWM after clear_refs" if _reset_peak_rss() else "sampled VmRSS") + \
                 ("" if released else ", allocator not switched (not glibc)")
    r.update(peak_bytes=peak, peaks_bytes=[peak], peak_method=method)
    flow = getattr(L["module"], "flow", None)
    if flow is not None:
        r["nfe"] = int(flow.last_nfe)
    used = _backend_used(L["module"], r["config"])
    if used:
        r["ssog_backend_used"] = used
    if cfg.get("check"):
        r["check"] = check_outputs(r["config"], L["module"], L["x"])


def _worker_main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lipcheck.bench '<json config>'", file=sys.stderr)
        return 2
    # Subnormal floats (far Gaussian tails, large negative softmax logits) slow x86 arithmetic by an
    # order of magnitude; flushing them to zero is what every production CPU stack does. Set here, in
    # the per-configuration process only: it is global processor state.
    torch.set_flush_denormal(True)
    cfg = json.loads(argv[0])
    res = measure_row(cfg) if "mixers" in cfg else measure(cfg)
    print(RESULT_TAG + json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main())
