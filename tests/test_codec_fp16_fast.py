"""The fp16 codec's Numba conversions are bit-identical to NumPy's astype."""

import numpy as np
import pytest

from hipress.codecs import _kernels_cast as kc
from hipress.codecs import get_codec

pytestmark = pytest.mark.skipif(kc.kernels() is None, reason="numba is not installed")


def test_every_float16_decodes_like_numpy():
    allh = np.arange(65536, dtype=np.uint16).view(np.float16)
    got, ref = kc.float16_to_float32(allh), allh.astype(np.float32)
    same = got.view(np.uint32) == ref.view(np.uint32)
    assert np.all(same | (np.isnan(got) & np.isnan(ref)))


@pytest.mark.parametrize("kind", ["bits", "normal", "tiny", "edges"])
def test_encode_matches_numpy_astype_bit_for_bit(kind):
    rng = np.random.default_rng(1)
    if kind == "bits":  # every exponent, both signs, NaN payloads
        x = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(
            np.float32)
    elif kind == "normal":
        x = rng.standard_normal(1 << 20).astype(np.float32)
    elif kind == "tiny":  # half subnormals and round-to-even ties around them
        x = (rng.standard_normal(1 << 20) * 1e-6).astype(np.float32)
    else:
        x = np.array([0.0, -0.0, 65504, 65519.99, 65520, 65536, -65520, 2**-24, 2**-25,
                      3 * 2**-26, 2**-14, np.inf, -np.inf, np.nan, 0.1, 1 + 2**-11,
                      1 + 3 * 2**-11], np.float32)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16)
    got = kc.float32_to_float16(x)
    same = got.view(np.uint16) == ref.view(np.uint16)
    assert np.all(same | (np.isnan(got) & np.isnan(ref)))


def test_codec_uses_them_and_keeps_dtypes():
    codec = get_codec("fp16")
    x = np.array([0.1, 0.2, 0.3], np.float32)
    p = codec.encode(x)
    assert p.sections[0].dtype == np.float16 and p.sections[0].nbytes == 6
    assert codec.decode(p).tolist() == [0.0999755859375, 0.199951171875, 0.300048828125]
    assert codec.decode(codec.encode(x.astype(np.float64))).dtype == np.float64
