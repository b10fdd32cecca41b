"""The engine side's PLE settings come from BACKPORT_PLE_* and a bad one is named."""

from __future__ import annotations

import pytest

from services.engine.backport.ple.hook_settings import PleHookSettings


def test_defaults_and_values_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKPORT_PLE_ADDRESS", "10.0.0.7:50071")
    monkeypatch.setenv("BACKPORT_PLE_TABLE_PATH", "/models/t")  # the service's; ignored here
    settings = PleHookSettings.from_environment()
    assert (settings.address, settings.shared_memory, settings.gpu_gather,
            settings.gather_threads) == ("10.0.0.7:50071", True, True, 4)
    monkeypatch.setenv("BACKPORT_PLE_SHARED_MEMORY", "0")
    monkeypatch.setenv("BACKPORT_PLE_GPU_GATHER", "false")
    monkeypatch.setenv("BACKPORT_PLE_CONNECT_TIMEOUT_S", "2.5")
    settings = PleHookSettings.from_environment()
    assert (settings.shared_memory, settings.gpu_gather, settings.connect_timeout_s) == (
        False, False, 2.5)


@pytest.mark.parametrize(("variable", "value"), [
    ("BACKPORT_PLE_GATHER_THREADS", "four"),
    ("BACKPORT_PLE_GATHER_THREADS", "0"),
    ("BACKPORT_PLE_REATTACH_TIMEOUT_S", "-1"),
    ("BACKPORT_PLE_SHARED_MEMORY", "perhaps"),
])
def test_a_bad_value_is_refused_by_its_variable(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                value: str) -> None:
    monkeypatch.setenv("BACKPORT_PLE_ADDRESS", "127.0.0.1:50071")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}: "):
        PleHookSettings.from_environment()


def test_no_address_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKPORT_PLE_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="BACKPORT_PLE_ADDRESS: Field required"):
        PleHookSettings.from_environment()
