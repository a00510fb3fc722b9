"""Outputs of two configurations compared token by token: the teacher-forced prompt logprobs and the
greedy continuations of the same fixed prompts.

    /v1/completions reply --prompt_logprobs_of()--> [logprob of the prompt's own token per position]
                          --greedy_of()-->          token ids, their logprobs
    row vs reference      --logprob_distance()-->   tokens, max and mean |difference|, top-1 agreement
                          --greedy_distance()-->    identical sequences, common prefixes, |difference| on them
    distance vs noise floor --within_floor()-->     True / False / None

The reference is ``allgather_reducescatter`` in the same mode; the noise floor is ``naive``'s
distance to it (in vLLM 0.33 a second run of the reference: ``matrix.py``). A distance is within the
floor when neither its max nor its mean is larger than the floor's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["greedy_distance", "greedy_of", "logprob_distance", "prompt_logprobs_of", "prompts_digest", "within_floor"]


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:16]


def prompt_logprobs_of(prompt: list[int], choice: dict[str, Any]) -> tuple[list[float | None], list[int | None]]:
    """From a completion choice asked with ``prompt_logprobs``: the logprob of the prompt's own token
    at each position (None at position 0, which has no context) and the rank-1 token there. Raises
    ValueError when the reply does not cover the prompt."""
    plp = choice.get("prompt_logprobs")
    if not isinstance(plp, list) or len(plp) != len(prompt):
        raise ValueError(f"prompt_logprobs cover {len(plp) if isinstance(plp, list) else 'no'} positions of a "
                         f"{len(prompt)}-token prompt")
    lps: list[float | None] = []
    top: list[int | None] = []
    for i, (tok, entry) in enumerate(zip(prompt, plp)):
        if entry is None:
            if i:
                raise ValueError(f"no prompt logprobs at position {i}")
            lps.append(None)
            top.append(None)
            continue
        own = entry.get(str(tok))
        if own is None:
            raise ValueError(f"position {i}: the prompt token {tok} is not among the returned logprobs")
        lps.append(float(own["logprob"]))
        top.append(next((int(k) for k, v in entry.items() if v.get("rank") == 1), None))
    return lps, top


def greedy_of(choice: dict[str, Any]) -> dict[str, Any]:
    """A greedy completion's token ids and each chosen token's logprob (``logprobs`` asked)."""
    ids = choice.get("token_ids")
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or lps is None or len(ids) != len(lps):
        raise ValueError("the reply has no token_ids with one logprob each (return_token_ids and logprobs asked)")
    return {"token_ids": [int(x) for x in ids], "logprobs": [None if x is None else float(x) for x in lps]}


def _abs_diffs(ref: list[list[float | None]], got: list[list[float | None]],
               spans: list[int] | None = None) -> tuple[list[float], tuple[int, int] | None, float]:
    diffs: list[float] = []
    worst, worst_d = None, -1.0
    for i, (a, b) in enumerate(zip(ref, got)):
        n = min(len(a), len(b)) if spans is None else spans[i]
        for j in range(n):
            if a[j] is None or b[j] is None:
                continue
            d = abs(float(a[j]) - float(b[j]))  # type: ignore[arg-type]
            diffs.append(d)
            if d > worst_d:
                worst, worst_d = (i, j), d
    return diffs, worst, worst_d


def logprob_distance(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Per token |logprob difference| of the prompts' own tokens (teacher forced), over every
    position of every prompt; ``top1_agreement``: the share of positions whose rank-1 token is the
    same. ``ref``/``got``: a row's ``outputs``. Different prompts, or a side without outputs, give
    ``{"compared": False, "why": ...}``."""
    if not ref or not got or ref.get("prompt_logprobs") is None or got.get("prompt_logprobs") is None:
        return {"compared": False, "why": "a side has no prompt logprobs"}
    if ref.get("prompts_digest") != got.get("prompts_digest"):
        return {"compared": False, "why": "different prompts (another --seed or prompt set)"}
    a, b = ref["prompt_logprobs"], got["prompt_logprobs"]
    if [len(x) for x in a] != [len(x) for x in b]:
        return {"compared": False, "why": "the logprob lists differ in length"}
    diffs, worst, _ = _abs_diffs(a, b)
    t_ref, t_got = ref.get("prompt_top1") or [], got.get("prompt_top1") or []
    pairs = [(x, y) for ra, rb in zip(t_ref, t_got) for x, y in zip(ra, rb) if x is not None and y is not None]
    return {"compared": True, "tokens": len(diffs), "max_abs": max(diffs) if diffs else 0.0,
            "mean_abs": sum(diffs) / len(diffs) if diffs else 0.0, "worst": list(worst) if worst else None,
            "top1_agreement": sum(x == y for x, y in pairs) / len(pairs) if pairs else None}


def greedy_distance(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Greedy continuations: how many are identical, each one's common prefix with the reference's
    and the first mismatch (sequence, position, reference token, this token); the |logprob
    difference| of the chosen tokens over the common prefixes (where both chose the same token)."""
    if not ref or not got or ref.get("greedy") is None or got.get("greedy") is None:
        return {"compared": False, "why": "a side has no greedy continuations"}
    if ref.get("prompts_digest") != got.get("prompts_digest"):
        return {"compared": False, "why": "different prompts (another --seed or prompt set)"}
    a, b = ref["greedy"], got["greedy"]
    if len(a) != len(b):
        return {"compared": False, "why": f"{len(a)} vs {len(b)} continuations"}
    prefixes, first = [], None
    for i, (x, y) in enumerate(zip(a, b)):
        tx, ty = x["token_ids"], y["token_ids"]
        n = 0
        while n < min(len(tx), len(ty)) and tx[n] == ty[n]:
            n += 1
        prefixes.append(n)
        if first is None and (n < len(tx) or n < len(ty)):
            first = [i, n, tx[n] if n < len(tx) else None, ty[n] if n < len(ty) else None]
    diffs, _, _ = _abs_diffs([x["logprobs"] for x in a], [y["logprobs"] for y in b], spans=prefixes)
    return {"compared": True, "sequences": len(a),
            "identical": sum(1 for x, y in zip(a, b) if x["token_ids"] == y["token_ids"]),
            "common_prefix": prefixes, "tokens": sum(len(x["token_ids"]) for x in a), "first_mismatch": first,
            "tokens_compared": len(diffs), "max_abs": max(diffs) if diffs else 0.0,
            "mean_abs": sum(diffs) / len(diffs) if diffs else 0.0}


def within_floor(dist: dict[str, Any] | None, floor: dict[str, Any] | None) -> bool | None:
    """Whether a distance is no larger than the noise floor's, in max and in mean (None: either was
    not measured)."""
    if not dist or not floor or not dist.get("compared") or not floor.get("compared"):
        return None
    return dist["max_abs"] <= floor["max_abs"] and dist["mean_abs"] <= floor["mean_abs"]
