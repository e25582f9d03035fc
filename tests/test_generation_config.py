"""GenerationConfig: one validated value for every setting of a generation.

Every wrong setting must fail on construction with a ValueError that names it, in
particular a method option the method does not take (it used to be dropped)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from xcosd.config import GenerationConfig, as_config, method_option_names
from xcosd.sampling import SamplingParams


def test_defaults_are_the_nodes_old_defaults() -> None:
    c = GenerationConfig()
    assert (c.method, c.codec, c.draft_len, c.max_new_tokens) == ("xcosd-e", "f32", 4, 64)
    assert c.sampling_params() == SamplingParams(1.0, 0, 1.0)
    assert c.method_options() == {} and c.stop_strings == () and c.seed is None


@pytest.mark.parametrize(("kw", "says"), [
    ({"method": "bogus"}, "unknown method 'bogus'"),
    ({"codec": "f33"}, "unknown codec 'f33'"),
    ({"codec": "f32+gzip"}, "gzip"),
    ({"method": "xcosd", "K": 5}, "'xcosd' does not take K"),
    ({"method": "ar", "hr_presample": False}, "'ar' does not take hr_presample"),
    ({"threshold": 0.3}, "'xcosd-e' does not take threshold"),
    ({"K": 0}, "K must be an integer >= 1"),
    ({"M": 2.5}, "M must be an integer"),
    ({"method": "uhlm", "threshold": 1.5}, "threshold must be in [0, 1]"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"draft_len": -1}, "draft_len"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"seed": -1}, "seed"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"stop_strings": [""]}, "stop_strings"),
    ({"stop_strings": ["ok", 3]}, "stop_strings"),
    ({"speculate": "yes"}, "speculate must be True, False or None"),
    ({"speculate": True, "seed": 1}, "a seeded output would not be reproducible"),
])
def test_bad_settings_fail_on_construction(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as e:
        GenerationConfig(**kw)
    assert says in str(e.value), str(e.value)


def test_speculation_is_on_unless_seeded() -> None:
    assert GenerationConfig().resolved_speculate()
    assert not GenerationConfig(seed=1).resolved_speculate()
    assert not GenerationConfig(speculate=False).resolved_speculate()


def test_method_options_each_method_takes() -> None:
    assert method_option_names("xcosd-e") == {"K", "M", "hr_presample"}
    assert method_option_names("xcosd") == {"hr_presample"}
    assert method_option_names("uhlm") == {"threshold"}
    assert method_option_names("ar") == frozenset()
    c = GenerationConfig(method="xcosd-e", K=5, hr_presample=False)
    assert c.method_options() == {"K": 5, "hr_presample": False}


def test_greedy_is_do_sample_false_or_temperature_zero() -> None:
    g = SamplingParams(0.0, 0, 1.0)
    # do_sample=False wins over the sampling values, as in transformers
    assert GenerationConfig(do_sample=False, temperature=0.7, top_k=5).sampling_params() == g
    assert GenerationConfig(temperature=0).sampling_params() == g
    assert GenerationConfig(temperature=0.5, top_k=3, top_p=0.9).sampling_params() == \
        SamplingParams(0.5, 3, 0.9)


def test_stop_strings_take_one_string_or_many() -> None:
    assert GenerationConfig(stop_strings="\n").stop_strings == ("\n",)
    assert GenerationConfig(stop_strings=["a", "bc"]).stop_strings == ("a", "bc")
    hash(GenerationConfig(stop_strings=["a"]))  # frozen and hashable


def test_replace_and_transformers_names() -> None:
    c = GenerationConfig(K=5, M=3)
    # switching method drops the options the new method does not take ...
    assert c.replace(method="xcosd").method_options() == {}
    # ... but naming one in the same call is still an error
    with pytest.raises(ValueError, match="does not take K"):
        c.replace(method="xcosd", K=4)
    with pytest.raises(ValueError, match="unknown generation setting"):
        c.replace(temprature=0.5)
    d = GenerationConfig.from_kwargs(c, stop="END", do_sample=False, top_p=None)
    assert d.stop_strings == ("END",) and d.greedy and d.top_p == 1.0 and d.K == 5
    with pytest.raises(ValueError, match="not both"):
        GenerationConfig.from_kwargs(stop="a", stop_strings="b")
    assert as_config({"method": "ar"}).method == "ar" and as_config(None) == GenerationConfig()
    assert GenerationConfig(stop_strings="x").to_dict()["stop_strings"] == ["x"]


@pytest.mark.parametrize("cfg", [
    GenerationConfig(),
    GenerationConfig(method="xcosd-e", codec="topk:64+zstd", draft_len=6, do_sample=False,
                     temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=12,
                     stop_strings=("\n\n", "END"), seed=7, K=5, M=3, hr_presample=False,
                     ignore_eos=True),
    GenerationConfig(method="uhlm", threshold=0.25, seed=0),
])
def test_dict_round_trip_through_json(cfg: GenerationConfig) -> None:
    """A config travels to the load tester's device processes (and into its report)
    as a dict: reading it back, even through JSON, gives an equal config."""
    d = json.loads(json.dumps(cfg.to_dict()))
    assert GenerationConfig.from_dict(d) == cfg
    assert as_config(d) == cfg


def test_from_dict_names_an_unknown_or_wrong_setting() -> None:
    with pytest.raises(ValueError, match=r"unknown generation setting.*temprature"):
        GenerationConfig.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig.from_dict({**GenerationConfig().to_dict(), "top_p": 2.0})
