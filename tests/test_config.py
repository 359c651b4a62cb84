import pytest

from cswap_lightning import CSwapConfig, Offloader, offload
from cswap_lightning.config import MAX_BYTES


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"min_bytes": -1}, ValueError, r"min_bytes must be >= 0 bytes, got -1"),
        ({"prefetch_bytes": -5}, ValueError, r"prefetch_bytes must be >= 0"),
        ({"plan": "zcv"}, ValueError, (r"plan must be one of 'auto', 'keep', 'raw', 'zvc', "
                                       r"'rle', 'exponent', 'int8', 'fp8', 'int4'; got 'zcv'")),
        ({"compressor": "raw"}, ValueError, r"compressor must be one of 'zvc', 'rle'; got 'raw'"),
        ({"budget": 1.5}, ValueError, r"budget must be None .* in \(0, 1\] .*; got 1.5"),
        ({"budget": "half"}, ValueError, r"budget must be None .*; got 'half'"),
        ({"budget": 0}, ValueError, r"budget must be .*; got 0"),
        ({"budget": True}, TypeError, r"budget must be of type .*, got True"),
        ({"profile_steps": 0}, ValueError, r"profile_steps must be >= 1, got 0"),
        ({"lossy": "int3"}, ValueError,
         r"lossy must be one of 'off', 'auto', 'int8', 'fp8', 'int4'"),
        ({"lossy_exclude": "head*"}, TypeError, r"lossy_exclude must be of type tuple"),
        ({"lossy_exclude": (1,)}, TypeError, r"lossy_exclude must hold strings, got \(1,\)"),
        ({"guard_every": -1}, ValueError, r"guard_every must be >= 0, got -1"),
        ({"guard_tolerance": 0.0}, ValueError, r"guard_tolerance must be > 0, got 0.0"),
        ({"min_bytes": "big"}, ValueError, (r"^CSwapConfig.min_bytes must be a number of bytes "
                                            r">= 0 \(an int, or a size such as '512MiB' or "
                                            r"'1.5GB'\); got 'big'$")),
        ({"min_bytes": "auto"}, ValueError, r"min_bytes must be a number of bytes .*got 'auto'"),
        ({"min_bytes": 1.5}, TypeError, r"min_bytes must be of type int or str"),
        ({"pin_memory": "yes"}, TypeError, r"pin_memory must be of type bool"),
        ({"prefetch_bytes": True}, TypeError,
         r"prefetch_bytes must be of type int or str, got True"),
        ({"prefetch_bytes": "big"}, ValueError, r"prefetch_bytes must be .auto. or a number"),
        ({"plan": None}, TypeError, r"plan must be of type str, got None"),
        ({"budget": 10**21}, ValueError, r"budget=10{21} bytes .* more than any device's memory"),
        ({"budget": 1}, ValueError, (r"budget=1 is 1 byte, less than any step saves .*: for "
                                     r"the whole device's memory write 1.0 or '100%'; for a "
                                     r"size write it with its unit, e.g. '2GiB'")),
        ({"budget": 1000}, ValueError, r"budget=1000 is 1000 bytes"),
        ({"budget": "150%"}, ValueError, r"a percentage such as '50%'\); got 1.5"),
        ({"budget": "2 gallons"}, ValueError, r"a size such as '2GiB' .*; got '2 gallons'"),
        ({"budget": 1e21}, ValueError, r"budget must be .* bytes > 0 \(an int, or a size"),
        ({"prefetch_bytes": 10**14}, ValueError, r"prefetch_bytes=10{14} bytes \(91 TiB\) is more"),
        ({"inflight_bytes": 1 << 45}, ValueError, r"inflight_bytes=.* more than any device"),
        ({"inflight_bytes": "big"}, ValueError, r"inflight_bytes must be .auto. or a number"),
        ({"min_bytes": 1 << 45}, ValueError, r"min_bytes=.* more than any device"),
        ({"recompute": "on"}, ValueError, r"recompute must be one of 'auto', 'off'; got 'on'"),
        ({"recompute": False}, TypeError, r"recompute must be of type str, got False"),
    ],
)
def test_bad_values_fail_at_construction_naming_the_field(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        CSwapConfig(**kwargs)


def test_defaults_and_valid_values():
    cfg = CSwapConfig()
    assert (cfg.plan, cfg.compressor, cfg.min_bytes) == ("auto", "zvc", 256 * 1024)
    assert cfg.budget == "auto" and cfg.lossy == "off" and cfg.recompute == "auto"
    assert CSwapConfig(lossy_exclude=["head*"]).lossy_exclude == ("head*",)
    for budget in (None, "auto", 1 << 30, 0.5, 1.0):
        assert CSwapConfig(budget=budget).budget == budget


@pytest.mark.parametrize(("written", "meant"), [
    ("2GiB", 2 << 30), ("2 GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("512MiB", 512 << 20),
    ("64kb", 64_000), ("1TiB", 1 << 40), ("50%", 0.5), ("100%", 1.0), ("12.5 %", 0.125),
])
def test_budgets_are_taken_in_the_forms_people_write(written, meant):
    """A size with its unit is bytes; a percentage is that share of the device's memory, the
    same as the float (the config keeps what they mean, so equal budgets are equal configs)."""
    config = CSwapConfig(budget=written)
    assert config.budget == meant and type(config.budget) is type(meant)
    assert config == CSwapConfig(budget=meant)


@pytest.mark.parametrize("field", ["min_bytes", "prefetch_bytes", "inflight_bytes",
                                   "host_budget"])
def test_byte_counts_are_taken_as_sizes_too(field):
    # as the budget is: a YAML recipe's `prefetch_bytes: 1GiB` means what `budget: 1GiB` does
    assert getattr(CSwapConfig(**{field: "64KiB"}), field) == 64 << 10
    assert CSwapConfig(**{field: "1.5GB"}) == CSwapConfig(**{field: 1_500_000_000})
    assert getattr(CSwapConfig(**{field: "0B"}), field) == 0


def test_the_host_budget_is_none_or_bytes():
    assert CSwapConfig().host_budget is None
    with pytest.raises(ValueError, match=r"host_budget must be a number of bytes >= 0 .*"
                       r"got 'auto'"):
        CSwapConfig(host_budget="auto")
    with pytest.raises(ValueError, match=r"host_budget must be >= 0 bytes, got -1"):
        CSwapConfig(host_budget=-1)


def test_the_largest_sizes_are_accepted():
    assert CSwapConfig(budget=MAX_BYTES, prefetch_bytes=MAX_BYTES).budget == MAX_BYTES


def test_offload_names_what_it_takes():
    with pytest.raises(TypeError, match=r"offload\(\) takes a CSwapConfig .* got 'raw' \(str\); "
                       r"for that plan: offload\(CSwapConfig\(plan='raw'\)\)"):
        offload("raw")
    with pytest.raises(TypeError, match=r"offload\(\) takes a CSwapConfig .* got 5 \(int\)$"):
        offload(5)


def test_watch_names_what_it_takes():
    with pytest.raises(TypeError, match=r"^Offloader.watch takes the torch.nn.Module being "
                       r"trained, got 'model' \(str\)$"):
        Offloader().watch("model")
