"""deploy/compose cannot be built here (no Docker engine); its shape and commands are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli

COMPOSE = Path(__file__).resolve().parent.parent / "deploy" / "compose" / "docker-compose.yml"


def compose_services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def parsed_commands(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each service's command as the real CLI parses it: the settings it would start with."""
    parsed: dict[str, Any] = {}
    # The model folder is the container's (/models/model), not this machine's.
    monkeypatch.setattr(cli, "_check_model_folder", lambda args, settings: None)
    for name, service in compose_services().items():
        if "command" not in service:
            continue

        def capture(settings: object, name: str = name) -> int:
            parsed[name] = settings
            return 0

        monkeypatch.setattr(cli, "_services", _capturing(cli._services(), capture))
        assert cli.main(service["command"]) == 0, name
    return parsed


def test_compose_runs_the_whole_mesh_with_commands_the_cli_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"redis", "tokenizer", "engine-0", "engine-1", "gateway"} <= set(compose_services())
    parsed = parsed_commands(monkeypatch)
    assert len(parsed) == 4
    gateway = parsed["gateway"]
    assert gateway.redis_url == "redis://redis:6379/0" and gateway.host == "0.0.0.0"


def test_each_engine_gets_its_own_gpu() -> None:
    """A reservation by `count` hands every container the host's first GPUs: both engines would
    load onto GPU 0."""
    engines = [service for name, service in compose_services().items() if name.startswith("engine-")]
    gpus = []
    for engine in engines:
        [request] = engine["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in request and request["capabilities"] == ["gpu"]
        gpus.extend(request["device_ids"])
    assert len(gpus) == len(engines) == len(set(gpus))


def test_docker_waits_for_the_drain_before_it_kills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's default is SIGKILL 10 s after SIGTERM, which cut the open streams that the gateway
    and engines drain for up to their `drain_timeout_s`."""
    services = compose_services()
    draining = {name: settings.drain_timeout_s for name, settings in parsed_commands(monkeypatch).items()
                if hasattr(settings, "drain_timeout_s")}
    assert set(draining) == {"engine-0", "engine-1", "gateway"}
    for name, drain_timeout_s in draining.items():
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain_timeout_s, name
        # PID 1 reaps vLLM's children and passes the signal on.
        assert services[name]["init"] is True, name


def _capturing(services: dict, capture) -> object:
    return lambda: {name: (settings, help_text, capture) for name, (settings, help_text, _) in services.items()}
