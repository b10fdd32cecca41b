"""Torch versions of the Triton metadata kernels DeepSeek-V4 attention launches.

vLLM builds sparse-attention metadata with Triton kernels every step; the PyPI
Triton has no CPU backend, so vLLM disables Triton and each launch fails
(`'function' object is not subscriptable`, or `Cannot inspect kernel
parameters`). These vectorised versions keep each launcher's call signature and
contract and replace the module-level launcher objects.
"""

from __future__ import annotations

import importlib
import sys

import torch


class _NoWarmup:
    def register_warmup(self, *args: object, **kwargs: object) -> None:
        """Nothing to compile."""


def compute_token_to_req_indices(
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    num_mapped_tokens: int,
    num_tokens: int,
) -> torch.Tensor:
    """Map each of the first `num_tokens` tokens to its request; tokens at or past
    `num_mapped_tokens` map to 0 (the contract of vLLM's kernel)."""
    num_reqs = query_start_loc.shape[0] - 1
    token = torch.arange(num_tokens, device=query_start_loc.device)
    ends = query_start_loc[1:].to(torch.int64)
    request = torch.searchsorted(ends, token, right=True).clamp(max=max(num_reqs - 1, 0))
    out[:num_tokens] = torch.where(token < num_mapped_tokens, request, 0).to(out.dtype)
    return out[:num_tokens]


class SlidingWindowIndices(_NoWarmup):
    """Per token: the paged slot ids of its causal window (-1 past its length)."""

    def __call__(
        self,
        swa_indices: torch.Tensor,
        swa_lens: torch.Tensor,
        window_size: int,
        index_width: int,
        left_visible: torch.Tensor,
        right_visible: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        replay_start: torch.Tensor,
        *,
        num_tokens: int,
        token_offset: int,
        has_image: bool = False,
    ) -> None:
        if num_tokens == 0:
            return
        token = torch.arange(num_tokens) + token_offset
        is_valid = is_valid_token[token].to(torch.bool)
        request = token_to_req_indices[token].to(torch.int64)
        query_start = query_start_loc[request].to(torch.int64)
        query_len = query_start_loc[request + 1].to(torch.int64) - query_start
        position = seq_lens[request].to(torch.int64) - query_len + token - query_start
        if has_image:
            left = left_visible[token].to(torch.int64)
            right = right_visible[token].to(torch.int64)
        else:
            left = right = torch.zeros_like(position)
        widened = torch.clamp(left - (window_size - 1), min=0)
        start = torch.clamp(position - (window_size - 1) - widened, min=0)
        start = torch.maximum(start, replay_start[request].to(torch.int64))
        length = torch.where(is_valid, position + right + 1 - start, 0)
        swa_lens[:num_tokens] = length.to(swa_lens.dtype)

        offset = torch.arange(index_width)
        window_pos = start.unsqueeze(-1) + offset
        logical_block = torch.clamp(
            torch.div(window_pos, block_size, rounding_mode="floor"), max=block_table.shape[1] - 1
        )
        blocks = block_table[request.unsqueeze(-1), logical_block].to(torch.int64)
        slots = blocks * block_size + window_pos % block_size
        inside = offset < length.unsqueeze(-1)
        # Rows may carry a unit head axis ([tokens, 1, width]); the kernel sees flat rows.
        rows = swa_indices[:num_tokens].flatten(1)
        rows[:, :index_width] = torch.where(inside, slots, -1).to(swa_indices.dtype)


class PrefillGatherLengths(_NoWarmup):
    """Per prefill request: its query length plus the visible window before it."""

    def __call__(
        self,
        prefill_gather_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        replay_start: torch.Tensor,
        num_prefills: int,
        num_decodes: int,
        window_size: int,
    ) -> None:
        first, last = num_decodes, num_decodes + num_prefills
        query_len = (query_start_loc[first + 1 : last + 1] - query_start_loc[first:last]).to(
            torch.int64
        )
        prefix_len = seq_lens[first:last].to(torch.int64) - query_len
        visible = torch.clamp(prefix_len - replay_start[first:last].to(torch.int64), min=0)
        gather = query_len + torch.clamp(visible, max=window_size - 1)
        prefill_gather_lens[:num_prefills] = gather.to(prefill_gather_lens.dtype)


class CompressedSlotMapping(_NoWarmup):
    """Per token: the compressed-cache slot its window writes, if it closes one (else -1)."""

    def __call__(
        self,
        compressed_slot_mapping: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        compress_ratio: int,
        dcp_world_size: int,
        cp_interleave: int,
    ) -> None:
        starts = query_start_loc.tolist()
        lengths = seq_lens.tolist()
        for request in range(block_table.shape[0]):
            query_start, query_end = starts[request], starts[request + 1]
            if query_end <= query_start:
                continue
            position = lengths[request] - (query_end - query_start) + torch.arange(
                query_end - query_start
            )
            own_slot = slot_mapping[query_start:query_end]
            closes = ((position + 1) % compress_ratio == 0) & (own_slot != -1)
            local = (
                torch.div(position, cp_interleave * dcp_world_size, rounding_mode="floor")
                * cp_interleave
                + position % cp_interleave
            )
            compressed = torch.div(local, compress_ratio, rounding_mode="floor")
            logical_block = torch.clamp(
                torch.div(compressed, block_size, rounding_mode="floor"),
                max=block_table.shape[1] - 1,
            )
            blocks = block_table[request, logical_block].to(torch.int64)
            compressed_slot_mapping[query_start:query_end] = torch.where(
                closes, blocks * block_size + compressed % block_size, -1
            ).to(compressed_slot_mapping.dtype)


class PrefillChunkMetadata(_NoWarmup):
    """Per prefill token: its row bounds in the compressed K layout; per K row: its request."""

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        uncompressed_seq_lens: torch.Tensor,
        cu_compressed_seq_lens: torch.Tensor,
        row_start_cu_compressed_seq_lens: torch.Tensor,
        token_to_seq: torch.Tensor,
        cu_compressed_seq_len_ks: torch.Tensor,
        cu_compressed_seq_len_ke: torch.Tensor,
        query_slice_start: int,
        query_slice_stop: int,
        DCP_RANK: int,
        DCP_WORLD: int,
        DCP_INTERLEAVE: int,
        *,
        num_reqs: int,
        COMPRESS_RATIO: int,
    ) -> None:
        starts = query_start_loc.tolist()
        seq_bounds = cu_compressed_seq_lens.tolist()
        row_starts = row_start_cu_compressed_seq_lens.tolist()
        lengths = uncompressed_seq_lens.tolist()
        for request in range(num_reqs):
            query_start, query_end = starts[request], starts[request + 1]
            offset = torch.arange(query_end - query_start)
            absolute = query_start + offset
            kept = (absolute >= query_slice_start) & (absolute < query_slice_stop)
            out_pos = absolute[kept] - query_slice_start
            context = lengths[request] - (query_end - query_start) + 1 + offset[kept]
            per_token = torch.div(context, COMPRESS_RATIO, rounding_mode="floor")
            if DCP_WORLD > 1:
                base = (
                    torch.div(per_token, DCP_INTERLEAVE * DCP_WORLD, rounding_mode="floor")
                    * DCP_INTERLEAVE
                )
                rest = torch.clamp(
                    per_token - base * DCP_WORLD - DCP_RANK * DCP_INTERLEAVE, 0, DCP_INTERLEAVE
                )
                per_token = base + rest
            row_start = row_starts[request]
            cu_compressed_seq_len_ks[out_pos] = row_start
            cu_compressed_seq_len_ke[out_pos] = (row_start + per_token).to(
                cu_compressed_seq_len_ke.dtype
            )
            token_to_seq[seq_bounds[request] : seq_bounds[request + 1]] = request


class UniformDecodePreparation(_NoWarmup):
    """Expand uniform-length decode requests to one row per token."""

    def __call__(
        self,
        seq_lens: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        expanded_block_table: torch.Tensor,
        decode_lens: torch.Tensor,
        num_decode_tokens: int,
        max_decode_len: int,
    ) -> None:
        token = torch.arange(num_decode_tokens)
        request = torch.div(token, max_decode_len, rounding_mode="floor")
        per_token = seq_lens[request].to(torch.int64) - max_decode_len + token % max_decode_len + 1
        decode_seq_lens[:num_decode_tokens] = torch.clamp(per_token, min=0).to(decode_seq_lens.dtype)
        width = min(block_table.shape[1], expanded_block_table.shape[1])
        expanded_block_table[:num_decode_tokens, :width] = block_table[request, :width]
        decode_lens[:num_decode_tokens] = 1


# module -> {attribute: replacement}
_REPLACEMENTS: dict[str, dict[str, object]] = {
    "vllm.v1.attention.ops.metadata": {
        "compute_token_to_req_indices": compute_token_to_req_indices,
    },
    "vllm.v1.attention.backends.mla.sparse_swa": {
        "compute_token_to_req_indices": compute_token_to_req_indices,
        "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL": SlidingWindowIndices(),
        "_COMPUTE_PREFILL_METADATA_KERNEL": PrefillGatherLengths(),
    },
    "vllm.v1.attention.backends.mla.compressor_utils": {
        "_COMPRESSED_SLOT_MAPPING_KERNEL": CompressedSlotMapping(),
    },
    "vllm.v1.attention.backends.mla.indexer": {
        "_BUILD_PREFILL_CHUNK_METADATA_KERNEL": PrefillChunkMetadata(),
        "_PREPARE_UNIFORM_DECODE_KERNEL": UniformDecodePreparation(),
    },
}


def use_torch_metadata_kernels() -> None:
    """Swap each launcher in the modules that hold it (imported here if not yet)."""
    for module_name, replacements in _REPLACEMENTS.items():
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        for attribute, replacement in replacements.items():
            if hasattr(module, attribute):
                setattr(module, attribute, replacement)
