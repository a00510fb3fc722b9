"""A small OpenAI-completions client on loopback (stdlib asyncio: ``vllm bench serve`` needs
``aiohttp``, which the device's vLLM bundle does not carry), and the latency figures of a load.

    arrivals(n, rate, seed) -> send times        post_json(...)   -> one reply (outputs)
    run_load(url, prompts, out_len, times)       post_stream(...) -> TTFT, ITLs, tokens of one request
        -> [per-request results] --load_stats()--> output tokens/s, TTFT and ITL p50/p99, TPOT

A streamed request counts tokens by each chunk's ``token_ids`` (``return_token_ids``); its TTFT is
the time to the first chunk that carries a token, its inter-token latencies the gaps between
successive token-carrying chunks (one per chunk, as ``vllm bench serve`` counts them).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any, AsyncIterator, Callable

__all__ = ["HTTPStatusError", "arrivals", "load_stats", "percentile", "post_json", "post_stream", "run_load"]


class HTTPStatusError(RuntimeError):
    """A reply whose status is not 200 (the body's start in the message)."""


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` requests: Poisson at ``rate`` requests/s (exponential
    gaps from ``seed``, the first at 0), or all at 0 for ``rate`` inf."""
    if n < 0 or not rate > 0:
        raise ValueError(f"arrivals needs n >= 0 and rate > 0, got n={n}, rate={rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``xs`` by linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _split_url(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.partition(":")
    return host, int(port or 80)


async def _request(url: str, path: str, body: dict[str, Any], stream: bool):
    host, port = _split_url(url)
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 24)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: {'text/event-stream' if stream else 'application/json'}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    status_line = (await reader.readline()).decode("latin-1").strip()
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return reader, writer, status, headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive (chunked transfer, a content length, or until close)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            chunk = await reader.readexactly(size)
            await reader.readexactly(2)
            yield chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(1 << 16):
            yield chunk


async def post_json(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body``; the JSON reply. Raises ``HTTPStatusError`` for a status other than 200."""
    reader, writer, status, headers = await _request(url, path, body, stream=False)
    try:
        raw = b"".join([c async for c in _body(reader, headers)])
    finally:
        writer.close()
    if status != 200:
        raise HTTPStatusError(f"HTTP {status}: {raw[:500].decode(errors='replace')}")
    return json.loads(raw)


async def post_stream(url: str, path: str, body: dict[str, Any],
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """POST ``body`` with ``stream: true``; times each server-sent event that carries tokens.
    Returns ``ok``, ``start`` (clock), ``ttft``, ``itl`` (list), ``latency``, ``output_tokens``,
    ``error``; never raises for a failed request (it is a result with ``ok`` False)."""
    t0 = clock()
    res: dict[str, Any] = {"ok": False, "start": t0, "ttft": None, "itl": [], "latency": None, "output_tokens": 0,
                           "error": None}
    try:
        reader, writer, status, headers = await _request(url, path, {**body, "stream": True}, stream=True)
    except OSError as exc:
        res["error"] = f"connect: {type(exc).__name__}: {exc}"
        return res
    last = None
    buf = b""
    try:
        if status != 200:
            raw = b"".join([c async for c in _body(reader, headers)])
            res["error"] = f"HTTP {status}: {raw[:500].decode(errors='replace')}"
            return res
        done = False
        async for chunk in _body(reader, headers):
            now = clock()
            buf += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buf and not done:
                event, buf = buf.split(b"\n\n", 1)
                data = b"\n".join(ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg and not msg.get("choices"):
                    res["error"] = f"server error in the stream: {str(msg['error'])[:300]}"
                    return res
                n = 0
                for ch in msg.get("choices") or []:
                    ids = ch.get("token_ids")
                    n += len(ids) if ids is not None else (1 if ch.get("text") else 0)
                if n:
                    if last is None:
                        res["ttft"] = now - t0
                    else:
                        res["itl"].append(now - last)
                    last = now
                    res["output_tokens"] += n
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res["usage_completion_tokens"] = usage["completion_tokens"]
            if done:
                break
        res["latency"] = clock() - t0
        res["ok"] = done
        if not done:
            res["error"] = "the stream ended without [DONE]"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        writer.close()
    return res


async def run_load(url: str, bodies: list[dict[str, Any]], times: list[float], timeout_s: float,
                   path: str = "/v1/completions") -> tuple[list[dict[str, Any]], float]:
    """Send ``bodies[i]`` (streamed) at ``times[i]`` s from the start; all bounded by ``timeout_s``.
    Returns the per-request results (a request cut by the timeout is one with ``ok`` False) and
    the wall time from the first send to the last reply."""
    if len(bodies) != len(times):
        raise ValueError(f"{len(bodies)} requests but {len(times)} send times")
    t0 = time.perf_counter()

    async def one(body: dict[str, Any], at: float) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await post_stream(url, path, body)

    tasks = [asyncio.ensure_future(one(b, t)) for b, t in zip(bodies, times)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    results = []
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is None:
            results.append(t.result())
        else:
            results.append({"ok": False, "error": f"no reply within {timeout_s:.0f}s" if t in pending else
                            f"{type(t.exception()).__name__}: {t.exception()}", "itl": [], "output_tokens": 0})
    ends = [r["start"] + r["latency"] for r in results if r.get("latency") is not None]
    wall = (max(ends) - t0) if ends else time.perf_counter() - t0
    return results, wall


def _dist_ms(xs: list[float]) -> dict[str, float | None]:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000.0 * x, 2)

    return {"p50": ms(percentile(xs, 50)), "p99": ms(percentile(xs, 99)),
            "mean": ms(sum(xs) / len(xs)) if xs else None}


def load_stats(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Output tokens/s (all output tokens over the wall time from the first send to the last reply),
    requests/s, TTFT, ITL and TPOT (per request: (latency - TTFT) / (tokens - 1)) in ms: p50, p99,
    mean; failed requests are counted, with the first error."""
    ok = [r for r in results if r.get("ok")]
    tokens = sum(r.get("output_tokens", 0) for r in results)
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    itl = [x for r in ok for x in r.get("itl", [])]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
            if r.get("ttft") is not None and r.get("output_tokens", 0) > 1]
    failed = [r for r in results if not r.get("ok")]
    return {"requests": len(results), "completed": len(ok), "failed": len(failed),
            "first_error": failed[0].get("error") if failed else None, "output_tokens": tokens,
            "wall_s": round(wall_s, 3), "output_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
            "request_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
            "ttft_ms": _dist_ms(ttft), "itl_ms": _dist_ms(itl), "tpot_ms": _dist_ms(tpot)}
