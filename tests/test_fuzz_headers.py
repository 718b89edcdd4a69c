"""Fuzzing every reader: a hostile input is a verdict or one clean line, and a PASS loads.

One target per reader: the safetensors header, config.json (and a sharded index), the GGUF
header, an FTW directory (manifest, dense file, banks) and the tokenizer files (HF ones, and a
GGUF's vocabulary and chat template). Each starts from a fixture and mutates its values or bytes
(tests/fuzz_inputs.py), then runs what the commands run:

* `diagnose(path)` returns a report, never raises: problems one line each, strict JSON;
* `prepare` + `convert` (checkpoints) and `Runtime` (FTW, and every converted checkpoint)
  succeed or raise an InputError, one printable line; any other exception fails the test;
* a PASS that is not a header-only stub converts and loads; what convert or load refuses,
  diagnose has failed first;
* nothing a reader returns holds a list longer than the input has bytes (memory stays within
  what the file allows, checked by size, not by measuring RSS).

CI runs a fixed, derandomized set of examples per target (about a minute in all); set
FTKIT_FUZZ_EXAMPLES=100000 for a long run (`make fuzz`), FTKIT_FUZZ_SEED to draw a different set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, seed, settings
from hypothesis import strategies as st

from ftkit.errors import InputError
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.ftw.manifest import fingerprint
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.spec import FULL_ATTENTION, LINEAR_ATTENTION
from ftkit.runtime.synthetic import write_tokenizer
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose
from fuzz_inputs import (
    VT,
    add_vocab,
    answer,
    assert_bounded,
    encode_gguf,
    input_bytes,
    mutate_bytes,
    mutate_gguf,
    mutate_json,
    read_gguf,
)
from gguf_fixtures import header_end, write_gguf_from_hf

EXAMPLES = int(os.environ.get("FTKIT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 60, deadline=None, derandomize=not os.environ.get("FTKIT_FUZZ_SEED"),
    database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.function_scoped_fixture],
)
SEED = os.environ.get("FTKIT_FUZZ_SEED")
LOAD = RuntimeOptions(threads=1)


def fuzz(examples: int) -> Callable:
    """The settings of one target: `examples` in CI (FTKIT_FUZZ_EXAMPLES overrides)."""
    def wrap(test: Callable) -> Callable:
        test = settings(FUZZ, max_examples=EXAMPLES or examples)(test)
        return seed(int(SEED))(test) if SEED else test
    return wrap


# ---- the property --------------------------------------------------------------------------------
def outcome(what: str) -> None:
    """Tallied by --hypothesis-show-statistics: how far the examples of a target got."""
    if currently_in_test_context():
        event(what)


def diagnosed(path: Path) -> dict:
    report = diagnose(path)
    assert report["verdict"] == ("FAIL" if report["problems"] else "PASS")
    for p in report["problems"]:
        assert p and "\n" not in p and p.isprintable(), repr(p)
    json.dumps(report, allow_nan=False)  # what --json prints: strict JSON
    assert_bounded(report, input_bytes(path), "report")
    return report


def loads(ftw: Path) -> Runtime | InputError:
    rt = answer(lambda: Runtime(ftw, LOAD))
    if isinstance(rt, Runtime):
        assert_bounded(rt.spec.to_dict(), input_bytes(ftw), "spec")
        rt.close()
    return rt


def check_checkpoint(path: Path, out: Path) -> None:
    """diagnose, then convert and load: each answers cleanly, and a PASS goes all the way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tokenizer notes: a rebuild skipped is not a failure
        report = diagnosed(path)
        conv = answer(lambda: prepare(path))
        if isinstance(conv, InputError):
            outcome(f"diagnose {report['verdict']}, convert refused")
            assert report["verdict"] == "FAIL" or report["header_only"], (report, conv)
            return
        assert_bounded(dataclasses.asdict(conv.spec), input_bytes(path), "conversion")
        done = answer(lambda: convert(conv, out))
        assert not isinstance(done, InputError), f"planned, then refused: {done}"
        rt = loads(out)
        assert not isinstance(rt, InputError), f"converted, then refused to load: {rt}"
        outcome(f"diagnose {report['verdict']}, converted and loaded")


def check_ftw(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diagnosed(path)
        rt = loads(path)
    outcome(f"diagnose {report['verdict']}, {'refused' if isinstance(rt, InputError) else 'loaded'}")
    if isinstance(rt, InputError):
        assert report["verdict"] == "FAIL" or report["header_only"], (report, rt)


# ---- seeds -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seeds(hf_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The inputs every target mutates, built once from the project's fixture writers."""
    root = tmp_path_factory.mktemp("fuzz-seeds")
    hf = hf_checkpoint("qwen3_moe")
    plain = root / "plain.gguf"
    write_gguf_from_hf(hf, plain, "Q8_0")
    vocab = root / "vocab.gguf"
    vocab.write_bytes(encode_gguf(add_vocab(read_gguf(plain), hf)))
    ftw = root / "qwen3_moe.ftw"
    convert(prepare(hf), ftw)
    out = {"hf": hf, "sharded": hf_checkpoint("qwen2_moe", sharded=True), "gguf": plain, "gguf_vocab": vocab,
           "ftw": ftw}
    for name, spec in _random_specs().items():
        out[f"ftw_{name}"] = root / f"{name}.ftw"
        write_random_ftw(out[f"ftw_{name}"], spec, side_files=lambda d: write_tokenizer(d, 288))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, path in out.items():  # a mutation must start from something that passes
            assert diagnose(path)["verdict"] == "PASS", name
    return out


def _random_specs():
    """Small specs of the families with their own fields: linear attention, grouped routing."""
    base = dataclasses.replace(demo_spec(288), hidden_size=32, moe_intermediate_size=32, num_experts=4, top_k=2,
                               num_layers=2, moe_layers=(0, 1), layer_kinds=(FULL_ATTENTION,) * 2, head_dim=8,
                               num_heads=4, num_kv_heads=2)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, linear_in_proj="qkvz")
    return {
        "qwen3_next": dataclasses.replace(base, family="qwen3_next", architecture=FAMILIES["qwen3_next"].architectures[0],
                                          layer_kinds=(LINEAR_ATTENTION, FULL_ATTENTION), extra=linear,
                                          shared_expert_intermediate_size=16, shared_expert_gate=True,
                                          partial_rotary_factor=0.25),
        "glm4_moe": dataclasses.replace(base, family="glm4_moe", architecture=FAMILIES["glm4_moe"].architectures[0],
                                        qk_norm="none", extra=dict(n_group=2, topk_group=1, routed_scaling_factor=2.5)),
    }


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        return Path(shutil.copytree(src, dst))
    shutil.copy(src, dst)
    return dst


def _safetensors_header_end(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _rewrite_header(path: Path, text: str) -> None:
    """`path` with its safetensors header replaced by `text` (padded as the format pads it)."""
    blob = path.read_bytes()
    raw = text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[_safetensors_header_end(path):])


def _mutate_safetensors(data: st.DataObject, path: Path) -> None:
    """The file's header mutated as JSON values, or its bytes mutated."""
    if data.draw(st.booleans()):
        header = json.loads(path.read_bytes()[8:_safetensors_header_end(path)])
        _rewrite_header(path, mutate_json(data, header))
    else:
        path.write_bytes(mutate_bytes(data, path.read_bytes(), _safetensors_header_end(path)))


def _mutate_json_file(data: st.DataObject, path: Path) -> None:
    if data.draw(st.integers(0, 3)):
        path.write_text(mutate_json(data, json.loads(path.read_text())), "utf-8", "surrogatepass")
    else:
        path.write_bytes(mutate_bytes(data, path.read_bytes(), path.stat().st_size))


# ---- the targets -------------------------------------------------------------------------------------
@fuzz(examples=80)
@given(data=st.data())
def test_fuzz_safetensors_header(seeds, data):
    with tempfile.TemporaryDirectory() as tmp:
        src = _copy(seeds["hf"], Path(tmp) / "hf")
        _mutate_safetensors(data, src / "model.safetensors")
        check_checkpoint(src, Path(tmp) / "out.ftw")


@fuzz(examples=80)
@given(data=st.data())
def test_fuzz_config(seeds, data):
    """config.json, and the index of a sharded checkpoint."""
    name, file = data.draw(st.sampled_from([("hf", "config.json"), ("sharded", "config.json"),
                                            ("sharded", "model.safetensors.index.json")]))
    with tempfile.TemporaryDirectory() as tmp:
        src = _copy(seeds[name], Path(tmp) / "hf")
        _mutate_json_file(data, src / file)
        check_checkpoint(src, Path(tmp) / "out.ftw")


@fuzz(examples=120)
@given(data=st.data())
def test_fuzz_gguf(seeds, data):
    name = data.draw(st.sampled_from(["gguf", "gguf_vocab"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        if data.draw(st.integers(0, 3)):
            path.write_bytes(mutate_gguf(data, read_gguf(seeds[name])))
        else:
            path.write_bytes(mutate_bytes(data, seeds[name].read_bytes(), header_end(seeds[name])))
        check_checkpoint(path, Path(tmp) / "out.ftw")


def _refingerprint(text: str) -> str:
    """The manifest with its fingerprint recomputed, where it still has the fields for one: so a
    mutation reaches the checks behind the fingerprint, as a deliberate edit would."""
    try:
        m = json.loads(text)
        m["fingerprint"] = fingerprint(m["spec"], m["experts"]["layout"], m["experts"]["banks"])
        return json.dumps(m)
    except Exception:  # the mutation broke what a fingerprint is made of: keep it as it is
        return text


@fuzz(examples=120)
@given(data=st.data())
def test_fuzz_ftw(seeds, data):
    name = data.draw(st.sampled_from(["ftw", "ftw_qwen3_next", "ftw_glm4_moe"]))
    with tempfile.TemporaryDirectory() as tmp:
        ftw = _copy(seeds[name], Path(tmp) / "m.ftw")
        part = data.draw(st.sampled_from(["manifest", "manifest", "manifest", "dense", "bank", "stub"]))
        if part == "manifest":
            text = mutate_json(data, json.loads((ftw / "manifest.json").read_text()))
            (ftw / "manifest.json").write_text(_refingerprint(text) if data.draw(st.booleans()) else text)
        elif part == "dense":
            _mutate_safetensors(data, ftw / "dense.safetensors")
        elif part == "bank":
            bank = sorted(ftw.glob("*.ftwb"))[0]
            bank.write_bytes(mutate_bytes(data, bank.read_bytes(), bank.stat().st_size))
        else:  # a header-only stub: PASS in diagnose, refused by the loader
            dense = ftw / "dense.safetensors"
            dense.write_bytes(dense.read_bytes()[: _safetensors_header_end(dense)])
            for bank in ftw.glob("*.ftwb"):
                bank.write_bytes(b"")
        check_ftw(ftw)


TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.eos_token_id",
                  "tokenizer.chat_template")


@fuzz(examples=80)
@given(data=st.data())
def test_fuzz_tokenizer(seeds, data):
    """tokenizer.json and tokenizer_config.json of an HF checkpoint and an FTW; a GGUF's
    vocabulary and chat template (rebuilt into those files by the converter)."""
    where = data.draw(st.sampled_from(["hf", "ftw", "gguf"]))
    with tempfile.TemporaryDirectory() as tmp:
        if where == "gguf":
            parts = read_gguf(seeds["gguf_vocab"])
            parts.kvs = [kv for kv in parts.kvs if kv[0] not in TOKENIZER_KEYS] + _mutated_vocab(data, parts.kvs)
            path = Path(tmp) / "m.gguf"
            path.write_bytes(encode_gguf(parts))
            check_checkpoint(path, Path(tmp) / "out.ftw")
            return
        src = _copy(seeds[where], Path(tmp) / "src")
        _mutate_json_file(data, src / data.draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json"])))
        if where == "ftw":  # the checksums are --verify's business: loading goes past them
            check_ftw(src)
        else:
            check_checkpoint(src, Path(tmp) / "out.ftw")


def _mutated_vocab(data: st.DataObject, kvs: list) -> list:
    """The vocabulary entries with hostile edits: a SentencePiece model over the BPE vocabulary,
    a long token, wrong types, lists cut short, a template that does not compile."""
    vocab = {k: (t, v) for k, t, v in kvs if k in TOKENIZER_KEYS}
    tokens = vocab["tokenizer.ggml.tokens"][1][1]
    edits = data.draw(st.lists(st.sampled_from([
        ("tokenizer.ggml.model", (VT.STRING, "llama")),
        ("tokenizer.ggml.scores", (VT.ARRAY, (VT.FLOAT32, [float(-i) for i in range(len(tokens))]))),
        ("tokenizer.ggml.scores", (VT.ARRAY, (VT.FLOAT32, [float("nan")] * len(tokens)))),
        ("tokenizer.ggml.tokens", (VT.ARRAY, (VT.STRING, [*tokens[:-1], "x" * 100_000]))),
        ("tokenizer.ggml.tokens", (VT.ARRAY, (VT.STRING, tokens[: len(tokens) // 2]))),
        ("tokenizer.ggml.tokens", (VT.ARRAY, (VT.STRING, ["\udcff", *tokens[1:]]))),
        ("tokenizer.ggml.tokens", (VT.ARRAY, (VT.UINT32, list(range(len(tokens)))))),
        ("tokenizer.ggml.token_type", (VT.INT32, 1)),
        ("tokenizer.ggml.token_type", (VT.ARRAY, (VT.INT32, [99] * len(tokens)))),
        ("tokenizer.ggml.merges", (VT.ARRAY, (VT.STRING, ["zzz", "a b c", " "]))),
        ("tokenizer.ggml.merges", (VT.ARRAY, (VT.STRING, []))),
        ("tokenizer.ggml.pre", (VT.STRING, "default")),
        ("tokenizer.ggml.pre", (VT.STRING, "llama-bpe")),
        ("tokenizer.ggml.eos_token_id", (VT.UINT32, 2**32 - 1)),
        ("tokenizer.chat_template", (VT.STRING, "{% for m in messages %}{{ m")),
        ("tokenizer.chat_template", (VT.STRING, "{% if x %}" * 2000 + "{% endif %}" * 2000)),
        ("tokenizer.chat_template", (VT.ARRAY, (VT.STRING, ["a"]))),
    ]), min_size=1, max_size=3))
    vocab.update(dict(edits))
    return [(k, t, v) for k, (t, v) in vocab.items()]


# ---- what the hostile tester found (issue 40), each a FAIL naming the problem -------------------
def _hf_edit(edit: Callable[[dict], None], stub: bool = False) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        src = _copy(seeds["hf"], tmp / "hf")
        cfg = json.loads((src / "config.json").read_text())
        edit(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
        if stub:  # the weights cut right after their headers
            st_file = src / "model.safetensors"
            st_file.write_bytes(st_file.read_bytes()[: _safetensors_header_end(st_file)])
        return src
    return build


def _config_text(text: str) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        src = _copy(seeds["hf"], tmp / "hf")
        (src / "config.json").write_text(text)
        return src
    return build


def _header_edit(edit: Callable[[dict], object], seed_name: str = "hf", file: str = "model.safetensors"):
    def build(seeds: dict, tmp: Path) -> Path:
        src = _copy(seeds[seed_name], tmp / "src")
        path = src / file
        header = json.loads(path.read_bytes()[8:_safetensors_header_end(path)])
        _rewrite_header(path, edit(header) or json.dumps(header))
        return src
    return build


def _first_tensor(header: dict, part: str = "") -> dict:
    return header[next(k for k in sorted(header) if k != "__metadata__" and part in k)]


def _retype_norm(header: dict) -> None:
    """model.norm.weight stored as int16: the same bytes, a dtype no dense tensor may have."""
    t = header["model.norm.weight"]
    t["dtype"], t["shape"] = "I16", [t["shape"][0] * 2]


def _gguf_edit(key: str, vtype: int, value: object) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        parts = read_gguf(seeds["gguf_vocab"])
        parts.kvs = [kv for kv in parts.kvs if kv[0] != key] + [(key, vtype, value)]
        path = tmp / "m.gguf"
        path.write_bytes(encode_gguf(parts))
        return path
    return build


def _gguf_rename_first_tensor(name: str, ttype: int) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        parts = read_gguf(seeds["gguf"])
        _, dims, _, offset = parts.tensors[0]
        parts.tensors[0] = (name, dims, ttype, offset)
        path = tmp / "m.gguf"
        path.write_bytes(encode_gguf(parts))
        return path
    return build


def _tokenizer_edit(edit: Callable[[dict], None]) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        src = _copy(seeds["hf"], tmp / "hf")
        tok = json.loads((src / "tokenizer.json").read_text())
        edit(tok)
        (src / "tokenizer.json").write_text(json.dumps(tok))
        return src
    return build


def _ftw_spec(**fields: object) -> Callable[[dict, Path], Path]:
    def build(seeds: dict, tmp: Path) -> Path:
        ftw = _copy(seeds["ftw"], tmp / "m.ftw")
        m = json.loads((ftw / "manifest.json").read_text())
        m["spec"].update(fields)
        (ftw / "manifest.json").write_text(_refingerprint(json.dumps(m)))
        return ftw
    return build


def _ftw_dense_appended(seeds: dict, tmp: Path) -> Path:
    ftw = _copy(seeds["ftw"], tmp / "m.ftw")
    with open(ftw / "dense.safetensors", "ab") as f:
        f.write(b"\0")
    return ftw


HOSTILE = {
    "10^8 layers, header-only": (_hf_edit(lambda c: c.update(num_hidden_layers=10**8), stub=True),
                                 "num_hidden_layers is 100000000, outside 1..1024"),
    "10^9 experts": (_hf_edit(lambda c: c.update(num_experts=10**9)), "num_experts is 1000000000, outside"),
    "layers [2]": (_hf_edit(lambda c: c.update(num_hidden_layers=[2])), "num_hidden_layers is [2], not a whole number"),
    "Infinity": (_config_text('{"num_hidden_layers": Infinity}'), "Infinity is not a JSON number"),
    "config null": (_config_text("null"), "the top level is null, not a JSON object"),
    "sparse step 1e-320": (_hf_edit(lambda c: c.update(decoder_sparse_step=1e-320)), "decoder_sparse_step is 1e-320"),
    "rope_parameters 5": (_hf_edit(lambda c: c.update(rope_parameters=5)), "rope_parameters is 5, not an object"),
    "top_k above experts": (_hf_edit(lambda c: c.update(num_experts_per_tok=9)), "top-k 9 is not within 1..8"),
    "100,000-deep config": (_config_text("[" * 100_000 + "]" * 100_000), "nests arrays or objects deeper than 64"),
    "string data_offsets": (_header_edit(lambda h: _first_tensor(h).update(data_offsets=["0", "4"])),
                            "is not a pair of byte offsets"),
    "float data_offsets": (_header_edit(lambda h: _first_tensor(h).update(data_offsets=[0.0, 256.0])),
                           "is not a pair of byte offsets"),
    "{} dtype": (_header_edit(lambda h: _first_tensor(h).update(dtype={})), "unsupported safetensors dtype {}"),
    "100,000-deep header": (_header_edit(lambda h: "[" * 100_000 + "]" * 100_000),
                            "safetensors header nests arrays or objects deeper than 64"),
    "weight_map null": (lambda seeds, tmp: _index_null(seeds, tmp), "weight_map is null, not an object"),
    "int16 dense tensor": (_header_edit(_retype_norm), "wrong dtype: model.norm.weight is int16"),
    "GGUF 10^6 blocks": (_gguf_edit("qwen3moe.block_count", VT.UINT32, 10**6), "num_hidden_layers is 1000000, outside"),
    "GGUF 2^32-1 blocks": (_gguf_edit("qwen3moe.block_count", VT.UINT32, 2**32 - 1), "num_hidden_layers is 4294967295"),
    "GGUF inf blocks": (_gguf_edit("qwen3moe.block_count", VT.FLOAT32, float("inf")), "num_hidden_layers is inf"),
    "GGUF u32 tokens": (_gguf_edit("tokenizer.ggml.tokens", VT.ARRAY, (VT.UINT32, [1, 2, 3])),
                        "tokenizer.ggml.tokens is an array of int, not an array of strings"),
    "GGUF scalar token_type": (_gguf_edit("tokenizer.ggml.token_type", VT.INT32, 1),
                               "tokenizer.ggml.token_type is 1, not an array of integers"),
    # the fuzzer's find (issue 40): a name of invalid UTF-8 (read as a lone surrogate) is escaped
    "GGUF tensor name not UTF-8": (_gguf_rename_first_tensor("\udcff", 41),
                                   "unsupported: GGUF type Q1_0 for tensor \\udcff"),
    # the fuzzer's find (issue 40): tokenizers' BPE builder panics in Rust (a BaseException)
    "tokenizer that panics": (_tokenizer_edit(lambda t: t["model"].update(continuing_subword_prefix="#" * 64)),
                              "not a tokenizer the tokenizers library reads"),
    "FTW 10^6 layers": (_ftw_spec(num_layers=10**6), "num_layers is 1000000, outside 1..1024"),
    "FTW top_k above experts": (_ftw_spec(top_k=9), "top-k 9 is not within 1..8"),
    "FTW short layer_kinds": (_ftw_spec(layer_kinds=["full_attention"]), "layer_kinds has 1 entries for 2 layers"),
    "FTW dense byte appended": (_ftw_dense_appended, "1 bytes after the last tensor"),
}


def _index_null(seeds: dict, tmp: Path) -> Path:
    src = _copy(seeds["sharded"], tmp / "hf")
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": None}))
    return src


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_inputs_fail_in_one_line(seeds, tmp_path, case):
    build, expected = HOSTILE[case]
    path = build(seeds, tmp_path)
    report = diagnose(path)
    assert report["verdict"] == "FAIL" and any(expected in p for p in report["problems"]), report["problems"]
    if path.is_dir() and (path / "manifest.json").is_file():
        check_ftw(path)
    else:
        check_checkpoint(path, tmp_path / "out.ftw")


def test_the_commands_answer_hostile_inputs_with_one_line(seeds, tmp_path):
    """The installed commands on four of them: exit 1 and one line on stderr (ft-diagnose --json:
    its report), never a traceback or a hang (the timeout only guards the test run)."""
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    stub = HOSTILE["10^8 layers, header-only"][0](seeds, tmp_path)
    gguf_path = HOSTILE["GGUF 2^32-1 blocks"][0](seeds, tmp_path)
    r = subprocess.run([str(bin_dir / "ft-diagnose"), str(stub), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and json.loads(r.stdout)["verdict"] == "FAIL" and not r.stderr, r.stderr
    r = subprocess.run([str(bin_dir / "ftw-convert"), str(gguf_path), "-o", str(tmp_path / "o.ftw")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "num_hidden_layers is 4294967295" in r.stderr, r.stderr
    panics = HOSTILE["tokenizer that panics"][0](seeds, tmp_path / "p")  # the panic's own lines held back
    r = subprocess.run([str(bin_dir / "ftw-convert"), str(panics), "-o", str(tmp_path / "p.ftw")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tokenizer.json: not a tokenizer the tokenizers library reads" in r.stderr, r.stderr
    (tmp_path / "u").mkdir()
    odd = HOSTILE["GGUF tensor name not UTF-8"][0](seeds, tmp_path / "u")  # the text report prints its names
    r = subprocess.run([str(bin_dir / "ft-diagnose"), str(odd)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and not r.stderr and "tensor \\udcff" in r.stdout, r.stderr
