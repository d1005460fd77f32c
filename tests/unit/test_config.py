import pydantic
import pytest

from weight_sync import SyncConfig
from weight_sync.config import MiB, auto_bucket_bytes


def test_defaults_are_valid_and_frozen() -> None:
    config = SyncConfig()
    assert config.master_addr == "127.0.0.1"
    with pytest.raises(pydantic.ValidationError):
        config.bucket_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alignment": 48}, "power of two"),
        ({"alignment": 8}, "power of two"),
        ({"bucket_bytes": 32, "alignment": 64}, "at least alignment"),
        ({"master_addr": "0.0.0.0"}, "allow_all_interfaces"),
        ({"master_addr": "::"}, "allow_all_interfaces"),
        ({"master_addr": "  "}, "master_addr"),
        ({"interface": "eth0/1"}, "network interface name"),
        ({"interface": ""}, "network interface name"),
        ({"interface": "a-very-long-interface-name"}, "network interface name"),
        ({"rendezvous_timeout_s": 0}, "greater than 0"),
        ({"push_timeout_s": -1}, "greater than 0"),
        ({"push_timeout_s": 60, "collective_timeout_s": 30}, "exceed 2 x collective_timeout_s"),
        ({"staging": "copy"}, "stream"),
        ({"cast_dtype": "int8"}, "bfloat16"),
        ({"backend": "mpi"}, "gloo"),
        ({"group_mode": "shared"}, "standalone"),
        ({"bucket_sise": 1}, "no field 'bucket_sise': did you mean 'bucket_bytes'"),
        ({"bucket_size": 1 << 20}, "did you mean 'bucket_bytes'.*docs/api.md"),
        ({"timeout_s": 60}, "did you mean .*'push_timeout_s'"),
        ({"frobnicate": True}, "no field 'frobnicate': its fields are bucket_bytes, "),
        ({"bucket_bytes": -1}, "at least alignment .* or 'auto'"),
    ],
)
def test_bad_values_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(**kwargs)


def test_wildcard_needs_opt_in() -> None:
    assert SyncConfig(master_addr="0.0.0.0", allow_all_interfaces=True).master_addr == "0.0.0.0"


def test_every_field_is_described() -> None:
    for name, field in SyncConfig.model_fields.items():
        assert field.description, name


def test_an_interface_resolves_to_its_address() -> None:
    from weight_sync.errors import TransportError
    from weight_sync.transport import address_of_interface

    assert address_of_interface("lo") == "127.0.0.1"
    with pytest.raises(TransportError, match=r"interface 'nosuch0' has no IPv4 address.*lo"):
        address_of_interface("nosuch0")


@pytest.mark.parametrize(
    ("given", "push", "collective", "rendezvous", "rpc"),
    [
        ({}, 900, 300, 120, 120),  # the defaults are what 900 s for a push derives
        ({"push_timeout_s": 20}, 20, 20 / 3, 20 / 3, 20 / 3),  # one number is enough
        ({"push_timeout_s": 3000}, 3000, 1000, 120, 120),
        ({"collective_timeout_s": 600}, 1800, 600, 120, 120),
        ({"collective_timeout_s": 2}, 6, 2, 2, 2),
        ({"push_timeout_s": 20, "rpc_timeout_s": 3}, 20, 20 / 3, 20 / 3, 3),  # given: kept
        ({"push_timeout_s": 100, "collective_timeout_s": 10}, 100, 10, 100 / 3, 100 / 3),
        ({"rpc_timeout_s": 5}, 900, 300, 120, 5),
    ],
)
def test_timeouts_left_out_are_derived_from_those_given(
    given: dict, push: float, collective: float, rendezvous: float, rpc: float
) -> None:
    config = SyncConfig(**given)
    got = (
        config.push_timeout_s,
        config.collective_timeout_s,
        config.rendezvous_timeout_s,
        config.rpc_timeout_s,
    )
    assert got == pytest.approx((push, collective, rendezvous, rpc))


@pytest.mark.parametrize(
    ("value", "kept"), [("auto", "auto"), (None, None), (1, 1), (64 << 20, 64 << 20)]
)
def test_direct_min_bytes_takes_auto_a_size_or_none(value: object, kept: object) -> None:
    assert SyncConfig().direct_min_bytes == "auto"
    assert SyncConfig(direct_min_bytes=value).direct_min_bytes == kept


@pytest.mark.parametrize("value", [0, -1, "big"])
def test_direct_min_bytes_refuses_the_rest(value: object) -> None:
    with pytest.raises(pydantic.ValidationError):
        SyncConfig(direct_min_bytes=value)


GiB = 1 << 30


@pytest.mark.parametrize(
    ("device_type", "free", "expected"),
    [
        ("cpu", None, 32 * MiB),  # the host: Gloo and the rings gain nothing from more
        ("cpu", 80 * GiB, 32 * MiB),  # free memory of a GPU says nothing about the host
        ("cuda", None, 256 * MiB),  # not known here: as if plenty
        ("cuda", 78 * GiB, 256 * MiB),  # an idle H100: the cap
        ("cuda", 8 * GiB, 256 * MiB),  # a thirty-second is 256 MiB exactly
        ("cuda", 6 * GiB, 128 * MiB),  # 192 MiB, rounded down to a power of two
        ("cuda", 2 * GiB, 64 * MiB),
        ("cuda", 600 * MiB, 16 * MiB),  # a crowded GPU: the floor
        ("cuda", 0, 16 * MiB),
    ],
)
def test_auto_buckets_fit_the_device(device_type: str, free: int | None, expected: int) -> None:
    assert auto_bucket_bytes(device_type, free) == expected
    sized = SyncConfig().sized_for(device_type, free)
    assert sized.sized_bucket_bytes == expected
    assert sized.bucket_bytes == expected


def test_a_bucket_size_given_is_kept_on_every_device() -> None:
    config = SyncConfig(bucket_bytes=3 * MiB)
    assert config.sized_for("cuda", 80 * GiB) is config
    assert config.sized_for("cpu").sized_bucket_bytes == 3 * MiB
