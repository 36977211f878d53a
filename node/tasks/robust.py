"""Robust aggregation of one slice: a norm bound, trimmed mean, coordinate-wise median, centered clipping.

Every rule streams over the producers' slices (8, 4 or 2 bits a value, or top-k) chunk by chunk, like
compute.aggregate_payload: a chunk of each producer is decoded, combined and written; nothing
whole-slice is kept per producer (centered clipping keeps one whole-slice center). Every node must
compute the same bits, so: producers in sorted order, CPU float32, sums of a chunk's rows added one
row after another (elementwise, so no reduction whose order could depend on the thread count), norms
summed with math.fsum over per-block partial sums, and sorting, whose result depends only on the values.

The norm bound and the robust rules weigh producers equally: a producer's claimed sample count is
what it controls most cheaply, so only the plain mean uses it.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass

import torch

from node.tasks import compute
from node.train.codecs import INT8, Codec
from node.train.compress import QuantPayload
from protocol.errors import IntegrityError
from protocol.task import AggregationSpec

PLAIN = AggregationSpec()
"""The weighted mean with no bound: compute.aggregate_payload, byte for byte."""
STACK_VALUES = 1 << 22
"""At most this many float32 values in a chunk's stack of producers (16 MiB; sorting it takes about 3x)."""
MAX_NORM = 2.0 ** 64
"""A slice with a larger norm is left out: no training moves weights that far, and below it no sum or difference
of a few thousand slices can overflow float32."""
_ROW = 256
"""Values per partial sum of a norm: each summed by one thread, whatever the thread count."""
DUPLICATE_COSINE = 0.99
"""Two honest producers' slices were never this alike: at most 0.952 (16 producers of the demo model, 2 inner
steps, from scratch), 0.77 from a warm start (scripts/screen_margins.py, docs/bench/screen-margins.json). A
copy passes it with noise past 14% of its norm."""
EMPTY_SHARE = 0.01
"""An honest producer's norm was never below 0.65x the median in the same runs."""
OPPOSED_COSINE = 0.0
"""A slice pointing against the median of the others (below this cosine with it) is left out. An honest
slice's cosine with the median was never below 0.19 (demo model: 4, 8 and 16 producers, 1 to 12 inner
steps, from scratch and from a warm start, scripts/screen_margins.py); Gaussian noise of 10x an update's rms is
about 0.05, so noise is left to OUTSIZED_SHARE, the norm bound and the rule."""
OUTSIZED_SHARE = 4.0
"""A slice with a norm of at least this many times the median norm of the others is left out: noise poured
into an update (Gaussian noise of 10x its rms is about 10x). An honest producer's norm was never above 1.6x
the median (scripts/screen_margins.py, docs/bench/screen-margins.json); below this, the norm bound scales a
loud slice down to the bound and the rule weighs it."""
ONE_SIDED_SHARE = 0.1
"""A slice that sits above the coordinate-wise median of the producers still in at more than 0.5 + this share of
the values it differs from it at, both where the median is positive and where it is negative (or below it at as
many), is "one-sided", and left out when fewer than half of the producers are one-sided on its side. An honest
update's deviation from the median is as often up as down: at most 0.52 of its values on one side
(docs/bench/screen-margins.json: max_one_sided), and a larger honest update is above it where the median is
positive and below where it is negative, not above in both. A crafted one such as ALIE ("a little is enough":
the honest mean plus z honest standard deviations in every coordinate) sits inside the honest spread in every
coordinate, near the median's direction and size, and above the median everywhere before it is compressed:
0.64-0.97 of its values after int4 on real nodes, where rounding moved it below the median at the values it
was closest to it. Not charged (node/tasks/runner.py CHARGED): an attacker that publishes last can place its
values so that one honest update lands on one side at two of three values, and is left out beside its own."""
MIN_SIDED_VALUES = 2048
"""Values that differ from the median, in each of its signs, below which a slice is not judged one-sided: with
fewer, chance alone moves an honest share by more than a few hundredths (0.5 / sqrt(n) is 0.011 at 2048)."""
MIN_OPPOSED_CHECK = 3
"""With fewer producers the median is no majority's direction (nor the norms' median a majority's size)."""
MAX_PAIRWISE = 32
"""Producers of a slice compared pairwise (cost: n(n-1)/2 passes over the slice)."""


@dataclass
class Combined:
    data: bytearray | None
    """The aggregate, encoded by the task's aggregate codec; None when the screen left nobody in."""
    bad: list[str]
    """Producers whose slice did not decode or whose norm is past MAX_NORM: their fault, charged."""
    screened: dict[str, str]
    """Producers the screen left out (``spec.screen``), with why: protocol.task.SCREEN_REASONS."""


def aggregate_slice(slices: dict, numel: int, spec: AggregationSpec = PLAIN,
                    codec: Codec = INT8, out: Codec = INT8) -> tuple[bytearray, list[str]]:
    """The slice's aggregate under ``spec`` and every producer left out (sorted): ``combine`` for callers
    that need not tell a bad slice from a screened one."""
    got = combine(slices, numel, spec, codec, out)
    if got.data is None:
        raise IntegrityError("every slice was screened out")
    return got.data, sorted([*got.bad, *got.screened])


def combine(slices: dict, numel: int, spec: AggregationSpec = PLAIN, codec: Codec = INT8,
            out: Codec = INT8) -> Combined:
    """The slice's aggregate under ``spec`` of the producers' slices (encoded by ``codec``), encoded by ``out``,
    with the producers left out: those whose slice did not decode or whose norm is past MAX_NORM, and those the
    screen left out; IntegrityError when no slice decoded."""
    if spec.rule == "mean" and spec.norm_bound == 0 and not spec.screen:
        try:
            data, bad = compute.aggregate_payload(slices, numel, codec, out)
            return Combined(data, bad, {})
        except ValueError:
            pass  # the mean overflowed float32: below, the slices past MAX_NORM are left out and blamed
    views, bad = compute.open_slices(slices, numel, codec)
    norms = {p: _norm(v, numel) for p, v in views.items()}
    for peer in [p for p, n in norms.items() if not n <= MAX_NORM]:
        bad.append(peer)
        del views[peer], norms[peer]
    screened = screen(views, norms, numel) if spec.screen and views else {}
    for peer in screened:
        del views[peer], norms[peer]
    bad.sort()
    if not views and screened:
        return Combined(None, bad, screened)
    if not views:
        raise IntegrityError("no slice decoded")
    agg = _Slices(views, numel, _bound_scales(norms, spec.norm_bound), out)
    if spec.rule == "mean":
        total = math.fsum(float(slices[p][1]) for p in views)
        weights = [torch.tensor(float(slices[p][1]) / total, dtype=torch.float32) for p in views]
        data = agg.write(lambda lo, hi, stack: _weighted_sum(stack, weights))
    elif spec.rule == "median":
        data = agg.write(lambda lo, hi, stack: _median(stack))
    elif spec.rule == "trimmed_mean":
        trim = min(int(spec.trim_fraction * len(views)), (len(views) - 1) // 2)
        data = agg.write(lambda lo, hi, stack: _trimmed_mean(stack, trim))
    else:
        assert spec.rule == "centered_clip", spec.rule
        data = _centered_clip(agg, spec.clip_radius)
    return Combined(data, bad, screened)


def screen(views: dict[str, QuantPayload], norms: dict[str, float], numel: int) -> dict[str, str]:
    """Producers whose slice is no contribution, with why, decided the same way on every node:

    - "duplicate": a cosine of DUPLICATE_COSINE or more with another producer's slice. Both are left out
      and neither is charged: the screen cannot tell the copy from the original (node/tasks/checks.py can).
      Compared pairwise up to MAX_PAIRWISE producers; beyond, only slices that decode to the very same
      values (a copy as it was sent).
    - "empty": a norm of at most EMPTY_SHARE x the median norm of the producers still in (zeros, or next
      to nothing).
    - "opposed": a cosine below OPPOSED_COSINE with the coordinate-wise median of the producers still in
      (a sign flip, or an update pulling against everyone else's), when at least MIN_OPPOSED_CHECK are in
      and fewer than half of them are opposed (without a majority there is no direction to oppose).
    - "outsized": a norm of at least OUTSIZED_SHARE x the median norm (noise poured in) in a slice not
      opposed, when at least MIN_OPPOSED_CHECK are in and fewer than half of them are that large.
    - "one-sided": above (or below) the coordinate-wise median at most of the values it differs from it at, on
      both of the median's signs (ONE_SIDED_SHARE), in a slice neither opposed nor outsized, when at least
      MIN_OPPOSED_CHECK are in and fewer than half of them are one-sided on that side (a crafted update inside
      the spread): the most one-sided such slice only, then the others again without it.

    The whole screen runs again on the producers left until it finds nothing (once more when it found
    something: fewer producers can change the median, the norms' median, or whether copies are compared
    pairwise), so that the producers left are screened clean: recomputing an aggregate from exactly them
    leaves nobody else out.
    """
    out: dict[str, str] = {}
    live = dict(norms)
    while live:
        found = _screen_once({p: views[p] for p in sorted(live)}, {p: live[p] for p in sorted(live)}, numel)
        if not found:
            break
        out.update(found)
        for p in found:
            del live[p]
    return dict(sorted(out.items()))


def _screen_once(views: dict[str, QuantPayload], norms: dict[str, float], numel: int) -> dict[str, str]:
    out: dict[str, str] = {}
    live = {p: n for p, n in norms.items() if n > 0}
    out.update({p: "empty" for p in norms if p not in live})
    for p in _duplicates({p: views[p] for p in sorted(live)}, live, numel):
        out[p] = "duplicate"
        del live[p]
    while live:
        median = statistics.median(live.values())
        found = {p: "empty" for p, n in live.items() if n <= EMPTY_SHARE * median}
        sided: list[str] = []
        if not found:
            opposed, sided = _against_median({p: views[p] for p in sorted(live)}, live, numel)
            found = {p: "opposed" for p in opposed}
        if not found:
            found = {p: "outsized" for p in _outsized(live, median)}
        if not found:
            found = {p: "one_sided" for p in sided}
        if not found:
            break
        for p, why in found.items():
            out[p] = why
            del live[p]
    return out


def _outsized(norms: dict[str, float], median: float) -> list[str]:
    loud = [p for p, n in norms.items() if n >= OUTSIZED_SHARE * median]
    return loud if len(norms) >= MIN_OPPOSED_CHECK and 2 * len(loud) < len(norms) else []


def _against_median(views: dict[str, QuantPayload], norms: dict[str, float],
                    numel: int) -> tuple[list[str], list[str]]:
    """The producers opposed to the coordinate-wise median (none without a majority), and the most one-sided one
    on a side fewer than half are on (or none)."""
    peers = list(views)
    if len(peers) < MIN_OPPOSED_CHECK:
        return [], []
    agg = _Slices(views, numel, [None] * len(peers))
    center = torch.empty(numel, dtype=torch.float32)
    for lo, hi, stack in agg.chunks():
        center[lo:hi] = _median(stack)
    center_norm = math.sqrt(math.fsum(_sum_squares(center)))
    if center_norm == 0:
        return [], []
    parts: list[list[float]] = [[] for _ in peers]
    # Per producer, values above and below the median where it is positive, then where it is negative: counts,
    # the same integers on every node.
    sides = [[0, 0, 0, 0] for _ in peers]
    for lo, hi, stack in agg.chunks():
        mid = center[lo:hi]
        wide = mid.double()
        for i, row in enumerate(stack):
            parts[i].extend(_row_sums(row.double() * wide))
            sides[i] = [a + b for a, b in zip(sides[i], side_counts(row, mid))]
    opposed = [p for p, part in zip(peers, parts) if math.fsum(part) < OPPOSED_COSINE * norms[p] * center_norm]
    # One update above the median everywhere pushes it up, so the others sit below it more often (two of three
    # honest updates of four): only the most one-sided slice, on a side fewer than half are on, is left out at a
    # time, and the screen looks again without it.
    found = {p: (one_sided_share(*counts), side) for p, counts in zip(peers, sides)
             if (side := one_sided(*counts)) is not None}
    sided = [p for p, (_, side) in found.items() if 2 * sum(s == side for _, s in found.values()) < len(peers)]
    worst = max(sided, key=lambda p: (found[p][0], p), default=None)
    return (opposed if 2 * len(opposed) < len(peers) else []), ([] if worst is None else [worst])


def one_sided_share(above_pos: int, below_pos: int, above_neg: int, below_neg: int) -> float | None:
    """The share of the values a slice differs from the median at that lie on its more common side, the lower of
    the two figures where the median is positive and where it is negative: about 0.5 for an honest update, near 1
    for one shifted one way everywhere; None with fewer than MIN_SIDED_VALUES differing values on either sign."""
    pos, neg = above_pos + below_pos, above_neg + below_neg
    if min(pos, neg) < MIN_SIDED_VALUES:
        return None
    return max(min(above_pos / pos, above_neg / neg), min(below_pos / pos, below_neg / neg))


def one_sided(above_pos: int, below_pos: int, above_neg: int, below_neg: int) -> str | None:
    """"above" or "below" when a slice is on that side of the median at more than 0.5 + ONE_SIDED_SHARE of the
    values it differs from it at, on both of the median's signs; else None."""
    share = one_sided_share(above_pos, below_pos, above_neg, below_neg)
    if share is None or share <= 0.5 + ONE_SIDED_SHARE:
        return None
    return "above" if min(above_pos / (above_pos + below_pos), above_neg / (above_neg + below_neg)) == share \
        else "below"


def side_counts(row: torch.Tensor, center: torch.Tensor) -> list[int]:
    """Values of ``row`` above and below ``center`` where it is positive, then where it is negative."""
    above, below, pos, neg = row > center, row < center, center > 0, center < 0
    return [int(torch.logical_and(side, sign).sum()) for sign in (pos, neg) for side in (above, below)]


def _duplicates(views: dict[str, QuantPayload], norms: dict[str, float], numel: int) -> set[str]:
    peers = list(views)
    if len(peers) < 2:
        return set()
    agg = _Slices(views, numel, [None] * len(peers))
    if len(peers) > MAX_PAIRWISE:
        digests: dict[bytes, list[str]] = {}
        hashes = {p: hashlib.sha256() for p in peers}
        for _, _, stack in agg.chunks():
            for p, row in zip(peers, stack):
                hashes[p].update(row.numpy().tobytes())
        for p in peers:
            digests.setdefault(hashes[p].digest(), []).append(p)
        return {p for group in digests.values() if len(group) > 1 for p in group}
    pairs = [(i, j) for i in range(len(peers)) for j in range(i + 1, len(peers))]
    # One exactly rounded sum per chunk and pair (chunks depend only on the producer count and the slice's
    # size, the same on every node): a pair's row sums of a whole slice would be n(n-1)/2 x numel/256 floats.
    parts: list[list[float]] = [[] for _ in pairs]
    product = torch.empty(agg.step, dtype=torch.float64)
    for lo, hi, stack in agg.chunks():
        wide, out = stack.double(), product[:hi - lo]
        for k, (i, j) in enumerate(pairs):
            parts[k].append(math.fsum(_row_sums(torch.mul(wide[i], wide[j], out=out))))
    found: set[str] = set()
    for (i, j), part in zip(pairs, parts):
        if math.fsum(part) >= DUPLICATE_COSINE * norms[peers[i]] * norms[peers[j]]:
            found.update((peers[i], peers[j]))
    return found


def _norm(view: QuantPayload, numel: int) -> float:
    """The L2 norm of a decoded slice, the same float whatever the thread count."""
    step = compute.CHUNK_BLOCKS * view.block_size
    scratch = view.scratch(step)
    parts: list[float] = []
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        parts.extend(_sum_squares(view.decode(lo, hi, scratch)))
    return math.sqrt(math.fsum(parts))


def _sum_squares(x: torch.Tensor) -> list[float]:
    # float32 squared in float64 is exact; each row is one thread's sequential sum, fsum adds the rows exactly.
    return _row_sums(x.double().square())


def _row_sums(x: torch.Tensor) -> list[float]:
    """Sums of consecutive runs of _ROW float64 values (each run one thread's sequential sum)."""
    full = x.numel() // _ROW * _ROW
    out = x[:full].view(-1, _ROW).sum(dim=1).tolist() if full else []
    if full < x.numel():
        out.append(float(x[full:].sum()))
    return out


def _bound_scales(norms: dict[str, float], bound: float) -> list[torch.Tensor | None]:
    """Per producer (sorted), the factor that brings its norm to at most bound x the median norm; None: as it is."""
    if bound == 0:
        return [None] * len(norms)
    limit = bound * statistics.median(norms.values())
    return [torch.tensor(limit / n, dtype=torch.float32) if n > limit else None for n in norms.values()]


class _Slices:
    """The producers' slices (sorted), norm-bounded, decoded a chunk at a time into one [producers, chunk] stack."""

    def __init__(self, views: dict, numel: int, scales: list[torch.Tensor | None], out: Codec = INT8):
        self.views, self.numel, self.scales, self.out = list(views.values()), numel, scales, out
        bs = self.views[0].block_size
        blocks = max(1, min(compute.CHUNK_BLOCKS, STACK_VALUES // (bs * len(self.views))))
        self.step = blocks * bs
        self.scratch = self.views[0].scratch(self.step)
        self.stack = torch.empty(len(self.views), min(self.step, max(numel, 1)), dtype=torch.float32)

    def chunks(self):
        """(lo, hi, stack[:, :hi - lo]) for consecutive chunks of the slice."""
        for lo in range(0, self.numel, self.step):
            hi = min(self.numel, lo + self.step)
            stack = self.stack[:, :hi - lo]
            for i, view in enumerate(self.views):
                stack[i].copy_(view.decode(lo, hi, self.scratch))
                if self.scales[i] is not None:
                    stack[i].mul_(self.scales[i])
            yield lo, hi, stack

    def write(self, combine) -> bytearray:
        writer = self.out.writer(self.numel)
        for lo, hi, stack in self.chunks():
            writer.write(lo, combine(lo, hi, stack))
        return writer.out


def _weighted_sum(stack: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    # compute.aggregate_payload's operations: zeros, then acc + x * w per producer in sorted order.
    acc = torch.zeros(stack.shape[1], dtype=torch.float32)
    for row, w in zip(stack, weights):
        acc.add_(row.mul_(w))
    return acc


def _row_mean(rows: torch.Tensor) -> torch.Tensor:
    acc = rows[0].clone()
    for row in rows[1:]:
        acc.add_(row)
    return acc.div_(rows.shape[0])


def _median(stack: torch.Tensor) -> torch.Tensor:
    ordered = torch.sort(stack, dim=0).values
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]).mul_(0.5)


def _trimmed_mean(stack: torch.Tensor, trim: int) -> torch.Tensor:
    ordered = torch.sort(stack, dim=0).values if trim else stack
    return _row_mean(ordered[trim:ordered.shape[0] - trim])


def _centered_clip(agg: _Slices, radius: float) -> bytearray:
    """One step of centered clipping (Karimireddy et al. 2021) around the coordinate-wise median v:
    v + mean_i((x_i - v) * min(1, tau / |x_i - v|)), tau = radius x the median distance |x_i - v|."""
    center = torch.empty(agg.numel, dtype=torch.float32)
    for lo, hi, stack in agg.chunks():
        center[lo:hi] = _median(stack)
    parts: list[list[float]] = [[] for _ in agg.views]
    for lo, hi, stack in agg.chunks():
        for i, row in enumerate(stack):
            parts[i].extend(_sum_squares(row.sub_(center[lo:hi])))
    distances = [math.sqrt(math.fsum(p)) for p in parts]
    tau = radius * statistics.median(distances)
    factors = [torch.tensor(tau / d if d > tau else 1.0, dtype=torch.float32) for d in distances]

    def combine(lo: int, hi: int, stack: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(hi - lo, dtype=torch.float32)
        for row, c in zip(stack, factors):
            acc.add_(row.sub_(center[lo:hi]).mul_(c))
        return acc.div_(len(factors)).add_(center[lo:hi])
    return agg.write(combine)
