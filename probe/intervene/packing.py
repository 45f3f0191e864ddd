"""How the engine cuts rows into model calls: plans only, no model is run here.

* :func:`pack_rows`: plain rows (padded on the right) sorted by width and cut into batches under
  the token budget, by a dynamic programme over padded tokens plus a per-call cost.
* :func:`plan_bins`: the segments of the prefix-reuse path (:mod:`probe.intervene.prefix`) placed
  side by side in bins, and the bins cut into batches, the cheapest of a few packings by a cost
  estimate.

Every choice here changes the batching only, never a value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from probe.intervene.rowcache import Row

#: Planning heuristics for packed prefix-reuse passes, in token-equivalents (they change the
#: batching only, never the values): one cached prefix slot carried by one bin (gathered and
#: copied into each layer's cache and its key/value heads: ~0.3 MB of memory traffic on
#: SmolLM2-135M, against ~1 ms of compute per token; its attention is counted per pair), and one
#: query-key pair of attention (a bin scores every query against every key before masking). The
#: FLOP ratio of one pair to one token is ~2 x hidden / parameters per layer (3e-4 for
#: SmolLM2-135M); CPU attention kernels are less efficient than its matmuls (~6e-4 measured),
#: hence the margin.
CACHE_SLOT_COST = 0.05
ATTENTION_PAIR_COST = 1e-3
#: Bin widths (tokens of packed segments per batch row) the prefix-reuse planner tries.
PACK_WIDTHS = (64, 128, 256, 512)


@dataclass
class Segment:
    """A perturbed causal-LM row as prefix reuse feeds it: its tokens from its first change on."""

    key: tuple | None  # the row's cache key (None: the value is not stored)
    row: Row
    shared: int  # c: tokens before the first change (read from the prefix cache)
    ids: list[int]  # row[c:] + the continuation but its last token
    slot: int  # the example's index in its prefix pass
    length: int  # the example's input length (for grouping similar examples)


# ---------------------------------------------------------------------- plain rows


def _width_buckets(widths: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Indices into ``widths`` sorted by width, and runs of equal width as ``[width, rows]``."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and buckets[-1][0] == widths[i]:
            buckets[-1][1] += 1
        else:
            buckets.append([widths[i], 1])
    return order, buckets


def pack_rows(widths: Sequence[int], token_budget: int, call_overhead_tokens: int) -> list[list[int]]:
    """Cut rows into batches: indices into ``widths``, each batch sorted by width.

    A batch computes ``rows x max width`` tokens (padding included), kept under the budget.
    Rows are sorted by width and batches are runs of consecutive widths; a dynamic programme
    over the distinct widths picks the runs that minimise padded tokens plus
    ``call_overhead_tokens`` per call (so rows of very different widths are not padded to the
    widest, and near-equal widths are not split into many small calls).
    """
    if not widths:
        return []
    order, buckets = _width_buckets(widths)
    k = len(buckets)

    def capacity(width: int) -> int:
        return max(1, token_budget // max(1, width))

    best = [0.0] + [math.inf] * k
    cut = [0] * (k + 1)
    for b in range(1, k + 1):
        width, rows = buckets[b - 1][0], 0
        for a in range(b - 1, -1, -1):  # the run of buckets a..b-1, padded to the widest (b-1)
            rows += buckets[a][1]
            cost = best[a] + rows * width + math.ceil(rows / capacity(width)) * call_overhead_tokens
            if cost < best[b]:
                best[b], cut[b] = cost, a
            if rows * width > 4 * token_budget:  # longer runs only add padding
                break
    runs = []
    b = k
    while b > 0:
        runs.append((cut[b], b))
        b = cut[b]
    batches: list[list[int]] = []
    start = 0
    for a, b in reversed(runs):
        rows = sum(bucket[1] for bucket in buckets[a:b])
        size = capacity(buckets[b - 1][0])
        members = order[start:start + rows]
        start += rows
        batches.extend(members[j:j + size] for j in range(0, rows, size))
    return batches


# ---------------------------------------------------------------------- segments of prefix reuse


def pack_segments(segments: list[Segment], width: int) -> list[list[int]]:
    """Bins of at most ``width`` segment tokens (indices into ``segments``), first fit.

    Segments are taken example by example (examples by length, each example's segments longest
    first) and placed in the first of the last few open bins they fit in, so a bin holds the
    segments of one or a few neighbouring examples and every bin but the last few is nearly full.
    """
    order = sorted(range(len(segments)), key=lambda i: (segments[i].length, segments[i].slot,
                                                        -len(segments[i].ids)))
    bins: list[list[int]] = []
    fill: list[int] = []
    open_bins: list[int] = []
    for i in order:
        size = len(segments[i].ids)
        home = next((b for b in open_bins if fill[b] + size <= width), None)
        if home is None:
            bins.append([])
            fill.append(0)
            home = len(bins) - 1
            open_bins.append(home)
            if len(open_bins) > 8:
                open_bins.pop(0)
        bins[home].append(i)
        fill[home] += size
    return bins


def bin_depth(members: Sequence[Segment]) -> int:
    """Cached prefix slots a bin needs: for each of its examples, the deepest first change."""
    deepest: dict[int, int] = {}
    for seg in members:
        deepest[seg.slot] = max(deepest.get(seg.slot, 0), seg.shared)
    return sum(deepest.values())


def pack_by_example(segments: list[Segment]) -> list[list[int]]:
    """Bins of one example's segments each, as wide as its longest segment (first fit
    decreasing). A bin then carries one example's prefix only, so each query scores about
    twice the example's length in keys rather than P + W; leave-one-out's segments pair off
    exactly (lengths L - c and c fill a bin of L)."""
    by_example: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        by_example.setdefault(seg.slot, []).append(i)
    bins: list[list[int]] = []
    for members in by_example.values():
        members.sort(key=lambda i: -len(segments[i].ids))
        width = len(segments[members[0]].ids)
        first = len(bins)
        room: list[int] = []
        for i in members:
            size = len(segments[i].ids)
            home = next((b for b, free in enumerate(room) if free >= size), None)
            if home is None:
                home = len(room)
                room.append(width)
                bins.append([])
            bins[first + home].append(i)
            room[home] -= size
    return bins


def plan_bins(segments: list[Segment], token_budget: int, call_overhead_tokens: int) -> list[list[list[int]]]:
    """Batches of bins of segments (indices into ``segments``): the packing that plans
    cheapest, among bins of one width W (from :data:`PACK_WIDTHS`, at least the longest
    segment) and bins of one example each (:func:`pack_by_example`).

    A bin of width W over P cached slots costs about ``W`` tokens, plus
    :data:`ATTENTION_PAIR_COST` per query-key pair (W x (P + W): every query of a bin is scored
    against every key, masked or not), plus :data:`CACHE_SLOT_COST` per cached slot; a model
    call costs ``call_overhead_tokens``.
    """
    longest = max(len(segment.ids) for segment in segments)
    packings = [pack_segments(segments, width) for width in sorted({max(w, longest) for w in PACK_WIDTHS})]
    packings.append(pack_by_example(segments))
    best_plan, best_cost = None, math.inf
    for bins in packings:
        sized = sorted(((bin_depth([segments[i] for i in b]), sum(len(segments[i].ids) for i in b), b)
                        for b in bins), key=lambda item: (item[1], item[0]))
        plan, cost = batch_bins(sized, token_budget, call_overhead_tokens)
        if cost < best_cost:
            best_plan, best_cost = plan, cost
    return best_plan or []


def batch_bins(sized: list[tuple[int, int, list[int]]], token_budget: int,
               call_overhead_tokens: int) -> tuple[list[list[list[int]]], float]:
    """Cut bins ``(cache depth, fill, members)``, sorted by fill, into runs of consecutive bins
    (one model call each, padded to the run's widest fill and deepest cache, with
    ``bins x (depth + fill)`` under the token budget) by a dynamic programme that minimises the
    estimated cost (see :func:`plan_bins`); returns the batches' members and that cost."""
    n = len(sized)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        depth = fill = 0
        for a in range(b - 1, -1, -1):  # the run a..b-1
            depth, fill = max(depth, sized[a][0]), max(fill, sized[a][1])
            bins = b - a
            if bins > 1 and bins * (depth + fill) > token_budget:
                break
            cost = best[a] + (bins * (fill + ATTENTION_PAIR_COST * fill * (depth + fill) + CACHE_SLOT_COST * depth)
                              + call_overhead_tokens)
            if cost < best[b]:
                best[b], cut[b] = cost, a
    batches: list[list[list[int]]] = []
    b = n
    while b > 0:
        batches.append([members for _, _, members in sized[cut[b]:b]])
        b = cut[b]
    return batches[::-1], best[n]
