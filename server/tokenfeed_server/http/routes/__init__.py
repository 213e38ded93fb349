"""One APIRouter per resource; :func:`tokenfeed_server.http.app.create_app` includes them
in this order (the order of the paths in ``/openapi.json``)."""
