"""The test tiers of tests/conftest.py (what the README command runs): the quick tier's covering
subset, the 1-device smoke pass, and the rest tier as the exact complement."""

from types import SimpleNamespace

import pytest
from conftest import tier_items, xla_flags
from helpers import child_env


class Item:
    """The part of a pytest item the tiers read: module, function name, parameters, markers."""

    def __init__(self, module, function, params=None, markers=()):
        self.module = SimpleNamespace(__name__=module)
        self.originalname = function
        if params is not None:
            self.callspec = SimpleNamespace(params=params)
        self.markers = {m.name: m for m in markers}
        self.name = f"{module}::{function}{sorted((params or {}).items())}"

    def get_closest_marker(self, name):
        return self.markers.get(name)

    def __repr__(self):
        return self.name


def marker(name, *args):
    return SimpleNamespace(name=name, args=args)


def collection():
    cover = marker("quick_cover", "mode")
    smoke = marker("one_device_smoke")
    return [
        Item("test_a", "test_plain", markers=[smoke]),
        *(
            Item("test_a", "test_matrix", {"mode": m, "n": n}, [cover, smoke])
            for m in ("real", "complex")
            for n in (1, 2)
        ),
        Item("test_a", "test_long", {"n": 1}, [marker("slow"), smoke]),
        Item("test_a", "test_search", markers=[marker("heavy"), smoke]),
        Item("test_b", "test_other", {"n": 1}),
        Item("test_b", "test_other", {"n": 2}),
        Item("test_b", "test_static"),
    ]


def names(items):
    return [item.name for item in items]


def test_quick_tier_on_four_devices_covers_each_named_parameter_value_once():
    items = collection()
    quick = tier_items(items, "quick", 4)
    assert names(quick) == names([items[0], items[1], items[3], items[7], items[9]])


def test_one_device_pass_is_the_first_instance_of_each_smoke_module_test():
    items = collection()
    assert names(tier_items(items, "quick", 1)) == names([items[0], items[1]])


@pytest.mark.parametrize("n_devices", [1, 4])
def test_rest_is_the_exact_complement_and_all_is_everything(n_devices):
    items = collection()
    quick, rest = tier_items(items, "quick", n_devices), tier_items(items, "rest", n_devices)
    assert sorted(names(quick) + names(rest)) == sorted(names(items))
    assert not set(names(quick)) & set(names(rest))
    assert names(tier_items(items, "all", n_devices)) == names(items)
    assert {"test_a::test_long[('n', 1)]", "test_a::test_search[]"} <= set(names(rest))  # slow, heavy


def test_the_suite_compiles_fast_unless_told_and_keeps_the_users_xla_flags():
    fast = xla_flags("", "fast").split()
    assert "--xla_backend_optimization_level=0" in fast and "--xla_cpu_use_fusion_emitters=false" in fast
    default = xla_flags("", "default").split()
    assert default == [
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=20",
        "--xla_cpu_collective_call_terminate_timeout_seconds=300",
    ]
    # a flag the user set is theirs, whatever its value; the others are added after it
    mine = xla_flags("--xla_backend_optimization_level=2 --xla_dump_to=/tmp/x", "fast").split()
    assert mine[:2] == ["--xla_backend_optimization_level=2", "--xla_dump_to=/tmp/x"]
    assert sum(f.startswith("--xla_backend_optimization_level") for f in mine) == 1
    assert "--xla_cpu_use_fusion_emitters=false" in mine
    with pytest.raises(ValueError, match="VMCGRAD_TEST_XLA='fastest': expected one of"):
        xla_flags("", "fastest")


def test_processes_the_suite_starts_compile_as_it_does_on_their_own_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 " + xla_flags("", "fast"))
    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("NETKET_EXPERIMENTAL_SHARDING_CPU", "4")
    env = child_env()
    assert env["XLA_FLAGS"].split() == xla_flags("", "fast").split()
    assert [k for k in env if k.startswith(("JAX_", "NETKET_", "XLA_"))] == ["XLA_FLAGS"]
