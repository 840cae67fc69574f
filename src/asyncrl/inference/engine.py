"""The embedded inference engine: continuous batching over a paged KV cache, on `asyncrl.model`.

    engine = Engine.from_config(InferenceConfig(model="outputs/tiny-moe"))
    engine.add_request("r1", [257, 104, 105], SamplingOptions(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():      # RequestOutput deltas: new tokens, logprobs, versions
            ...                        # (the last also: finish_reason, context_version, routing)

One `step()` = schedule, one forward of all scheduled tokens as a single row, sample, commit.
A request added with `stream=False` gets no deltas: one output when it finishes, with every token.
The engine is token-in/token-out and single-threaded; `async_engine.AsyncEngine` drives it from a
background thread for the HTTP server. Weight updates happen between steps (`load_weights`).

Shape legend: N scheduled tokens, S sampled sequences, V vocab, D model dim, L layers, K top_k.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import numpy as np
import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.sampling import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
)
from asyncrl.inference.block_pool import BlockPool
from asyncrl.inference.cpu_decode import KERNEL_DTYPES, DecodeKernel
from asyncrl.inference.cpu_decode import load as load_decode_kernel
from asyncrl.inference.cpu_matmul import load as load_matmul_kernels
from asyncrl.inference.decode_kv import DecodeKV, DecodePlan
from asyncrl.inference.kv_cache import AttentionPaths, KVCache, PagedAttention, SeqSlice
from asyncrl.inference.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingOptions,
)
from asyncrl.inference.sampler import sample
from asyncrl.inference.scheduler import ScheduledSeq, Scheduler
from asyncrl.inference.stopping import check_stop
from asyncrl.model import Transformer, from_pretrained, torch_dtype
from asyncrl.model.compute import Linear, set_cpu_packing
from asyncrl.model.devices import resolve_device
from asyncrl.model.fp8 import apply_fp8
from asyncrl.model.hf import check_state_dict, load_into, load_state_dict
from asyncrl.model.moe import GroupedExperts, Router

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: Transformer,
        config: InferenceConfig,
        *,
        detokenize: Callable[[list[int]], str] | None = None,
        version: int = 0,
        attention_paths: AttentionPaths | None = None,
    ) -> None:
        self.model, self.config, self.detokenize, self.version = model.eval(), config, detokenize, version
        self.attention_paths = attention_paths or AttentionPaths()
        if not config.cpu_packed_weights:
            set_cpu_packing(False)  # process-wide (asyncrl.model.compute)
        args = model.args
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        bs = config.block_size
        num_blocks = -(-config.kv_cache_tokens // bs)
        self.max_model_len = config.max_model_len or args.max_position_embeddings
        if self.max_model_len > num_blocks * bs:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV pool ({num_blocks * bs} tokens): "
                f"raise kv_cache_tokens or lower max_model_len"
            )
        eos = args.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.cache = KVCache(
            num_layers=args.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=bs,
            num_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            routing_top_k=args.routing_top_k,
            dtype=self.dtype,
            device=self.device,
            latent_dim=args.kv_lora_rank + args.qk_rope_head_dim if args.uses_mla else 0,
            index_dim=args.index_head_dim if args.uses_dsa else 0,
        )
        self._log_kv_memory()
        self.decode_kv = self._build_decode_kv()
        self.decode_kernel, self.decode_attention_note = self._load_decode_kernel()
        self.matmul_kernel_note = self._attach_matmul_kernels()
        self.scheduler = Scheduler(
            self.pool,
            block_size=bs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.requests: dict[str, Request] = {}
        self._routing_start: dict[str, int] = {}
        self._rng = torch.Generator().manual_seed(config.seed)
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.num_failed_requests = 0

    def _log_kv_memory(self) -> None:
        per_token = self.cache.bytes_per_token()
        parts = ", ".join(f"{name} {n}" for name, n in per_token.items())
        log.info(
            "KV cache: %d bytes per token (%s) x %d tokens (%d blocks of %d) = %.1f MiB",
            sum(per_token.values()),
            parts,
            self.cache.num_tokens,
            self.pool.num_blocks,
            self.cache.block_size,
            self.cache.nbytes() / 2**20,
        )

    def _build_decode_kv(self) -> DecodeKV | None:
        """Dense decode rows for per-head K/V models (MLA decode reads its latent cache directly)."""
        args = self.model.args
        budget = self.config.decode_buffer_tokens
        if args.uses_mla or not self.attention_paths.decode_buffer or budget == 0:
            return None
        return DecodeKV(
            num_layers=args.num_hidden_layers,
            num_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            block_size=self.config.block_size,
            max_rows=self.config.max_num_seqs,
            budget_tokens=self.cache.num_tokens if budget is None else budget,
            dtype=self.dtype,
            device=self.device,
        )

    def _load_decode_kernel(self) -> tuple[DecodeKernel | None, str]:
        """The CPU decode kernel (cpu_decode) where it applies, and how per-head K/V decode attention
        runs (the start-up line's part; empty on other devices and for MLA models)."""
        if self.model.args.uses_mla or self.device.type != "cpu":
            return None, ""
        if not (self.config.cpu_decode_kernel and self.attention_paths.decode_kernel):
            return None, "decode attention SDPA (cpu_decode_kernel = false)"
        if self.dtype not in KERNEL_DTYPES:
            return None, f"decode attention SDPA (no kernel for {self.dtype})"
        build = load_decode_kernel()
        return build.kernel, build.note

    def _attach_matmul_kernels(self) -> str:
        """The CPU matmul kernels (cpu_matmul) on the routers, routed experts and linears they can
        compute, and how those run (the start-up line's part; empty on other devices)."""
        modules = list(self.model.modules())
        experts = [m for m in modules if isinstance(m, GroupedExperts) and m.expert_linear is None]
        linears = [m for m in modules if isinstance(m, Linear)]
        routers = [m for m in modules if isinstance(m, Router)]
        if self.device.type != "cpu" or not (experts or linears or routers):
            return ""
        if not self.config.cpu_matmul_kernel:
            return "decode matmuls torch (cpu_matmul_kernel = false)"
        build = load_matmul_kernels()
        if build.kernels is None:
            return build.note
        if self.dtype not in build.kernels.dtypes:
            return f"decode matmuls torch (no kernel for {self.dtype} on this CPU)"
        for module in experts:
            module.cpu_kernel = build.kernels.experts
        for module in linears:
            module.cpu_kernel = build.kernels.linear
        for module in routers:
            module.cpu_kernel = build.kernels.router
        return build.note

    @classmethod
    def from_config(cls, config: InferenceConfig, **kwargs) -> Engine:
        dtype = torch_dtype(config.dtype)
        model = from_pretrained(config.model, dtype=dtype, device=str(resolve_device(config.device)))
        if config.fp8.enabled:
            report = apply_fp8(model, config.fp8.ignore, config.fp8.backend)
            log.info(
                "FP8 inference: %d modules quantized, %d kept in high precision",
                len(report.converted),
                len(report.kept),
            )
        return cls(model, config, **kwargs)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        *,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        stream: bool = True,
    ) -> None:
        """Queue a request; raises InvalidRequestError naming the field for input it cannot serve.

        stream=False: `step()` returns nothing for this request until it finishes; its final
        output then carries all its tokens, logprobs and versions (what a non-streaming HTTP
        response needs, without a Python object per token and step).
        """
        self._validate(request_id, prompt_token_ids, options)
        _validate_options(options)
        if cache_salt is not None and not _is_utf8(cache_salt):
            raise InvalidRequestError("cache_salt", "is not valid Unicode (lone surrogate)")
        if options.seed is not None:
            seed = options.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            options=options,
            cache_salt=cache_salt,
            return_routed_experts=return_routed_experts,
            arrival=next(self._arrivals),
            generator=generator,
            stream=stream,
        )
        self.requests[request_id] = req
        self._routing_start[request_id] = min(routed_experts_start, len(prompt_token_ids))
        self.num_prompt_tokens += len(prompt_token_ids)
        self.scheduler.add(req)

    def _validate(self, request_id: str, prompt: list[int], options: SamplingOptions) -> None:
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.model.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                "prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        bad = [t for t in options.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"token ids {bad[:5]} are outside [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt)} tokens; the context limit is {self.max_model_len}"
            )
        if options.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {options.max_tokens}")
        if len(prompt) + options.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens ({options.max_tokens}) exceeds the context "
                f"limit {self.max_model_len}",
            )
        if options.stop and self.detokenize is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this engine has none")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with finish_reason 'abort' (None if it is unknown or already done)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.finish_reason, req.needs_final_routing = FinishReason.ABORT, False
        return self._finish(req, [], [], [])

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self.requests) if (out := self.abort(rid)) is not None]

    def fail(self, request_id: str, reason: str) -> RequestOutput | None:
        """Finish a request the engine could not compute: an 'abort' output that carries `error`."""
        out = self.abort(request_id)
        if out is None:
            return None
        self.num_failed_requests += 1
        log.error("request %s failed: %s", request_id, reason)
        return dataclasses.replace(out, error=reason)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        return [out for rid in list(self.requests) if (out := self.fail(rid, reason)) is not None]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- weights ----------------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap in new weights between steps. Running requests keep their KV and continue.

        The engine takes `state` over: on its device the model's tensors become `state`'s (a pointer
        swap, no copy), so the caller must neither change nor reuse them afterwards.

        The prefix cache moves to a new weights epoch: blocks computed by the old weights are never
        matched again (running requests keep theirs), and the unreferenced ones are freed now. A
        running request's later tokens attend over KV of the old weights; its final output says so
        (`RequestOutput.context_version`).
        """
        load_into(self.model, state, where="weight update", share=True)  # `state` is ours to keep
        self.version = version
        self.scheduler.weights_epoch += 1
        self.pool.reset_prefix_cache()

    def read_weights(self, path: str) -> dict[str, torch.Tensor]:
        """Read and validate an HF safetensors directory in this model's names and dtype (no swap yet).

        Every file is read in full and every name, shape and dtype checked here, before
        `load_weights` copies anything: a rejected checkpoint leaves the served weights untouched.
        """
        state = load_state_dict(path, self.model.args, self.dtype)
        check_state_dict(self.model, state, where=str(path))
        return state

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, admit: bool = True) -> list[RequestOutput]:
        batch = self.scheduler.schedule(admit=admit)
        if not batch:
            return []
        self.num_steps += 1
        ids_N, pos_N, seqs, slots_N = self._inputs(batch)
        plan = self._decode_plan(batch, seqs)
        backend = PagedAttention(self.cache, seqs, slots_N, self.attention_paths, plan, self.decode_kernel)
        out = self.model(
            torch.tensor([ids_N], device=self.device),
            torch.tensor([pos_N], device=self.device),
            return_routing=True,
            attention=backend,
            compute_logits=False,
        )
        backend.write_routing(out.routed_experts[0])
        return self._sample_and_commit(batch, out.hidden_states[0], seqs)

    def _inputs(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[int], list[SeqSlice], torch.Tensor]:
        """The step's flattened token ids and positions, each sequence's slice, and the KV slots [N]."""
        ids_N: list[int] = []
        pos_N: list[int] = []
        seqs, slots = [], []
        bs = self.cache.block_size
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            req.note_kv_version(self.version)  # this step's KV joins the request's context
            q_start = len(ids_N)
            if n == 1:  # a decode token: plain ints, no tensor ops
                ids_N.append(_token_at(req, start))
                pos_N.append(start)
                slots.append(req.block_ids[start // bs] * bs + start % bs)
            else:
                ids_N += _token_slice(req, start, start + n)
                pos_N += range(start, start + n)
                slots.append(self.cache.slots(req, start + n)[start:])
            block_ids = self.cache.block_table(req)
            seqs.append(SeqSlice(q_start=q_start, q_len=n, num_ctx=start + n, block_ids=block_ids))
        return ids_N, pos_N, seqs, _as_slot_tensor(slots, self.device)

    def _decode_plan(self, batch: list[ScheduledSeq], seqs: list[SeqSlice]) -> DecodePlan | None:
        decodes = [(s.request, seq.num_ctx) for s, seq in zip(batch, seqs) if seq.q_len == 1]
        if self.decode_kv is None or not decodes:
            return None
        return self.decode_kv.plan(decodes)

    def _sample_and_commit(
        self, batch: list[ScheduledSeq], hidden_ND: torch.Tensor, seqs: list[SeqSlice]
    ) -> list[RequestOutput]:
        to_sample = [
            i
            for i, s in enumerate(batch)
            if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
            and not s.request.needs_final_routing
        ]
        tokens, logprobs, failures = [], [], {}
        if to_sample:
            last_rows = [seqs[i].q_start + seqs[i].q_len - 1 for i in to_sample]
            logits_SV = self.model.lm_head(hidden_ND[last_rows])
            reqs = [batch[i].request for i in to_sample]
            tokens, logprobs, failures = sample(
                logits_SV, [r.options for r in reqs], [r.generator for r in reqs]
            )
        sampled = dict(zip(to_sample, zip(tokens, logprobs)))
        failed = {to_sample[row]: reason for row, reason in failures.items()}
        outputs = []
        for i, s in enumerate(batch):
            req = s.request
            self.scheduler.commit(req, s.num_new_tokens)
            if i in failed:  # this request alone fails; the rest of the batch goes on
                outputs.append(self.fail(req.request_id, failed[i]))
            elif req.needs_final_routing and req.num_computed_tokens == req.num_tokens:
                req.needs_final_routing = False
                outputs.append(self._finish(req, [], [], []))
            elif i in sampled and (out := self._append_token(req, *sampled[i])) is not None:
                outputs.append(out)
        return outputs

    def _append_token(self, req: Request, token: int, logprob: float) -> RequestOutput | None:
        """Record a sampled token; its output delta (None for a request that does not stream)."""
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        req.output_versions.append(self.version)
        self.num_generated_tokens += 1
        req.finish_reason = check_stop(req, self.eos_token_ids, self.max_model_len, self.detokenize)
        if req.finish_reason is not None and req.return_routed_experts:
            req.needs_final_routing = True  # one more forward gives the last token's routing
        elif req.finish_reason is not None:
            return self._finish(req, [token], [logprob], [self.version])
        if not req.stream:
            return None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_logprobs=[logprob],
            new_versions=[self.version],
        )

    def _finish(
        self, req: Request, tokens: list[int], logprobs: list[float], versions: list[int]
    ) -> RequestOutput:
        """The final output: the last delta (`tokens`...), or all tokens for a request that does not
        stream."""
        if not req.stream:
            tokens, logprobs, versions = req.output_token_ids, req.output_logprobs, req.output_versions
        start = self._routing_start.pop(req.request_id)
        routing = self._routing(req, start) if req.return_routed_experts else None
        self.scheduler.remove(req)
        del self.requests[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            new_versions=versions,
            finish_reason=req.finish_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_prompt_tokens=len(req.prompt_token_ids),
            routed_experts=routing,
            context_version=req.context_version,
        )

    def _routing(self, req: Request, start: int) -> np.ndarray:
        """Expert ids of the computed tokens from `start` on [T - start, L, K]; uint8, or uint16 past
        256 experts. Only those rows leave the device: a later turn's context is mostly known."""
        slots = self.cache.slots(req, req.num_computed_tokens)[start:]
        routing = self.cache.routing_PLK[slots].cpu().numpy()
        return routing.astype(np.uint8 if self.model.args.num_experts <= 256 else np.uint16)

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_cached": self.pool.num_cached,
            "prefix_cache_queries": self.pool.num_queries,
            "prefix_cache_hits": self.pool.num_hits,
            "generated_tokens": self.num_generated_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "failed_requests": self.num_failed_requests,
            "weight_version": self.version,
            "kv_cache_tokens": self.cache.num_tokens,
            "kv_bytes_per_token": sum(self.cache.bytes_per_token().values()),
        }


def _validate_options(o: SamplingOptions) -> None:
    """What the sampler cannot compute, rejected before the request joins a batch."""
    if not (o.temperature == 0 or MIN_TEMPERATURE <= o.temperature <= MAX_TEMPERATURE):
        raise InvalidRequestError(
            "temperature",
            f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {o.temperature}",
        )
    if not 0 < o.top_p <= 1:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {o.top_p}")
    if not 0 <= o.min_p <= 1:
        raise InvalidRequestError("min_p", f"must be in [0, 1], got {o.min_p}")
    if o.top_k < -1:
        raise InvalidRequestError("top_k", f"must be -1 (off) or >= 0, got {o.top_k}")
    if o.seed is not None and not 0 <= o.seed <= MAX_SEED:
        raise InvalidRequestError("seed", f"must be in [0, {MAX_SEED}], got {o.seed}")
    if len(o.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(o.stop)}")
    for s in o.stop:
        if len(s) > MAX_STOP_STRING_CHARS or not _is_utf8(s):
            raise InvalidRequestError(
                "stop", f"each stop string must be valid Unicode of at most {MAX_STOP_STRING_CHARS} chars"
            )
    if len(o.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(o.stop_token_ids)}"
        )


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _as_slot_tensor(slots: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
    """One long tensor from decode slots (ints) and prefill slot ranges (tensors), in order."""
    if all(isinstance(x, int) for x in slots):  # a pure decode step: one tensor from a list
        return torch.tensor(slots, dtype=torch.long, device=device)
    return torch.cat([torch.tensor([x], device=device) if isinstance(x, int) else x for x in slots])


def _token_at(req: Request, pos: int) -> int:
    num_prompt = len(req.prompt_token_ids)
    return req.output_token_ids[pos - num_prompt] if pos >= num_prompt else req.prompt_token_ids[pos]


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output without copying the whole sequence (decode: one token)."""
    num_prompt = len(req.prompt_token_ids)
    if start >= num_prompt:
        return req.output_token_ids[start - num_prompt : end - num_prompt]
    return req.all_token_ids[start:end]
