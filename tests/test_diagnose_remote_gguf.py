"""`ft-diagnose --remote` on GGUF repositories: a real HTTP server on loopback serves fixture
repositories as the Hub does (`resolve` URLs with ranges, and the model-info API's `siblings`),
and the CLI picks the model a spec names (`org/name`, `org/name:TAG`, `org/name/FILE.gguf`),
fetches the headers of each of its files and gives the local file's verdict, for a small
fraction of its bytes."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from test_diagnose_remote import Hub
from typer.testing import CliRunner

import gguf_fixtures as gfx
from ftkit.runtime.random_model import demo_spec, write_random_gguf
from ftkit.tools.diagnose.cli import app
from ftkit.tools.diagnose.remote import FIRST_RANGE, RemoteError, parse_remote, pick_gguf
from ftkit.tools.diagnose.report import diagnose

ORG = "tiny-org"
MANY, ONE, BROKEN = f"{ORG}/Tiny-GGUF", f"{ORG}/One-GGUF", f"{ORG}/Broken-GGUF"
API = "/api/models/{repo}/revision/main"
SPEC = dataclasses.replace(demo_spec(256), hidden_size=256, moe_intermediate_size=256, head_dim=32, num_experts=8)
EXPERTS = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(SPEC.num_layers) for p in ("gate", "up", "down")]
MIX = {"blk.0.ffn_gate_exps.weight": "q4_k", "blk.0.ffn_up_exps.weight": "q4_k", "blk.0.ffn_down_exps.weight": "q6_k",
       "blk.1.ffn_down_exps.weight": "q8_0", "blk.2.attn_q.weight": "q8_0"}
PAD_KEY, PAD_COUNT = "ftkit.test.padding", 18_000  # ~1.15 MB of metadata: past the first 1 MiB range


class RepoHub(Hub):
    """The Hub's routes over `root/ORG/NAME/...`: GET /ORG/NAME/resolve/main/PATH (files in
    subfolders too; `Range: bytes=a-b` honoured unless `ignore_range`) and the model-info API,
    GET /api/models/ORG/NAME/revision/main -> {"siblings": [{"rfilename": PATH}, ...]} of every
    file under the repository, recursively; counts the body bytes sent."""

    gone: frozenset[str] = frozenset()  # files the listing names that resolve does not serve

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.requests.append(self.path)
        path = urllib.parse.unquote(self.path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/main", path):
            repo = self.root / m[1]
            if not repo.is_dir():
                return self._reply(404, b"Repository not found")
            return self._reply(200, json.dumps(listing(repo)).encode(), {"content-type": "application/json"})
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/main/(.+)", path)
        file = (self.root / m[1] / m[2]).resolve() if m else None
        if file is None or not file.is_relative_to(self.root.resolve()) or not file.is_file() or m[2] in self.gone:
            return self._reply(404, b"Entry not found")
        size = file.stat().st_size
        r = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("range", ""))
        with open(file, "rb") as f:
            if r and not self.ignore_range:
                start, end = int(r[1]), min(int(r[2]), size - 1)
                f.seek(start)
                return self._reply(206, f.read(end + 1 - start), {"content-range": f"bytes {start}-{end}/{size}"})
            self._reply(200, f.read())


def listing(repo: Path) -> dict:
    """The model-info API's answer for a repository directory: every file, as a posix path in it."""
    names = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    return {"siblings": [{"rfilename": n} for n in names]}


def padded(src: Path, out: Path) -> Path:
    """The GGUF `src` with a large string array in its metadata (the gguf package's writer), as a
    vocabulary makes a real header a few MB."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    gfx._copy_metadata(reader, writer)
    writer.add_array(PAD_KEY, [f"token-{i:06d}-" + "x" * 42 for i in range(PAD_COUNT)])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Three repositories under one root: MANY (Q8_0, Q4_K_M, a split Q6_K in big/, an mmproj
    file, a README; no config.json), ONE (one model, an mmproj file, a README) and BROKEN (a
    Q3_K file cut short in the middle of its metadata)."""
    work, root = tmp_path_factory.mktemp("gguf-work"), tmp_path_factory.mktemp("gguf-hub")
    f32 = padded(write_random_gguf(work / "f32.gguf", SPEC), work / "padded.gguf")
    many = root / MANY
    (many / "big").mkdir(parents=True)
    q8 = gfx.requantize_gguf(f32, many / "Tiny-Q8_0.gguf", dict.fromkeys(EXPERTS, "q8_0"))
    q4 = gfx.requantize_gguf(f32, many / "Tiny-Q4_K_M.gguf", MIX)
    q6 = gfx.requantize_gguf(f32, work / "Tiny-Q6_K.gguf", {**dict.fromkeys(EXPERTS[:6], "q6_k"), **MIX})
    parts = gfx.split_gguf(q6, many / "big" / "Tiny-Q6_K.gguf", max_tensors=12)
    shutil.copy(q8, many / "mmproj-Tiny-F16.gguf")
    (many / "README.md").write_text("# Tiny-GGUF\n")
    one = root / ONE
    one.mkdir(parents=True)
    single = shutil.copy(q8, one / "One-Q8_0.gguf")
    shutil.copy(q8, one / "mmproj-One-F16.gguf")
    (one / "README.md").write_text("# One-GGUF\n")
    broken = root / BROKEN
    broken.mkdir(parents=True)
    field = gguf.GGUFReader(q8).fields[PAD_KEY]  # cut among the padding array's strings, past 1 MiB
    cut = field.offset + sum(p.nbytes for p in field.parts) - 50_000
    (broken / "Broken-Q3_K.gguf").write_bytes(q8.read_bytes()[:cut])
    return SimpleNamespace(root=root, q8=q8, q4=q4, parts=parts, single=single, cut=cut)


@pytest.fixture
def hub(repos: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[RepoHub]]:
    handler = type("FixtureHub", (RepoHub,), {"root": repos.root, "sent": [], "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def run(spec: str) -> tuple[int, dict, str]:
    """`ft-diagnose --remote SPEC --json`: the exit code, the report, and all the output."""
    result = CliRunner().invoke(app, ["--remote", spec, "--json"])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, json.loads(result.stdout), result.output


def asked(handler: type[RepoHub], repo: str) -> set[str]:
    """The repository's files that were requested (unquoted paths inside it)."""
    prefix = f"/{repo}/resolve/main/"
    return {urllib.parse.unquote(p).removeprefix(prefix) for p in handler.requests if p.startswith(prefix)}


def same_as_local(r: dict, local_file: Path) -> None:
    local = diagnose(local_file)
    assert local["verdict"] == "PASS" and local["header_only"] is False, local
    assert (r["verdict"], r["header_only"], r["kind"], r["problems"]) == ("PASS", True, "gguf", []), r
    assert (r["family"], r["tensors"], r["memory"]) == (local["family"], local["tensors"], local["memory"])


def test_a_tag_picks_its_model_and_fetches_only_its_header(repos, hub) -> None:
    spec = f"{MANY}:Q4_K_M"
    code, r, _ = run(spec)
    assert (code, r["path"]) == (0, spec)
    same_as_local(r, repos.q4)
    size, header = repos.q4.stat().st_size, gfx.header_end(repos.q4)
    assert header > 1 << 20  # the doubling ranges were needed
    sent = sum(hub.sent)
    assert header <= sent < size / 10, (header, sent, size)
    assert asked(hub, MANY) == {"Tiny-Q4_K_M.gguf"}
    assert [p for p in hub.requests if p.startswith("/api/")] == [API.format(repo=MANY)]
    assert len(hub.requests) == 1 + 2  # the API, then 1 MiB and the next 1 MiB of the file


def test_no_tag_and_no_config_picks_q4_k_m(repos, hub) -> None:
    code, r, _ = run(MANY)
    assert (code, r["path"]) == (0, MANY)
    same_as_local(r, repos.q4)
    assert asked(hub, MANY) == {"config.json", "Tiny-Q4_K_M.gguf"}  # config.json: a 404


def test_a_lower_case_tag_picks_the_split_model_and_fetches_every_part(repos, hub) -> None:
    code, r, _ = run(f"{MANY}:q6_k")
    assert code == 0
    assert len(repos.parts) >= 3 and repos.parts[0].name == f"Tiny-Q6_K-00001-of-{len(repos.parts):05d}.gguf"
    same_as_local(r, repos.parts[0])
    assert asked(hub, MANY) == {f"big/{p.name}" for p in repos.parts}
    # each file from its start in ranges that double from 1 MiB: at most that or twice its header
    bound = sum(max(FIRST_RANGE, 2 * gfx.header_end(p)) for p in repos.parts)
    assert sum(hub.sent) - len(json.dumps(listing(repos.root / MANY))) <= bound
    assert sum(hub.sent) < sum(p.stat().st_size for p in repos.parts) / 2


def test_a_file_path_names_the_split_model(repos, hub) -> None:
    spec = f"{MANY}/big/{repos.parts[0].name}"
    code, r, _ = run(spec)
    assert (code, r["path"]) == (0, spec)
    same_as_local(r, repos.parts[0])
    assert asked(hub, MANY) == {f"big/{p.name}" for p in repos.parts}


def test_an_unknown_tag_is_one_line_listing_the_models(hub) -> None:
    code, r, output = run(f"{MANY}:Q2_K")
    assert (code, r["verdict"], len(r["problems"])) == (2, "FAIL", 1)
    problem = r["problems"][0]
    assert "\n" not in problem and problem.startswith(f"{MANY}: no file ends in Q2_K"), problem
    for model in ("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "big/Tiny-Q6_K-00001-of-"):
        assert model in problem
    assert "mmproj" not in problem and "-00002-of-" not in problem
    assert asked(hub, MANY) == set()  # no file fetched
    result = CliRunner().invoke(app, ["--remote", f"{MANY}:Q2_K"])  # the readable form: one line
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and f"{MANY}: no file ends in Q2_K" in lines[0], result.output


def test_a_server_that_ignores_ranges(repos, hub) -> None:
    hub.ignore_range = True
    code, r, _ = run(f"{MANY}:Q8_0")
    assert code == 0
    same_as_local(r, repos.q8)
    assert asked(hub, MANY) == {"Tiny-Q8_0.gguf"}


def test_the_only_model_needs_no_tag(repos, hub) -> None:
    code, r, _ = run(ONE)
    assert (code, r["path"]) == (0, ONE)
    same_as_local(r, repos.single)
    assert asked(hub, ONE) == {"config.json", "One-Q8_0.gguf"}  # not the mmproj file


def test_a_truncated_header_fails(repos, hub) -> None:
    assert 1 << 20 < repos.cut < repos.q8.stat().st_size
    code, r, _ = run(BROKEN)
    assert (code, r["verdict"]) == (1, "FAIL"), r
    assert len(r["problems"]) == 1 and "Broken-Q3_K.gguf" in r["problems"][0], r["problems"]
    assert "truncated header" in r["problems"][0] and PAD_KEY in r["problems"][0], r["problems"]
    assert r["problems"] == diagnose(repos.root / BROKEN / "Broken-Q3_K.gguf")["problems"]  # as the local file
    assert asked(hub, BROKEN) == {"config.json", "Broken-Q3_K.gguf"}


def test_parse_remote_forms() -> None:
    assert parse_remote("org/name") == ("org/name", None, None)
    assert parse_remote("org/name:Q4_K_M") == ("org/name", None, "Q4_K_M")
    assert parse_remote("org/name:ud-q4_k_xl.1") == ("org/name", None, "ud-q4_k_xl.1")
    assert parse_remote("org/name/m.gguf") == ("org/name", "m.gguf", None)
    assert parse_remote("org/name/sub/dir/M-Q8_0.GGUF") == ("org/name", "sub/dir/M-Q8_0.GGUF", None)
    for bad in ("org", "org/", "/name", "org//name", "org/name/file.bin", "org/name/../x.gguf", "org/name:bad tag",
                "org/name/x.gguf:Q4_K_M", "org/name/sub/"):
        with pytest.raises(RemoteError, match="is not a Hugging Face repository"):
            parse_remote(bad)


def test_pick_gguf_names_an_ambiguous_tag() -> None:
    names = ["a/M-Q4_K_M.gguf", "b/M-Q4_K_M.gguf", "M-Q8_0-00002-of-00002.gguf", "M-Q8_0-00001-of-00002.gguf"]
    assert pick_gguf("o/n", names, "q8_0") == ["M-Q8_0-00001-of-00002.gguf", "M-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(RemoteError, match=r"o/n: 2 files end in Q4_K_M; name one as o/n:TAG"):
        pick_gguf("o/n", names, "Q4_K_M")
    with pytest.raises(RemoteError, match=r"o/n: 3 models; name one"):
        pick_gguf("o/n", names, None)
    with pytest.raises(RemoteError, match="no GGUF file"):
        pick_gguf("o/n", ["README.md", "mmproj-F16.gguf"], None)


def test_a_listed_file_the_hub_does_not_serve_is_one_line(repos, hub) -> None:
    hub.gone = frozenset({f"big/{repos.parts[1].name}"})
    code, r, _ = run(f"{MANY}:Q6_K")
    assert (code, r["verdict"], len(r["problems"])) == (2, "FAIL", 1)
    assert "not found (HTTP 404)" in r["problems"][0] and repos.parts[1].name in r["problems"][0], r["problems"]
