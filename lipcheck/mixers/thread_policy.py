"""The thread count of each SSoG call on a CPU, chosen by timing both settings."""
from __future__ import annotations

import collections
import statistics

import torch


class ThreadPolicy:
    """Thread count for one SSoG call on a CPU, chosen by measurement: torch's count or one thread.

    A call is a handful of parallel regions (the projections, the axis products). On a machine whose other
    cores are busy, every region waits for its slowest thread, which the scheduler may have parked
    for a whole time slice: more threads can then be many times slower than one. The policy times
    the mixing under both settings and uses the faster; now and then (a probe, see below) it runs `burst`
    calls of the other setting. The first call after any change of the thread count is never timed: it wakes
    the parked threads (or parks them) and meets cold caches, tens of microseconds that once made a
    0.2 ms call look slower at two threads than at one, so that a probe of torch's count after a stretch
    of one-thread calls never won it back. Before its first choice it times each setting `burst - 1` times,
    one thread first: the first calls of a process run cold (up to twice the steady time at 14 x 14), and
    such a time at torch's count once sent the policy to one thread on a quiet machine for a whole probe
    period. Each setting's time is the median of its last `window` timed calls per grid: not a minimum (under
    load a lucky fast call at torch's count would win) and not an average, which one slow call (a time slice
    lost to another process) turns over: with an exponential average (weight 0.5) 16 % of a quiet machine's
    3000 calls at 14 x 14, C=192, batch 1 ran at one thread, each stray slow call at torch's count sending the
    policy to one thread until the next probe; with the median of 5, 1-2 % (the initial samples and the probes).
    A setting in use that slows down for good loses after three calls; on a quiet machine the policy settles on
    torch's count, under load on one thread.
    A probe costs `burst` calls at the slower setting (measured: 5-11 % of a quiet machine's mixer time at
    14 x 14 and 28 x 28 with a probe every 32 calls), so each probe that confirms the choice doubles the
    period to the next, up to `max_period`; a probe or a median that changes the choice resets it to
    `probe_every`. A machine that gets busy needs no probe to be noticed (the setting in use slows down and
    its own median overtakes the other's); one that gets quiet again is found by the second probe (each adds
    burst - 1 timed calls to the other setting's window).
    The result is the same number either way: only the thread count changes.
    """

    def __init__(self, probe_every: int = 32, burst: int = 3, window: int = 5, max_period: int = 1024):
        if not 2 <= burst < probe_every <= max_period:
            raise ValueError(f"need 2 <= burst < probe_every <= max_period, got burst={burst}, "
                             f"probe_every={probe_every}, max_period={max_period}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.probe_every, self.burst, self.window, self.max_period = probe_every, burst, window, max_period
        self.stats: dict = {}

    def choose(self, key) -> int:
        n = torch.get_num_threads()
        if n <= 1:
            return n
        st = self.stats.get((key, n))
        if st is None:  # (not setdefault: its default, two deques and three dicts, would be built on every call)
            st = self.stats[key, n] = {"calls": 0, "last": None, n: None, 1: None, "timed": {n: 0, 1: 0},
                                       "recent": {n: collections.deque(maxlen=self.window),
                                                  1: collections.deque(maxlen=self.window)},
                                       "best": None, "probe_at": 0, "period": self.probe_every}
        st["calls"] += 1
        for k in (1, n):  # the initial samples: one thread first (the coldest calls of a process fall on it,
            # so that on a quiet machine the policy starts on torch's count, where it stays), then torch's count
            if st["timed"][k] < self.burst - 1:
                return k
        c, best = st["calls"], (n if st[n] <= st[1] else 1)
        if st["probe_at"] <= c < st["probe_at"] + self.burst:  # a probe of the other setting
            return 1 if st["best"] == n else n
        if best == st["best"]:
            if c == st["probe_at"] + self.burst:  # a probe has just confirmed the choice: probe less often
                st["period"] = min(self.max_period, 2 * st["period"])
                st["probe_at"] = c + st["period"]
        else:  # the first choice, or a changed one: probe at the base period again
            st["best"], st["period"], st["probe_at"] = best, self.probe_every, c + self.probe_every
        return best

    def record(self, key, threads: int, seconds: float) -> None:
        n = torch.get_num_threads() if threads == 1 else threads
        st = self.stats.get((key, n))
        if st is None:
            return
        switched, st["last"] = st["last"] != threads, threads
        if switched:  # the first call at a thread count (of the key, or after a change): not representative
            return
        st["timed"][threads] += 1
        recent = st["recent"][threads]
        recent.append(seconds)
        st[threads] = statistics.median(recent)
