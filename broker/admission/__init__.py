"""Admission: whether to say yes to a session (or a plain call) before any GPU memory is taken.

Which module owns which part:

- ``policy``      the decision, pure: ``decide`` over a ``SessionNeed``, a ``FleetSnapshot`` and
                  the ``Holdings``, clock and jitter passed in; pressure bands; over-commit.
- ``objectives``  what admission learns from outcomes, pure: each tier group's over-commit
                  window (from the objectives admitted calls met) and the pace sessions kept.
- ``tenants``     who may ask for what: tenants, keys, quotas, tiers and their shares.
- ``needs``       the one builder of ``SessionNeed`` (a session request, a plain call, a batch).
- ``state``       the admission state's interface and its in-process twin (one replica).
- ``redis_store`` the same interface in Redis, shared by replicas; its Lua is ``store.lua``.
- ``signals``     what admission reads of the fleet: workers' readings and queue lag.
- ``admitter``    the I/O shell: read the signals, decide, reserve, hold for room, record.
- ``leases``      an admitted session afterwards: read it, hold its call slots, close it.
- ``metrics``     the Prometheus metrics admission observes.

Imports run one way: the pure modules import nothing with I/O (``tests/test_layers.py``), and
nothing in this package imports the front door (``api``) or the workers.
"""
