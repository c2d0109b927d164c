"""Bucketing and flattening of weights for the flattened-bucket sync format."""

from __future__ import annotations

import torch

from relax_launch.weights.sync import buckets, flatten


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


def test_dtype_change_starts_a_new_bucket():
    tensors = named(((2,), torch.float32), ((2,), torch.bfloat16), ((2,), torch.bfloat16))
    assert [b.names for b in buckets(tensors, bucket_bytes=1 << 20)] == [["w0"], ["w1", "w2"]]


def test_flatten_writes_bytes_back_to_back_and_reuses_the_buffer():
    (bucket,) = buckets(named(((2, 3), torch.float32), ((5,), torch.float32)), bucket_bytes=1 << 20)
    spare = torch.empty(1024, dtype=torch.uint8)
    flat = flatten(bucket, spare)
    assert flat.numel() == 44 and flat.data_ptr() == spare.data_ptr()
    values = flat.view(torch.float32)
    assert torch.equal(values[:6], torch.zeros(6)) and torch.equal(values[6:], torch.ones(5))
    grown = flatten(bucket, torch.empty(4, dtype=torch.uint8))
    assert torch.equal(grown, flat)
