import pytest

from cswap_lightning import CSwapConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"min_bytes": -1}, ValueError, r"min_bytes must be >= 0 bytes, got -1"),
        ({"prefetch_bytes": -5}, ValueError, r"prefetch_bytes must be >= 0"),
        ({"plan": "zcv"}, ValueError, r"plan must be one of 'auto', 'keep', 'raw', 'zvc', 'rle'; got 'zcv'"),
        ({"compressor": "raw"}, ValueError, r"compressor must be one of 'zvc', 'rle'; got 'raw'"),
        ({"sparsity_threshold": 1.5}, ValueError, r"sparsity_threshold must be in \[0, 1\], got 1.5"),
        ({"min_bytes": "1MB"}, TypeError, r"min_bytes must be of type int, got '1MB' \(str\)"),
        ({"min_bytes": 1.5}, TypeError, r"min_bytes must be of type int"),
        ({"pin_memory": "yes"}, TypeError, r"pin_memory must be of type bool"),
        ({"prefetch_bytes": True}, TypeError, r"prefetch_bytes must be of type int, got True"),
        ({"plan": None}, TypeError, r"plan must be of type str, got None"),
    ],
)
def test_bad_values_fail_at_construction_naming_the_field(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        CSwapConfig(**kwargs)


def test_defaults_and_valid_values():
    cfg = CSwapConfig()
    assert (cfg.plan, cfg.compressor, cfg.min_bytes) == ("auto", "zvc", 256 * 1024)
    assert CSwapConfig(sparsity_threshold=1, min_bytes=0, plan="rle").sparsity_threshold == 1
