"""How the engine notices a peer that stopped, names it, and still tears down.

- ``timeouts``: the one bound on every collective and device-side wait;
- ``bounded_collectives``: ``BoundedCollectives``, every MoonEP collective over a group,
  bounded, naming the peer that did not arrive (with ``arrival_board``'s records);
- ``error_board``: where device-side waits and checks report, read by the host without a sync;
- ``teardown``: ``each``, teardown that goes on with every object after a failed collective.

The error types themselves are ``engine/errors.py`` (public, raised for bad input too).
"""
