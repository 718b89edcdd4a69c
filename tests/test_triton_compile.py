"""Every Triton kernel compiles for an H100/H200 (sm_90) without a GPU present.

The interpreter (TRITON_INTERPRET=1) runs kernels on CPU but accepts code the compiler rejects
(globals that are not constexpr, unsupported casts), so the GPU machine used to be the first
to find such errors. Compiling to a cubin here catches them on any machine with Triton.

The compiler cannot run in a process where TRITON_INTERPRET=1 (conftest sets it without CUDA:
triton's own library functions are then interpreted), so this file compiles in a child process
without it and with an empty kernel cache, and the tests read its answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ftkit.kernels.triton import (  # noqa: E402
    attention,
    blocks,
    decode,
    delta_rule,
    experts,
    gemv,
    norm,
    plan,
    router,
    zero_copy,
)

PLAN_SIG = {
    "ids_ptr": "*i64", "w_ptr": "*bf16", "x_ptr": "*bf16", "base": "i32", "table_ptr": "*i32",
    "owner_ptr": "*i32", "stamp_ptr": "*i64", "clock_ptr": "*i64", "ratio_ptr": "*fp32", "counts_ptr": "*i64",
    "gslot_ptr": "*i32", "gw_ptr": "*bf16", "grow_ptr": "*i64", "gfill_ptr": "*i32", "gpos_ptr": "*i32",
    "gcount_ptr": "*i32", "payload_ptr": "*fp32", "cap": "i32", "H": "i32", "XN": "i32", "NMAX": "i32",
}
PLAN_TOKENS_SIG = {
    "ids_ptr": "*i64", "w_ptr": "*bf16", "x_ptr": "*bf16", "n_items": "i32", "base": "i32", "table_ptr": "*i32",
    "owner_ptr": "*i32", "stamp_ptr": "*i64", "clock_ptr": "*i64", "ratio_ptr": "*fp32", "counts_ptr": "*i64",
    "fill_all_above": "i32", "e_tile_ptr": "*i32", "tiles_ptr": "*i32", "tfill_ptr": "*i32",
    "trow_ptr": "*i64", "tok_ptr": "*i32", "sw_ptr": "*fp32", "dst_ptr": "*i32", "gpos_ptr": "*i32",
    "gcount_ptr": "*i32", "payload_ptr": "*fp32", "cap": "i32", "H": "i32", "XN": "i32", "NMAX": "i32",
}
WAIT_SIG = {"ctrl_ptr": "*i32", "value": "i32", "stamp_ptr": "*i64", "count_ptr": "*i32", "total_ptr": "*i64",
            "gpu_ns_ptr": "*i64"}
GEMV = {"w_ptr": "*bf16", "slot_ptr": "*i32", "count_ptr": "*i32", "fill_ptr": "*i32", "row_ptr": "*i64",
        "addr_ptr": "*i64", "H": "i32", "I": "i32", "slot_elems": "i32"}
GEMM = {"w_ptr": "*bf16", "tile_ptr": "*i32", "count_ptr": "*i32", "H": "i32", "I": "i32", "slot_elems": "i32"}
# the gate/up kernels' slot offsets and gpt-oss's bias offsets and clamped SwiGLU constants
GATE_UP_EXTRA = {"up_off": "i32", "down_off": "i32", "tail": "i32", "gb_off": "i32", "ub_off": "i32",
                 "alpha": "fp32", "limit": "fp32", "g_row": "i32", "u_row": "i32"}
# the part formats: TYPED (float slots through their own pointer) or GGUF blocks through bytes
# (Q4_K_M's q4_k gate/up and q6_k down, mxfp4, iq4_xs: the non-linear levels)
TYPED = dict(FMT_G=blocks.TYPED, FMT_U=blocks.TYPED)
Q4_K = dict(FMT_G=blocks.CODES["q4_k"], FMT_U=blocks.CODES["q4_k"])
BYTES = {"w_ptr": "*u8"}
GEMM_CONSTS = dict(PREC="tf32", UPCAST=False)


def gemm_tile(fmt: dict | int, columns: int | None = None) -> dict:
    """A GEMM launch's tile constants for format `fmt` (gate/up's codes, or down's), as
    grouped_expert_gemm picks them (the warps are the compile's default)."""
    code = fmt["FMT_G"] if isinstance(fmt, dict) else fmt
    return {k: v for k, v in experts.gemm_tile(code, columns).items() if k.startswith("BLOCK")}

KERNELS = [
    (plan._plan, PLAN_SIG, dict(K=8, KP=8, CAP=1024, SB=32, MODE=plan.HYBRID_MODE, HAS_CPU=True, BLOCK_H=1024)),
    (plan._plan, PLAN_SIG, dict(K=6, KP=8, CAP=0, SB=1, MODE=plan.CPU_MODE, HAS_CPU=True, BLOCK_H=1024)),
    *((plan._plan_tokens, PLAN_TOKENS_SIG, dict(E=e, EP=e, K=k, NP=np_, CAP=16384, SB=128, MODE=plan.HYBRID_MODE,
                                                HAS_CPU=True, BLOCK_H=1024)) for e, k, np_ in ((128, 8, 512), (512, 10, 1024))),
    (plan._merge, {"out_ptr": "*bf16", "dev_ptr": "*bf16", "host_ptr": "*fp32", "gpos_ptr": "*i32", "H": "i32"},
     dict(K=8, HAS_DEV=True, HAS_CPU=True, BLOCK=256)),
    (norm._rms_norm, {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*fp32", "sum_ptr": "*bf16", "out_ptr": "*fp32",
                      "n": "i32", "eps": "fp32"}, dict(BLOCK=2048, ADD=False, OFFSET=False, FLOAT32=False)),
    *((norm._rms_norm, {**{n: "*bf16" for n in ("x_ptr", "d_ptr", "w_ptr", "sum_ptr", "out_ptr")}, "n": "i32",
                        "eps": "fp32"}, dict(BLOCK=2048, ADD=True, OFFSET=offset, FLOAT32=False)) for offset in (False, True)),
    (norm._rms_norm, {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*fp32", "sum_ptr": "*bf16", "out_ptr": "*bf16",
                      "n": "i32", "eps": "fp32"}, dict(BLOCK=4096, ADD=True, OFFSET=False, FLOAT32=True)),  # gpt-oss
    (delta_rule._conv_step, {**{n: "*bf16" for n in ("x_ptr", "s_ptr", "w_ptr", "out_ptr")}, "C": "i32"},
     dict(KS=4, BC=256)),
    (delta_rule._delta_step, {**{n: "*bf16" for n in ("qkv_ptr", "z_ptr", "b_ptr", "a_ptr", "dt_ptr", "nw_ptr", "out_ptr")},
                              "alog_ptr": "*fp32", "s_ptr": "*fp32", "R": "i32", "eps": "fp32"},
     dict(HK=16, DK=128, DV=128, BK=128, BV=128)),
    (zero_copy._ring, {"ctrl_ptr": "*i32", "value": "i32", "stamp_ptr": "*i64", "count_ptr": "*i32"}, dict(TIMER=True)),
    (zero_copy._wait, WAIT_SIG, dict(TIMER=True)),
    (zero_copy._wait_word, {"ctrl_ptr": "*i32", "value": "i32"}, {}),
    *((experts._gate_up, {**GEMV, **GATE_UP_EXTRA, "x_ptr": "*bf16", "tok_ptr": "*i32", "h_ptr": "*fp32",
                          "n_gu": "i32", "lut_ptr": "*fp32", **(BYTES if fmt is Q4_K else {})},
       dict(FILL=fill, BIAS=gpt_oss, CLAMP=gpt_oss, BLOCK_N=32, BLOCK_K=128, COPY_PROGS=24, COPY_BLOCK=2048, **fmt))
      for fill, gpt_oss, fmt in ((True, False, TYPED), (False, False, TYPED), (True, True, TYPED),
                                 (True, False, Q4_K), (False, True, Q4_K))),
    *((experts._down, {"h_ptr": "*fp32", "w_ptr": "*bf16", "slot_ptr": "*i32", "wt_ptr": "*bf16", "count_ptr": "*i32",
                       "y_ptr": "*bf16", "H": "i32", "I": "i32", "slot_elems": "i32", "down_off": "i32", "db_off": "i32",
                       "lut_ptr": "*fp32", **(BYTES if fmt else {})},
       dict(BIAS=bias, BLOCK_M=32, BLOCK_K=128, FMT_D=fmt))
      for bias, fmt in ((False, blocks.TYPED), (True, blocks.TYPED), (False, blocks.CODES["q6_k"]),
                        (True, blocks.CODES["mxfp4"]), (False, blocks.CODES["iq4_xs"]))),
    *((experts._gemm_gate_up, {**GEMM, **GATE_UP_EXTRA, "x_ptr": "*bf16", "tok_ptr": "*i32", "fill_ptr": "*i32",
                               "row_ptr": "*i64", "addr_ptr": "*i64", "h_ptr": "*bf16", **(BYTES if fmt is Q4_K else {})},
       dict(GEMM_CONSTS, COUNT=count, FILL=fill, BIAS=gpt_oss, CLAMP=gpt_oss, COPY_PROGS=copy, COPY_BLOCK=2048,
            **gemm_tile(fmt, experts.FILL_N if fill else None), **fmt))
      for count, fill, gpt_oss, copy, fmt in ((False, False, False, 1, TYPED), (True, True, False, 24, TYPED),
                                              (True, True, True, 24, TYPED), (False, False, False, 1, Q4_K),
                                              (True, True, False, 24, Q4_K))),
    *((experts._gemm_down, {**GEMM, "h_ptr": "*bf16", "dst_ptr": "*i32", "wt_ptr": "*bf16", "y_ptr": "*bf16",
                            "down_off": "i32", "db_off": "i32", **(BYTES if fmt else {})},
       dict(GEMM_CONSTS, COUNT=count, BIAS=bias, FMT_D=fmt, **gemm_tile(fmt)))
      for count, bias, fmt in ((False, False, blocks.TYPED), (True, False, blocks.TYPED), (True, True, blocks.TYPED),
                               (False, False, blocks.CODES["q6_k"]), (True, False, blocks.CODES["q8_0"]),
                               (True, True, blocks.CODES["mxfp4"]))),
    (gemv._gemv, {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"},
     dict(BN=16, BK=512, HAS_BIAS=True)),
    *((router._softmax_topk, {"logits_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "E": "i32"},
       dict(K=k, KP=k, RENORM=not top_first, BLOCK=128, TOP_FIRST=top_first)) for k, top_first in ((8, False), (4, True))),
    *((decode._rope_store, {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                                                    "qout_ptr", "kc_ptr", "vc_ptr")}, "pos_ptr": "*i64",
                            "caches_ptr": "*i64", "eps": "fp32",
                            **{n: "i32" for n in ("q_stride", "k_stride", "v_stride", "table_start", "ring")}},
       dict(HEADS=32, KV_HEADS=4, D=128, R=128, BLOCK_D=128, NORM=True, BATCH=batch, RING=ring))
      for batch in (False, True) for ring in (False, True)),  # ring: a sliding layer's (row p mod ring)
    *((attention._partial, {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")}, "acc_ptr": "*fp32", "ml_ptr": "*fp32",
                            "pos_ptr": "*i64" if dev else "*bf16", "caches_ptr": "*i64" if batch else "*bf16",
                            "T": "i32", "S": "i32", "offset": "i32", "window": "i32", "scale": "fp32", "chunk": "i32",
                            "first": "i32", "ring": "i32"},
       dict(HEADS=32, KV_HEADS=4, D=128, BLOCK_D=128, BT=1 if dev else 4, BLOCK_M=16 if dev else 32, BLOCK_S=64,
            IEEE=ieee, POS_ON_DEVICE=dev, BATCH=batch, RING=ring))
      for ieee, dev, batch, ring in ((False, False, False, False), (True, False, False, False),
                                     (False, True, False, False), (False, True, True, False), (False, False, False, True),
                                     (False, True, False, True), (False, True, True, True))),
    *((attention._combine, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "sink_ptr": "*bf16" if sink else "*fp32",
                            "out_ptr": "*bf16", "T": "i32", "splits": "i32"},
       dict(HEADS=32, D=128, BLOCK_D=128, BLOCK_P=32, SINK=sink)) for sink in (False, True)),
]




SHARED_LIMIT = 232448  # bytes of shared memory one program may use on an H100/H200 (227 KB)


def _compile(fn, signature: dict, consts: dict):
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))


def _child(shard: int = 0, shards: int = 1) -> None:
    """Compile every kernel of this shard (index % shards == shard; the default launch options:
    four warps, three stages); print {index: "ok" | error} as JSON, shard 0 adding
    "wait_ptx_volatile" and "wait_reads_the_gpu_clock". A kernel needing more shared memory than
    the GPU has compiles but fails at launch: that is an error here."""
    out: dict[str, object] = {}
    for i, (fn, sig, consts) in enumerate(KERNELS):
        if i % shards != shard:
            continue
        try:
            compiled = _compile(fn, {**sig, **{name: "constexpr" for name in consts}}, consts)
            shared = compiled.metadata.shared
            out[str(i)] = ("no cubin" if not compiled.asm["cubin"] else
                           f"{shared} bytes of shared memory, over {SHARED_LIMIT}" if shared > SHARED_LIMIT else "ok")
        except Exception as e:  # reported per kernel by the test
            out[str(i)] = f"{type(e).__name__}: {e}"
    if shard:
        print(json.dumps(out))
        return
    wait = _compile(zero_copy._wait, {**WAIT_SIG, "TIMER": "constexpr"}, dict(TIMER=True))
    out["wait_ptx_volatile"] = "ld.volatile" in wait.asm["ptx"]
    out["wait_reads_the_gpu_clock"] = "%globaltimer" in wait.asm["ptx"]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Every kernel's answer, compiled in child processes, one per CPU core (up to 4) that each
    compile every n-th kernel: compiling is single-threaded and the test process only waits."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shards = max(1, min(4, os.cpu_count() or 1, len(KERNELS)))
    children = []
    for shard in range(shards):
        env_n = {**env, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))}  # really compile
        children.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(shard), str(shards)],
                                         env=env_n, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out: dict = {}
    failed = []
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=600)
            if child.returncode:
                failed.append(stderr)
            else:
                out.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for stderr in failed:
        if "ptxas" in stderr:  # no CUDA toolchain in this Triton build
            pytest.skip(stderr.strip().splitlines()[-1])
        raise AssertionError(stderr)
    assert sorted(int(k) for k in out if k.isdigit()) == list(range(len(KERNELS)))
    return out


@pytest.mark.parametrize("index", range(len(KERNELS)), ids=[f"{fn.__name__}-{i}" for i, (fn, _, _) in enumerate(KERNELS)])
def test_kernel_compiles_for_sm90(compiled, index):
    result = compiled[str(index)]
    if "ptxas" in result:
        pytest.skip(result)
    assert result == "ok", result


def test_wait_spins_on_a_volatile_load(compiled):
    """The doorbell wait must re-read memory the CPU writes, never a cached value, and reads
    the GPU clock (the hybrid split is balanced from it)."""
    assert compiled["wait_ptx_volatile"] and compiled["wait_reads_the_gpu_clock"]


if __name__ == "__main__":
    _child(*map(int, sys.argv[1:3]))
