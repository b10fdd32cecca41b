"""The ports `backport up` gives its services: engines count up past the mesh's other ports,
and two services given one port are refused before anything starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import Mesh, UpSettings
from services.mesh.errors import ServiceStartError
from tests.conftest import free_port
from tests.ple.table_files import random_rows, write_table


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


@pytest.mark.parametrize("flag", ["--engine-port", "--engine-metrics-port"])
def test_engines_counted_past_the_last_port_are_refused(meshes: list[Mesh], flag: str) -> None:
    """Port 65536 was handed to the port probe, which raised OverflowError (a traceback)."""
    settings = {"--engine-port": {"engine_port": 65535}, "--engine-metrics-port": {
        "engine_metrics_port": 65535}}[flag]
    mesh = Mesh(UpSettings(model="unused", engines=2, port=free_port(),
                           tokenizer_port=free_port(), **settings))
    meshes.append(mesh)
    with pytest.raises(ServiceStartError, match=f"--engines 2 count {flag} past port 65535"):
        mesh._refuse_taken_ports()


def _qwen4_exp_checkpoint(folder: Path) -> Path:
    """A checkpoint whose PLE table `backport up` serves from a PLE service of its own."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForCausalLM"]}))
    write_table(folder / "model.safetensors", random_rows(1000, 160, seed=6),
                safetensors_dtype="F8_E4M3", scale=0.25)
    return folder


def test_the_ple_service_s_port_is_one_of_the_mesh_s(meshes: list[Mesh], tmp_path: Path) -> None:
    """It was checked alone, as the PLE service started: the tokenizer given that port failed
    once started, and the engines counted into it and failed once their model had loaded."""
    model = str(_qwen4_exp_checkpoint(tmp_path / "qwen4"))
    ple_port = free_port(3)
    mesh = Mesh(UpSettings(model=model, engines=2, engine_port=ple_port - 1, ple_port=ple_port,
                           port=free_port(), tokenizer_port=free_port()))
    meshes.append(mesh)
    assert [_flag_value(mesh._engine_args(i), "--port") for i in range(2)] == [
        str(ple_port - 1), str(ple_port + 1)]
    shared = Mesh(UpSettings(model=model, ple_port=ple_port, tokenizer_port=ple_port,
                             port=free_port(), engine_port=free_port()))
    meshes.append(shared)
    with pytest.raises(ServiceStartError,
                       match=f"port {ple_port} is given to both --tokenizer-port and --ple-port"):
        shared._refuse_taken_ports()
