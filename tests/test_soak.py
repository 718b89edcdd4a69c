"""ft-bench soak against the real server, bounded by turns rather than time: every request it
sends is accounted for, none is lost or a 5xx, the streams it drops are dropped, the cache
rebuilds apply, and with one request running at a time (no batching) the replies sent again
alone are the same, bit for bit."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from ftkit.runtime.random_model import demo_spec
from ftkit.runtime.spec import FULL_ATTENTION
from ftkit.tools.bench import soak
from serving import served, write_model

KEY = "soak-key"


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory):
    spec = replace(demo_spec(512), num_layers=1, moe_layers=(0,), layer_kinds=(FULL_ATTENTION,),
                   max_position_embeddings=1024)
    with served(write_model(tmp_path_factory.mktemp("soak") / "soak.ftw", spec), "soak", KEY, max_running=1) as srv:
        yield srv


def test_soak_accounts_for_every_request(one_at_a_time):
    work = soak.Workload(sessions=2, turns=6, max_tokens=8, disconnect=0.5, rebuild_every=3, replay=6)
    r = soak.soak(one_at_a_time.url, KEY, work, pid=os.getpid(), say=lambda line: None)
    assert r["model"] == "soak" and r["context"] == 1024
    assert r["sent"] == 12 and r["completed"] + r["disconnected"] == 12, r
    assert (r["lost"], r["4xx"], r["5xx"], r["errors"]) == (0, 0, 0, [])
    assert r["disconnected"] > 0 and r["rebuilds"] == {"applied": r["completed"] // 3, "refused": 0}
    assert r["replay"]["sent"] == 6 and r["replay"]["differ"] == []
    assert r["rss_bytes"]["end"] > 0
    assert r["prefix_max_tokens"] == 1024 and 0 < r["prefix_tokens"]["end"] <= 1024  # the rows beside the RSS
    assert r["server"]["failed"] == 0
    assert [row[0] for row in soak.rows(r)][:3] == ["duration", "requests sent", "completed"]
