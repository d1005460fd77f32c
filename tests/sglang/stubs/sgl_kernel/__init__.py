"""Stand-in for ``sgl_kernel`` in the CPU test environment only.

This is NOT part of the ``weight_sync`` library and must never be installed
outside ``tests/sglang/install.sh``'s test venv.

SGLang's real ``sgl_kernel`` (``sglang-kernel`` on PyPI) ships CUDA builds
only.  On CPU, SGLang 0.5.23 imports the names below from it at module import
time (``from sgl_kernel import ...`` under ``if _is_cpu:``), but none of them
is called on the plain (non-speculative, no hierarchical cache) text
generation path: they serve speculative decoding and KV-cache moves.
Attention runs on the ``torch_native`` backend (SGLang's CPU default without
Intel AMX), and ``_is_intel_amx_backend_available()`` is False because this
module registers no ``torch.ops.sgl_kernel`` ops.  Model modules that touch
``torch.ops.sgl_kernel.*`` at import (minicpm, qwen3_5, grok, ...) are skipped
by SGLang's model registry with an "Ignore import error" log line; Qwen2 and
Llama are unaffected.

Each name below raises ``NotImplementedError`` if it is ever called, so a
code path that really needs a kernel fails loudly instead of silently.
"""

__version__ = "0.0.0+stand-in"

_MSG = (
    "sgl_kernel.{name} is a stand-in from tests/sglang/stubs (CPU test "
    "environment); the real SGLang CPU kernel is not available here."
)


def _missing(name):
    def _raise(*args, **kwargs):
        raise NotImplementedError(_MSG.format(name=name))

    _raise.__name__ = name
    _raise.__qualname__ = name
    _raise.__doc__ = f"Stand-in for sgl_kernel.{name}; always raises NotImplementedError."
    return _raise


# Names SGLang 0.5.23 imports at start on CPU (file:line of the import).
# sglang/kernels/ops/kvcache/cache_move.py (if _is_cpu) -- used only when
# copying KV cache between slots (hierarchical/spec paths).
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
# sglang/srt/mem_cache/allocation.py (if _is_cpu) -- used only by
# alloc_for_spec_decode (speculative decoding).
assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")
# sglang/kernels/ops/speculative/spec_tree.py:40
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
# sglang/kernels/ops/speculative/spec_tree.py:43
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
# sglang/kernels/ops/speculative/cache_locs.py:28
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
# sglang/kernels/ops/speculative/cache_locs.py:28
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
# sglang/kernels/ops/speculative/eagle.py:10
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
# sglang/kernels/ops/speculative/eagle.py:10
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
