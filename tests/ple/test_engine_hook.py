"""The vLLM hook: Qwen4Exp's n-gram embedding served by the PLE service gives the same
embeddings as vLLM's stock table, from shared memory and over gRPC.

vLLM's pinned-host class needs CUDA UVA, which this CPU build lacks; the stock reference
here is vLLM's device-resident class, which holds the same table and returns the same rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from services.engine.backport import ple as ple_hook  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.ple.service_process import ServiceProcess  # noqa: E402

PREFIX = "model.layers.0.ple.ple_embedding"
NUM_SHARDS = 4
HIDDEN = 32  # ple_embed_dim: 2 n-gram sizes x 2 heads x 8 values per row


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[object]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig()
    config.engram_config = EngramConfig(cpu_offload=False)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _hf_config(dtype: str) -> object:
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=1000, ngram_size=3, heads_per_ngram=2, ple_embed_dim=HIDDEN,
        ngram_vocab_size_base=5000, make_ngram_vocab_size_divisible_by=64, eos_token_id=2,
        split_ngram_parts=NUM_SHARDS,
        ple_embedding_dtype="float8_e4m3fn" if dtype == "fp8" else None)


def _build(dtype: str) -> object:
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    return Qwen4ExpNGramEmbedding(_hf_config(dtype), HIDDEN, 0, 256, data_parallel_rank=0,
                                  prefix=PREFIX, params_dtype=torch.bfloat16)


def _checkpoint(dtype: str, num_rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """Qwen4Exp-style shards of a random table (names relative to the n-gram embedding)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == "fp8":
        table = torch.randint(0, 256, (num_rows, width), dtype=torch.uint8, generator=generator)
        table = table.view(torch.float8_e4m3fn)
    else:
        table = torch.randn(num_rows, width, generator=generator).to(torch.bfloat16)
    shard_rows = -(-num_rows // NUM_SHARDS)
    weights = {f"ngram_embedding.shard_{i}.weight": table[i * shard_rows:(i + 1) * shard_rows].clone()
               for i in range(NUM_SHARDS)}
    if dtype == "fp8":
        weights["ngram_embedding.weight_scale"] = torch.tensor(0.0625)
    return weights


def _inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 1000, (40,), generator=generator)
    input_ids[17] = 2  # an EOS inside a request resets its n-grams
    query_start_loc = torch.tensor([0, 1, 25, 40])  # a decode step and two prefills
    ngram_context = torch.randint(3, 1000, (3, 2), generator=generator)
    return torch.zeros(40, HIDDEN, dtype=torch.bfloat16), input_ids, query_start_loc, ngram_context


def _raw(embeddings: torch.Tensor) -> np.ndarray:
    return embeddings.contiguous().view(torch.uint8).numpy()


@pytest.fixture(params=["fp8", "bf16"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def reference(vllm_config: object, dtype: str) -> tuple[dict[str, torch.Tensor], object]:
    stock = _build(dtype)
    assert type(stock.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    table = stock.ngram_embedding
    weights = _checkpoint(dtype, table.org_vocab_size, table.embedding_dim, seed=11)
    stock.load_weights(weights.items())
    return weights, stock


@pytest.fixture
def service(reference: tuple[dict[str, torch.Tensor], object], tmp_path: Path) -> Iterator[ServiceProcess]:
    from safetensors.torch import save_file

    weights, _ = reference
    path = tmp_path / "ple.safetensors"
    save_file({f"{PREFIX}.{name}": tensor for name, tensor in weights.items()}, str(path))
    with ServiceProcess(path) as running:
        yield running


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_hook_gives_the_stock_embeddings(reference: tuple[dict[str, torch.Tensor], object],
                                         service: ServiceProcess, shared_memory: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    weights, stock = reference
    monkeypatch.setenv("BACKPORT_PLE_ADDRESS", service.address)
    monkeypatch.setenv("BACKPORT_PLE_SHARED_MEMORY", "1" if shared_memory else "0")
    assert ple_hook.install()
    try:
        served = _build("fp8" if stock.ngram_embedding.weight.dtype == torch.float8_e4m3fn else "bf16")
    finally:
        ple_hook.uninstall()
    table = served.ngram_embedding
    assert type(table).__name__ == "ServicePleEmbedding"
    assert table.table.is_local is shared_memory
    served.load_weights(weights.items())
    # The process holds one row, not the table.
    assert table.weight.untyped_storage().nbytes() == table.embedding_dim * table.weight.element_size()

    inputs = _inputs()
    expected = stock(*inputs)
    got = served(*inputs)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (40, HIDDEN)
    assert np.array_equal(_raw(got), _raw(expected))
    dequantized = table.dequantize(got, torch.bfloat16)
    assert np.array_equal(_raw(dequantized), _raw(stock.ngram_embedding.dequantize(expected, torch.bfloat16)))


def test_checkpoint_that_differs_from_the_served_table_is_refused(
        reference: tuple[dict[str, torch.Tensor], object], service: ServiceProcess, dtype: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    weights, _ = reference
    monkeypatch.setenv("BACKPORT_PLE_ADDRESS", service.address)
    ple_hook.install()
    try:
        served = _build(dtype)
    finally:
        ple_hook.uninstall()
    other = _checkpoint(dtype, served.ngram_embedding.org_vocab_size,
                        served.ngram_embedding.embedding_dim, seed=12)
    with pytest.raises(ValueError, match="rows differ from this checkpoint"):
        served.load_weights(other.items())


def test_install_is_a_no_op_without_a_service(vllm_config: object,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKPORT_PLE_ADDRESS", raising=False)
    assert not ple_hook.install()
    assert type(_build("bf16").ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_a_lookup_without_ids_gives_no_rows_like_the_stock_table(
        reference: tuple[dict[str, torch.Tensor], object], service: ServiceProcess, dtype: str,
        shared_memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with no tokens on this rank (DP): the bf16 layer failed viewing the empty
    gather's bytes ("stride(-1) must be 1 to view Byte as BFloat16")."""
    weights, stock = reference
    monkeypatch.setenv("BACKPORT_PLE_ADDRESS", service.address)
    monkeypatch.setenv("BACKPORT_PLE_SHARED_MEMORY", "1" if shared_memory else "0")
    ple_hook.install()
    try:
        served = _build(dtype)
    finally:
        ple_hook.uninstall()
    served.load_weights(weights.items())
    no_ids = torch.empty((0, 4), dtype=torch.int64)
    expected = stock.ngram_embedding(no_ids)
    got = served.ngram_embedding(no_ids)
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype) == (
        (0, 4, HIDDEN // 4), stock.ngram_embedding.weight.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gathers_begin_once_the_table_comes_back_in_shared_memory(
        reference: tuple[dict[str, torch.Tensor], object], dtype: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first CUDA lookup reached the table over gRPC (its segment not on this machine).
    The layer kept that "no GPU gathers" for the engine's life: after the service restarted
    with its segment here, the client registered the new table with the driver, yet every
    lookup still gathered on the host, synced and copied."""
    from safetensors.torch import save_file

    weights, _ = reference
    path = tmp_path / "ple.safetensors"
    save_file({f"{PREFIX}.{name}": tensor for name, tensor in weights.items()}, str(path))
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    elsewhere = tmp_path / "shm-of-another-machine"
    first = ServiceProcess(path, extra_args=("--shm-dir", str(shm_dir))).start()
    services = [first]
    try:
        shm_dir.rename(elsewhere)  # the engine cannot map the segment: rows come over gRPC
        monkeypatch.setenv("BACKPORT_PLE_ADDRESS", first.address)
        ple_hook.install()
        try:
            served = _build(dtype)
        finally:
            ple_hook.uninstall()
        layer = served.ngram_embedding
        client = layer.table
        try:
            assert not client.is_local
            served.load_weights(weights.items())
            shards = [weights[f"ngram_embedding.shard_{i}.weight"] for i in range(NUM_SHARDS)]
            rows = torch.cat(shards).view(torch.uint8).numpy()
            ids = torch.randint(0, rows.shape[0], (40, 4), generator=torch.Generator().manual_seed(6))
            device = torch.device("cuda", torch.cuda.current_device())
            gpu_ids = ids.to(device)

            def lookup() -> np.ndarray:
                return layer.lookup_rows(gpu_ids).cpu().view(torch.uint8).reshape(40, 4, -1).numpy()

            assert np.array_equal(lookup(), rows[ids.numpy()])
            assert client.cuda_table is None

            elsewhere.rename(shm_dir)
            first.stop()
            services.append(ServiceProcess(path, shm_name=first.shm_name, port=first.port,
                                           extra_args=("--shm-dir", str(shm_dir))).start())
            # This lookup finds the restart; the client reattaches to the shared segment
            # and registers it for the GPU.
            assert np.array_equal(lookup(), rows[ids.numpy()])
            assert client.is_local and client.cuda_table is not None
            # The GPU gathers from the registered table now: no host gather, so no sync.
            torch.cuda.set_sync_debug_mode("error")
            try:
                gathered = layer.lookup_rows(gpu_ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert gathered.device == device
            assert np.array_equal(gathered.cpu().view(torch.uint8).reshape(40, 4, -1).numpy(),
                                  rows[ids.numpy()])
        finally:
            client.close()
    finally:
        for service in services:
            service.stop()
