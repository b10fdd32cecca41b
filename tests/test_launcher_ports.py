"""The ports `backport up` gives its services: engines count up past the mesh's other ports,
and two services given one port are refused before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher import Mesh, UpSettings
from services.mesh.errors import ServiceStartError
from tests.conftest import free_port


@pytest.fixture
def meshes() -> Iterator[list[Mesh]]:
    """Meshes built here, stopped after the test (nothing runs; their lifelines close)."""
    built: list[Mesh] = []
    yield built
    for mesh in built:
        mesh.stop()


def test_engines_count_up_past_the_mesh_s_other_ports(meshes: list[Mesh]) -> None:
    """The defaults put the tokenizer on the second engine's port: the tokenizer answered that
    engine's health check, the gateway routed to it, and the engine failed once loaded."""
    mesh = Mesh(UpSettings(model="unused", engines=3, engine_port=50051, tokenizer_port=50052,
                           engine_metrics_port=9000, port=9001))
    meshes.append(mesh)
    assert [_flag_value(mesh._engine_args(i), "--port") for i in range(3)] == [
        "50051", "50053", "50054"]
    assert [_flag_value(mesh._engine_args(i), "--metrics-port") for i in range(3)] == [
        "9000", "9002", "9003"]


def test_one_port_given_to_two_services_is_refused(meshes: list[Mesh]) -> None:
    port = free_port()
    mesh = Mesh(UpSettings(model="unused", port=port, tokenizer_port=port))
    meshes.append(mesh)
    with pytest.raises(ServiceStartError,
                       match=f"port {port} is given to both --port and --tokenizer-port"):
        mesh._refuse_taken_ports()


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_a_host_that_does_not_resolve_is_named_without_a_traceback(meshes: list[Mesh]) -> None:
    mesh = Mesh(UpSettings(model="unused", host="no-such-host.invalid", port=free_port()))
    meshes.append(mesh)
    with pytest.raises(ServiceStartError, match="--host no-such-host.invalid: "):
        mesh._refuse_taken_ports()
