"""The built-in engine's transports: how one step's rows move between ranks.

``base.Transport`` is the interface (plan, dispatch, combine, close; each transport's own
record of a step rides in the buffer's ``Plan``); ``collective``, ``symmetric`` and ``hybrid``
implement it; ``select`` names them and resolves ``transport="auto"``. The ``Buffer``
(``engine/buffer.py``) builds the one it uses and delegates to it. Only the names and the
choice are imported here: a transport's module (the symmetric one loads Triton) is imported
when a buffer uses it.
"""

from vllm_moonep.engine.transports.select import TRANSPORTS, resolve_transport

__all__ = ["TRANSPORTS", "resolve_transport"]
