"""API keys (gateway/auth.py), request ids (request_ids.py) and the concurrency limit
(admission.py): the rules, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh.gateway.errors import InvalidRequest, Overloaded, Unauthenticated
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.wire.admission import FALLBACK_LIMIT, Admission
from stagemesh.gateway.wire.auth import ANONYMOUS, ApiKeys, bearer_token, owner_id, parse_keys
from stagemesh.shared.proto.v1 import common_pb2


def test_keys_come_from_the_environment_and_the_file_together(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# ops team\nsk-file-1\n\n  sk-file-2  # rotated in May\n#sk-old\n")
    keys = ApiKeys.load({"STAGEMESH_API_KEYS": " sk-env-1, ,sk-env-2"}, keys_file)
    for key in ("sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"):
        assert keys.owner(f"Bearer {key}") == owner_id(key)
    for refused in ("Bearer sk-old", "Bearer # ops team", "Bearer sk-file-1 # x", None, "",
                    "Basic sk-env-1", "Bearer", "sk-env-1"):
        with pytest.raises(Unauthenticated):
            keys.owner(refused)


def test_with_no_key_configured_everyone_is_the_anonymous_owner() -> None:
    keys = ApiKeys.load({})
    assert not keys.enabled
    assert keys.owner(None) == keys.owner("Bearer anything") == ANONYMOUS


def test_an_owner_id_names_a_key_without_revealing_it() -> None:
    assert owner_id("sk-a") == owner_id("sk-a") != owner_id("sk-b")
    assert "sk-a" not in owner_id("sk-a") and len(owner_id("sk-a")) < 32
    assert ApiKeys.of(["sk-a"]).digests != (owner_id("sk-a").encode(),)


def test_the_bearer_scheme_is_case_insensitive_and_a_huge_token_is_not_hashed() -> None:
    assert bearer_token("bearer  sk-1 ") == bearer_token("BEARER sk-1") == "sk-1"
    assert bearer_token("Bearer " + "x" * 5000) is None
    assert parse_keys(["a # b", "#c", "  ", "d"]) == ["a", "d"]


@pytest.mark.parametrize("bad", ["a\nb", "a b", "caf\u00e9", "x" * 129, "a/b", "\x00"])
def test_a_bad_request_id_is_refused_naming_where_it_came_from(bad: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_request_id(bad, "x-request-id")
    assert refused.value.field_name == "x-request-id"


def test_a_good_request_id_is_kept_as_it_is() -> None:
    assert check_request_id("req-1.a:b_C", "request_id") == "req-1.a:b_C"
    assert check_request_id("", "request_id") == ""  # not given: the gateway assigns one


def test_over_the_limit_admission_refuses_with_a_retry_after_from_recent_latency() -> None:
    now = [0.0]
    admission = Admission(None, limit=2, clock=lambda: now[0])
    with admission.slot():
        now[0] += 30.0  # one request of 30 s finishes
    assert admission.retry_after() == 15  # a slot frees every 30 s / 2 slots
    with admission.slot(), admission.slot():
        with pytest.raises(Overloaded) as refused, admission.slot():
            pass
        assert refused.value.http_status == 429 and refused.value.retry_after == 15
    assert admission.running == 0


def test_retry_after_is_at_least_a_second_and_bounded() -> None:
    now = [0.0]
    admission = Admission(None, limit=100, clock=lambda: now[0])
    assert admission.retry_after() == 1  # nothing measured yet
    with admission.slot():
        now[0] += 0.01
    assert admission.retry_after() == 1
    with admission.slot():
        now[0] += 1e9
    assert admission.retry_after() == 120


class _Catalog:
    def __init__(self, pending: dict[str, int | None]) -> None:
        self.pending = pending

    async def description(self, endpoint: StageEndpoint) -> common_pb2.StageDescription | None:
        value = self.pending[endpoint.address]
        return None if value is None else common_pb2.StageDescription(max_pending=value)


class _Core:
    """What Admission reads of a GatewayCore: the recipes and their stages' descriptions."""

    def __init__(self, pending: dict[str, int | None]) -> None:
        stages = {name: StageEndpoint(name, name) for name in pending}
        self.recipes = {
            "img": Recipe("img", Task.TEXT_TO_IMAGE, "m",
                          {k: v for k, v in stages.items() if k in ("tokenizer", "dit", "vae")}),
            "tts": Recipe("tts", Task.TEXT_TO_SPEECH, "m",
                          {k: v for k, v in stages.items() if k in ("talker", "codec")})}
        self.catalog = _Catalog(pending)


async def test_the_default_limit_is_what_the_stages_can_queue() -> None:
    core = _Core({"tokenizer": 256, "dit": 8, "vae": 256, "talker": 16, "codec": 64})
    admission = Admission(core)  # type: ignore[arg-type]  # the two attributes it reads
    with admission.slot():  # sized after a request, in the background
        pass
    assert admission._sizing is not None
    await admission._sizing
    assert admission.limit == 8 + 16  # per recipe its smallest queue, summed


async def test_an_unreadable_stage_leaves_the_limit_as_it_is() -> None:
    core = _Core({"tokenizer": 256, "dit": None, "vae": 256, "talker": 16, "codec": 64})
    admission = Admission(core)  # type: ignore[arg-type]
    with admission.slot():
        pass
    assert admission._sizing is not None
    await admission._sizing
    assert admission.limit == FALLBACK_LIMIT
