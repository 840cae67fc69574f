"""The decoder-only transformer shared by the trainer and the embedded inference engine.

    model = Transformer(args)
    out = model(input_ids_BT, position_ids_BT, routed_experts=None, return_routing=True)
    out.logits          # [B, T, V]
    out.routed_experts  # int32 [B, T, L, K]; dense layers hold zeros
    out = model(input_ids_BT, routed_experts=replay_BTLK, return_routing=True)
    out.router_topk     # int32 [B, T, L, K]: the router's own top-k while replaying (agreement metrics)

Parameter names follow the Hugging Face layout except that each MoE layer's experts are stacked
(`mlp.experts.gate_proj` is [E, I, D]); `asyncrl.model.hf` converts at load and save.

Shape legend: B batch, T tokens, D model dim, V vocab, L layers, K top_k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import Linear
from asyncrl.model.dsa import DSAttention
from asyncrl.model.grouped_router import GroupedSigmoidRouter
from asyncrl.model.layers import (
    MLP,
    Attention,
    AttentionBackend,
    PackedCausalAttention,
    RMSNorm,
    RotaryEmbedding,
)
from asyncrl.model.mla import MLAttention
from asyncrl.model.moe import MoE
from asyncrl.model.mtp import PassthroughTensors

__all__ = ["DecoderLayer", "LayerOutput", "ModelOutput", "Transformer"]


@dataclass(frozen=True, kw_only=True)
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when compute_logits=False
    hidden_states: torch.Tensor  # [B, T, D], after the final norm (input of the LM head)
    routed_experts: torch.Tensor | None = None  # int32 [B, T, L, K]
    router_topk: torch.Tensor | None = None  # int32 [B, T, L, K]; only when replaying with return_routing


class LayerOutput(NamedTuple):
    """A decoder layer's output (a NamedTuple so FSDP2 / checkpointing see its tensors; see moe.py)."""

    x_BTD: torch.Tensor  # [B, T, D]
    ids_BTK: torch.Tensor | None  # int64 [B, T, K] experts used; None for dense layers
    router_topk_BTK: torch.Tensor | None  # int64 [B, T, K] router's own top-k; None unless asked or dense


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = args.is_moe_layer(layer_idx)
        self.self_attn = build_attention(args, layer_idx)
        self.mlp: MoE | MLP = build_mlp(args, layer_idx)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        replay_ids_BTK: torch.Tensor | None = None,
        *,
        with_router_topk: bool = False,
    ) -> LayerOutput:
        """The layer output and, for MoE layers, the expert ids used.

        with_router_topk: also report the router's own top-k ids (MoE layers only).
        """
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), rope, backend)
        h_BTD = self.post_attention_layernorm(x_BTD)
        if isinstance(self.mlp, MoE):
            moe = self.mlp(h_BTD, replay_ids_BTK, with_router_topk=with_router_topk)
            return LayerOutput(
                x_BTD=x_BTD + moe.out_BTD, ids_BTK=moe.ids_BTK, router_topk_BTK=moe.router_topk_BTK
            )
        return LayerOutput(x_BTD=x_BTD + self.mlp(h_BTD), ids_BTK=None, router_topk_BTK=None)


def build_attention(args: ModelArgs, layer_idx: int) -> nn.Module:
    """GQA (Qwen3, GLM-4.5), MLA (DeepSeek-V3, Kimi-K2) or MLA + sparse attention (GLM-5)."""
    if args.uses_dsa:
        return DSAttention(args, layer_idx)
    return MLAttention(args, layer_idx) if args.uses_mla else Attention(args, layer_idx)


def build_mlp(args: ModelArgs, layer_idx: int) -> MoE | MLP:
    """SwiGLU for dense layers; MoE with a softmax (Qwen3-MoE) or grouped sigmoid router otherwise."""
    if not args.is_moe_layer(layer_idx):
        return MLP(args.hidden_size, args.intermediate_size)
    return MoE(args, GroupedSigmoidRouter(args) if args.sigmoid_router else None)


class _Backbone(nn.Module):
    """Holds the `model.*` parameters, so state-dict keys match Hugging Face's."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = _Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(args.rope_dim, args.rope_theta, args.rope_scaling)
        self.mtp = PassthroughTensors()  # checkpoint MTP layers, kept and written back unchanged
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the embedding when configured (again after `to_empty`)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init for models trained from scratch: N(0, std) matrices, unit norms, zero buffers."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in self.named_buffers():
                b.zero_()
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        return_routing: bool = False,
        *,
        attention: AttentionBackend | None = None,
        compute_logits: bool = True,
    ) -> ModelOutput:
        """Run the decoder.

        input_ids: [B, T]. position_ids: [B, T], default 0..T-1 per row; packed rows restart
        positions at each sequence. routed_experts: [B, T, L, K] expert ids to replay (R3), each in
        [0, num_experts) (the caller checks the ids where they enter, as the trainer does for every
        rollout batch); with return_routing=True the output then also carries `router_topk`, the
        routers' own choices.
        attention: a custom attention backend (the inference engine's paged KV cache).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape {(B, T)}"
            )
        if routed_experts is not None:
            self._check_routed_experts(routed_experts, B, T)
        backend = attention if attention is not None else PackedCausalAttention(position_ids)

        x_BTD = self.model.embed_tokens(input_ids)
        rope = self.rotary(position_ids, x_BTD.dtype)
        own_topk = return_routing and routed_experts is not None
        captured, captured_own = [], []
        for layer in self.model.layers:
            replay = (
                None if routed_experts is None or not layer.is_moe else routed_experts[:, :, layer.layer_idx]
            )
            out = layer(x_BTD, rope, backend, replay, with_router_topk=own_topk)
            x_BTD = out.x_BTD
            if return_routing:
                captured.append(out.ids_BTK)
                captured_own.append(out.router_topk_BTK)
        h_BTD = self.model.norm(x_BTD)
        logits = self.lm_head(h_BTD) if compute_logits else None
        routing = self._stack_routing(captured, B, T, input_ids.device) if return_routing else None
        router_topk = self._stack_routing(captured_own, B, T, input_ids.device) if own_topk else None
        return ModelOutput(
            logits=logits, hidden_states=h_BTD, routed_experts=routing, router_topk=router_topk
        )

    def _stack_routing(self, captured: list[torch.Tensor | None], B: int, T: int, device) -> torch.Tensor:
        K = self.args.routing_top_k
        zeros = torch.zeros(B, T, K, dtype=torch.int32, device=device)
        return torch.stack([zeros if ids is None else ids.to(torch.int32) for ids in captured], dim=2)

    def _check_routed_experts(self, routed: torch.Tensor, B: int, T: int) -> None:
        """Shape and dtype only: reading the ids would sync the device on every forward."""
        if not self.args.is_moe:
            raise ValueError("routed_experts was given but this model has no MoE layers")
        want = (B, T, self.args.num_hidden_layers, self.args.num_experts_per_tok)
        if tuple(routed.shape) != want:
            raise ValueError(
                f"routed_experts must have shape [batch, tokens, layers, top_k] = {list(want)}, "
                f"got {list(routed.shape)}"
            )
        if routed.dtype.is_floating_point or routed.dtype == torch.bool:
            raise ValueError(f"routed_experts must be an integer tensor, got {routed.dtype}")
