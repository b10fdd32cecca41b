"""deploy/compose cannot be built here (no Docker engine); its shape and commands are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services import cli

COMPOSE = Path(__file__).resolve().parent.parent / "deploy" / "compose" / "docker-compose.yml"


def test_compose_runs_the_whole_mesh_with_commands_the_cli_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"redis", "tokenizer", "engine-0", "engine-1", "gateway"} <= set(services)
    parsed = []

    def capture(settings: object) -> int:
        parsed.append(settings)
        return 0

    for name, service in services.items():
        if "command" not in service:
            continue
        command = service["command"]
        monkeypatch.setattr(cli, "_services", _capturing(cli._services(), capture))
        assert cli.main(command) == 0, name
    assert len(parsed) == 4
    gateway = parsed[-1]
    assert gateway.redis_url == "redis://redis:6379/0" and gateway.host == "0.0.0.0"


def _capturing(services: dict, capture) -> object:
    return lambda: {name: (settings, help_text, capture) for name, (settings, help_text, _) in services.items()}
