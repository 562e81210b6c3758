import pytest

from clusterctl.errors import ConfigError, MissingInput
from clusterctl.plan.inventory import load_cluster

from clusters import THREE, write_cluster


def test_three_nodes_parse(tmp_path):
    c = load_cluster(write_cluster(tmp_path / "c.toml", THREE))
    assert c.name == "lab"
    assert [n.name for n in c.nodes] == ["a", "b", "c"]
    a, b, _ = c.nodes
    assert a.is_local and not b.is_local
    assert b.ips == ["10.0.0.2", "fe80::1%en10"]
    assert a.python == "python3" and a.port == 22


BAD = [
    ("[[node]]\nname='a'\ncolour='red'\n", "node a: colour: unknown key"),
    ("[[node]]\nname='a'\n[[node]]\nname='a'\n", "node a: name: duplicate node name"),
    ("[[node]]\nname='a'\nips=['10.0.0.300']\n", "node a: ips: '10.0.0.300' is not an IP address"),
    ("[[node]]\nname='a'\nips=['10.0.0.1%en0']\n", "a zone id is only valid on IPv6"),
    ("[[node]]\nname='a'\nhost='-oProxyCommand=touch /tmp/x'\n", "node a: host: '-oProxyCommand=touch /tmp/x' starts with '-'"),
    ("[[node]]\nname='a'\nhost='a b'\n", "node a: host:"),
    ("[[node]]\nname='a'\npython='venv/bin/python'\n", "node a: python: 'venv/bin/python' is relative"),
    ("[[node]]\nname='a'\nmodel_path='models/m'\n", "node a: model_path: 'models/m' is relative"),
    ("[[node]]\nname='a'\nport=70000\n", "node a: port:"),
    ("[[node]]\nname='a'\nmemory_gb=-1\n", "node a: memory_gb:"),
    ("[[node]]\nname='a'\nusable_fraction=1.5\n", "node a: usable_fraction:"),
    ("[[node]]\nname='a'\nmemory_gb=inf\n", "node a: memory_gb:"),
    ("[[node]]\nname='a'\nmemory_gb=1e308\n", "node a: memory_gb:"),
    ("[[node]]\nname='a'\nmemory_gb='8'\n", "node a: memory_gb:"),
    ("[[node]]\nname='a'\nport=true\n", "node a: port:"),
    ("[[node]]\nname='a'\nips=['fe80::1%']\n", "empty zone id"),
    ("[[node]]\nname='a'\nlinks=[{peer='zz', rdma=true}]\n", "node a: links: unknown peer 'zz'"),
    ("[[node]]\nhost='x'\n", "node #1: name: required"),
    ("[cluster]\nname='lab'\n", "no [[node]] entries"),
    ("[clusterr]\n", "unknown top-level key 'clusterr'"),
    ("[[node]\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_inventory_is_one_clear_error(tmp_path, text, message):
    path = write_cluster(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert str(path) in e.value.message
    assert message in e.value.message
    assert "\n" not in e.value.message


def test_missing_file(tmp_path):
    with pytest.raises(MissingInput) as e:
        load_cluster(tmp_path / "nope.toml")
    assert e.value.exit_code == 66


def test_ipv6_and_link_local_ok(tmp_path):
    c = load_cluster(write_cluster(tmp_path / "c.toml", "[[node]]\nname='a'\nips=['::1','fe80::1%en10','192.168.1.4']\n"))
    assert c.nodes[0].ips[1] == "fe80::1%en10"


def test_local_flag_overrides_host(tmp_path):
    c = load_cluster(write_cluster(tmp_path / "c.toml",
                                   "[[node]]\nname='a'\nhost='127.0.0.1'\n[[node]]\nname='b'\nlocal=true\nhost='x'\n"))
    assert not c.nodes[0].is_local and c.nodes[1].is_local
