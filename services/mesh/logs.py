"""One log format for every service, so `backport up` output reads as one stream."""

import logging
import os


def configure_logging(service: str) -> None:
    level = os.environ.get("BACKPORT_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
