"""One log format for every service, so `backport up` output reads as one stream."""

import logging
import os

from services.mesh.settings import SettingsError

LEVEL_ENV = "BACKPORT_LOG_LEVEL"


def configure_logging(service: str) -> None:
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    # logging's own refusal names neither the variable nor the levels it takes.
    if not isinstance(logging.getLevelName(level), int):
        raise SettingsError(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r}: not a log level "
                            "(DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
