"""Engine roles and the `disaggregation:` section of proxy.yaml: defaults that leave today's
configurations unchanged, and refusals that name the key and the fix."""

from __future__ import annotations

import pytest

from router.config import ConfigError, parse_config


def config(backends: list[dict], **sections) -> dict:
    return {
        "models": [{"name": "m"}],
        "backends": [
            {"url": f"http://127.0.0.1:{8000 + i}", **backend} for i, backend in enumerate(backends)
        ],
        **sections,
    }


KV_AWARE = {"name": "kv_aware"}
SHARED = [{"name": "shared", "backends": ["p", "d"]}]


def test_a_backend_takes_both_roles_by_default_and_no_section_means_no_disaggregation():
    parsed = parse_config(config([{"name": "a"}, {"name": "b"}]))
    assert [backend.role for backend in parsed.backends] == ["both", "both"]
    assert parsed.disaggregation is None


def test_a_prefill_and_a_decode_engine_sharing_a_tier_are_a_valid_split():
    parsed = parse_config(
        config(
            [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
            policy=KV_AWARE,
            shared_tiers=SHARED,
            disaggregation={"mode": "always", "prefill_timeout_s": 5},
        )
    )
    assert [(b.name, b.role) for b in parsed.backends] == [("p", "prefill"), ("d", "decode")]
    assert parsed.disaggregation is not None
    assert (parsed.disaggregation.mode, parsed.disaggregation.prefill_timeout_s) == ("always", 5)
    assert parsed.disaggregation.prefill_attempts == 2


@pytest.mark.parametrize(
    ("backends", "sections", "expected"),
    [
        (
            [{"name": "p", "role": "prefill"}, {"name": "d"}],
            {},
            "`backends[0].role`: backend 'p' takes only prefills, which only `disaggregation:` sends",
        ),
        (
            [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
            {"shared_tiers": SHARED, "disaggregation": {}},
            "a split is decided from the prompt's cached prefix, which only `policy: kv_aware`",
        ),
        (
            [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
            {"policy": KV_AWARE, "disaggregation": {}},
            "`backends[0].role`: prefill backend 'p' shares no `shared_tiers` entry with a decode backend",
        ),
        (
            [{"name": "p", "role": "prefill"}, {"name": "q", "role": "prefill"}],
            {
                "policy": KV_AWARE,
                "disaggregation": {},
                "shared_tiers": [{"name": "shared", "backends": ["p", "q"]}],
            },
            "`disaggregation`: no backend takes decodes",
        ),
        (
            [{"name": "p", "role": "prefiller"}],
            {},
            "`backends[0].role`: Invalid enum value 'prefiller'; expected one of both, decode, prefill",
        ),
        (
            [{"name": "p"}, {"name": "d"}],
            {"policy": KV_AWARE, "disaggregation": {"prefill_attempts": 3}},
            "`disaggregation.prefill_attempts`: Expected `int` <= 2",
        ),
        (
            [{"name": "p"}, {"name": "d"}],
            {"policy": KV_AWARE, "disaggregation": {"mode": "sometimes"}},
            "`disaggregation.mode`: Invalid enum value 'sometimes'; expected one of always, conditional, "
            "never",
        ),
    ],
)
def test_bad_roles_and_disaggregation_are_refused_with_the_key(backends, sections, expected):
    with pytest.raises(ConfigError) as refused:
        parse_config(config(backends, **sections), "proxy.yaml")
    assert expected in str(refused.value)
    assert str(refused.value).startswith("proxy.yaml: invalid configuration at ")


def test_two_engines_of_role_both_can_split_between_them_without_a_prefill_only_one():
    # Each may prefill for the other: no shared tier is required of a `both` engine by the schema
    # (it may also run every request colocated).
    parsed = parse_config(config([{"name": "a"}, {"name": "b"}], policy=KV_AWARE, disaggregation={}))
    assert parsed.disaggregation is not None and parsed.disaggregation.mode == "conditional"
