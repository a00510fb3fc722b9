"""The plan made on the host from the all-gathered counts (the collective and hybrid transports).

    tokens_per_expert [E] ─► all-gather (bounded, framed) ─► tpe [R, E] on the host ─► every rank
                             refuses bad counts together ─► plan_global(tpe, S, K, B, tp)

A rank that refuses its own dispatch input (``Buffer`` checks) sends a refusal frame in place of its
counts (``refuse_framed``), so its peers, already in the all-gather, refuse the same call with it
instead of pairing with the refusing rank's next call (two calls mixed: rows of another layer).

The plan comes from the small ``[R, E]`` table, the one host read of the step; an all-to-all
needs its split sizes on the host anyway, and they come from the same plan. The symmetric
transport plans on the device instead (``device_planner.py``), inside its dispatch launch.

Framing: the counts all-gather and a buffer's construction check (``Buffer.__init__``) are the
first collective of their call, so when ranks disagree on which call they make (one builds a
buffer of another capacity while its peers dispatch: a token count that differs across ranks)
the two meet. Both therefore send one frame, ``[tag, S, payload padded to frame_words(E) - 2]``:
the sizes match (for one ``E``), and each rank reads what its peers were doing from the tags and
refuses together with a message that says so, instead of the backend aborting on mismatched sizes
(gloo) or one call reading the other's data. Buffers of one layer share ``E``; ranks constructing
buffers whose ``E`` lies in different ``FRAME_BLOCK`` blocks still send frames of different sizes.
"""

from __future__ import annotations

import torch

from vllm_moonep.engine.errors import MoonEPInputError
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.planning.planner import GlobalPlan, plan_global

__all__ = ["CONFIG_WORDS", "DISPATCH_GATHER_OP", "FRAME_BLOCK", "TAG_CONFIG", "TAG_DISPATCH", "TAG_REFUSED",
           "exchange_framed", "frame_words", "plan_on_host", "refuse_framed", "refuse_short_counts"]

#: the frame's tags (distinctive values: no count or configuration word reads as one)
TAG_CONFIG = 0x4D6F6F6E45500001  # Buffer.__init__'s configuration check
TAG_DISPATCH = 0x4D6F6F6E45500002  # dispatch's counts
TAG_REFUSED = 0x4D6F6F6E45500003  # a dispatch this rank refused (its own input), in place of its counts
#: words of ``Buffer.__init__``'s configuration payload ([S,H,K,E,R,B,tp,transport,ranks per node,host])
CONFIG_WORDS = 10
#: a frame's payload is padded to a multiple of this many words, so that ``E`` that differ within a
#: block (every model's ``E`` up to 512) still give frames of one size and the construction check
#: reports them; 4 KB a rank per step
FRAME_BLOCK = 512
_HEAD = 2  # [tag, S]
#: the name errors give the counts all-gather (and the refusal frame that stands in for it)
DISPATCH_GATHER_OP = "dispatch: all_gather(tokens_per_expert)"


def frame_words(E: int) -> int:
    """Words of the frame of a buffer of ``E`` experts (counts or configuration: the same)."""
    return _HEAD + FRAME_BLOCK * -(-max(E, CONFIG_WORDS) // FRAME_BLOCK)


def exchange_framed(collectives: BoundedCollectives, tag: int, S: int, E: int, payload: torch.Tensor,
                    op: str) -> torch.Tensor:
    """Every rank's ``payload`` (1-D, at most ``frame_words(E) - 2`` words) as ``[R, n]`` int64 on the
    host, all-gathered in one frame; ``MoonEPInputError`` on every rank together when a peer's frame
    says it is in another call (``tag``), or, for dispatches, on a buffer of another capacity ``S``.
    Metadata and fills only before the all-gather (no host synchronization of its own)."""
    n = payload.numel()
    if collectives.local:
        return collectives.all_gather(payload.to(torch.int64), op).cpu()
    every = _gather_frames(collectives, tag, S, E, payload, op)
    tags, sizes = every[:, 0].tolist(), every[:, 1].tolist()
    _refuse_mismatched_calls(tag, S, tags, sizes)
    return every[:, _HEAD:_HEAD + n]


def refuse_framed(collectives: BoundedCollectives, S: int, E: int, device: torch.device, op: str) -> None:
    """This rank refused its dispatch input: send the refusal frame where its counts would go, so that its
    peers' all-gather of this call completes and they refuse it too (``exchange_framed``). What the peers
    sent is not read: the caller raises its own error. Nothing to send with one rank."""
    if not collectives.local:
        _gather_frames(collectives, TAG_REFUSED, S, E, torch.zeros(0, dtype=torch.int64, device=device), op)


def _gather_frames(collectives: BoundedCollectives, tag: int, S: int, E: int, payload: torch.Tensor,
                   op: str) -> torch.Tensor:
    """Every rank's frame ``[tag, S, payload, 0...]`` as ``[R, frame_words(E)]`` int64 on the host."""
    msg = torch.zeros(frame_words(E), dtype=torch.int64, device=payload.device)
    msg[0] = tag
    msg[1] = S
    msg[_HEAD:_HEAD + payload.numel()].copy_(payload)
    return collectives.all_gather(msg, op).cpu()


def _refuse_mismatched_calls(tag: int, S: int, tags: list[int], sizes: list[int]) -> None:
    """The frames' tags and capacities, every rank's (so every rank refuses together)."""
    names = {TAG_CONFIG: "constructing a MoonEP Buffer of", TAG_DISPATCH: "dispatching on a buffer of",
             TAG_REFUSED: "refusing its input to a dispatch on a buffer of"}
    here = "dispatch" if tag == TAG_DISPATCH else "Buffer.__init__"
    refused = [r for r, t in enumerate(tags) if t == TAG_REFUSED]
    if tag == TAG_DISPATCH and refused and all(t in (TAG_DISPATCH, TAG_REFUSED) for t in tags) \
            and len(set(sizes)) == 1:
        raise MoonEPInputError(
            f"dispatch: rank(s) {refused} refused their input to this dispatch (their own error says why), so every "
            "rank refuses it: nothing moved, and the buffer stays usable for the next step")
    why = ("ranks that disagree on the step's token count (e.g. num_tokens_across_dp) pick buffers of different "
           "capacity; every rank must make the same calls, on the same buffer, in the same order")
    other = [r for r, t in enumerate(tags) if t != tag]
    if other:
        doing = "; ".join(f"rank {r} is {names[tags[r]]} S={sizes[r]}" if tags[r] in names
                          else f"rank {r} is in another MoonEP collective" for r in other)
        mine = "dispatches on a buffer" if tag == TAG_DISPATCH else "constructs one"
        raise MoonEPInputError(f"{here}: {doing}, while this rank {mine} of S={S}: {why}")
    if tag == TAG_DISPATCH and len(set(sizes)) > 1:  # a construction's S is in its configuration check
        raise MoonEPInputError(f"dispatch: the ranks disagree on the step's capacity: S per rank {sizes} "
                               f"(each dispatched on a buffer of its own capacity): {why}")


def plan_on_host(collectives: BoundedCollectives, tokens_per_expert: torch.Tensor, S: int, K: int, E: int, B: int,
                 token_padding: int) -> GlobalPlan:
    """All-gather every rank's counts over ``collectives`` and plan on the host (the same plan on
    every rank). ``MoonEPInputError`` on every rank together, before any row moves, when some
    rank's counts do not sum to ``S*K``, or a rank is in another call or on a buffer of another
    capacity (``exchange_framed``)."""
    tpe_host = exchange_framed(collectives, TAG_DISPATCH, S, E, tokens_per_expert, DISPATCH_GATHER_OP)
    refuse_short_counts(tpe_host, S, K, E)
    return plan_global(tpe_host, S, K, B, token_padding)


def refuse_short_counts(tpe_host: torch.Tensor, S: int, K: int, E: int) -> None:
    """``MoonEPInputError`` where a rank's counts in the all-ranks table ``tpe_host [R, E]`` do not sum to
    ``S*K``. Every rank sees the same table, so all refuse together (nothing moved yet): such counts mean
    ids outside ``[0, E)`` dropped from the count (CUDA counts them on the device) or counts that are not
    the ids' bincount. Counts that are not the bincount yet sum to ``S*K`` pass here: only ``check_inputs``
    (on the host) or the GPU's placement check (an entry past its expert's count) sees them."""
    sums = tpe_host.sum(dim=1).tolist()
    short = [r for r, n in enumerate(sums) if n != S * K]
    if short:
        raise MoonEPInputError(
            f"dispatch: tokens_per_expert of rank(s) {short} does not sum to S*K = {S * K} "
            f"(sums {sums}): expert ids outside [0, {E}) or counts that are not "
            "the bincount of the ids; sanitize invalid ids first"
        )
