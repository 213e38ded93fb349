"""The HTTP edge: the JSON API, Prometheus metrics, the console page and the admin CLI.

:func:`~.app.create_app` assembles the FastAPI application from one router per
resource (:mod:`.routes`); handlers only read (the data plane's snapshot, the store's
look-ups), never a ZeroMQ socket. :mod:`.access` says who is asking and what they may
see, :mod:`.models` declares every answer, :mod:`.console` serves the status page and
the offline API docs, and :mod:`.admin_cli` is the command line over this API.
"""
