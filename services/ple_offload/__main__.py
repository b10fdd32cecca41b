"""`python -m services.ple_offload [--flags]`: the PLE service without the `backport` CLI."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.mesh.errors import ServiceStartError
from services.mesh.logs import configure_logging
from services.mesh.settings import SettingsError
from services.mesh.grpc_io import prefer_polling_thread_io
from services.ple_offload.settings import PleSettings


def main() -> None:
    prefer_polling_thread_io()  # before the server's import loads grpc
    from services.ple_offload.server import serve

    parser = argparse.ArgumentParser(prog="python -m services.ple_offload", description=__doc__)
    PleSettings.add_arguments(parser)
    try:
        configure_logging("ple")
        settings = PleSettings.from_namespace(parser.parse_args())
    except SettingsError as error:
        parser.error(str(error))  # status 2 and the usage line, as for an unknown flag
    try:
        asyncio.run(serve(settings))
    except ServiceStartError as error:
        # One line, as `backport ple` reports it: the message names the cause.
        logging.getLogger("services.ple_offload").error("%s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
