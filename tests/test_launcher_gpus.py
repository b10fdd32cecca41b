"""How `backport up` shares a machine's GPUs out among its engines. The placement itself runs on
real processes in `test_launcher_killed.py`; this machine has no GPU, so the GPUs here are
named through `CUDA_VISIBLE_DEVICES`, as an operator or a container runtime names them."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gpu_placement import split_gpus, visible_gpus
from services.launcher import Mesh, UpSettings
from services.mesh.errors import ServiceStartError
from tests.conftest import free_port


def test_the_launcher_s_own_visible_devices_are_the_gpus_it_shares_out() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " 2, 3,GPU-9f1c,"}) == ["2", "3", "GPU-9f1c"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_no_driver_means_no_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi to ask
    assert visible_gpus({}) == []


def test_engines_get_disjoint_slices_of_tensor_parallel_size() -> None:
    assert split_gpus(["0", "1", "2", "3", "4"], 2, 2) == [["0", "1"], ["2", "3"]]
    assert split_gpus(["6"], 1, 1) == [["6"]]
    assert split_gpus([], 3, 2) is None


def test_more_engines_than_gpus_are_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two engines on one GPU load twice into its memory: the second fails only after minutes of
    loading, where the count can be refused at once."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    mesh = Mesh(UpSettings(model=str(tmp_path), engines=2, tensor_parallel_size=2,
                           port=free_port(), engine_port=free_port(2), tokenizer_port=free_port()))
    try:
        with pytest.raises(ServiceStartError, match=r"--engines 2 with --tensor-parallel-size 2 "
                                                    r"needs 4 GPUs; this machine shows 3: 0,1,2"):
            mesh.start()
        assert mesh.services == []
    finally:
        mesh.stop()


def test_engines_are_given_their_tensor_parallel_size(tmp_path: Path) -> None:
    mesh = Mesh(UpSettings(model=str(tmp_path), tensor_parallel_size=4))
    try:
        args = mesh._engine_args(0)
        assert args[args.index("--tensor-parallel-size") + 1] == "4"
    finally:
        mesh.stop()
