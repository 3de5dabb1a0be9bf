"""pagedserve's own log handler, as vLLM has: INFO lines (the KV-cache sizing at start-up, the server's
stats line) reach stderr without the application configuring logging. PAGEDSERVE_LOGGING_LEVEL changes
the level; PAGEDSERVE_CONFIGURE_LOGGING=0 leaves logging entirely to the application."""

from __future__ import annotations

import logging

from pagedserve.envs import ENV


def configure() -> None:
    if not ENV.configure_logging:
        return
    logger = logging.getLogger("pagedserve")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(ENV.logging_level)
    logger.propagate = False  # the handler above prints it; the root logger would print it twice
