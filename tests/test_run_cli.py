"""ft-run end to end: a converted checkpoint reproduces transformers' greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from fixtures import load_reference
from ftkit.runtime.cli import PREFIX_FLAGS, SERVE_FLAGS, runtime_argv, runtime_flags
from ftkit.runtime.engine.loader import RuntimeOptions
from ftkit.tools.convert.pipeline import convert, prepare

FT_RUN = [sys.executable, "-m", "ftkit.runtime.cli"]


def ft_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FT_RUN, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_generate_json_matches_transformers(hf_checkpoint, tmp_path, family):
    ckpt = hf_checkpoint(family)
    out = tmp_path / "m.ftw"
    convert(prepare(ckpt), out)
    prompt = [4, 19, 77, 150, 23, 9]
    ref = load_reference(ckpt)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    want = want[0, len(prompt):].tolist()
    r = ft_run("generate", "-m", out, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12",
               "--ignore-eos", "--json", "--strategy", "hybrid", "--cache-experts", "3", "--bandwidth-ratio", "0.4",
               "--device", "cpu")  # transformers' tokens, bitwise: on the CPU also where a GPU is
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["token_ids"] == want
    assert got["stats"]["completion_tokens"] == 12 and got["stats"]["strategy"] == "hybrid"
    e = got["stats"]["experts"]
    assert e["hits"] + e["fills"] + e["cpu"] == e["active"] > 0
    assert isinstance(got["text"], str)


def test_generate_text_prompt_and_stop(tmp_path):
    r = ft_run("demo", "--out", tmp_path, "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stdout and "hybrid" in r.stdout
    model = tmp_path / "demo.ftw"
    r = ft_run("generate", "-m", model, "--prompt", "hello", "--chat", "--max-tokens", "6", "--json",
               "--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9")
    a = json.loads(r.stdout)
    b = json.loads(ft_run("generate", "-m", model, "--prompt", "hello", "--chat", "--max-tokens", "6", "--json",
                          "--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9").stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) <= 6  # seeded sampling reproduces


def test_bad_requests_fail_cleanly(tmp_path):
    r = ft_run("generate", "-m", tmp_path / "nope.ftw", "--prompt-ids", "1,2")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "error:" in r.stderr
    ft_run("demo", "--out", tmp_path, "--max-tokens", "1")
    model = tmp_path / "demo.ftw"
    for args in (["--prompt-ids", "1,x"], ["--prompt-ids", "999999"], ["--strategy", "magic", "--prompt-ids", "1"]):
        r = ft_run("generate", "-m", model, *args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (args, r.stderr)


def test_verify_refuses_a_corrupt_bank(tmp_path):
    ft_run("demo", "--out", tmp_path, "--max-tokens", "1")
    model = tmp_path / "demo.ftw"
    assert ft_run("generate", "-m", model, "--prompt-ids", "1,2", "--max-tokens", "1", "--verify").returncode == 0
    bank = next(model.glob("experts-*.ftwb"))
    data = bytearray(bank.read_bytes())
    data[100] ^= 1
    bank.write_bytes(bytes(data))
    r = ft_run("generate", "-m", model, "--prompt-ids", "1,2", "--max-tokens", "1", "--verify")
    assert r.returncode == 1 and "checksum" in r.stderr and "Traceback" not in r.stderr


def test_gpu_budget_sizes_the_expert_cache(tmp_path):
    ft_run("demo", "--out", tmp_path, "--max-tokens", "1")
    model = tmp_path / "demo.ftw"
    base = ["generate", "-m", model, "--prompt-ids", "1,2", "--max-tokens", "2", "--json", "--strategy", "offload"]
    small = json.loads(ft_run(*base, "--gpu-budget", "12M").stdout)
    big = json.loads(ft_run(*base, "--gpu-budget", "40M").stdout)
    assert small["token_ids"] == big["token_ids"]
    r = ft_run(*base, "--gpu-budget", "1M")
    assert r.returncode == 1 and "--gpu-budget" in r.stderr and "Traceback" not in r.stderr
    # the KV it reserves is --kv-tokens': 20000 tokens of this model's 1 KiB do not fit 12M
    r = ft_run(*base, "--gpu-budget", "12M", "--kv-tokens", "20000")
    assert r.returncode == 1 and "KV 20000 tokens" in r.stderr and "Traceback" not in r.stderr


def test_runtime_argv_gives_the_options_back():
    """ft-bench serve starts ft-run serve with `runtime_argv(opts)`: parsed by the same flag
    declaration, those flags give every option back (a flag added to one and not the other
    would drop silently)."""
    got = {}
    app = typer.Typer()

    @app.command()
    @runtime_flags(PREFIX_FLAGS, SERVE_FLAGS)
    def capture(opts: RuntimeOptions = None) -> None:
        got["opts"] = opts

    # what serve sizes itself, or no flag sets
    own = {"kv_tokens", "trace_stats", "stream_prefill"}
    changed = RuntimeOptions(strategy="hybrid", cache_bytes=5 << 30, device="cuda", threads=7,
                             profile=Path("p.json"), bandwidth_ratio=0.4, dtype="float16", verify=True,
                             prefix_cache=False, anchors=False, prefix_cache_tokens=4096, anchor_slots=8,
                             graphs=False, prefill_chunk=2048)
    for opts in (RuntimeOptions(), changed, RuntimeOptions(cache_experts=12), RuntimeOptions(gpu_budget=8 << 30)):
        r = CliRunner().invoke(app, runtime_argv(opts))
        assert r.exit_code == 0, r.output
        for f in fields(RuntimeOptions):
            if f.name not in own:
                assert getattr(got["opts"], f.name) == getattr(opts, f.name), f.name


def test_auto_says_what_it_chose_and_why(tmp_path):
    """On stderr, one line, so --json output stays one object: on the CPU the device tier is
    host memory (cpu, however much fits); with a ratio, hybrid."""
    ft_run("demo", "--out", tmp_path, "--max-tokens", "1")
    model = tmp_path / "demo.ftw"
    base = ["generate", "-m", model, "--prompt-ids", "1,2", "--max-tokens", "2", "--json"]
    r = ft_run(*base)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["strategy"] == "cpu"
    assert "ftkit: strategy cpu (auto: the device tier is host memory; all 64 experts fit the " in r.stderr
    r = ft_run(*base, "--cache-experts", "8", "--bandwidth-ratio", "0.5")
    assert json.loads(r.stdout)["stats"]["strategy"] == "hybrid"
    assert "ftkit: strategy hybrid (auto: --bandwidth-ratio 0.5; --cache-experts 8 asked; all 64 experts fit" in r.stderr
    if not torch.cuda.is_available():  # the default is cpu here; asking for cuda is one clear line
        r = ft_run(*base, "--device", "cuda")
        assert r.returncode == 1 and "no CUDA device is available" in r.stderr and "Traceback" not in r.stderr


def test_ft_bench_takes_ft_runs_runtime_flags_from_the_same_declaration():
    """ft-bench decode and serve take ft-run's runtime flags, the same options with the same
    help, but --strategy and --no-graphs, which decode sweeps (--strategies, --graphs)."""
    from ftkit.runtime.cli import RUNTIME_FLAGS
    from ftkit.runtime.cli import app as run_app
    from ftkit.tools.bench.cli import app as bench_app

    def options(app, name):
        return {p.name: (p.opts, p.help, p.default) for p in typer.main.get_command(app).commands[name].params}

    generate = options(run_app, "generate")
    names = {name for name, _, _ in RUNTIME_FLAGS}
    for command, without in (("decode", {"strategy", "no_graphs"}), ("serve", set())):
        bench = options(bench_app, command)
        assert {n: bench[n] for n in names - without} == {n: generate[n] for n in names - without}, command
        assert not without & set(bench)
    assert "cuda when a GPU is present" in generate["device"][1] and "ft-calibrate" in generate["profile"][1]
