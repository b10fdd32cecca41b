"""llvmlite's C library wrapper, readied for vLLM's kernel scan in a forked engine core.

A forked engine core inherits every module its service imported. With a KV connector that
includes llvmlite: building vLLM's config imports LMCache's connector, whose kernels import
numba. As the CPU worker starts, vLLM rebinds its Triton kernels by reading
`vars(value).get("kernel")` for every module attribute that has a `__dict__`. llvmlite's
`ffi.lib` answers any attribute it lacks with a wrapped C function, `__dict__` included, and
the scan failed: `'_lib_fn_wrapper' object has no attribute 'get'`.
"""

from __future__ import annotations

import sys


def give_llvmlites_library_an_empty_namespace() -> None:
    """Puts an empty namespace under `__dict__` in `ffi.lib`'s table of wrapped functions, where
    its attribute lookup answers first. No C function has that name."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab.setdefault("__dict__", {})
