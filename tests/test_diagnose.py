"""ft-diagnose: PASS on every family in every form and its header-only stub, FAIL (exit 1) with
the problem named on each kind of damage, no traceback ever, no weight bytes read, and fast on
the headers of a 48-layer, 128-expert model."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import fixtures as fx
from ftkit import __version__
from ftkit.runtime.checkpoint.gguf import READ_CHUNK
from ftkit.runtime.engine.loader import RuntimeOptions
from ftkit.runtime.engine.resolve import Machine, resolve
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models.kv import KVCache
from ftkit.runtime.spec import ModelSpec
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.cli import app
from ftkit.tools.diagnose.report import diagnose
from ftkit.vocab import slot_layout
from gguf_fixtures import write_gguf_from_hf

NAMES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]
VARIANTS = ["hf", "sharded", "stacked", "gguf_q8_0", "gguf_f16", "ftw"]
LAYOUT = {"hf": "per-expert", "sharded": "per-expert", "stacked": "stacked",
          "gguf_q8_0": "stacked", "gguf_f16": "stacked", "ftw": "ftw slots"}
FT_DIAGNOSE = Path(sys.executable).parent / "ft-diagnose"


# ---- building checkpoints and stubs ------------------------------------------------------------
def gguf_header_end(path: Path) -> int:
    """End of the tensor-info section, found with the gguf package (independent of our reader)."""
    field = gguf.GGUFReader(path).tensors[-1].field
    return field.offset + sum(p.nbytes for p in field.parts)


def gguf_type_offset(path: Path, tensor: str) -> int:
    """Byte offset of `tensor`'s ggml type in its tensor info (parts: name len, name, n_dims, dims, type)."""
    field = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor).field
    return field.offset + sum(p.nbytes for p in field.parts[:4])


def stub_of(src: Path, out: Path) -> Path:
    """What a CI job gets by fetching only each file's header: safetensors cut after the JSON
    header, GGUF after the tensor infos, FTW banks (no header) empty."""
    if src.is_file():
        out.write_bytes(src.read_bytes()[: gguf_header_end(src)])
        return out
    fx.header_only_stub(src, out)
    for bank in out.glob("*.ftwb"):
        bank.write_bytes(b"")
    return out


@pytest.fixture(scope="module")
def model_path(hf_checkpoint, tmp_path_factory) -> Callable[..., Path]:
    """`model_path(name, variant, stub=False)`, built once per module."""
    built: dict[tuple[str, str, bool], Path] = {}

    def get(name: str, variant: str, stub: bool = False) -> Path:
        key = (name, variant, stub)
        if key in built:
            return built[key]
        tmp = tmp_path_factory.mktemp(f"{name}-{variant}{'-stub' if stub else ''}")
        if stub:
            path = stub_of(get(name, variant), tmp / get(name, variant).name)
        elif variant in ("hf", "sharded", "stacked"):
            path = hf_checkpoint(name, sharded=variant == "sharded", stacked=variant == "stacked")
        elif variant.startswith("gguf"):
            path = tmp / f"{name}.gguf"
            write_gguf_from_hf(hf_checkpoint(name), path, variant.removeprefix("gguf_").upper())
        else:
            path = tmp / "ftw"
            convert(prepare(hf_checkpoint(name)), path)
        built[key] = path
        return path

    return get


def run_cli(*args: str) -> tuple[int, str]:
    """ft-diagnose in-process; any exception other than the exit itself fails the test."""
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def run_json(path: Path) -> tuple[int, dict[str, Any]]:
    code, out = run_cli(str(path), "--json")
    return code, json.loads(out)


# ---- PASS ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stub", [False, True], ids=["full", "stub"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_pass(model_path, name: str, variant: str, stub: bool) -> None:
    path = model_path(name, variant, stub)
    t0 = time.perf_counter()
    code, r = run_json(path)
    assert time.perf_counter() - t0 < 2.0
    assert (code, r["verdict"], r["problems"]) == (0, "PASS", [])
    cfg = fx.TINY_CONFIGS[name]
    assert (r["family"], r["layers"], r["experts"]) == (name, cfg["num_hidden_layers"], 8)
    assert r["header_only"] is stub
    assert r["expert_layout"] == LAYOUT[variant]
    assert r["kind"] == {"gguf": "gguf", "ftw": "ftw"}.get(variant.split("_")[0], "safetensors")
    if variant == "sharded":
        assert r["files"] >= 3
    # A stub plans the same memory as the checkpoint it was cut from.
    assert r["memory"] == run_json(model_path(name, variant))[1]["memory"]


@pytest.mark.parametrize("name", NAMES)
def test_readable_report(model_path, name: str) -> None:
    code, out = run_cli(str(model_path(name, "sharded", stub=True)))
    assert code == 0
    for text in (name, "header-only stub", "host expert pool", "dense (GPU)", "KV per 1,000 tokens",
                 "smallest GPU budget", "PASS"):
        assert text in out


def test_config_in_a_subdirectory_is_found(hf_checkpoint, tmp_path: Path) -> None:
    """The reference system failed here: the config a family needs lives below the top."""
    out = shutil.copytree(hf_checkpoint("qwen3_moe"), tmp_path / "ckpt")
    (out / "llm").mkdir()
    (out / "config.json").rename(out / "llm" / "config.json")
    code, r = run_json(out)
    assert (code, r["verdict"], r["config"], r["family"]) == (0, "PASS", "llm/config.json", "qwen3_moe")


def test_config_nested_under_text_config(hf_checkpoint, tmp_path: Path) -> None:
    out = shutil.copytree(hf_checkpoint("mixtral"), tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    wrapper = {"architectures": ["MixtralForCausalLM"], "model_type": "wrapper", "text_config": cfg}
    (out / "config.json").write_text(json.dumps(wrapper))
    code, r = run_json(out)
    assert (code, r["verdict"], r["family"], r["experts"]) == (0, "PASS", "mixtral", 8)


# ---- the memory plan ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_memory_plan_matches_what_convert_and_the_runtime_allocate(model_path, name: str) -> None:
    _, r = run_json(model_path(name, "hf"))
    m = r["memory"]
    ftw = model_path(name, "ftw")
    spec = ModelSpec.from_dict(json.loads((ftw / "manifest.json").read_text())["spec"])
    # Experts: the f32 checkpoint's slots, and the host pool is exactly the FTW banks' bytes.
    assert m["expert_dtype"] == "float32"
    assert m["expert_slot_bytes"] == slot_layout(spec, "float32").slot_bytes
    assert m["host_expert_pool_bytes"] == sum(f.stat().st_size for f in ftw.glob("*.ftwb"))
    # Dense: every tensor of the FTW dense file, at bf16.
    _, header = fx.read_safetensors_header(ftw / "dense.safetensors")
    numel = sum(torch.Size(v["shape"]).numel() for k, v in header.items() if k != "__metadata__")
    assert m["dense_bytes"] == 2 * numel
    # KV: what the runtime's cache allocates for 1,000 tokens at bf16.
    kv = KVCache(spec, 1000, torch.bfloat16, "meta")
    assert m["kv_bytes_per_1k_tokens"] == sum(t.nbytes for t in (*kv.k.values(), *kv.v.values()))
    assert m["prefix_cache_bytes"] == m["kv_bytes_per_1k_tokens"] * spec.max_position_embeddings // 1000
    # The smallest budget is the one ft-run's own plan accepts on CUDA with --kv-tokens 1000 and
    # no prefix cache, with top_k slots; a byte less is refused.
    assert m["min_gpu_bytes"] == sum(m["min_gpu_terms"].values())
    opts = RuntimeOptions(device="cuda", strategy="offload", dtype="bfloat16", prefix_cache=False,
                          gpu_budget=m["min_gpu_bytes"], kv_tokens=1000)
    model, gpu = FTWModel(ftw), Machine(torch.device("cuda"))  # the plan needs no GPU
    assert resolve(model, opts, gpu).cache_slots == spec.top_k
    with pytest.raises(ValueError, match="prefill workspace"):
        resolve(model, dataclasses.replace(opts, gpu_budget=m["min_gpu_bytes"] - 1), gpu)


# ---- FAIL ----------------------------------------------------------------------------------
def set_bytes(path: Path, offset: int, data: bytes) -> Path:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    return path


def retyped_hf(src: Path, out: Path, name_substring: str, dtype: torch.dtype) -> Path:
    """A copy of `src` where the first tensor whose name contains `name_substring` is cast to `dtype`."""
    shutil.copytree(src, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if name_substring in n)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, path)
    return out


def gguf_copy(model_path, tmp: Path) -> Path:
    return Path(shutil.copy(model_path("qwen3_moe", "gguf_q8_0"), tmp / "model.gguf"))


def gguf_retyped(model_path, tmp: Path, tensor: str) -> Path:
    path = gguf_copy(model_path, tmp)
    return set_bytes(path, gguf_type_offset(path, tensor), struct.pack("<I", gguf.GGMLQuantizationType.IQ2_XXS))


FAILURES: dict[str, tuple[Callable[[Any, Any, Path], Path], str]] = {
    "missing dense tensor": (lambda mp, hf, t: fx.missing_tensor(hf("qwen3_moe"), t / "c", "layers.1.self_attn.k_proj"),
                             "missing tensor: layers.1.attn.k.weight"),
    "missing expert tensor": (lambda mp, hf, t: fx.missing_tensor(hf("olmoe"), t / "c", "experts.3.down_proj"),
                              "down projection of expert(s) 3"),
    "wrong shape": (lambda mp, hf, t: fx.wrong_shape(hf("mixtral"), t / "c", "layers.0.self_attn.q_proj"),
                    "wrong shape: model.layers.0.self_attn.q_proj.weight is [64, 63], expected [64, 64]"),
    "wrong expert shape": (lambda mp, hf, t: fx.wrong_shape(hf("qwen2_moe", stacked=True), t / "c", "experts.down_proj"),
                           "wrong shape: model.layers.0.mlp.experts.down_proj"),
    "unsupported GGUF type": (lambda mp, hf, t: gguf_retyped(mp, t, "blk.1.ffn_down_exps.weight"),
                              "unsupported: GGUF type IQ2_XXS for tensor blk.1.ffn_down_exps.weight"),
    "unsupported GGUF embedding": (lambda mp, hf, t: gguf_retyped(mp, t, "token_embd.weight"),
                                   "unsupported: GGUF type IQ2_XXS for tensor token_embd.weight"),
    "wrong dense dtype": (lambda mp, hf, t: retyped_hf(hf("qwen2_moe"), t / "c", "model.norm", torch.int8),
                          "wrong dtype: model.norm.weight is int8, expected one of float32, float16, bfloat16"),
    "wrong expert dtype": (lambda mp, hf, t: retyped_hf(hf("olmoe", stacked=True), t / "c", "experts.", torch.float64),
                           "wrong dtype: experts stored as float64"),
    "unknown architecture": (lambda mp, hf, t: fx.unknown_architecture(hf("qwen3_moe"), t / "c"),
                             "unknown architecture 'FooBarForCausalLM'"),
    "missing shard": (lambda mp, hf, t: fx.missing_shard(hf("qwen2_moe", sharded=True), t / "c"),
                      "missing shard(s) named in model.safetensors.index.json"),
    "config without expert count": (lambda mp, hf, t: fx.config_without_expert_count(hf("mixtral"), t / "c"),
                                    "config has no expert count"),
    "bad GGUF magic": (lambda mp, hf, t: set_bytes(gguf_copy(mp, t), 0, b"GGUX"), "not a GGUF file (bad magic"),
    "bad GGUF version": (lambda mp, hf, t: set_bytes(gguf_copy(mp, t), 4, struct.pack("<I", 7)),
                         "unsupported GGUF version 7"),
    "safetensors header length": (lambda mp, hf, t: fx.bad_header_length(hf("olmoe"), t / "c"),
                                  "header length"),
    "offsets past the file": (lambda mp, hf, t: fx.offsets_past_end(hf("qwen3_moe", sharded=True), t / "c"),
                              "past the end of the file"),
    "header not JSON": (lambda mp, hf, t: fx.header_not_json(hf("mixtral"), t / "c"), "header is not valid JSON"),
    "truncated data": (lambda mp, hf, t: fx.truncate_safetensors(hf("qwen3_moe"), t / "c"), "truncated or corrupt"),
    "FTW bank missing": (lambda mp, hf, t: _ftw_without_bank(mp, t), "the FTW directory is incomplete"),
    "FTW manifest edited": (lambda mp, hf, t: _ftw_edited(mp, t), "fingerprint mismatch"),
    "FTW dense tensor missing": (lambda mp, hf, t: fx.missing_tensor(mp("mixtral", "ftw"), t / "ftw", "layers.0.attn.q.weight"),
                                 "missing tensor: layers.0.attn.q.weight"),
}


def _ftw_without_bank(model_path, tmp: Path) -> Path:
    out = shutil.copytree(model_path("olmoe", "ftw"), tmp / "ftw")
    sorted(out.glob("*.ftwb"))[0].unlink()
    return out


def _ftw_edited(model_path, tmp: Path) -> Path:
    out = shutil.copytree(model_path("olmoe", "ftw"), tmp / "ftw")
    m = json.loads((out / "manifest.json").read_text())
    m["spec"]["top_k"] = 3
    (out / "manifest.json").write_text(json.dumps(m))
    return out


@pytest.mark.parametrize("case", list(FAILURES))
def test_fail_names_the_problem(model_path, hf_checkpoint, tmp_path: Path, case: str) -> None:
    build, expected = FAILURES[case]
    path = build(model_path, hf_checkpoint, tmp_path)
    code, r = run_json(path)
    assert (code, r["verdict"]) == (1, "FAIL")
    assert any(expected in p for p in r["problems"]), r["problems"]
    code, out = run_cli(str(path))
    assert code == 1 and "FAIL" in out
    assert expected.split(": ")[-1][:40] in " ".join(out.split())


def test_broken_weights_still_name_the_model(hf_checkpoint, tmp_path: Path) -> None:
    """A missing shard or an incomplete config fails, but the report still says what it can."""
    _, r = run_json(fx.missing_shard(hf_checkpoint("qwen3_moe", sharded=True), tmp_path / "a"))
    assert r["verdict"] == "FAIL" and r["family"] == "qwen3_moe" and r["memory"]["min_gpu_bytes"] > 0
    _, r = run_json(fx.config_without_expert_count(hf_checkpoint("mixtral"), tmp_path / "b"))
    assert r["verdict"] == "FAIL" and r["family"] == "mixtral" and r["memory"] is None


def test_unsupported_tensor_is_not_also_missing(model_path, tmp_path: Path) -> None:
    _, r = run_json(gguf_retyped(model_path, tmp_path, "blk.1.ffn_down_exps.weight"))
    assert r["problems"] == ["unsupported: GGUF type IQ2_XXS for tensor blk.1.ffn_down_exps.weight"]
    # the plan prices the part it cannot read as bfloat16 (what --dtype bfloat16 would write)
    assert r["memory"]["expert_dtype"] == "gate q8_0, up q8_0, down bfloat16|q8_0"


def test_console_script_exit_codes(model_path, tmp_path: Path) -> None:
    """The installed command: 0 PASS, 1 FAIL (no traceback), 2 usage error."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(FT_DIAGNOSE), *args], capture_output=True, text=True, timeout=60)

    ok = run(str(model_path("qwen2_moe", "gguf_q8_0", stub=True)), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["verdict"] == "PASS"
    bad = run(str(set_bytes(gguf_copy(model_path, tmp_path), 0, b"GGUX")))
    assert bad.returncode == 1 and "Traceback" not in bad.stdout + bad.stderr
    assert "bad magic" in bad.stdout
    usage = run(str(tmp_path / "no-such-model"))
    assert usage.returncode == 2 and "Traceback" not in usage.stdout + usage.stderr
    assert usage.stderr.strip() == f"error: {tmp_path / 'no-such-model'}: no such file or directory"
    as_json = run(str(tmp_path / "no-such-model"), "--json")  # a CI step still gets a verdict
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["verdict"] == "FAIL"
    assert json.loads(as_json.stdout)["problems"] == [f"{tmp_path / 'no-such-model'}: no such file or directory"]
    version = run("--version")
    assert (version.returncode, version.stdout) == (0, f"ft-diagnose {__version__}\n")


# ---- no weight bytes ---------------------------------------------------------------------------
class _TrackedFile:
    """A binary file object that records the furthest byte any read reached."""

    def __init__(self, f: io.BufferedIOBase, path: Path, ends: dict[Path, int]):
        self._f, self._path, self._ends = f, path, ends

    def read(self, n: int = -1) -> bytes:
        start = self._f.tell()
        data = self._f.read(n)
        self._ends[self._path] = max(self._ends.get(self._path, 0), start + len(data))
        return data

    def readinto(self, buf: Any) -> int:
        start = self._f.tell()
        n = self._f.readinto(buf)
        self._ends[self._path] = max(self._ends.get(self._path, 0), start + (n or 0))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _TrackedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def diagnose_tracked(path: Path) -> dict[Path, int]:
    """Diagnose `path` (it must PASS) and return, per file, the furthest byte read through
    `open`; positional reads and mmaps are refused outright."""
    ends: dict[Path, int] = {}
    real_open = builtins.open

    def tracking_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        if "b" in mode and "r" in mode and isinstance(file, (str, os.PathLike)):
            return _TrackedFile(f, Path(file).resolve(), ends)
        return f

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ft-diagnose read tensor data (pread/mmap)")

    with pytest.MonkeyPatch.context() as mp:
        for module, name, value in ((builtins, "open", tracking_open), (io, "open", tracking_open),
                                    (os, "pread", refuse), (os, "preadv", refuse), (mmap, "mmap", refuse)):
            mp.setattr(module, name, value)
        verdict = diagnose(path)["verdict"]
    assert verdict == "PASS"
    return ends


def test_reads_stay_within_safetensors_headers(model_path) -> None:
    path = model_path("qwen3_moe", "sharded")
    ends = diagnose_tracked(path)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 3 and {p.resolve() for p in shards} <= set(ends)
    for shard in shards:
        n, _ = fx.read_safetensors_header(shard)
        assert ends[shard.resolve()] == 8 + n < shard.stat().st_size


def test_reads_stay_within_gguf_header(model_path) -> None:
    path = model_path("olmoe", "gguf_f16")
    ends = diagnose_tracked(path)
    # The header is read in chunks, so the last chunk may run past its end, never a chunk more.
    assert ends[path.resolve()] <= gguf_header_end(path) + READ_CHUNK < path.stat().st_size


def test_ftw_banks_are_never_opened(model_path) -> None:
    path = model_path("mixtral", "ftw")
    ends = diagnose_tracked(path)
    assert not [p for p in ends if p.suffix == ".ftwb"]
    n, _ = fx.read_safetensors_header(path / "dense.safetensors")
    assert ends[(path / "dense.safetensors").resolve()] == 8 + n


# ---- a large model's headers -----------------------------------------------------------------
BIG = {  # Qwen3-30B-A3B's shape: 48 layers, 128 experts of width 768, top-8
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "norm_topk_prob": True, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
}


def big_stub(out: Path, drop: str | None = None) -> Path:
    """BIG's header-only checkpoint: one shard per layer plus one for the rest, per-expert names,
    an index; safetensors headers written directly, no data."""
    out.mkdir()
    h, i, e, q, kv = BIG["hidden_size"], BIG["moe_intermediate_size"], BIG["num_experts"], 32 * 128, 4 * 128
    shards: dict[str, dict[str, tuple[int, ...]]] = {"model-00000.safetensors": {
        "model.embed_tokens.weight": (BIG["vocab_size"], h), "model.norm.weight": (h,),
        "lm_head.weight": (BIG["vocab_size"], h)}}
    for layer in range(BIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
             p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
             p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
             p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
             p + "mlp.gate.weight": (e, h)}
        for x in range(e):
            t |= {f"{p}mlp.experts.{x}.gate_proj.weight": (i, h), f"{p}mlp.experts.{x}.up_proj.weight": (i, h),
                  f"{p}mlp.experts.{x}.down_proj.weight": (h, i)}
        shards[f"model-{layer + 1:05d}.safetensors"] = t
    weight_map = {}
    for file, tensors in shards.items():
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape in tensors.items():
            if name == drop:
                continue
            n = 2 * torch.Size(shape).numel()
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            weight_map[name] = file
            off += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (out / file).write_bytes(struct.pack("<Q", len(raw)) + raw)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(BIG))
    return out


def test_large_model_stub_is_fast(tmp_path: Path) -> None:
    path = big_stub(tmp_path / "big")
    t0 = time.perf_counter()
    r = diagnose(path)
    seconds = time.perf_counter() - t0
    assert r["verdict"] == "PASS", r["problems"]
    assert (r["layers"], r["experts"], r["files"], r["header_only"]) == (48, 128, 49, True)
    assert r["tensors"] == 3 + 48 * (9 + 128 * 3) > 18_000
    m = r["memory"]
    assert m["expert_slot_bytes"] == 3 * 768 * 2048 * 2  # 9 MiB, already 4096-aligned
    assert m["host_expert_pool_bytes"] == 48 * 128 * m["expert_slot_bytes"]  # 54 GiB
    per_layer = 2 * 4096 * 2048 + 2 * 512 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128  # attention, router, norms
    assert m["dense_bytes"] == 2 * (2 * 151936 * 2048 + 2048 + 48 * per_layer)  # bf16, ~2.9 GiB
    assert m["kv_bytes_per_1k_tokens"] == 1000 * 48 * 2 * 4 * 128 * 2
    print(f"\n48-layer, 128-expert stub ({r['tensors']} tensors): diagnosed in {seconds:.2f} s")
    assert seconds < 2.0


def test_large_model_stub_names_a_missing_expert(tmp_path: Path) -> None:
    r = diagnose(big_stub(tmp_path / "big", drop="model.layers.47.mlp.experts.127.up_proj.weight"))
    assert r["verdict"] == "FAIL"
    assert r["problems"] == ["missing tensor: layer 47 up projection of expert(s) 127"]


def test_unsupported_gguf_types_are_each_named_and_still_plan(hf_checkpoint, tmp_path):
    """A GGUF in types ftkit does not read (IQ2_XXS, TQ1_0, ...): FAIL, naming each tensor and
    its type, with the model still identified and its memory plan given."""
    from gguf_fixtures import write_gguf_from_hf

    path = tmp_path / "iq2.gguf"
    write_gguf_from_hf(hf_checkpoint("qwen3_moe"), path, "F32")
    retyped = [t.name for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight" or "_exps" in t.name]
    for offset in [gguf_type_offset(path, n) for n in retyped]:  # the data is never read
        set_bytes(path, offset, struct.pack("<I", gguf.GGMLQuantizationType.IQ2_XXS))
    report = diagnose(path)
    assert report["verdict"] == "FAIL" and report["family"] == "qwen3_moe"
    assert report["problems"] == [f"unsupported: GGUF type IQ2_XXS for tensor {n}" for n in retyped]
    assert len(retyped) == 1 + 3 * 2  # embedding + 3 parts x 2 layers
    assert report["memory"]["host_expert_pool_bytes"] > 0


# ---- no torch on the header path -------------------------------------------------------------------
TORCH_FREE = """
import sys
from ftkit.tools.diagnose.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("variant", ["sharded", "gguf_q8_0"])
def test_the_header_path_loads_no_torch(model_path, variant: str, tmp_path: Path) -> None:
    """An HF directory's or a GGUF file's verdict (stub or full), --help and --version import no
    torch: what makes a header-only check start in well under a second (README, docs/diagnose.md)."""
    fx.skip_unless_header_path_can_be_torch_free()
    runs = [([str(model_path("qwen3_moe", variant, stub=True)), "--json"], 0), ([str(model_path("olmoe", variant))], 0),
            (["--help"], 0), (["--version"], 0), ([str(tmp_path / "none"), "--json"], 2)]
    for args, code in runs:
        r = subprocess.run([sys.executable, "-c", TORCH_FREE, *args], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        assert r.stderr.strip().splitlines()[-1] == f"exit {code} False", (args, r.stderr)
