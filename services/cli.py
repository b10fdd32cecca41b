"""The `backport` console script: one subcommand per service, plus `up` and tools."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from services.mesh.errors import ServiceStartError
from services.mesh.grpc_io import prefer_polling_thread_io
from services.mesh.logs import configure_logging
from services.mesh.settings import ServiceSettings, SettingsError

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    # Before the parser is built: that imports grpc, which reads its experiments once.
    prefer_polling_thread_io()
    parser = argparse.ArgumentParser(prog="backport", description="vLLM Backport serving mesh")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (settings_type, help_text, _) in _services().items():
        settings_type.add_arguments(commands.add_parser(name, help=help_text))
    commands.add_parser("model-path", help="print the folder of the model `backport up` would serve "
                                           "(preparing the embedded default if needed)")
    from services.gateway.parsing import cli as parse_cli
    parse_cli.add_arguments(commands.add_parser("parse", help="parse raw model output into an "
                                                              "assistant message (JSON)"))
    args = parser.parse_args(argv)

    if args.command == "parse":
        return parse_cli.run(args)
    try:
        if args.command == "model-path":
            from services.embedded_model import ensure_embedded_model
            print(ensure_embedded_model())
            return 0
        settings_type, _, run = _services()[args.command]
        _default_to_embedded_model(args, settings_type)
    except ServiceStartError as error:
        print(f"backport {args.command}: error: {error}", file=sys.stderr)
        return 1
    try:
        configure_logging(args.command)
        settings = settings_type.from_namespace(args)
        _check_model_folder(args, settings)
    except SettingsError as error:
        # argparse's own status and shape for a bad option, without a traceback.
        print(f"backport {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ServiceStartError as error:
        print(f"backport {args.command}: error: {error}", file=sys.stderr)
        return 1
    from services.launcher import stop_with_launcher
    stop_with_launcher()  # a service `backport up` started stops when it goes
    try:
        return run(settings) or 0
    except ServiceStartError as error:
        logger.error("%s", error)
        return 1
    except KeyboardInterrupt:
        return 130


def _default_to_embedded_model(args: argparse.Namespace, settings_type: type[ServiceSettings]) -> None:
    """No --model and no environment value: serve the embedded default."""
    if "model" not in settings_type.model_fields or "model" in vars(args):
        return
    env_name = (settings_type.model_config.get("env_prefix") or "") + "MODEL"
    if os.environ.get(env_name):
        return
    from services.embedded_model import ensure_embedded_model
    args.model = str(ensure_embedded_model())


def _check_model_folder(args: argparse.Namespace, settings: ServiceSettings) -> None:
    """Before anything loads: transformers and vLLM take any other string for a hub id and
    fail on it with a traceback, once a model's worth of start-up has gone by."""
    model = getattr(settings, "model", None)
    if model is None or Path(model).is_dir():
        return
    source = ("--model " if "model" in vars(args)
              else (settings.model_config.get("env_prefix") or "") + "MODEL=")
    raise ServiceStartError(f"{source}{model}: no such folder; give a local Hugging Face model folder")


def _services() -> dict[str, tuple[type[ServiceSettings], str, Callable[[ServiceSettings], int | None]]]:
    from services.engine.settings import EngineSettings
    from services.gateway.settings import GatewaySettings
    from services.kvcache.settings import KvCacheSettings
    from services.launcher import UpSettings
    from services.ple_offload.settings import PleSettings
    from services.tokenizer.settings import TokenizerSettings

    def run_engine(settings: ServiceSettings) -> int:
        from services.engine.server import serve
        return asyncio.run(serve(settings))

    def run_tokenizer(settings: ServiceSettings) -> None:
        if not settings.trust_remote_code:
            from services.tokenizer.without_torch import hide_torch_from_transformers
            hide_torch_from_transformers()
        from services.tokenizer.server import serve
        asyncio.run(serve(settings))

    def run_gateway(settings: ServiceSettings) -> None:
        from services.gateway.server import serve
        serve(settings)

    def run_ple(settings: ServiceSettings) -> None:
        from services.ple_offload.server import serve
        asyncio.run(serve(settings))

    def run_kvcache(settings: ServiceSettings) -> int:
        from services.kvcache.runner import run
        return run(settings)

    def run_up(settings: ServiceSettings) -> int:
        from services.launcher import run_mesh
        return run_mesh(settings)

    return {
        "up": (UpSettings, "start tokenizer, engine(s) and gateway as one mesh", run_up),
        "gateway": (GatewaySettings, "the OpenAI-compatible HTTP gateway", run_gateway),
        "engine": (EngineSettings, "a gRPC engine over vLLM", run_engine),
        "tokenizer": (TokenizerSettings, "the gRPC tokenizer service", run_tokenizer),
        "kvcache": (KvCacheSettings, "the KV-cache service (LMCache's server; `make kvcache-deps`)",
                    run_kvcache),
        "ple": (PleSettings, "the PLE offload service: one shared-memory copy of an n-gram "
                             "embedding table per machine", run_ple),
    }


if __name__ == "__main__":
    sys.exit(main())
