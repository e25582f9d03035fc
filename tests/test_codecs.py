"""The commit rule's contract for every codec, on random vectors and on
language-model-like rows: decode(encode(v)) == commit(v) bit for bit, commit is
idempotent, exact codecs are exact, and malformed payloads raise CodecError."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from xcosd.codecs import get_codec
from xcosd.errors import CodecError
from xcosd.methods.distance import total_variation, tv_distance
from xcosd.sampling import SamplingParams, warp

NAMES = ["f32", "f16", "bf16", "q8", "q8:lin", "q8:sqrt", "sparse", "topk:1", "topk:7",
         "topk:50", "head:1", "head:7", "head:50", "f32+zstd", "f16+zstd", "q8+zstd",
         "sparse+zstd", "topk:50+zstd:9", "head:50+zstd"]
EXACT = {"f32", "sparse", "f32+zstd", "sparse+zstd"}
VOCAB = 151_936  # Qwen2.5's vocabulary size

finite = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, width=32,
                   allow_subnormal=True)
vectors = st.one_of(
    arrays(np.float32, st.integers(1, 300), elements=finite),
    # mostly zeros: the shape of a top-k / top-p row
    st.integers(1, 2000).flatmap(lambda n: st.lists(
        st.tuples(st.integers(0, n - 1), finite), max_size=20).map(
        lambda kv, n=n: _scatter(n, kv))),
)


def _scatter(n: int, kv: list[tuple[int, float]]) -> np.ndarray:
    v = np.zeros(n, dtype=np.float32)
    for i, x in kv:
        v[i] = x
    return v


def bits(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype=np.float32).tobytes()


def check_contract(name: str, v: np.ndarray) -> None:
    c = get_codec(name)
    data = c.encode(v)
    dec = c.decode(data, v.shape[0])
    com = c.commit(v)
    assert dec.dtype == np.float32 and dec.shape == v.shape
    if c.exact:
        assert np.array_equal(dec, v)  # exact in value (the sign of a zero may differ)
        assert np.array_equal(com, v)
    else:
        assert bits(dec) == bits(com)
    assert bits(c.commit(com)) == bits(com)
    again = c.decode(c.encode(com), v.shape[0])
    if c.exact:  # exact in value: a sparse codec does not send a zero's sign
        assert np.array_equal(again, com)
    else:
        assert again.tobytes() == bits(com)
    assert len(data) <= c.max_encoded_size(v.shape[0])
    assert c.encoded_size(v) == len(data)
    assert np.all(dec >= 0) and np.all(np.isfinite(dec))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=vectors)
def test_contract_on_random_vectors(name: str, v: np.ndarray) -> None:
    check_contract(name, v)


def zipf_row(rng: np.random.Generator, s: float = 1.1, n: int = VOCAB) -> np.ndarray:
    p = (np.arange(n) + 2.7) ** -s
    rng.shuffle(p)
    return (p / p.sum()).astype(np.float32)


WARPS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_p=0.95),
         SamplingParams(top_k=50), SamplingParams(temperature=0)]


@pytest.fixture(scope="module")
def model_rows() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    rows = []
    for s in (0.9, 1.1, 1.5):
        p = zipf_row(rng, s)
        rows += [(f"zipf{s} {w.label()}", warp(p, w)) for w in WARPS]
    logits = rng.normal(0, 3, VOCAB)
    g = np.exp(logits - logits.max())
    rows.append(("gauss-logits", (g / g.sum()).astype(np.float32)))
    return rows


@pytest.mark.parametrize("name", NAMES)
def test_contract_on_model_like_rows(name: str, model_rows: list[tuple[str, np.ndarray]]) -> None:
    for _, p in model_rows:
        check_contract(name, p)


def test_exactness_flags() -> None:
    for name in NAMES:
        assert get_codec(name).exact == (name in EXACT), name
        assert get_codec(name).name == name.replace("+zstd:3", "+zstd")


def test_sparse_is_exact_and_small_after_top_k(model_rows: list[tuple[str, np.ndarray]]) -> None:
    p = dict(model_rows)["zipf1.1 T=1 top-k 50"]
    c = get_codec("sparse")
    assert tv_distance(p, c) == 0.0
    assert len(c.encode(p)) <= 5 + 50 * 8  # u32 indices at worst, f32 values
    assert np.array_equal(c.decode(c.encode(p), p.size), p)


def test_topk_keeps_the_largest_with_ties_to_lowest_index() -> None:
    v = np.array([0.1, 0.3, 0.1, 0.3, 0.0, 0.1, 0.1], dtype=np.float32)
    c = get_codec("topk:3")
    assert np.flatnonzero(c.commit(v)).tolist() == [0, 1, 3]
    assert np.flatnonzero(get_codec("topk:10").commit(v)).tolist() == [0, 1, 2, 3, 5, 6]


def test_q8_log_has_lowest_tv_of_the_8_bit_quantisers(
        model_rows: list[tuple[str, np.ndarray]]) -> None:
    for label, p in model_rows:
        if "greedy" in label:
            continue
        tv = {n: tv_distance(p, get_codec(n)) for n in ("q8", "q8:lin", "q8:sqrt")}
        assert tv["q8"] <= tv["q8:lin"], (label, tv)
        if "T=1" in label or "gauss" in label:
            assert tv["q8"] <= tv["q8:sqrt"] + 1e-4, (label, tv)
        else:  # a sharpened row has little tail; sqrt can come slightly ahead
            assert tv["q8"] <= 1.5 * tv["q8:sqrt"], (label, tv)
        if "T=1" in label and "top" not in label:  # dense rows
            assert tv["q8"] < 0.02 and tv["q8:lin"] > 0.1


def test_lossy_tv_is_small_on_dense_rows(model_rows: list[tuple[str, np.ndarray]]) -> None:
    p = dict(model_rows)["zipf1.1 T=1"]
    assert tv_distance(p, get_codec("bf16")) < 2e-3
    assert tv_distance(p, get_codec("f16")) < 3e-3
    assert tv_distance(p, get_codec("f32")) == 0.0
    assert total_variation(p, p) == 0.0


def test_sizes() -> None:
    v = np.zeros(1000, dtype=np.float32)
    v[[3, 500, 999]] = [0.5, 0.25, 0.25]
    assert len(get_codec("f32").encode(v)) == 4000
    assert len(get_codec("f16").encode(v)) == 2000
    assert len(get_codec("bf16").encode(v)) == 2000
    assert len(get_codec("q8").encode(v)) == 1005
    assert len(get_codec("sparse").encode(v)) == 5 + 3 * (2 + 4)  # u16 gaps
    assert len(get_codec("sparse+zstd").encode(np.ones(5000, np.float32) / 5000)) < 200


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize("name", NAMES)
def test_wrong_length_and_junk_are_rejected(name: str) -> None:
    c = get_codec(name)
    v = np.zeros(64, dtype=np.float32)
    v[[1, 5]] = [0.75, 0.25]
    data = c.encode(v)
    for bad in (data[:-1], data + b"\x00", b"", b"\xff" * 7):
        with pytest.raises(CodecError):
            c.decode(bad, 64)
    with pytest.raises(CodecError):
        c.decode(data, 63 if "zstd" not in name and "sparse" not in name
                 and "topk" not in name and "head" not in name else 1)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_nan_and_negative_payloads_are_rejected(name: str) -> None:
    c = get_codec(name)
    dtype = {"f32": "<f4", "f16": "<f2"}.get(name)
    for bad in (np.nan, -0.5, np.inf):
        v = np.array([0.5, bad], dtype=np.float64)
        if dtype:
            raw = v.astype(dtype).tobytes()
        else:
            raw = (v.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        with pytest.raises(CodecError):
            c.decode(raw, 2)
        with pytest.raises(CodecError):
            c.encode(v.astype(np.float32))


def test_sparse_payloads_are_checked() -> None:
    import struct

    c = get_codec("sparse")

    def pairs(width: int, idx: list[int], vals: list[float], fmt: str) -> bytes:
        return (struct.pack("<BI", width, len(idx)) + np.array(idx, fmt).tobytes()
                + np.array(vals, "<f4").tobytes())

    assert np.array_equal(c.decode(pairs(4, [1, 9], [0.5, 0.5], "<u4"), 10)[[1, 9]],
                          [0.5, 0.5])
    bad = [
        pairs(4, [1, 10], [0.5, 0.5], "<u4"),  # index out of range
        pairs(4, [5, 1], [0.5, 0.5], "<u4"),  # not ascending
        pairs(4, [1, 1], [0.5, 0.5], "<u4"),  # repeated
        pairs(2, [1, 0], [0.5, 0.5], "<u2"),  # zero gap
        pairs(1, [5, 5], [0.5, 0.5], "<u1"),  # gaps past the end
        pairs(4, [1, 2], [np.nan, 0.5], "<u4"),
        pairs(4, [1, 2], [-0.5, 0.5], "<u4"),
        pairs(4, [1, 2], [0.0, 0.5], "<u4"),  # zeros are never sent
        pairs(3, [1, 2], [0.5, 0.5], "<u4"),  # unknown width
        struct.pack("<BI", 4, 11),  # more entries than the vector has
    ]
    for b in bad:
        with pytest.raises(CodecError):
            c.decode(b, 10)
    with pytest.raises(CodecError):  # topk refuses more than K entries
        get_codec("topk:1").decode(pairs(4, [1, 2], [0.5, 0.5], "<u4"), 10)


def test_head_keeps_the_tail_mass_flat_and_checks_its_value() -> None:
    c = get_codec("head:2")
    v = np.array([0.1, 0.5, 0.05, 0.3, 0.05, 0.0], dtype=np.float32)
    com = c.commit(v)
    # the head exactly; the other four positions share the tail's 0.2 evenly
    assert com[[1, 3]].tolist() == [np.float32(0.5), np.float32(0.3)]
    assert np.all(com[[0, 2, 4, 5]] == np.float32(0.2 / 4))
    assert len(c.encode(v)) == len(get_codec("topk:2").encode(v)) + 4
    # a row with no more non-zeros than K has no tail: topk's row
    w = np.array([0.0, 0.6, 0.0, 0.4], dtype=np.float32)
    assert bits(c.commit(w)) == bits(get_codec("topk:2").commit(w))
    head = get_codec("topk:2").encode(v)
    for tail in (float("nan"), float("inf"), -0.1, 0.31):  # 0.31 > the head's least value
        with pytest.raises(CodecError):
            c.decode(head + struct.pack("<f", tail), 6)
    # a head of every position leaves no tail, nor does a head of fewer than K entries
    for row in ([0.6, 0.4], [0.0, 1.0, 0.0, 0.0]):
        x = np.array(row, dtype=np.float32)
        with pytest.raises(CodecError, match="no encoder sends"):
            c.decode(get_codec("topk:2").encode(x) + struct.pack("<f", 0.1), x.size)


def test_q8_payloads_are_checked() -> None:
    import struct

    c = get_codec("q8")
    good = c.encode(np.array([0.5, 0.25, 0.0], np.float32))
    assert c.decode(good, 3)[0] == np.float32(0.5)
    codes = good[5:]
    for head in (struct.pack("<fB", np.nan, 0), struct.pack("<fB", -1.0, 0),
                 struct.pack("<fB", np.inf, 0), struct.pack("<fB", 0.5, 9),
                 struct.pack("<fB", 0.0, 0)):
        with pytest.raises(CodecError):
            c.decode(head + codes, 3)
    with pytest.raises(CodecError):  # the maximum must carry code 255
        c.decode(struct.pack("<fB", 0.5, 0) + bytes([3, 2, 1]), 3)


def test_zstd_bombs_and_trailing_bytes_are_refused() -> None:
    import zstandard

    c = get_codec("f32+zstd")
    bomb = zstandard.ZstdCompressor().compress(bytes(4 * 10_000))
    with pytest.raises(CodecError):
        c.decode(bomb, 100)  # expands beyond 4 * 100 bytes: refused before inflating
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(400))
    with pytest.raises(CodecError):
        c.decode(no_size, 100)
    ok = c.encode(np.full(100, 0.01, np.float32))
    with pytest.raises(CodecError):
        c.decode(ok + b"junk", 100)


def test_registry_names() -> None:
    for bad in ("f64", "topk:0", "topk:x", "f16+gzip", "f16+zstd+zstd", "q8:cube", "+zstd"):
        with pytest.raises(CodecError):
            get_codec(bad)
    assert get_codec("topk:5").k == 5  # type: ignore[attr-defined]
    assert get_codec("q8:log").name == "q8"


def test_q8_commit_is_idempotent_when_the_grid_choice_would_change() -> None:
    # committed on one log grid, this vector's cost model prefers another on re-encoding
    v = np.array([0.25, 0.25, 0.01, 1.0, 0.375, 0.625, 0.1875, 0.125] + [0.75] * 6,
                 dtype=np.float32)
    for name in ("q8", "q8+zstd"):
        c = get_codec(name)
        once = c.commit(v)
        assert once.tobytes() == c.commit(once).tobytes()


def test_every_log_grid_lies_on_the_128_step_lattice() -> None:
    """The encoder looks for the grid a committed vector is on only when its first
    entry lies on the 128-steps lattice: every level of every grid must, and a raw
    entry between two lattice points must not (else a committed vector would lose
    its grid, and commit would stop being idempotent)."""
    from xcosd.codecs.q8 import _LOG_STEPS, _levels_log, _on_log_lattice

    rng = np.random.default_rng(7)
    for scale in [1.0, 0.5, 3e-4, *rng.uniform(1e-6, 1.0, 6)]:
        scale = float(np.float32(scale))
        for steps in _LOG_STEPS:
            levels = _levels_log(scale, steps)
            assert all(_on_log_lattice(float(x), scale) for x in levels if x > 0), (scale, steps)
        mids = np.float32(scale) * np.float32(2.0) ** (-(np.arange(1, 200) + 0.5) / 128)
        assert not any(_on_log_lattice(float(x), scale) for x in mids), scale
        # committed on a grid whose levels sit far below the finest grid's range,
        # a vector keeps that grid whatever its first entry
        v = np.concatenate(([scale], scale * 2.0 ** -rng.uniform(0, 30, 40))).astype(np.float32)
        once = get_codec("q8").commit(v)
        assert once.tobytes() == get_codec("q8").commit(once).tobytes()


# ------------------------------------------- fast paths: bits, adversarial rows


def _hash(n: int, salt: int) -> np.ndarray:
    """Deterministic pseudo-random uint32 per index (integer arithmetic only, so the
    rows below are the same bits on every platform and numpy version)."""
    h = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B1) + np.uint32(salt)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _floats(exponent: np.ndarray, h: np.ndarray) -> np.ndarray:
    """float32 with these biased exponent fields and hashed mantissas."""
    bits = (exponent.astype(np.uint32) << np.uint32(23)) | (h >> np.uint32(9))
    return bits.view(np.float32)


def adversarial_rows(n: int = 262_144) -> dict[str, np.ndarray]:
    """Rows that stress the codecs' fast paths (at the size the speed target is for)."""
    h, g = _hash(n, 1), _hash(n, 2)
    rows = {"dense": _floats(87 + (g % np.uint32(40)), h)}  # 2^-40 .. 2^-1, log-spread
    den = (h >> np.uint32(10)).view(np.float32).copy()  # float32 subnormals ...
    den[::4099] = _floats(np.full(den[::4099].size, 120), g[::4099])  # ... and a few normals
    rows["denormal"] = den
    rows["half-subnormal"] = _floats(101 + (g % np.uint32(13)), h)  # 2^-26 .. 2^-13
    # a 4-gram row's shape: most entries share one backed-off value, a few hundred
    # distinct others, some zeros
    palette = _floats(100 + np.arange(300) % 20, _hash(300, 3))
    ties = np.full(n, palette[0], dtype=np.float32)
    pick = g % np.uint32(100) < 15
    ties[pick] = palette[h[pick] % np.uint32(300)]
    ties[g % np.uint32(997) == 0] = 0
    rows["ties"] = ties
    # four values mixed uniformly: ties at every rank, on an exact log grid
    rows["four-values"] = np.array([2e-6, 1e-6, 5e-7, 2.5e-7], np.float32)[h % np.uint32(4)]
    rows["all-equal"] = np.full(n, 1.0 / n, dtype=np.float32)
    one = np.zeros(n, dtype=np.float32)
    one[n // 3] = 1.0
    rows["one-hot"] = one
    rows["signed-zeros"] = np.where(g % np.uint32(7) == 0, _floats(np.full(n, 110), h),
                                    np.float32(-0.0)).astype(np.float32)
    return rows


@pytest.fixture(scope="module")
def adversarial() -> dict[str, np.ndarray]:
    return adversarial_rows()


#: sha256 (first 16 hex digits) of each codec's bytes for each adversarial row, as the
#: float64 / numpy-cast encoders wrote them before the fast paths: the fast encoders
#: must write the same bytes (zstd's own output is not pinned: it is the library's)
PINNED: dict[str, dict[str, str]] = {
    "dense": {"f32": "91ecb34b4cb94364", "f16": "6431ff32f755d8d4", "bf16": "efeb0294a03b2a1a",
              "q8": "50d5b0eb3979a37d", "q8:lin": "f12ea8a6d20c491a",
              "q8:sqrt": "273f979cf37722ec", "sparse": "4efa7e7b1ff19a91",
              "topk:50": "462550a2d5ea70ca"},
    "denormal": {"f32": "d3f1845c1ab82aa3", "f16": "d5c63b9411d489fb",
                 "bf16": "9f2fe840312fe55c", "q8": "c7dfaa80f2f70873",
                 "q8:lin": "24a1b91790fdb4ff", "q8:sqrt": "da75acf11a350401",
                 "sparse": "d17713050b5056d9", "topk:50": "ca416354c7eb7d78"},
    "half-subnormal": {"f32": "ee14161ab5da005a", "f16": "3757aeecfe47eeb9",
                       "bf16": "ef95496c5f66ae74", "q8": "ad853e2f3fec3af5",
                       "q8:lin": "bec1201dbe808a48", "q8:sqrt": "10f206a134759549",
                       "sparse": "065a2f0007b50b9e", "topk:50": "66640a16ec3eb1d9"},
    "ties": {"f32": "8cfb0dbdd022fdfc", "f16": "b7119acff62c7aae", "bf16": "44b7a7396f6c9058",
             "q8": "bfccbe0aa5f2b910", "q8:lin": "20a45bb03f7b5669",
             "q8:sqrt": "d444cbded9624a6c", "sparse": "56fe3a2f82269225",
             "topk:50": "0769481fcc2118d7"},
    "four-values": {"f32": "a66c8142351633a5", "f16": "39c2ba5715863cbd",
                    "bf16": "5edcf55e438bce4a", "q8": "c219d518e58d58f8",
                    "q8:lin": "ed0b3e46d3914cc7", "q8:sqrt": "ccb15b60c71ecdd8",
                    "sparse": "3ddb6921a15a1245", "topk:50": "3f5b05b0af9a4e69"},
    "all-equal": {"f32": "b88091f3f33029b5", "f16": "5d13ba5d22458efb",
                  "bf16": "df22f2424127bd7a", "q8": "44ae3f460fb9a45d",
                  "q8:lin": "a25685da4792d620", "q8:sqrt": "a25685da4792d620",
                  "sparse": "aaf680c411c9ec8a", "topk:50": "881f16527030f4b5"},
    "one-hot": {"f32": "539b9850beff54b5", "f16": "32a97dde69fdbede",
                "bf16": "0e683fd5a0a6b683", "q8": "617b7849fd6d1252",
                "q8:lin": "0e16eb9ae512f4de", "q8:sqrt": "0e16eb9ae512f4de",
                "sparse": "6ba0f0fea82e1570", "topk:50": "6ba0f0fea82e1570"},
    "signed-zeros": {"f32": "9a0d5e3ee4f865f0", "f16": "5356daba8e92291d",
                     "bf16": "effcbe6a83c4ea06", "q8": "c9a890d4ee572535",
                     "q8:lin": "17733c35756ea765", "q8:sqrt": "e2913ddfa7392822",
                     "sparse": "b7c2c67a7018d614", "topk:50": "226169a274847bd1"},
}


@pytest.mark.parametrize("row", sorted(PINNED))
def test_encoded_bytes_are_pinned_on_adversarial_rows(row: str,
                                                      adversarial: dict[str, np.ndarray]) -> None:
    import hashlib

    v = adversarial[row]
    for name, digest in PINNED[row].items():
        c = get_codec(name)
        data = c.encode(v)
        assert hashlib.sha256(data).hexdigest()[:16] == digest, name
        zstd = get_codec(name + "+zstd")
        assert zstd.decode(zstd.encode(v), v.size).tobytes() == c.decode(data, v.size).tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_contract_on_adversarial_rows(name: str, adversarial: dict[str, np.ndarray]) -> None:
    for v in adversarial.values():
        check_contract(name, v)


def _f16_reference(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v.astype("<f2").view("<u2")


def _f16_edge_cases() -> np.ndarray:
    f = np.float32
    ulp = np.nextafter
    edges = [0.0, 2.0 ** -149, 2.0 ** -126, 2.0 ** -26, 2.0 ** -25, 2.0 ** -24, 2.0 ** -15,
             2.0 ** -14, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 - 2.0 ** -12,
             2.0 - 2.0 ** -11, 65504.0, 65519.0, 65520.0, 65536.0, 1e30,
             float(np.finfo(np.float32).max)]
    # every rounding boundary of the subnormal halves, and of the step into 2^-14:
    # (j + 1/2) * 2^-24 rounds to even
    edges += [(j + 0.5) * 2.0 ** -24 for j in range(1025)]
    # normal halves: the halfway point of every mantissa step in a few binades
    for e in (-14, -13, -1, 0, 10, 15):
        edges += [(1 + (m + 0.5) / 1024) * 2.0 ** e for m in range(0, 1024, 7)]
    x = np.array(edges, dtype=np.float32)
    with np.errstate(over="ignore"):
        around = np.concatenate([x, ulp(x, f(np.inf)), ulp(x, f(0))])
    return around[np.isfinite(around)]


def test_f16_encoding_is_numpys_half_cast_bit_for_bit() -> None:
    from xcosd.codecs.halves import f32_to_f16_bits

    edge = _f16_edge_cases()
    assert np.array_equal(f32_to_f16_bits(edge), _f16_reference(edge))
    # random bit patterns over every finite non-negative float32, and each binade
    # from 2^-30 to 2^16 with its low 13 bits at and around the rounding point
    rng = np.random.default_rng(16)
    bits = rng.integers(0, 0x7F800000, 1 << 20, dtype=np.uint32)
    e = rng.integers(97, 144, 1 << 18, dtype=np.uint32)
    low = rng.choice(np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], np.uint32), e.size)
    mid = rng.integers(0, 1 << 10, e.size, dtype=np.uint32) << np.uint32(13)
    bits = np.concatenate((bits, (e << np.uint32(23)) | mid | low))
    v = bits.view(np.float32)
    assert np.array_equal(f32_to_f16_bits(v), _f16_reference(v))
    # -0.0, the only signed value an encoder accepts, keeps its sign
    z = np.array([-0.0, 0.5, -0.0, 2.0 ** -20], np.float32)
    assert np.array_equal(f32_to_f16_bits(z), _f16_reference(z))


def test_f16_decoding_is_numpys_half_cast_and_refuses_the_rest() -> None:
    c = get_codec("f16")
    h = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    valid = (h < 0x7C00) | (h == 0x8000)  # finite non-negative halves and -0.0
    ok = h[valid]
    assert c.decode(ok.tobytes(), ok.size).tobytes() == ok.view("<f2").astype(np.float32).tobytes()
    for bad in h[~valid][::97]:
        with pytest.raises(CodecError):
            c.decode(np.array([0, bad], "<u2").tobytes(), 2)


def test_f16_encoding_on_adversarial_rows(adversarial: dict[str, np.ndarray]) -> None:
    for name, v in adversarial.items():
        assert get_codec("f16").encode(v) == _f16_reference(v).tobytes(), name


@pytest.mark.parametrize("kind", ["log", "lin", "sqrt"])
def test_q8_codes_are_the_float64_quantisers(kind: str, adversarial: dict[str, np.ndarray],
                                            model_rows: list[tuple[str, np.ndarray]]) -> None:
    """The float32 estimates with float64 fix-ups give the float64 formula's codes,
    on every grid, for every entry."""
    from xcosd.codecs.q8 import _LOG_STEPS, Q8

    c = Q8(kind)
    rows = [*adversarial.values(), *(p for _, p in model_rows)]
    for v in rows:
        scale = float(v.max())
        for steps in (_LOG_STEPS if kind == "log" else (0,)):
            levels = c._levels(scale, steps)
            ref = c._codes_exact(v, scale, steps)
            ref[levels[ref] == 0] = 0
            assert np.array_equal(c._codes(v, scale, steps, levels, np.empty_like(v)), ref)


def test_q8_grid_choice_is_the_float64_cost_models(
        adversarial: dict[str, np.ndarray], model_rows: list[tuple[str, np.ndarray]]) -> None:
    from xcosd.codecs.q8 import _choose_steps, _choose_steps_exact

    rows = [*adversarial.values(), *(p for _, p in model_rows)]
    rng = np.random.default_rng(3)
    rows += [(rng.random(5000) ** e).astype(np.float32) for e in (1, 4, 16, 64, 256)]
    for v in rows:
        if v.max() > 0:
            assert _choose_steps(v, float(v.max())) == _choose_steps_exact(v, float(v.max()))


def test_q8_keeps_its_guarantees_on_adversarial_rows(adversarial: dict[str, np.ndarray]) -> None:
    for name in ("q8", "q8:lin", "q8:sqrt"):
        c = get_codec(name)
        for row, v in adversarial.items():
            data = c.encode(v)
            codes = np.frombuffer(data, np.uint8, offset=5)
            com = c.commit(v)
            assert com.tobytes() == c.commit(com).tobytes(), (name, row)  # idempotent
            assert np.all(com[v == 0] == 0) and np.all(codes[v == 0] == 0), (name, row)
            top = v == v.max()
            assert np.all(codes[top] == 255) and np.all(com[top] == v.max()), (name, row)


def test_topk_keeps_the_largest_with_ties_to_lowest_index_on_adversarial_rows(
        adversarial: dict[str, np.ndarray]) -> None:
    for k in (1, 7, 50, 1000, 100_000):
        c = get_codec(f"topk:{k}")
        for row, v in adversarial.items():
            nz = np.flatnonzero(v)
            best = nz[np.lexsort((nz, -v[nz]))][:k]  # by value, then by index
            assert np.array_equal(c.keep(v), np.sort(best)), (k, row)  # type: ignore[attr-defined]


def test_sparse_decodes_dense_and_gappy_index_runs() -> None:
    """Both ways of rebuilding indices from gaps (the prefix sum, and the mask built
    from the few gaps other than 1) agree with the encoder on rows with zero runs at
    the start, the end, and longer than a u8 gap."""
    c = get_codec("sparse")
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = int(rng.integers(1, 5000)) if trial % 4 else 70_000
        v = (rng.random(n) + 0.01).astype(np.float32)
        for _ in range(int(rng.integers(0, 4))):
            a = int(rng.integers(0, n))
            v[a:a + int(rng.choice([1, 2, 255, 256, 300, 65_536]))] = 0
        if trial % 3 == 0:
            v[rng.random(n) < 0.5] = 0
        if trial % 5 == 0:
            v[0] = 0
        assert np.array_equal(c.decode(c.encode(v), n), v)


def test_zstd_level_is_3_for_small_payloads_and_1_for_large_ones() -> None:
    """Levels are the sender's choice (any level decodes alike): ``+zstd`` keeps level
    3's bytes under 128 KiB of inner payload and switches to level 1 above, where it
    is faster for about the same size; ``+zstd:LEVEL`` is one level throughout."""
    import zstandard

    from xcosd.codecs.zstd import FAST_FROM

    def z(level: int, raw: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=level, write_content_size=True,
                                        write_checksum=False).compress(raw)

    rng = np.random.default_rng(5)
    for n in (1000, FAST_FROM // 4 - 1, FAST_FROM // 4, 262_144):
        v = (rng.random(n) ** 8).astype(np.float32)
        raw = get_codec("f32").encode(v)
        assert get_codec("f32+zstd").encode(v) == z(3 if len(raw) < FAST_FROM else 1, raw)
        assert get_codec("f32+zstd:3").encode(v) == z(3, raw)
        assert get_codec("f32+zstd:1").encode(v) == z(1, raw)
        for name in ("f32+zstd", "f32+zstd:3", "f32+zstd:1", "f32+zstd:19"):
            assert np.array_equal(get_codec("f32+zstd").decode(get_codec(name).encode(v), n), v)
    assert get_codec("q8+zstd:3").name == "q8+zstd:3" and get_codec("q8+zstd").name == "q8+zstd"
