"""`ft-run launch`: a coding agent pointed at `ft-run serve`, the way each agent reads its settings.

- Claude Code reads environment variables: `ANTHROPIC_BASE_URL` (it appends `/v1/messages`),
  `ANTHROPIC_AUTH_TOKEN` (sent as `Authorization: Bearer`), and the model for every role it
  picks one for (`ANTHROPIC_MODEL`, the opus/sonnet/haiku defaults, the subagent model).
  `ANTHROPIC_API_KEY` is removed from its environment, so a real key is not sent along.
- Codex reads providers from its config; `-c key=value` flags override it for one run (highest
  precedence), so a provider `ftkit` (`base_url` .../v1, `wire_api = "responses"`, the key from
  `env_key`) is given on the command line and the user's `$CODEX_HOME` is left as it is.
- OpenCode merges the JSON config file that `OPENCODE_CONFIG` names over the user's global one:
  one is written to a temporary directory with a provider `ftkit` (`@ai-sdk/openai-compatible`,
  `baseURL` .../v1) and `model` / `small_model` set to it.

Nothing is written over the user's files; the temporary directory is removed when the agent exits.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

KEY_ENV = "FTKIT_API_KEY"  # the agents' key variable (Codex's env_key, OpenCode's {env:...})
NO_KEY = "ftkit-local"  # sent where the server takes no key: the agents want one to start
PROVIDER = "ftkit"
POLL_S = 0.2  # how often a starting server's /health is asked
STOP_S = 30  # a started server's time to stop after SIGTERM, before it is killed


@dataclass
class Setup:
    """What one agent run is given: environment to set and to remove, leading arguments, files."""

    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    args: list[str] = field(default_factory=list)
    files: dict[Path, str] = field(default_factory=dict)

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        return {**{k: v for k, v in base.items() if k not in self.unset}, **self.env}

    def describe(self, executable: str, secret: str | None) -> str:
        """The setup as shell lines: what `--print` shows (the key as the variable it comes from)."""
        def shown(v: str) -> str:
            return f'"${KEY_ENV}"' if secret and v == secret else shlex.quote(v)

        lines = [f"unset {name}" for name in self.unset]
        lines += [f"export {k}={shown(v)}" for k, v in self.env.items() if not (k == KEY_ENV and v == secret)]
        for path, text in self.files.items():
            lines += [f"# {path}:", *text.rstrip("\n").splitlines()]
        lines.append(shlex.join([executable, *self.args]) + " ARGS...")
        return "\n".join(lines)


def claude(url: str, model: str, key: str, tmp: Path) -> Setup:
    roles = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
             "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
    return Setup(env={"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key, **dict.fromkeys(roles, model)},
                 unset=("ANTHROPIC_API_KEY",))


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def codex(url: str, model: str, key: str, tmp: Path) -> Setup:
    overrides = {"model": model, "model_provider": PROVIDER, f"model_providers.{PROVIDER}.name": PROVIDER,
                 f"model_providers.{PROVIDER}.base_url": f"{url}/v1",
                 f"model_providers.{PROVIDER}.env_key": KEY_ENV,
                 f"model_providers.{PROVIDER}.wire_api": "responses"}
    return Setup(env={KEY_ENV: key}, args=[a for k, v in overrides.items() for a in ("-c", f"{k}={_toml(v)}")])


def opencode(url: str, model: str, key: str, tmp: Path) -> Setup:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": "ftkit (ft-run serve)",
                                "options": {"baseURL": f"{url}/v1", "apiKey": f"{{env:{KEY_ENV}}}"},
                                "models": {model: {"name": model}}}},
        "model": f"{PROVIDER}/{model}",
        "small_model": f"{PROVIDER}/{model}",
    }
    path = tmp / "opencode.json"
    return Setup(env={KEY_ENV: key, "OPENCODE_CONFIG": str(path)}, files={path: json.dumps(config, indent=2) + "\n"})


AGENTS = {"claude": claude, "codex": codex, "opencode": opencode}
INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "codex": "npm install -g @openai/codex",
           "opencode": "npm install -g opencode-ai"}


def setup_for(agent: str, url: str, model: str, api_key: str | None, tmp: Path) -> Setup:
    if agent not in AGENTS:
        raise ValueError(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}")
    return AGENTS[agent](url.rstrip("/"), model, api_key or NO_KEY, tmp)


def write_files(setup: Setup) -> None:
    for path, text in setup.files.items():
        path.write_text(text)


# ---- the server the agent talks to -----------------------------------------------------------
def served_model(url: str, timeout: float = 2.0) -> str | None:
    """The model an `ft-run serve` at `url` serves (its /health needs no key), or None when
    nothing answers; something else answering is a ValueError."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            body = json.loads(resp.read(1 << 16))
    except (urllib.error.HTTPError, ValueError):
        raise ValueError(f"{url} answers, but not as ft-run serve (no /health of its shape)") from None
    except (urllib.error.URLError, OSError):
        return None
    if not isinstance(body, dict) or body.get("status") != "ok" or not isinstance(body.get("model"), str):
        raise ValueError(f"{url} answers, but not as ft-run serve (no /health of its shape)")
    return body["model"]


def client_host(host: str) -> str:
    """Where a client reaches a server bound to `host` (a wildcard address: this machine)."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@contextmanager
def server(argv: list[str], url: str, log: Path, env: dict[str, str], say: Callable[[str], None]) -> Iterator[str]:
    """`ft-run serve argv` running (its output in `log`, in a session of its own so the agent's
    Ctrl-C does not reach it) until the block ends; yields the model name once /health answers.
    A server that exits first is a ValueError with its last line."""
    say(f"starting ft-run serve {shlex.join(argv)} (log: {log})")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ftkit.runtime.cli", "serve", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        while (model := served_model(url)) is None:
            if proc.poll() is not None:
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                raise ValueError(f"ft-run serve exited with code {proc.returncode}: "
                                 + (lines[-1].strip() if lines else "no output"))
            time.sleep(POLL_S)
        yield model
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def executable(agent: str) -> str:
    if agent not in AGENTS:
        raise ValueError(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}")
    exe = shutil.which(agent)
    if exe is None:
        raise ValueError(f"{agent} is not on PATH (install it: {INSTALL[agent]})")
    return exe


def run(exe: str, setup: Setup, args: list[str]) -> int:
    """Run the agent in the foreground with its setup; its exit code. Ctrl-C is the agent's
    (interrupting its turn), not this process's."""
    write_files(setup)
    proc = subprocess.Popen([exe, *setup.args, *args], env=setup.environ(dict(os.environ)))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # after the start: the agent keeps its own
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
