import random

import pytest

from clusterctl.errors import ConfigError
from clusterctl.launch.hostfile import choose_ports, ordered_addresses, rank_address, ring_hostfiles
from clusterctl.plan.inventory import Node


def test_zone_ids_stripped_and_routable_first():
    n = Node(name="a", host="x", ips=["fe80::1%en10", "10.0.0.5", "fe80::2%en11", "2001:db8::1"])
    assert ordered_addresses(n) == ["10.0.0.5", "2001:db8::1", "fe80::1", "fe80::2"]


def test_ring_needs_ipv4():
    assert rank_address(Node(name="a", host="x", ips=["2001:db8::1", "10.0.0.7"]), all_local=False) == "10.0.0.7"
    with pytest.raises(ConfigError, match="needs an IPv4 address"):
        rank_address(Node(name="a", host="x", ips=["fe80::1%en0"]), all_local=False)
    assert rank_address(Node(name="a", host="x", ips=["fe80::1%en0"]), all_local=False, backend="jaccl") == "fe80::1"
    assert rank_address(Node(name="a"), all_local=True) == "127.0.0.1"


def test_fresh_ports_avoid_recorded_ones():
    rng = random.Random(7)
    avoid = set(range(20000, 32000))
    block = choose_ports(3, avoid, rng=rng)
    assert len(block) == 3 and not avoid.intersection(block)
    assert all(p < 32768 for p in block)  # below the kernel's ephemeral ports (Linux from 32768, macOS 49152)
    with pytest.raises(ConfigError):
        choose_ports(3, set(range(19000, 33000)), rng=rng)


def test_hostfiles_and_mlx_launch_copy(tmp_path):
    assert ring_hostfiles(["10.0.0.1", "10.0.0.2"], [5000, 5001])[1] == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
