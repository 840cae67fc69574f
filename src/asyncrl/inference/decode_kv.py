"""Dense decode K/V: each decoding sequence's keys and values kept contiguous across steps.

Decode attention over the paged cache would gather every sequence's blocks into a padded copy in
every layer of every step, a copy as large as the whole batch's context. Here each decoding
sequence owns a row of per-layer buffers [R, G, C, Dh]: the row is filled once from the paged
cache when the sequence starts decoding (a gather of that sequence alone), and each step's new
key and value are written in place at their position. Decode attention then reads a view over
rows [0, R) and their first positions, with a length mask: no copy of the context. Each (row, kv
head) holds its positions contiguously, the layout the attention kernel reads fastest.

The paged cache stays the source of truth (prefill, prefix caching and routing read it; every
token is written there first). A row is released when its sequence leaves the decode batch
(finished, aborted, preempted, or not scheduled this step) and the last row moves into the hole,
so the rows in use are always exactly this step's decode sequences, in rows [0, R). A row filled
before a preemption is never reused after it: rows are keyed by the request and its preemption
count. Rows grow by doubling; capacity by doubling too, or at once to what the step's sequences
will need if they run to their `max_tokens` (at most `ANTICIPATE` times the step's width): growing
copies every row of every layer, and contexts that go from 64 to 192 positions would otherwise pay
it twice over an answer. When rows x capacity would exceed `budget_tokens`, the
buffers are dropped and `plan` returns None: that step's decode attention gathers from the paged
cache as before (long contexts).

Shape legend: L layers, R rows (decode sequences), G kv heads, C capacity (positions per row),
Dh head dim, S decode sequences of the step, W width of the step's view (the longest context,
rounded up to whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.inference.request import Request

__all__ = ["ANTICIPATE", "DecodeKV", "DecodePlan", "RowFill"]

# Capacity grows at once to the step's sequences' longest final context, but at most to this many
# times the step's width (sequences that stop early would leave the rest unused).
ANTICIPATE = 4


@dataclass(frozen=True, kw_only=True)
class RowFill:
    """Row `row` is new this step: copy its sequence's first `num_blocks` paged blocks into it and
    zero the rest of the row (masked positions still meet a zero weight, and 0 * NaN is NaN)."""

    row: int
    block_ids: torch.Tensor  # long [num_blocks]


@dataclass(frozen=True, kw_only=True)
class DecodePlan:
    """One step's use of the dense buffers, built once and read by every layer.

    Row r holds the step's decode sequence `order_R[r]` (an index into the step's decode
    sequences, R = S of them); its new key and value, head g, go to flat position
    `write_RG[r * G + g]` of the layer's [R * G * C, Dh] view. Attention reads positions
    [0, width) of rows [0, R), `mask_R11W` (None: nothing to mask) keeping each row's context
    (`length_R` positions; the CPU kernel reads those only).
    """

    k_LRGCd: torch.Tensor
    v_LRGCd: torch.Tensor
    order_R: torch.Tensor  # long [R]
    write_RG: torch.Tensor  # long [R * G]
    width: int
    length_R: torch.Tensor  # long [R]: each row's context, the new token included
    mask_R11W: torch.Tensor | None  # bool [R, 1, 1, W]
    fills: tuple[RowFill, ...]


class DecodeKV:
    """The dense decode buffers of all layers and which request owns each row."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_rows: int,
        budget_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size, self.max_rows, self.budget_tokens = block_size, max_rows, budget_tokens
        self._shape = (num_layers, num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.owners: list[tuple[Request, int]] = []  # row -> (request, its num_preemptions at fill)
        self.k_LRGCd = self.v_LRGCd = self._empty(0, 0)
        self.num_fills = 0  # rows filled from the paged cache, over the engine's life
        self.num_fallbacks = 0  # steps whose decode attention gathered from the paged cache

    @property
    def num_rows(self) -> int:
        return len(self.owners)

    @property
    def capacity(self) -> int:
        return self.k_LRGCd.shape[3]

    def plan(self, decodes: list[tuple[Request, int]]) -> DecodePlan | None:
        """Rows for this step's decode sequences, given as (request, context length incl. the new
        token) in step order; None when they do not fit the budget (gather this step)."""
        bs = self.block_size
        width = self._whole_blocks(max(n for _, n in decodes))
        self._release_others(decodes)
        if not self._reserve(width, decodes):
            self.release_all()
            self.num_fallbacks += 1
            return None
        row_of = {id(req): r for r, (req, _) in enumerate(self.owners)}
        fills = []
        rows = []
        for req, num_ctx in decodes:
            row = row_of.get(id(req))
            if row is None:
                row = len(self.owners)
                self.owners.append((req, req.num_preemptions))
                blocks = req.block_ids[: -(-num_ctx // bs)]
                fills.append(RowFill(row=row, block_ids=torch.tensor(blocks, device=self._device)))
            rows.append(row)
        self.num_fills += len(fills)
        return self._build(rows, [n for _, n in decodes], width, fills)

    def release_all(self) -> None:
        """Drop every row and the buffers' memory."""
        self.owners = []
        self.k_LRGCd = self.v_LRGCd = self._empty(0, 0)

    def _build(self, rows: list[int], lengths: list[int], width: int, fills: list[RowFill]) -> DecodePlan:
        device, cap, G = self._device, self.capacity, self._shape[1]
        order = [0] * len(rows)
        row_lengths = [0] * len(rows)
        for i, r in enumerate(rows):
            order[r], row_lengths[r] = i, lengths[i]
        length_R = torch.tensor(row_lengths, device=device)
        length_R1 = length_R[:, None]
        head_RG = torch.arange(len(rows) * G, device=device).view(-1, G)
        first_RG = head_RG * cap  # where each (row, kv head) starts in the flat view
        mask_R11W = None
        if min(row_lengths) < width:
            mask_R11W = (torch.arange(width, device=device)[None, :] < length_R1)[:, None, None, :]
        return DecodePlan(
            k_LRGCd=self.k_LRGCd,
            v_LRGCd=self.v_LRGCd,
            order_R=torch.tensor(order, dtype=torch.long, device=device),
            write_RG=(first_RG + length_R1 - 1).flatten(),
            width=width,
            length_R=length_R,
            mask_R11W=mask_R11W,
            fills=tuple(fills),
        )

    def _release_others(self, decodes: list[tuple[Request, int]]) -> None:
        """Free the rows of requests not decoding now (or preempted since their fill), moving the
        last row into each hole so the rows in use stay [0, R)."""
        keep = {id(req): req.num_preemptions for req, _ in decodes}
        for r in range(len(self.owners) - 1, -1, -1):
            req, preemptions = self.owners[r]
            if keep.get(id(req)) == preemptions:
                continue
            last = len(self.owners) - 1
            if r != last:  # rows past r were checked already: the one moved in stays
                self.k_LRGCd[:, r].copy_(self.k_LRGCd[:, last])
                self.v_LRGCd[:, r].copy_(self.v_LRGCd[:, last])
                self.owners[r] = self.owners[last]
            self.owners.pop()

    def _reserve(self, width: int, decodes: list[tuple[Request, int]]) -> bool:
        """Grow the buffers to hold a row of `width` positions per decode sequence; False if over
        budget."""
        num_rows, rows, cap = len(decodes), self.k_LRGCd.shape[1], self.capacity
        if num_rows <= rows and width <= cap:
            return True
        need_rows, need_cap = max(rows, num_rows), max(cap, width)
        if need_rows * need_cap > self.budget_tokens:
            return False
        new_rows = rows if num_rows <= rows else min(max(2 * rows, num_rows), self.max_rows)
        new_cap = cap
        if width > cap:
            final = max(len(req.prompt_token_ids) + req.options.max_tokens for req, _ in decodes)
            final = self._whole_blocks(final)
            new_cap = max(2 * cap, width, min(final, ANTICIPATE * width))
        if new_rows * new_cap > self.budget_tokens:
            # Less than double, but all the budget allows: growing by a block at a time would copy
            # the whole buffers every few steps.
            new_rows, new_cap = need_rows, max(need_cap, min(new_cap, self.budget_tokens // need_rows))
        k, v = self._empty(new_rows, new_cap), self._empty(new_rows, new_cap)
        used = self.num_rows
        for new, old in ((k, self.k_LRGCd), (v, self.v_LRGCd)):
            new[:, :used, :, :cap].copy_(old[:, :used])
            new[:, :used, :, cap:].zero_()
        self.k_LRGCd, self.v_LRGCd = k, v
        return True

    def _whole_blocks(self, positions: int) -> int:
        return -(-positions // self.block_size) * self.block_size

    def _empty(self, rows: int, cap: int) -> torch.Tensor:
        # Uninitialised: a row is zeroed past its context when filled (RowFill), and rows in use are
        # zeroed past the old capacity when the buffers grow, so rows in use hold finite values only.
        L, G, Dh = self._shape
        return torch.empty(L, rows, G, cap, Dh, dtype=self._dtype, device=self._device)
