"""The client's transport: how a trainer process talks to tokenfeed servers over ZeroMQ.

- :mod:`~tokenfeed.transport.client`: :class:`FeedClient`, hello, the request stream,
  retries and failover (Lazy Pirate).
- :mod:`~tokenfeed.transport.connection`: one DEALER socket, its security and monitor.
- :mod:`~tokenfeed.transport.handshake`: what a failed handshake means.
- :mod:`~tokenfeed.transport.welcome`: what the client checks in a ``welcome``.
- :mod:`~tokenfeed.transport.answer`: the rows of one request, read from a ``chunk``.
- :mod:`~tokenfeed.transport.options`, :mod:`~tokenfeed.transport.endpoint`,
  :mod:`~tokenfeed.transport.replicas`, :mod:`~tokenfeed.transport.retry`: settings,
  addresses, which replica to try, how long to wait before trying again.

The messages themselves are :mod:`tokenfeed.protocol`, shared with the server. Nothing
here imports torch.
"""
