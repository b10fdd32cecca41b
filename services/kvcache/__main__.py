"""`python -m services.kvcache`: the KV-cache service without the `backport` CLI."""

from __future__ import annotations

import argparse
import sys

from services.kvcache.runner import run
from services.kvcache.settings import KvCacheSettings
from services.mesh.logs import configure_logging
from services.mesh.settings import SettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.kvcache", description=__doc__)
    KvCacheSettings.add_arguments(parser)
    try:
        configure_logging("kvcache")
        settings = KvCacheSettings.from_namespace(parser.parse_args(argv))
    except SettingsError as error:
        parser.error(str(error))  # status 2 and the usage line, as for an unknown flag
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
