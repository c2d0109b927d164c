"""Bucketing of weights for sync, and the host copy a failed sync restores."""

from __future__ import annotations

import torch

from relax_launch.weights.sync import buckets, copy_bucket, dtype_name


def named(*specs):
    return [
        (f"w{i}", torch.full(shape, float(i), dtype=dtype))
        for i, (shape, dtype) in enumerate(specs)
    ]


def test_buckets_respect_size_and_keep_order():
    tensors = named(((4, 4), torch.float32), ((4, 4), torch.float32), ((8,), torch.float32))
    out = list(buckets(tensors, bucket_bytes=128))
    assert [b.names for b in out] == [["w0", "w1"], ["w2"]]
    assert [b.nbytes for b in out] == [128, 32]


def test_a_tensor_larger_than_a_bucket_travels_alone():
    out = list(buckets(named(((2,), torch.float32), ((64,), torch.float32)), bucket_bytes=16))
    assert [b.names for b in out] == [["w0"], ["w1"]]


def test_a_bucket_mixes_dtypes_and_says_which():
    tensors = named(((2,), torch.float32), ((3,), torch.bfloat16), ((2, 2), torch.float16))
    (bucket,) = buckets(tensors, bucket_bytes=1 << 20)
    assert bucket.nbytes == 8 + 6 + 8
    assert bucket.metadata() == {
        "names": ["w0", "w1", "w2"],
        "dtypes": ["float32", "bfloat16", "float16"],
        "shapes": [[2], [3], [2, 2]],
    }
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"


def test_bucketed_tensors_are_dense_for_the_broadcast():
    strided = torch.arange(12.0).reshape(3, 4).t()
    (bucket,) = buckets([("w", strided)], bucket_bytes=1 << 20)
    assert bucket.tensors[0].is_contiguous() and torch.equal(bucket.tensors[0], strided)


def test_copy_outlives_the_source_and_reuses_matching_spares():
    (bucket,) = buckets(named(((2, 3), torch.float32), ((5,), torch.bfloat16)), 1 << 20)
    spare = [torch.empty(2, 3), torch.empty(5)]  # the second has the wrong dtype
    copy = copy_bucket(bucket, iter(spare))
    assert copy.tensors[0] is spare[0] and copy.tensors[1] is not spare[1]
    assert copy.tensors[1].dtype == torch.bfloat16
    for tensor in bucket.tensors:
        tensor.add_(1)  # the trainer's next step updates its tensors in place
    assert torch.equal(copy.tensors[0], torch.zeros(2, 3))
    assert torch.equal(copy.tensors[1], torch.ones(5, dtype=torch.bfloat16))
    assert copy_bucket(bucket, iter([])).names == ["w0", "w1"]  # no spares: fresh tensors
