"""An independent, loop-by-loop transcription of docs/CONTRACT.md's planner in plain Python.

Written separately from ``vllm_moonep.engine.planning.planner`` (which is vectorized torch) so tests can
compare the two. Inputs are Python lists; outputs are Python lists.
"""

from __future__ import annotations


def argmax_first(v):
    best = max(v)
    return v.index(best)


def argmin_first(v):
    best = min(v)
    return v.index(best)


def reference_plan(tpe, S, K, B, tp):
    """``tpe``: list of R lists of E counts. Returns a dict with alloc, etc, seg_len, cu, row_base."""
    R, E = len(tpe), len(tpe[0])
    epn = E // R
    count = [sum(tpe[r][e] for r in range(R)) for e in range(E)]
    cap = S * K
    balance = [sum(count[h * epn:(h + 1) * epn]) - cap for h in range(R)]
    z = [[0] * R for _ in range(R)]
    while True:
        h = argmax_first(balance)
        u = argmin_first(balance)
        if balance[h] <= 0:
            break
        z[h][u] = -balance[u]
        balance[h] += balance[u]
        balance[u] = 0
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][e // epn] = count[e]
    for h in range(R):
        remaining = count[h * epn:(h + 1) * epn]
        quota = list(z[h])
        while True:
            d = argmax_first(quota)
            if quota[d] <= 0:
                break
            le = argmax_first(remaining)
            take = min(remaining[le], quota[d])
            assert take > 0, "a home ran out of rows before its quota"
            e = h * epn + le
            alloc[e][d] += take
            alloc[e][h] -= take
            remaining[le] -= take
            quota[d] -= take
    etc = [[-1] * B for _ in range(R)]
    seg_len = [[0] * (E + B) for _ in range(R)]
    group_of = [[None] * R for _ in range(E)]
    for d in range(R):
        remote = [e for e in range(E) if alloc[e][d] > 0 and e // epn != d]
        remote.sort(key=lambda e: (alloc[e][d], e), reverse=True)
        for b, e in enumerate(remote[:B]):
            etc[d][b] = e
            seg_len[d][E + b] = alloc[e][d]
            group_of[e][d] = E + b
        for e in range(E):
            if alloc[e][d] > 0 and group_of[e][d] is None:
                seg_len[d][e] = alloc[e][d]
                group_of[e][d] = e
    cu = []
    start = []
    for d in range(R):
        acc, row_cu, row_start = 0, [], []
        for g in range(E + B):
            n = seg_len[d][g]
            padded = ((n + tp - 1) // tp) * tp if n > 0 else 0
            row_start.append(acc)
            acc += padded
            row_cu.append(acc)
        cu.append(row_cu)
        start.append(row_start)
    return {
        "z": z,
        "alloc": alloc,
        "etc": etc,
        "seg_len": seg_len,
        "cu": cu,
        "start": start,
        "group_of": group_of,
    }


def reference_placement(tpe, ids_by_rank, plan):
    """``ids_by_rank[r]``: rank r's flat ids. Returns ``dest[r][i]``, ``row[r][i]``."""
    R, E = len(tpe), len(tpe[0])
    alloc = plan["alloc"]
    dests, rows = [], []
    for r in range(R):
        seen = [0] * E
        d_r, row_r = [], []
        for e in ids_by_rank[r]:
            g = sum(tpe[rr][e] for rr in range(r)) + seen[e]
            seen[e] += 1
            cum = 0
            for d in range(R):
                prev = cum
                cum += alloc[e][d]
                if cum > g:
                    break
            d_r.append(d)
            row_r.append(plan["start"][d][plan["group_of"][e][d]] + g - prev)
        dests.append(d_r)
        rows.append(row_r)
    return dests, rows
