"""A Qwen4Exp PLE embedding whose rows live in the PLE offload service.

Stands in for vLLM's `Qwen4ExpPLEPinnedHostEmbedding`/`Qwen4ExpPLEDeviceEmbedding`: same
constructor, same ETP/DP ownership rules and the same storage-dtype output, so the stock
`dequantize` and projection follow unchanged. Rows come from this machine's shared-memory
copy when the service runs here, over gRPC otherwise; the process holds no table. On a
CUDA engine with the table here, the GPU gathers the rows itself from the shared copy
(registered with the driver, read over PCIe); otherwise the host gathers and copies.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import torch

from services.engine.backport.ple.hook_settings import PleHookSettings
from services.ple_offload.client import PleTableClient
from services.ple_offload.table_format import RowDtype
from vllm.logger import init_logger
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
)
from vllm.utils.torch_utils import direct_register_custom_op

logger = init_logger(__name__)

_TORCH_DTYPES = {RowDtype.FLOAT8_E4M3FN: torch.float8_e4m3fn, RowDtype.BFLOAT16: torch.bfloat16}

_layers: dict[str, ServicePleEmbedding] = {}
_clients: dict[tuple[str, bool], PleTableClient] = {}
_clients_lock = threading.Lock()
_op_registered = False


class ServicePleEmbedding(Qwen4ExpPLEEmbedding):
    """PLE table served by the PLE offload service (`BACKPORT_PLE_ADDRESS`)."""

    supports_prefetch: ClassVar[bool] = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype,
        padding_size: int,
        prefix: str,
        embedding_method: Qwen4ExpPLEEmbeddingMethod,
        num_ngram_heads: int = 1,
        max_total_tokens: int = 0,
        data_parallel_rank: int = 0,
        reduce_results: bool = True,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype=params_dtype,
            padding_size=padding_size,
            prefix=prefix,
            embedding_method=embedding_method,
            num_ngram_heads=num_ngram_heads,
            max_total_tokens=max_total_tokens,
            data_parallel_rank=data_parallel_rank,
            reduce_results=reduce_results,
        )
        self.layer_name = prefix
        settings = PleHookSettings.from_environment()
        self.table = _shared_client(settings)
        # Decided at the first CUDA lookup, on the device the ids live on (registering
        # a 50 GB table takes seconds and needs the engine's device), and again for each
        # table generation the client attaches to: one first reached over gRPC may come
        # back in this machine's shared memory, which the client then registers.
        self._is_gpu_gather_allowed = settings.gpu_gather
        self._gpu_gather = False
        self._gpu_gather_generation: int | None = None
        self._check_table_fits()
        _register_lookup_op()
        _layers[prefix] = self
        logger.info("PLE %s served by %s (%s)", prefix, self.table.address,
                    "shared memory" if self.table.is_local else "gRPC")

    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int,
                                  dtype: torch.dtype) -> torch.Tensor:
        """One zero row stretched to the table's shape: vLLM's loader and logs see the
        parameter they expect, and the process spends one row of memory on it."""
        return torch.zeros(embedding_dim, dtype=dtype, device="cpu").expand(num_embeddings,
                                                                           embedding_dim)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      checkpoint_start: int | None = None) -> None:
        """Checks a checkpoint shard against the service's rows instead of copying it."""
        if param is not self.weight:
            super().weight_loader(param, loaded_weight, checkpoint_start)
            self._check_scale(param)
            return
        start = checkpoint_start or 0
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != self.embedding_dim:
            raise ValueError(f"{self.layer_name}: checkpoint rows {tuple(loaded_weight.shape)} "
                             f"do not have width {self.embedding_dim}")
        if loaded_weight.dtype != self.weight.dtype:
            raise ValueError(f"{self.layer_name}: checkpoint stores {loaded_weight.dtype}, the "
                             f"PLE service {self.weight.dtype}")
        num_rows = loaded_weight.shape[0]
        if num_rows == 0:
            return
        probe = np.array([start, start + num_rows - 1], dtype=np.int64)
        expected = loaded_weight[[0, num_rows - 1]].contiguous().view(torch.uint8).numpy()
        if not np.array_equal(self.table.gather(probe), expected):
            raise ValueError(
                f"{self.layer_name}: the PLE service at {self.table.address} serves "
                f"{self.table.info.tensor_name} (sha256 {self.table.info.header_sha256.hex()[:16]}), "
                f"whose rows differ from this checkpoint at rows {probe.tolist()}")

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Rows for [tokens, heads] ids in the storage dtype, like the stock classes."""
        slot_size, slot_offset = self._get_dp_gather_slot(ngram_ids.shape[0])
        gathered_ids = self._gather_dp_ids(ngram_ids, slot_size)
        embeddings = torch.ops.vllm.backport_ple_lookup(gathered_ids, self.layer_name)
        if self.reduce_results and self.tp_size > 1:
            embeddings = self._reduce_owned_rows(embeddings)
        return self._select_embeddings(embeddings, ngram_ids.shape[0], slot_offset)

    sync_lookup = forward

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        return None

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        raise RuntimeError("the PLE service embedding looks rows up in forward()")

    def lookup_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the ids this ETP rank owns; zeros for the rest (another rank adds them)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Even the GPU gather needs the host: it checks the table is still served
            # before each launch, and a reattach moves the table to a new address that a
            # replayed graph would not know.
            raise RuntimeError("PLE service lookups check the served table on the host and "
                               "cannot be captured in a CUDA graph; exclude the PLE layer from "
                               "capture or use enforce_eager")
        if ids.numel() == 0:
            # numpy gives an empty gather zero strides, which a bf16 view of its bytes refuses.
            return ids.new_empty((*ids.shape, self.embedding_dim), dtype=self.weight.dtype)
        start = self.shard_indices.org_vocab_start_index
        end = self.shard_indices.org_vocab_end_index
        if ids.is_cuda and self._gathers_on_gpu(ids.device):
            rows = self.table.gather_cuda(ids, start, end)
        else:
            flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
            rows = torch.from_numpy(self.table.gather_owned(flat, start, end))
        out = rows.view(self.weight.dtype)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _gathers_on_gpu(self, device: torch.device) -> bool:
        """Whether lookups on `device` gather on the GPU: asked of the client once per
        table generation, not at every lookup."""
        if not self._is_gpu_gather_allowed:
            return False
        generation = self.table.info.generation
        if generation != self._gpu_gather_generation:
            self._gpu_gather = self.table.enable_cuda(device)
            self._gpu_gather_generation = generation
            logger.info("PLE %s: rows gathered %s", self.layer_name,
                        f"by {device} from the shared table" if self._gpu_gather else
                        f"on the host and copied ({self.table.cuda_unavailable_reason})")
        return self._gpu_gather

    def _reduce_owned_rows(self, embeddings: torch.Tensor) -> torch.Tensor:
        # Each row has exactly one owning rank, so summing raw fp8 bytes is exact.
        assert self.parallel_group is not None
        if embeddings.dtype == torch.float8_e4m3fn:
            return self.parallel_group.all_reduce(embeddings.view(torch.int8)).view(embeddings.dtype)
        return self.parallel_group.all_reduce(embeddings)

    def _check_scale(self, param: torch.Tensor) -> None:
        served_scale = self.table.info.scale if self.table.info.HasField("scale") else None
        if param is getattr(self, "weight_scale", None) and served_scale is not None:
            if not torch.allclose(param.float().cpu(), torch.tensor(served_scale), rtol=0, atol=0):
                raise ValueError(f"{self.layer_name}: checkpoint scale {param.flatten().tolist()} "
                                 f"differs from the PLE service's {served_scale}")

    def _check_table_fits(self) -> None:
        info = self.table.info
        want_dtype = self.weight.dtype
        problems = []
        if info.num_rows != self.org_vocab_size:
            problems.append(f"{info.num_rows} rows, the layer needs {self.org_vocab_size}")
        if info.row_width != self.embedding_dim:
            problems.append(f"row width {info.row_width}, the layer needs {self.embedding_dim}")
        if _TORCH_DTYPES.get(self.table.dtype) != want_dtype:
            problems.append(f"dtype {self.table.dtype.name}, the layer stores {want_dtype}")
        if problems:
            raise ValueError(f"PLE service at {self.table.address} serves {info.tensor_name}, "
                             f"which does not fit {self.layer_name}: " + "; ".join(problems))


def _shared_client(settings: PleHookSettings) -> PleTableClient:
    """One client per process and address, shared by every PLE layer."""
    key = (settings.address, settings.shared_memory)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = PleTableClient(
                settings.address,
                allow_shared_memory=settings.shared_memory,
                reattach_timeout_s=settings.reattach_timeout_s,
                connect_timeout_s=settings.connect_timeout_s,
                gather_threads=settings.gather_threads,
            )
        return _clients[key]


def _lookup_op(ngram_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    return _layers[layer_name].lookup_rows(ngram_ids)


def _lookup_op_fake(ngram_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer = _layers[layer_name]
    return ngram_ids.new_empty((*ngram_ids.shape, layer.embedding_dim), dtype=layer.weight.dtype)


def _register_lookup_op() -> None:
    """An opaque op, so torch.compile traces around the host-side lookup."""
    global _op_registered
    if not _op_registered:
        direct_register_custom_op("backport_ple_lookup", _lookup_op, fake_impl=_lookup_op_fake)
        _op_registered = True
