"""Buckets in one process: packing and assembly give back the exact bits, dense or delta, and an
incomplete or inconsistent transfer is refused; FP8 shards quantised apart give the whole weight's blocks."""

from __future__ import annotations

import pytest
import torch

import asyncrl.weight_transfer.buckets as buckets_module
from asyncrl.model.fp8 import AMAX_FLOOR, FP8_MAX, quantize_weight
from asyncrl.weight_transfer import Assembly, BucketHeader, Rendezvous, Shard, TransferError, pack_buckets
from asyncrl.weight_transfer.buckets import changes_against, copy_differing, count_differing
from asyncrl.weight_transfer.shards import partial_amax, quantize_rows


def _shards(name: str, full: torch.Tensor, dim: int, parts: int) -> list[Shard]:
    """`full` cut into `parts` shards along `dim`, as ranks would hold them."""
    out, start = [], 0
    for chunk in full.chunk(parts, dim=dim):
        offset = tuple(start if d == dim else 0 for d in range(full.dim()))
        out.append(
            Shard(
                name=name,
                shape=tuple(full.shape),
                offset=offset,
                local_shape=tuple(chunk.shape),
                values=chunk.contiguous().view(-1),
            )
        )
        start += chunk.shape[dim]
    return out


def _assemble(buckets, expected, base=None) -> dict[str, torch.Tensor]:
    assembly = Assembly(expected=expected, base=base or {})
    for header, payload in buckets:
        header = BucketHeader.decode(header.encode())  # as it travels
        for piece in header.pieces:
            assembly.add(piece, payload)
    return assembly.finish()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(6, 40, generator=g).bfloat16(),  # rows: contiguous shards
        "b": torch.randn(4, 6, 10, generator=g).bfloat16(),  # cut along dim 1: strided shards
    }


def _all_shards(w: dict[str, torch.Tensor]) -> list[Shard]:
    return _shards("a", w["a"], 0, 3) + _shards("b", w["b"], 1, 2)


def test_small_buckets_split_shards_and_reassemble_the_exact_bits():
    w = _weights()
    buckets = list(pack_buckets(_all_shards(w), bucket_bytes=100, version=1))
    assert buckets[-1][0].last and not buckets[-1][0].pieces
    assert len(buckets) > 10 and all(h.payload_bytes == p.numel() <= 100 for h, p in buckets)
    got = _assemble(buckets, {n: tuple(t.shape) for n, t in w.items()})
    assert all(_bits_equal(got[n], w[n]) for n in w)


def test_delta_sends_only_changed_elements_and_gives_the_dense_result():
    old = _weights()
    new = {n: t.clone() for n, t in old.items()}
    new["a"].view(-1)[[3, 100, 101]] += 1.0
    new["b"][0, 5, 2] = -7.0
    base = {s.key: s.values for s in _all_shards(old)}
    shapes = {n: tuple(t.shape) for n, t in new.items()}
    delta = list(pack_buckets(_all_shards(new), bucket_bytes=1 << 16, version=2, base=base, base_version=1))
    dense = list(pack_buckets(_all_shards(new), bucket_bytes=1 << 16, version=2))
    pieces = [p for h, _ in delta for p in h.pieces]
    assert sum(p.num_changed for p in pieces) == 4
    assert sum(p.nbytes for p in pieces) == 4 * (4 + 2)  # positions int32 + bf16 values
    assert sum(p.nbytes for h, _ in dense for p in h.pieces) == 2 * (240 + 240)
    from_delta = _assemble(delta, shapes, base=old)
    from_dense = _assemble(dense, shapes)
    assert all(_bits_equal(from_delta[n], new[n]) and _bits_equal(from_dense[n], new[n]) for n in new)


def test_a_mostly_changed_piece_goes_dense():
    old = _weights()
    new = {n: t + 1 for n, t in old.items()}
    base = {s.key: s.values for s in _all_shards(old)}
    buckets = list(pack_buckets(_all_shards(new), bucket_bytes=1 << 16, version=2, base=base, base_version=1))
    assert all(p.num_changed is None for h, _ in buckets for p in h.pieces)


def test_a_reused_dirty_buffer_gives_the_same_payloads():
    """A sender packs every bucket into one memory: leftovers of the previous bucket (here 0xFF)
    must not reach the wire, alignment padding included."""
    w = _weights()
    shards = _shards("a", w["a"][:, :3].contiguous(), 0, 3) + _all_shards(w)  # 3-element rows: padding
    memory = torch.full((1 << 16,), 255, dtype=torch.uint8)
    fresh = list(pack_buckets(shards, bucket_bytes=100, version=1))
    reused = [
        (h, p.clone())
        for h, p in pack_buckets(shards, bucket_bytes=100, version=1, buffer=lambda n, _: memory[:n])
    ]
    assert any(p.at % 8 == 0 and p.at > 0 and p.nbytes % 8 for h, _ in fresh for p in h.pieces)
    assert [h for h, _ in reused] == [h for h, _ in fresh]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(reused, fresh))


def test_delta_and_counts_across_comparison_chunks():
    """A piece longer than the comparison's chunk: positions past the first chunk are found and
    placed, and count_differing agrees with the delta's count."""
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3 << 20, generator=g).bfloat16()
    new = old.clone()
    changed = torch.tensor([0, (1 << 20) - 1, 1 << 20, (2 << 20) + 5, (3 << 20) - 1])
    new[changed] += 1.0
    shard = dict(name="w", shape=(3 << 20,), offset=(0,), local_shape=(3 << 20,))
    base = {Shard(**shard, values=old).key: old}
    buckets = list(
        pack_buckets([Shard(**shard, values=new)], bucket_bytes=1 << 30, version=2, base=base, base_version=1)
    )
    (piece,) = buckets[0][0].pieces
    assert piece.num_changed == 5 and count_differing(old, new) == 5
    got = _assemble(buckets, {"w": (3 << 20,)}, base={"w": old})
    assert _bits_equal(got["w"], new)


def test_a_missing_shard_or_a_wrong_shape_is_refused():
    w = _weights()
    shapes = {n: tuple(t.shape) for n, t in w.items()}
    with pytest.raises(TransferError, match="incomplete transfer: 1 tensors"):
        _assemble(pack_buckets(_all_shards(w)[1:], bucket_bytes=1 << 16, version=1), shapes)
    with pytest.raises(TransferError, match=r"tensor 'a' arrived with shape \[6, 40\], expected \(6, 41\)"):
        _assemble(pack_buckets(_all_shards(w), bucket_bytes=1 << 16, version=1), shapes | {"a": (6, 41)})


def test_a_delta_without_a_base_is_refused():
    w = _weights()
    shards = _all_shards(w)
    base = {s.key: s.values for s in shards}
    buckets = pack_buckets(shards, bucket_bytes=1 << 16, version=2, base=base, base_version=1)
    with pytest.raises(TransferError, match="holds no base"):
        _assemble(buckets, {n: tuple(t.shape) for n, t in w.items()})


def test_fp8_rows_quantised_apart_are_the_whole_weights_blocks():
    """Row shards that straddle 128-row blocks (and a stack of experts cut by rows) share their
    blocks' amax and give quantize_weight's bits and scales."""
    g = torch.Generator().manual_seed(0)
    for full, cuts in (
        (torch.randn(384, 256, generator=g), (100, 150, 134)),
        (torch.randn(2, 256, 128, generator=g), (70, 186)),
    ):
        offsets = [sum(cuts[:i]) for i in range(len(cuts))]
        locals_ = [full.narrow(-2, o, n) for o, n in zip(offsets, cuts)]
        where = [((0,) * (full.dim() - 2) + (o, 0), tuple(t.shape)) for o, t in zip(offsets, locals_)]
        amax = torch.stack(
            [partial_amax(t, tuple(full.shape), s, o) for t, (o, s) in zip(locals_, where)]
        ).amax(0)
        scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
        q = torch.cat([quantize_rows(t, scale, s, o) for t, (o, s) in zip(locals_, where)], dim=-2)
        for e, (q_e, s_e) in enumerate(zip(q.view(-1, *q.shape[-2:]), scale.view(-1, *scale.shape[-2:]))):
            want_q, want_scale = quantize_weight(full.view(-1, *full.shape[-2:])[e])
            assert torch.equal(s_e, want_scale) and torch.equal(
                q_e.view(torch.uint8), want_q.view(torch.uint8)
            )


def test_a_channel_needs_senders_and_a_receiver():
    with pytest.raises(ValueError, match="num_senders=2, world_size=2"):
        Rendezvous(host="127.0.0.1", port=1, num_senders=2, world_size=2)


def test_delta_pieces_across_buckets_from_precomputed_positions():
    """Changes found once per shard (`changes_against`, as a sender does for every channel) give the
    same buckets as the comparison inside `pack_buckets`, with shards split over small buckets:
    each piece takes its own range of the shard's positions."""
    old = _weights()
    new = {n: t.clone() for n, t in old.items()}
    new["a"].view(-1)[[0, 79, 80, 81, 159, 239]] += 1.0
    new["b"].view(-1)[[1, 2, 200]] -= 1.0
    shards = _all_shards(new)
    base = {s.key: s.values for s in _all_shards(old)}
    changes = {s.key: changes_against(s.values, base[s.key]) for s in shards}
    assert sum(c.count for c in changes.values()) == 9
    inside = list(pack_buckets(shards, bucket_bytes=96, version=2, base=base, base_version=1))
    given = list(pack_buckets(shards, bucket_bytes=96, version=2, base=base, base_version=1, changes=changes))
    assert sum(len(h.pieces) for h, _ in inside) > len(shards)  # shards split into several pieces
    # a bucket covers as many values as a dense one, so the receiver can place one as the next comes
    dense = list(pack_buckets(shards, bucket_bytes=96, version=2))
    assert len(inside) == len(dense) > 4
    assert [[(p.name, p.start, p.count) for p in h.pieces] for h, _ in inside] == [
        [(p.name, p.start, p.count) for p in h.pieces] for h, _ in dense
    ]
    assert [h for h, _ in given] == [h for h, _ in inside]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(given, inside))
    assert any(p.num_changed for h, _ in given for p in h.pieces)
    got = _assemble(given, {n: tuple(t.shape) for n, t in new.items()}, base=old)
    assert all(_bits_equal(got[n], new[n]) for n in new)


def test_copy_differing_is_a_cast_then_a_comparison_chunk_by_chunk(monkeypatch):
    """The fused snapshot pass gives the cast's bits in `out`, and the positions and values where they
    differ from the base, also across chunk boundaries and where the bits are a NaN's."""
    monkeypatch.setattr(buckets_module, "_CHUNK", 64)
    torch.manual_seed(0)
    src = torch.randn(1000)
    base = src.to(torch.bfloat16)
    src[[0, 63, 64, 65, 500, 999]] += 1.0
    src[7] = float("nan")
    src[8] = float("nan")  # a NaN in the base and in the new values: the same bits, unchanged
    base.view(torch.int16)[8:9] = src[8:9].to(torch.bfloat16).view(torch.int16)
    out = torch.empty(1000, dtype=torch.bfloat16)
    changes = copy_differing(out, src, base)
    assert torch.equal(out.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert changes.positions.tolist() == [0, 7, 63, 64, 65, 500, 999]
    assert torch.equal(changes.values.view(torch.int16), out.view(torch.int16)[changes.positions])
    assert changes.base is base
    none = copy_differing(torch.empty_like(out), src, out)
    assert none.positions.numel() == none.values.numel() == 0
    # the same pieces as a comparison made afterwards
    shard = dict(name="w", shape=(1000,), offset=(0,), local_shape=(1000,))
    fused = pack_buckets(
        [Shard(**shard, values=out, changes=changes)],
        bucket_bytes=256,
        version=2,
        base={"w@0": base},
        base_version=1,
        changes={"w@0": changes},
    )
    after = pack_buckets(
        [Shard(**shard, values=out)], bucket_bytes=256, version=2, base={"w@0": base}, base_version=1
    )
    assert all(ha == hb and torch.equal(pa, pb) for (ha, pa), (hb, pb) in zip(fused, after, strict=True))


def test_a_mostly_changed_shard_keeps_no_positions_and_goes_dense(monkeypatch):
    """Past a third of bf16 values changed a delta of the shard is larger than the shard: the
    snapshot keeps counting but keeps no positions (they would outweigh the values), for the fused
    pass and the comparison alike, and every piece goes dense with the exact bits."""
    monkeypatch.setattr(buckets_module, "_CHUNK", 64)
    torch.manual_seed(0)
    src = torch.randn(1000)
    base = src.to(torch.bfloat16)
    src[:400] += 1.0  # 400 of 1000 changed: over a third
    out = torch.empty(1000, dtype=torch.bfloat16)
    fused = copy_differing(out, src, base)
    after = changes_against(out, base)
    for changes in (fused, after):
        assert changes.count == 400 and changes.positions is None and changes.values is None
    shard = Shard(name="w", shape=(1000,), offset=(0,), local_shape=(1000,), values=out, changes=fused)
    buckets = list(
        pack_buckets(
            [shard], bucket_bytes=256, version=2, base={"w@0": base}, base_version=1, changes={"w@0": fused}
        )
    )
    assert all(p.num_changed is None for h, _ in buckets for p in h.pieces)
    got = _assemble(buckets, {"w": (1000,)}, base={"w": base})
    assert _bits_equal(got["w"], out)
    # a third exactly is still a delta candidate: 333 changed keep their positions
    src = base.float()
    src[:333] += 1.0
    kept = copy_differing(torch.empty_like(out), src, base)
    assert kept.count == 333 and kept.positions is not None and kept.positions.numel() == 333
