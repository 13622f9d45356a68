"""Cache-layer configuration: LMCache key names, YAML or dict, clear errors."""

import pytest

from cachelayer.config import CacheLayerConfigError, load_config, parse_config


def test_lmcache_keys_are_accepted_as_they_are(tmp_path):
    file = tmp_path / "lmcache.yaml"
    file.write_text(
        "chunk_size: 8\nlocal_cpu: true\nmax_local_cpu_size: 2.5\n"
        f"local_disk: file://{tmp_path}/disk\nmax_local_disk_size: 1\n"
        "save_unfull_chunk: false\nenable_kv_events: true\npre_caching_hash_algorithm: sha256_cbor_64bit\n"
        "cache_policy: LFU\nenable_controller: true\nlmcache_instance_id: inst\n"
        "controller_pull_url: localhost:9001\nlmcache_worker_ports: [8001]\n"
        "p2p_host: localhost\np2p_init_ports: [8200]\n"
    )
    config = load_config(file)
    assert config.chunk_size == 8
    assert config.max_local_cpu_bytes == int(2.5 * 2**30)
    assert config.local_disk_path == tmp_path / "disk"
    assert config.cache_policy == "LFU"
    assert config.lmcache_worker_ports == [8001]


def test_defaults_follow_lmcache_documented_example():
    config = parse_config({})
    assert config.chunk_size == 256
    assert config.save_unfull_chunk is True
    assert config.lmcache_instance_id == "lmcache_default_instance"


@pytest.mark.parametrize("variable", ["CACHELAYER_CONFIG_FILE", "LMCACHE_CONFIG_FILE"])
def test_file_is_found_through_the_environment(tmp_path, monkeypatch, variable):
    file = tmp_path / "c.yaml"
    file.write_text("chunk_size: 16\n")
    monkeypatch.delenv("CACHELAYER_CONFIG_FILE", raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.setenv(variable, str(file))
    assert load_config().chunk_size == 16


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"chunk_size": 0}, r"at `chunk_size`: Expected `int` >= 1"),
        ({"chunk_sise": 8}, r"unknown field `chunk_sise`.*accepted keys: chunk_size"),
        (
            {"cache_policy": "ARC"},
            r"at `cache_policy`: Invalid enum value 'ARC' \(choose one of LRU, LFU, FIFO\)",
        ),
        ({"local_disk": "/tmp/x"}, r"max_local_disk_size is 0"),
        ({"max_local_cpu_size": "big"}, r"at `max_local_cpu_size`: Expected `float`"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(data, message):
    with pytest.raises(CacheLayerConfigError, match=message):
        parse_config(data, "mine.yaml")


def test_unreadable_and_invalid_files_are_reported_with_their_path(tmp_path):
    with pytest.raises(CacheLayerConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: [\n")
    with pytest.raises(CacheLayerConfigError) as caught:
        load_config(bad)
    # One line, file:line:column (1-based) and PyYAML's problem, never "<unicode string>".
    assert str(caught.value) == (
        f"{bad}:2:1: not valid YAML: expected the node content, but found '<stream end>' "
        "(while parsing a flow node at line 2)"
    )


def test_a_wrong_type_shows_the_value_given(tmp_path):
    path = tmp_path / "cachelayer.yaml"
    path.write_text("chunk_size: 256\nmax_local_cpu_size: big\n")
    with pytest.raises(CacheLayerConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: invalid cache-layer configuration at `max_local_cpu_size`: Expected `float`, got `str` "
        "(the value given: 'big')"
    )
