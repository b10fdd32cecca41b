"""Triton kernels for the DeepSeek-V4 path on sm80/86/89 cards.

Upstream vLLM runs these pieces only on sm90+ (FlashMLA, DeepGEMM, Triton kernels that
use `tl.float8e4nv`). Every kernel here keeps fp8 e4m3 data as raw bytes (uint8) and
converts it with the software codec in `fp8_e4m3`, so it compiles for Ampere.

One kernel per module, each with its launcher and a plain-torch reference:

- `fp8_e4m3`: encode/decode device functions (round to nearest even, saturating).
- `ds_mla_cache`: the DeepSeek-V4 `fp8_ds_mla` paged cache layout and its torch codec.
- `k_cache_insert`: quantize bf16 K rows and insert them into the paged cache.
- `k_cache_gather`: dequantize and gather cache rows back to bf16 (prefill).
- `sparse_mla_decode`: split-K sparse MLA decode over top-k slot lists.
- `sparse_mla_combine`: merge the split-K partial results (attention sink included).
- `indexer_q_quant`: indexer Q rope + per-token fp8 quant + weight folding.
- `inv_rope_fp8_quant`: inverse RoPE + per-group fp8 quant before the output projection.
- `indexer_k_compress`: indexer K compress + RMSNorm + RoPE + fp8 quant into its cache.
- `arch_fidelity`: compile for sm80/86/89 on a newer card; fp8-matmul guard; resource reports.

Importing this package does nothing; import the module you need.
"""
