"""The data plane: the ZeroMQ side of the server, where trainers get their batches.

- :mod:`.plane` runs the ROUTER loop (:class:`~.plane.DataPlane`) and dispatches;
- :mod:`.admission` answers ``hello`` (limits, tenants, the job), :mod:`.gets` queues
  ``get`` requests, :mod:`.serving` answers them, :mod:`.wire` sends without blocking;
- :mod:`.registry` keeps the jobs and connections (:mod:`.jobs`), :mod:`.scheduler` the
  fair queue and the egress cap, :mod:`.snapshot` what the HTTP side reads, and
  :mod:`.rates` the rates it shows;
- :mod:`.auth` knows the tenants (tokens, rights, weights, CURVE keys) and
  :mod:`.security` sets up PLAIN or CURVE on the socket.
"""
