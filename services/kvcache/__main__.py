"""`python -m services.kvcache`: the KV-cache service without the `backport` CLI."""

from __future__ import annotations

import argparse
import sys

from services.kvcache.runner import run
from services.kvcache.settings import KvCacheSettings
from services.mesh.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.kvcache", description=__doc__)
    KvCacheSettings.add_arguments(parser)
    configure_logging("kvcache")
    return run(KvCacheSettings.from_namespace(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
