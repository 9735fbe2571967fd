"""A hook on the wire for the weight push's tests: flip one bit of one tensor as it leaves the trainer, on a
copy, so the trainer's own weights stay as they are and the servers really receive and install the changed
bytes. On the stage heads' path the bit is flipped in a bucket the head posts (``weights/link.StageLink.post``);
on the shard path in a slice a rank packs for the wire (``weights/shard_send.SliceSource.values``). The lowest
mantissa bit of a float: the value stays finite, so no receiver refuses it for that."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def corrupt_on_the_wire(name: str | None = None, bucket_index: int = 0) -> Iterator[dict[str, str]]:
    """Within the block, the first flat bucket holding ``name`` (``None``: bucket ``bucket_index``'s last
    tensor) goes out with one bit of that tensor flipped; the dict yielded gets ``{"name": ...}`` once done."""
    from megatron_areal.weights import link, shard_send

    done: dict[str, str] = {}
    seen = [0]
    original = link.StageLink.post

    def post(self, bucket, version):
        index = seen[0]
        seen[0] += 1
        target = name if name is not None else (bucket.names[-1] if index == bucket_index else None)
        if not done and bucket.flat and target in bucket.names:
            offset = 0
            for n, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
                itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                size = torch.Size(shape).numel() * itemsize
                if n == target:
                    break
                offset += size
            payload = bucket.payload[0].clone()
            payload[offset + (size // 2 // itemsize) * itemsize] ^= 1  # an element mid-tensor
            bucket.payload = [payload]
            done["name"] = target
        return original(self, bucket, version)

    names: list[str] = []  # the shard path's tensors in the order this rank packs them
    original_values = shard_send.SliceSource.values

    def values(self, source, want):
        tensor = original_values(self, source, want)
        if want.name not in names:
            names.append(want.name)
        target = name if name is not None else (names[bucket_index] if len(names) > bucket_index else None)
        if done or want.name != target:
            return tensor
        flipped = tensor.clone()
        lanes = flipped.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flipped.element_size()])
        lanes[lanes.numel() // 2] ^= 1  # an element mid-slice
        done["name"] = target
        return flipped

    link.StageLink.post = post
    shard_send.SliceSource.values = values
    try:
        yield done
    finally:
        link.StageLink.post = original
        shard_send.SliceSource.values = original_values
