"""The one C helper of the server (``store/_rows.c``); everything else is in pyproject.toml.

``optional=True``: where no C compiler is found at install (e.g. a slim image) the package
installs without it and reads rows through ``os.preadv`` instead (see ``store/rows.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenfeed_server.store._rows",
            ["tokenfeed_server/store/_rows.c"],
            optional=True,
        )
    ]
)
