import pytest

from lightning_memopt.memory import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (512, 512),
        ("512", 512),
        ("512MB", 512 * 10**6),
        ("6GiB", 6 * 2**30),
        ("1.5 GB", 1_500_000_000),
        ("1.5gb", 1_500_000_000),
        ("2 KiB", 2048),
        ("3kb", 3000),
        ("1TiB", 2**40),
        ("10B", 10),
    ],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["-1GB", "banana", "6 GiBs", "", "1.5.2GB", "G"])
def test_parse_bytes_rejects_text(value):
    with pytest.raises(ValueError, match=f"budget must be a byte size, got {value!r}"):
        parse_bytes(value, name="budget")


@pytest.mark.parametrize("value", [0, -5, "0GB", "0.0001B"])
def test_parse_bytes_rejects_non_positive(value):
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [True, 1.5, None, [1]])
def test_parse_bytes_rejects_types(value):
    with pytest.raises(ValueError, match="must be a byte size"):
        parse_bytes(value)


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(2**30 * 1.5) == "1.50 GiB"
    assert format_bytes(2**42) == "4096.00 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"


def test_parse_bytes_rejects_overflow():
    with pytest.raises(ValueError, match=r"budget must be a finite byte size, got '1e400GB'"):
        parse_bytes("1e400GB", name="budget")


@pytest.mark.parametrize("value", ["5", True, None])
def test_format_bytes_needs_a_number(value):
    with pytest.raises(
        TypeError, match=rf"format_bytes expects a number of bytes \(int or float\), got {value!r}"
    ):
        format_bytes(value)
