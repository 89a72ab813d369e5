"""Property test over the whole key set: any mutation of a valid config loads or raises a ValueError naming a key.

Random keys get random values (wrong types, nan/inf/-inf, negatives, zero, huge integers, random
strings, None, lists) on top of a small valid base. The properties:

* ``load_config`` raises nothing but ``ValueError``, and its message names a config key;
* a value of the wrong type, or a non-finite number, is refused naming the mutated key itself
  (the per-key check catches it, not a later rule or a crash downstream);
* an accepted config holds no non-finite float anywhere and survives its own flat round trip.
"""

from __future__ import annotations

import math
import re
import typing

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet_ext import config as cfg
from fleet_ext.config import load_config

DSV4_BASE = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "csa_compress_ratios": [0, 4, 128, -1],
    "num_attention_heads": 4, "q_lora_rank": 32, "v_head_dim": 32, "qk_pos_emb_head_dim": 8, "o_groups": 2,
    "o_lora_rank": 16, "dsa_index_n_heads": 2, "dsa_index_head_dim": 16, "dsa_index_topk": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64,
    "moe_n_hash_layers": 1, "max_seq_len": 64, "max_steps": 10, "warmup_steps": 2,
}
HYBRID_BASE = {
    **DSV4_BASE, "csa_compress_ratios": [0, 4, 128, -2], "hybrid_mla_attention": "mqa_dsa",
    "hybrid_mla_q_lora_rank": 16, "hybrid_mla_kv_lora_rank": 16, "hybrid_mla_qk_nope_head_dim": 8,
    "hybrid_mla_qk_rope_head_dim": 8, "hybrid_mla_v_head_dim": 8, "hybrid_mla_num_attention_heads": 4,
}
KEYS = sorted(cfg.KEY_TO_SECTION)
HINTS = {key: typing.get_type_hints(cfg.SECTIONS[s])[key] for key, s in cfg.KEY_TO_SECTION.items()}
EDGE_NUMBERS = [math.nan, math.inf, -math.inf, 0, 0.0, -0.0, -1, -1.0, 1, 0.5, 1.0, 2**63, 2**64, 10**400, 1e308,
                5e-324, -1e-300]
EDGE_STRINGS = ["nan", "inf", "-inf", ".nan", "1e999", "-1e-3", "0", "", " ", "auto", "triton", "float32"]

values = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.sampled_from(EDGE_STRINGS),
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 130), st.sampled_from([math.nan, 4.0, True, "4"])), max_size=6),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
DEFAULTS = load_config().to_dict()
CHOICES = {f.name: f.metadata["choices"] for c in cfg.SECTIONS.values()
           for f in c.__dataclass_fields__.values() if "choices" in f.metadata}


def _plausible(key: str) -> st.SearchStrategy:
    """Values of the key's own type near its default, so that accepted configs are drawn too."""
    default, (base, _) = DEFAULTS[key], _base_type(HINTS[key])
    if key in CHOICES:
        return st.sampled_from(CHOICES[key])
    if base is bool:
        return st.booleans()
    if base is int:
        return st.integers(min_value=0, max_value=max(2 * (default or 0), 64))
    if base is float:
        return st.floats(min_value=0.0, max_value=max(2 * default, 1.0))
    return values


@st.composite
def _mutation(draw: st.DrawFn) -> tuple[str, typing.Any]:
    key = draw(st.sampled_from(KEYS))
    return key, draw(st.one_of(values, _plausible(key)))


mutations = st.lists(_mutation(), min_size=1, max_size=3, unique_by=lambda kv: kv[0]).map(dict)


def _base_type(annotation: typing.Any) -> tuple[typing.Any, bool]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    return (args[0] if args and typing.get_origin(annotation) is not list else annotation), optional


def _finite_number(value: typing.Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        return math.isfinite(float(value))
    except (ValueError, OverflowError):
        return False


def _refused_by_its_own_check(key: str, value: typing.Any) -> bool:
    """Independent of fleet_ext.config: whether ``value`` has the wrong type for ``key`` or is non-finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return True
    base, optional = _base_type(HINTS[key])
    if value is None:
        return not optional
    if base is float:
        return not _finite_number(value)
    if base is int:
        return isinstance(value, bool) or not isinstance(value, int)
    if base in (bool, str):
        return not isinstance(value, base)
    return not isinstance(value, (list, tuple))


def _floats(value: typing.Any) -> typing.Iterator[float]:
    if isinstance(value, float):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floats(item)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from([DSV4_BASE, HYBRID_BASE]), changes=mutations)
def test_every_mutation_loads_or_raises_a_value_error_naming_a_key(base, changes):
    try:
        config = load_config({**base, **changes})
    except ValueError as err:
        named = set(re.findall(r"`(\w+)`", str(err))) & set(KEYS)
        assert str(err).startswith("config key `") and named, f"{changes!r}: {err}"
        own = [key for key, value in changes.items() if _refused_by_its_own_check(key, value)]
        if len(changes) == 1 and own:
            assert f"config key `{own[0]}`" in str(err), f"{changes!r}: {err}"
        return
    assert not [key for key, value in changes.items() if _refused_by_its_own_check(key, value)], changes
    flat = config.to_dict()
    bad = {key: value for key, value in flat.items() if any(not math.isfinite(x) for x in _floats(value))}
    assert not bad, f"{changes!r} was accepted with non-finite values {bad}"
    assert load_config(flat) == config
