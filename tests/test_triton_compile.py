"""Every Triton kernel compiles for an H100/H200 (sm_90) without a GPU present.

The interpreter (TRITON_INTERPRET=1) runs kernels on CPU but accepts code the compiler rejects
(globals that are not constexpr, unsupported casts), so the GPU machine used to be the first
to find such errors. Compiling to a cubin here catches them on any machine with Triton.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ftkit.kernels.triton import experts, norm, plan, zero_copy  # noqa: E402

PLAN_SIG = {
    "ids_ptr": "*i64", "w_ptr": "*bf16", "x_ptr": "*bf16", "base": "i32", "table_ptr": "*i32",
    "owner_ptr": "*i32", "stamp_ptr": "*i64", "clock_ptr": "*i64", "ratio_ptr": "*fp32", "counts_ptr": "*i64",
    "rows_ptr": "*i64", "slot_ptr": "*i32", "fill_ptr": "*i32", "gslot_ptr": "*i32", "gw_ptr": "*bf16",
    "gpos_ptr": "*i32", "gcount_ptr": "*i32", "payload_ptr": "*fp32", "cap": "i32", "H": "i32",
}

KERNELS = [
    (plan._plan, PLAN_SIG, dict(K=8, KP=8, CAP=1024, MODE=plan.HYBRID_MODE, HAS_CPU=True, BLOCK_H=1024)),
    (plan._plan, PLAN_SIG, dict(K=6, KP=8, CAP=0, MODE=plan.CPU_MODE, HAS_CPU=True, BLOCK_H=1024)),
    (plan._merge, {"out_ptr": "*bf16", "dev_ptr": "*bf16", "host_ptr": "*fp32", "gpos_ptr": "*i32", "H": "i32"},
     dict(K=8, HAS_DEV=True, HAS_CPU=True, BLOCK=256)),
    (norm._rms_norm, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "eps": "fp32"},
     dict(BLOCK=2048)),
    (zero_copy._fill, {"addr_ptr": "*i64", "row_ptr": "*i64", "flag_ptr": "*i32", "slot_ptr": "*i32",
                       "dst_ptr": "*i64", "words": "i32"}, dict(CHUNK=zero_copy.FILL_CHUNK, BLOCK=zero_copy.FILL_BLOCK)),
    (zero_copy._copy, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32"}, dict(BLOCK=1024)),
    (zero_copy._ring, {"ctrl_ptr": "*i32", "value": "i32"}, {}),
    (zero_copy._wait, {"ctrl_ptr": "*i32", "value": "i32", "spins_ptr": "*i32"}, {}),
    (experts._gate_up, {"x_ptr": "*bf16", "w_ptr": "*bf16", "slot_ptr": "*i32", "tok_ptr": "*i32",
                        "count_ptr": "*i32", "h_ptr": "*fp32", "H": "i32", "I": "i32", "slot_elems": "i32",
                        "up_off": "i32"}, dict(BLOCK_N=32, BLOCK_K=128)),
]


def _compile(fn, signature: dict, consts: dict):
    # Under TRITON_INTERPRET=1 (CPU test runs) @triton.jit gives interpreted functions: compile
    # the Python function underneath instead.
    jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)
    return triton.compile(ASTSource(fn=jit, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("fn, sig, consts", KERNELS, ids=lambda v: getattr(v, "__name__", None))
def test_kernel_compiles_for_sm90(fn, sig, consts):
    signature = {**sig, **{name: "constexpr" for name in consts}}
    try:
        compiled = _compile(fn, signature, consts)
    except RuntimeError as e:  # no CUDA toolchain in this Triton build (ptxas missing)
        if "ptxas" in str(e):
            pytest.skip(str(e))
        raise
    assert compiled.asm["cubin"]


def test_wait_spins_on_a_volatile_load():
    """The doorbell wait must re-read memory the CPU writes, never a cached value."""
    ptx = _compile(zero_copy._wait, {"ctrl_ptr": "*i32", "value": "i32", "spins_ptr": "*i32"}, {}).asm["ptx"]
    assert "ld.volatile" in ptx
