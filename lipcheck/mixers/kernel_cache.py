"""The SSoG kernel cache: each layer's axis factors kept per grid while its kernel parameters keep their values,
and `prepared_kernels`, which readies the kernels of several layers with one evaluation of the kernel series."""
from __future__ import annotations

import contextlib

import torch

from .. import gaussian
from .backends import BACKEND_PARTS
from .backends.cost import choose_backend
from .backends.stacked import _apply_stacked, _StackedFactors
from .tap_grad import _TapGrad
from .taps import _axis_taps, _effective_sigma, _flush, _split_taps, tap_floor

CHOICE_REFRESH = 32  # builds of one grid's factors between two evaluations of the backend cost model

# bound once: these run on every forward (older torch: no functorch wrappers to worry about)
_IS_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_PEEK_STACK = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_FUNCTORCH = _IS_WRAPPED is not None and _PEEK_STACK is not None


def _cat(ts):
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _needs_taps(entry: dict, tap_grad: bool) -> bool:
    return entry["taps"] is None or (tap_grad and entry["dlog"] is None)


def _tap_bank(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor, tap_grad: bool) -> tuple:
    """(taps, d log g / d mu, d log g / d sigma) of the (h, M, 2) kernels on an H x W grid, flushed below
    `tap_floor`, from one evaluation of the kernel series (the log-derivatives None unless tap_grad): the
    evaluation is a few hundred small operations whatever its size, so a dozen layers' kernels concatenated
    cost about what one layer's do."""
    with torch.no_grad():
        out = gaussian.lattice_taps(max(H, W) - 1, mu, sigma, derivatives=tap_grad)
        g, dlog = (out[0], out[1:]) if tap_grad else (out, (None, None))
        return (_flush(g, tap_floor(max(H, W), g.dtype)), *dlog)


def _fill_taps(items, H: int, W: int, tap_grad: bool) -> None:
    """Taps (and, for tap_grad, their log-derivatives) of every (entry, mu, sigma) in `items`, from one
    `_tap_bank` over the concatenated parameters."""
    mus = [m for _, m, _ in items]
    taps, d_mu, d_sigma = _tap_bank(H, W, _cat(mus), _cat([s for _, _, s in items]), tap_grad)
    sizes = [m.shape[0] for m in mus]
    parts = zip(taps.split(sizes), *((d_mu.split(sizes), d_sigma.split(sizes)) if tap_grad else ()))
    for (entry, _, _), (t, *dlog) in zip(items, parts):
        entry["taps"] = t
        if tap_grad:
            entry["dlog"] = tuple(dlog)


@contextlib.contextmanager
def prepared_kernels(layers, H: int, W: int):
    """Within the block: the kernels of several SSoG layers made ready for an H x W grid with one evaluation
    of the kernel series and one representability check for all of them.

    - Layers whose kernels train (autograd on, stacked backend): their factors, from one autograd node
      (`_StackedFactors`) for all of them, straight from the current parameters, for every use inside the
      block (a looped or ODE model applies its layer a dozen times per forward). Nothing of them is cached
      across blocks: a training step changes every kernel, so a cache would only be written, never served,
      and its bookkeeping (snapshots, comparisons, entries) cost a quarter of the refresh (measured for 12
      layers at 14x14 tokens: 0.5 of 2.3 ms).
    - Other layers (inference, frozen kernels, other backends): their kernel caches brought up to date.

    A training step changes every layer's kernels; evaluated layer by layer the series costs a few
    hundred small operations per layer, about as much as the layer's mixing at 224x224. The ViT wraps
    its blocks in this once per forward. Every number is the same as layer by layer; layers inside
    torch.func transforms are left alone. On leaving the block the factors are dropped, so no later use
    (after a backward has freed their graph) can reach them; inside it a layer serves them only while its
    kernel parameters are the same tensors at the same versions (`SSoG._live_factors`).
    """
    layers = list(layers)
    _refresh(layers, H, W)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_live", None)


def _versions(ps: tuple) -> tuple:
    return ps[0]._version, ps[1]._version, ps[2]._version


def _refresh(layers, H: int, W: int) -> None:
    groups: dict = {}
    banks: dict = {}
    for layer in layers:
        key = layer._cache_key(H, W)
        if key is None:
            continue
        graph, tap_grad = layer._grad_needs()
        if graph and layer._choose_backend(H, W) == "stacked":
            ps = layer._kernel_params()
            bk = (tuple(ps[1].shape[1:]), ps[1].dtype, ps[1].device, tuple(p.requires_grad for p in ps))
            banks.setdefault(bk, []).append(layer)
            continue
        entry = layer._cache().get(key)
        if not layer._is_current(entry):
            entry = None
        elif not _needs_taps(entry, tap_grad):
            continue
        alpha, mu, sigma = layer.gaussian_params()
        gk = (tuple(mu.shape[1:]), mu.dtype, mu.device, tap_grad)
        groups.setdefault(gk, []).append((layer, key, entry, alpha, mu.detach(), sigma.detach()))
    for (_, dtype, _, tap_grad), todo in groups.items():
        fresh = [t for t in todo if t[2] is None]
        if fresh:
            gaussian.check_representable(torch.cat([t[4] for t in fresh]), torch.cat([t[5] for t in fresh]),
                                         dtype, name="SSoG kernel")
        items = [(entry if entry is not None else layer._new_entry(key, H, W, alpha, mu, sigma, checked=True),
                  mu, sigma) for layer, key, entry, alpha, mu, sigma in todo]
        _fill_taps(items, H, W, tap_grad)
    for (_, dtype, _, need), members in banks.items():
        params = [layer._kernel_params() for layer in members]
        alpha, mu, sigma_raw = (_cat([ps[i] for ps in params]) for i in range(3))
        sigma = _effective_sigma(sigma_raw.detach())  # elementwise: the same numbers as layer by layer
        gaussian.check_representable(mu.detach(), sigma, dtype, name="SSoG kernel")
        taps, d_mu, d_sigma = _tap_bank(H, W, mu.detach(), sigma, need[1] or need[2])
        GW, GH = _StackedFactors.apply(H, W, alpha, mu, sigma_raw, taps, d_mu, d_sigma)
        sizes = [layer.num_heads for layer in members]
        for layer, ps, gw, gh in zip(members, params, GW.split(sizes), GH.split(sizes)):
            layer.__dict__["_live"] = ((H, W), ps, _versions(ps), gw, gh)


class KernelCache:
    """The kernel cache of `SSoG` (a base class of it: these methods read the layer's kernel parameters,
    `gaussian_params()` and `backend`), and the mixing of values with the cached factors (`mix_values`)."""

    # The axis factors depend on alpha, mu, sigma_raw and the grid only. Building them (the
    # normaliser, the taps, the representability check, the backend choice) costs a few hundred
    # small operations: at 14x14 tokens as much as the mixing itself. They are kept per grid, dtype,
    # device, backend and inference mode, together with a copy of the parameter values they were built
    # from, and served only while the parameters still hold exactly those values (torch.equal on
    # 5 h M numbers). Version counters alone would miss writes through `.data` (which gradcheck and
    # older optimiser code use); the values see every change: optimizer steps, copy_ under no_grad,
    # set_gaussian_params, load_state_dict, .to(). The taps (flushed below `tap_floor`) and, for
    # training, their log-derivatives are cached; nothing cached carries an autograd graph. Where the
    # kernel parameters need gradients, each forward (or, inside `prepared_kernels`, each model
    # forward) builds the factors from the cached taps through `_StackedFactors` or `_TapGrad`, whose
    # backward is the kernel's derivative in closed form (so no cached tensor is tied to a graph that a
    # backward pass has already freed).

    def _kernel_params(self) -> tuple:
        """(alpha, mu, sigma_raw), read from the parameter dict directly: nn.Module's attribute lookup costs
        about half a microsecond per name, and a forward at 14 x 14 reads them a dozen times."""
        ps = self._parameters
        return ps["alpha"], ps["mu"], ps["sigma_raw"]

    def _cache_key(self, H: int, W: int, ps: tuple | None = None):
        ps = ps if ps is not None else self._kernel_params()
        # spelled out (no generator): this runs on every forward
        if _FUNCTORCH and (_PEEK_STACK() is not None
                           or _IS_WRAPPED(ps[0]) or _IS_WRAPPED(ps[1]) or _IS_WRAPPED(ps[2])):
            # inside a torch.func transform (jvp, vmap, jacfwd, ...): plain autograd operations only,
            # built afresh, so the transform sees every dependence on the parameters
            return None
        return (H, W, self.backend, torch.is_inference_mode_enabled(), ps[0].dtype, ps[0].device)

    def clear_kernel_cache(self) -> None:
        self.__dict__["_kernel_cache"] = {}

    def mix_values(self, v: torch.Tensor, _ws=None) -> torch.Tensor:
        """sum_m alpha G_H v G_W^T per head on values v (B, H, W, h, d), with this forward's factors inside
        `prepared_kernels`, else with the kernels of the cache: the backend chosen (for backend='auto'), kernels
        the dtype cannot carry refused. `_ws` (from `_mix` only): a `_Workspace` the stacked backend may write
        its result into."""
        H, W = v.shape[1], v.shape[2]
        live = self._live_factors(H, W)
        if live is not None:  # training inside prepared_kernels: this forward's factors
            return _apply_stacked(v, *live)
        ps = self._kernel_params()
        key = self._cache_key(H, W, ps)
        graph, tap_grad = self._grad_needs(ps)
        entry = self._cache().get(key) if key is not None else None
        if not graph and entry is not None and entry["factors"] is not None and self._is_current(entry, ps):
            if _ws is not None and entry["backend"] == "stacked":
                return _apply_stacked(v, *entry["factors"], _ws)
            return BACKEND_PARTS[entry["backend"]][1](v, *entry["factors"])  # inference: nothing to build
        alpha, mu, sigma = self.gaussian_params()
        if key is None:
            backend, factors = self._build_factors(H, W, alpha, mu, sigma)
            return BACKEND_PARTS[backend][1](v, *factors)
        if not self._is_current(entry, ps):
            entry = self._new_entry(key, H, W, alpha, mu, sigma)
        if _needs_taps(entry, tap_grad):
            _fill_taps([(entry, mu, sigma)], H, W, tap_grad)
        backend, taps = entry["backend"], entry["taps"]
        prepare, apply = BACKEND_PARTS[backend]
        if not graph:
            if entry["factors"] is None:
                with torch.no_grad():
                    entry["factors"] = prepare(H, W, alpha, mu, sigma, *_split_taps(H, W, taps))
            if _ws is not None and backend == "stacked":
                return _apply_stacked(v, *entry["factors"], _ws)
            return apply(v, *entry["factors"])
        dlog = entry["dlog"] if tap_grad else (None, None)
        if backend == "stacked":  # factors from one node with a closed-form backward
            return apply(v, *_StackedFactors.apply(H, W, *ps, taps, *dlog))
        # Other backends: the factors are assembled from the cached taps on every forward (a few cheap
        # operations, differentiated by autograd; alpha enters here), the taps' own gradient comes
        # from _TapGrad in closed form.
        if tap_grad:
            taps = _TapGrad.apply(self.mu, self.sigma_raw, taps, *dlog)
        return apply(v, *prepare(H, W, alpha, mu.detach(), sigma.detach(), *_split_taps(H, W, taps)))

    def _live_factors(self, H: int, W: int):
        """The stacked factors `prepared_kernels` made for this forward, if they are for an H x W grid, no
        torch.func transform is active, and the kernel parameters are the tensors they were made from at the
        same versions (any in-place write since, an optimizer step or copy_, bumps a version); else None."""
        live = self.__dict__.get("_live")
        if live is None or live[0] != (H, W) or (_FUNCTORCH and _PEEK_STACK() is not None):
            return None
        ps = self._kernel_params()
        made = live[1]
        if made[0] is not ps[0] or made[1] is not ps[1] or made[2] is not ps[2] or live[2] != _versions(ps):
            return None
        return live[3], live[4]

    def _cache(self) -> dict:
        return self.__dict__.setdefault("_kernel_cache", {})

    def _grad_needs(self, ps: tuple | None = None) -> tuple[bool, bool]:
        """(factors need an autograd path, the taps need one to mu / sigma_raw)."""
        alpha, mu, sigma_raw = ps if ps is not None else self._kernel_params()
        graph = torch.is_grad_enabled() and (alpha.requires_grad or mu.requires_grad or sigma_raw.requires_grad)
        return graph, graph and (mu.requires_grad or sigma_raw.requires_grad)

    def _is_current(self, entry, ps: tuple | None = None) -> bool:
        ps = ps if ps is not None else self._kernel_params()
        if entry is None:
            return False
        a, m, s = entry["snapshot"]  # equal values, not only an unchanged version: an edit through .data bumps none
        return (a.dtype == ps[0].dtype and m.dtype == ps[1].dtype and s.dtype == ps[2].dtype
                and torch.equal(a, ps[0]) and torch.equal(m, ps[1]) and torch.equal(s, ps[2]))

    def _new_entry(self, key, H, W, alpha, mu, sigma, checked: bool = False) -> dict:
        """A fresh cache entry for the current parameters: checked, backend chosen, no taps yet."""
        with torch.no_grad():
            if not checked:
                gaussian.check_representable(mu, sigma, alpha.dtype, name="SSoG kernel")
            backend = self._choose_backend(H, W, alpha, mu, sigma)
        cache = self._cache()
        if len(cache) >= 8:  # a handful of grids at most (one per resolution in use)
            cache.clear()
        cache[key] = entry = dict(snapshot=tuple(p.detach().clone() for p in (self.alpha, self.mu, self.sigma_raw)),
                                  backend=backend, taps=None, dlog=None, factors=None)
        return entry

    def _choose_backend(self, H, W, alpha=None, mu=None, sigma=None) -> str:
        """The backend for an H x W grid: self.backend, or for "auto" the cost model's choice on the kernels
        (alpha, mu, sigma), by default the layer's own."""
        if self.backend != "auto":
            return self.backend
        # The choice changes speed only (every backend is exact to float rounding), so it is
        # re-evaluated every CHOICE_REFRESH builds of a grid rather than at each parameter update.
        choices = self.__dict__.setdefault("_backend_choice", {})
        backend, uses = choices.get((H, W), (None, 0))
        if backend is None or uses >= CHOICE_REFRESH:
            if alpha is None:
                with torch.no_grad():
                    alpha, mu, sigma = self.gaussian_params()
            backend, uses = choose_backend(H, W, alpha, mu, sigma), 0
        choices[(H, W)] = (backend, uses + 1)
        return backend

    def _build_factors(self, H, W, alpha, mu, sigma):
        """Backend and factors built afresh with plain autograd operations (inside torch.func transforms)."""
        # a kernel the dtype cannot carry would come out as NaN: refuse instead
        gaussian.check_representable(mu, sigma, alpha.dtype, name="SSoG kernel")
        backend = self._choose_backend(H, W, alpha, mu, sigma)
        return backend, BACKEND_PARTS[backend][0](H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma))

    def _apply(self, fn, *args, **kwargs):
        self.clear_kernel_cache()  # .to(), .float(), .cuda(): never serve factors of the old tensors
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_kernel_cache"] = {}
        state.pop("_live", None)
        return state
