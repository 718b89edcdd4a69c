"""`ft-run launch claude | codex | opencode`: stand-in agents on PATH record the environment, arguments
and config they were given, then talk to the real server with the official SDK the way the real
agent would read those settings (Claude Code: ANTHROPIC_* variables and the Messages API; Codex:
`-c` provider overrides and the Responses API; OpenCode: the config file OPENCODE_CONFIG names and
Chat Completions). Nothing is written over the user's files."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftkit.runtime.cli import app
from ftkit.runtime.random_model import demo_spec
from ftkit.runtime.server.agents import served_model
from serving import served, write_model

KEY, MODEL = "launch-key", "tiny"

# One program for the three agents: what it was given, then one request to the server it was
# pointed at, made from those settings alone.
STAND_IN = r'''#!{python}
import json, os, sys
agent, args, env = os.path.basename(sys.argv[0]), sys.argv[1:], dict(os.environ)
record = {"argv": args, "env": env}
if agent == "claude":
    import anthropic
    client = anthropic.Anthropic(base_url=env["ANTHROPIC_BASE_URL"], auth_token=env["ANTHROPIC_AUTH_TOKEN"],
                                 api_key=None, max_retries=0)
    reply = client.messages.create(model=env["ANTHROPIC_MODEL"], max_tokens=3,
                                   messages=[{"role": "user", "content": "hi"}])
    record["reply"] = reply.model_dump()
elif agent == "codex":
    import openai
    over = dict(a.split("=", 1) for a in args[1::2][:6] if "=" in a)
    cfg = {k: json.loads(v) for k, v in over.items()}
    p = "model_providers." + cfg["model_provider"] + "."
    client = openai.OpenAI(base_url=cfg[p + "base_url"], api_key=env[cfg[p + "env_key"]], max_retries=0)
    assert cfg[p + "wire_api"] == "responses"
    record["reply"] = client.responses.create(model=cfg["model"], input="hi", max_output_tokens=3).model_dump()
else:
    import openai
    config = json.load(open(env["OPENCODE_CONFIG"]))
    record["config"] = config
    provider, model = config["model"].split("/", 1)
    options = config["provider"][provider]["options"]
    key = env[options["apiKey"].removeprefix("{env:").removesuffix("}")]
    client = openai.OpenAI(base_url=options["baseURL"], api_key=key, max_retries=0)
    record["reply"] = client.chat.completions.create(model=model, max_tokens=3,
                                                     messages=[{"role": "user", "content": "hi"}]).model_dump()
json.dump(record, open(env["STANDIN_RECORD"], "w"))
sys.exit(7)
'''


@pytest.fixture
def agents_on_path(tmp_path: Path) -> dict[str, str]:
    """The environment a launch runs in: stand-ins first on PATH, a HOME of its own, a real
    Anthropic key the launcher must not pass on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex", "opencode"):
        path = bin_dir / name
        path.write_text(STAND_IN.replace("{python}", sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "home").mkdir()
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
            "STANDIN_RECORD": str(tmp_path / "record.json"), "ANTHROPIC_API_KEY": "sk-ant-real-key",
            "FTKIT_API_KEY": None, "OPENCODE_CONFIG": None, "CODEX_HOME": None}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("launch") / MODEL, demo_spec(512))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(env: dict[str, str], *args: str):
    result = CliRunner().invoke(app, ["launch", *args], env=env)
    assert "Traceback" not in result.output, result.output
    return result


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_an_agent_reuses_the_server_on_the_port(model: Path, agents_on_path: dict, tmp_path: Path, agent: str) -> None:
    with served(model, MODEL, KEY) as srv:
        port = srv.url.rsplit(":", 1)[1]
        result = launch(agents_on_path, agent, "--port", port, "--api-key", KEY, "--", "--resume", "x y")
        assert result.exit_code == 7, result.output  # the agent's own exit code
        assert f"using the ft-run serve on {srv.url} ({MODEL})" in result.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["argv"][-2:] == ["--resume", "x y"]
    assert record["reply"]["model"] == MODEL or record["reply"]["model"].endswith(MODEL)
    env = record["env"]
    if agent == "claude":
        assert "ANTHROPIC_API_KEY" not in env
        assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"]) == (srv.url, KEY)
        assert {env[k] for k in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")} == {MODEL}
        assert record["reply"]["type"] == "message"
    elif agent == "codex":
        assert record["argv"][:2] == ["-c", f'model="{MODEL}"'] and "CODEX_HOME" not in env
        assert record["reply"]["object"] == "response"
    else:
        config_path = Path(env["OPENCODE_CONFIG"])
        assert record["config"]["model"] == f"ftkit/{MODEL}"
        assert not config_path.exists()  # the temporary directory went with the run
        assert not str(config_path).startswith(agents_on_path["HOME"])
        assert record["reply"]["object"] == "chat.completion"
    assert list(Path(agents_on_path["HOME"]).iterdir()) == []  # nothing of the user's touched


def test_a_server_is_started_and_stopped_when_none_answers(model: Path, agents_on_path: dict, tmp_path: Path) -> None:
    port = free_port()
    result = launch(agents_on_path, "claude", "-m", str(model), "--port", str(port), "--device", "cpu",
                    "--strategy", "cpu", "--threads", "1", "--api-key", KEY)
    assert result.exit_code == 7, result.output
    assert "starting ft-run serve -m" in result.stderr and "FTKIT_API_KEY" not in result.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert record["reply"]["usage"]["output_tokens"] >= 1
    assert served_model(f"http://127.0.0.1:{port}") is None  # stopped with the agent


def test_print_shows_the_settings_and_starts_nothing(model: Path, agents_on_path: dict, tmp_path: Path) -> None:
    port = free_port()
    result = launch(agents_on_path, "opencode", "--print", "-m", str(model), "--port", str(port),
                    "--api-key", KEY, "--cache-experts", "8")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"# ft-run serve -m {model} --host 127.0.0.1 --port {port} --cache-experts 8" in out
    assert "export OPENCODE_CONFIG=" in out and f'"baseURL": "http://127.0.0.1:{port}/v1"' in out
    assert KEY not in out  # the key is shown as the variable it comes from
    claude = launch(agents_on_path, "claude", "--print", "-m", str(model), "--port", str(port), "--api-key", KEY)
    assert 'export ANTHROPIC_AUTH_TOKEN="$FTKIT_API_KEY"' in claude.stdout and "unset ANTHROPIC_API_KEY" in claude.stdout
    assert served_model(f"http://127.0.0.1:{port}") is None and not (tmp_path / "record.json").exists()


def test_failures_are_one_line(model: Path, agents_on_path: dict, tmp_path: Path) -> None:
    port = free_port()
    cases = {
        ("claude", "--port", str(port)): f"no ft-run serve answers on http://127.0.0.1:{port}; give -m MODEL",
        ("aider", "-m", str(model), "--port", str(port)): "unknown agent 'aider'; one of claude, codex, opencode",
    }
    for args, message in cases.items():
        result = launch(agents_on_path, *args)
        assert result.exit_code == 1 and result.stderr.strip() == f"error: {message}" + (
            " to start one" if "no ft-run" in message else "")
    no_agents = {**agents_on_path, "PATH": str(tmp_path)}
    result = launch(no_agents, "codex", "-m", str(model), "--port", str(port))
    assert result.exit_code == 1 and result.stderr.strip() == \
        "error: codex is not on PATH (install it: npm install -g @openai/codex)"
    with socket.socket() as busy:  # something that is not ft-run serve holds the port
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = launch(agents_on_path, "claude", "-m", str(model), "--port", str(port), "--device", "cpu")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and "ft-run serve exited with code 1: error: cannot listen on 127.0.0.1" in lines[-1]
    assert "Address already in use" in lines[-1]
