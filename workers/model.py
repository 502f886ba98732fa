"""A Llama-family decoder with a paged KV cache: the model the prefill and decode workers run (DESIGN.md §9).

Architecture (as Hugging Face `LlamaForCausalLM`): token embedding; per layer
`h += o_proj(attn(rope(q_proj(rms(h))), rope(k_proj(rms(h))), v_proj(rms(h))))` then
`h += down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))`; final RMSNorm; `lm_head` (or the embedding
matrix when `tie_word_embeddings`). GQA: query head `i` uses kv head `i // (num_heads / num_kv_heads)`.
RoPE is the rotate-half form with `rope_theta`, optionally with Llama 3 frequency scaling.

Engine API (`PagedLlama`), all on one sequence store, `PagedKVCache`:
    prefill(seq_id, token_ids, start_pos=None) -> logits of the chunk's last token    [vocab] fp32
    decode(seq_ids, last_tokens) -> one step for a batch of sequences               [n, vocab] fp32
    export_pages(seq_id, block_indices=None) / import_pages(seq_id, pages)    pages for the cache service
    free(seq_id)
    greedy_generate(prompt_ids, max_new_tokens, prefix_pages=None) -> Generation

Attention paths:
- prefill writes the chunk's K/V with `kernels.reshape_and_cache`, then gathers the whole sequence's
  K/V (cached prefix + chunk) into dense tensors and runs `scaled_dot_product_attention` with the causal
  mask shifted by the chunk's start. NOTE: a paged prefill kernel (attention straight from the blocks)
  is future work; the gather costs one copy of the sequence's K/V per layer per chunk.
- decode writes one token per sequence and runs `kernels.paged_attention_decode` over ragged lengths.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from kernels import planning
from kvstore.layout import PageLayout
from workers.paged_cache import CacheFullError, PagedKVCache, SeqId

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CacheConfig",
    "Generation",
    "LayerWeights",
    "ModelConfig",
    "ModelWeights",
    "PagedLlama",
    "RopeConfig",
    "RopeType",
    "UnsupportedModelError",
]

SUPPORTED_MODEL_TYPES = ("llama",)

TokenIds = Sequence[int] | torch.Tensor


class UnsupportedModelError(NotImplementedError):
    """The checkpoint describes a model this implementation does not compute (type, activation, RoPE kind)."""


# ---------------------------------------------------------------------------------------- config


class RopeType(enum.StrEnum):
    DEFAULT = "default"
    LLAMA3 = "llama3"  # Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth band between


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters. The llama3 fields are used only when rope_type is LLAMA3."""

    theta: float = 10000.0
    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.rope_type is RopeType.LLAMA3:
            if not self.factor > 0 or not self.original_max_position_embeddings > 0:
                raise ValueError("llama3 rope scaling needs factor > 0 and original_max_position_embeddings > 0")
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
                    f"got {self.low_freq_factor}, {self.high_freq_factor}"
                )

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
        """From an HF config: `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older)."""
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        if kind == RopeType.DEFAULT:
            return cls(theta=theta)
        if kind == RopeType.LLAMA3:
            original = params.get("original_max_position_embeddings", max_position_embeddings)
            return cls(
                theta=theta,
                rope_type=RopeType.LLAMA3,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(original),
            )
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {[t.value for t in RopeType]}")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """fp32 [head_dim // 2]: the angular frequency of each rotated pair (computed as transformers does)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.rope_type is RopeType.DEFAULT:
            return inv
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        # Long wavelengths (beyond the pretraining context) are slowed by `factor`; short ones are kept;
        # the band between is interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model. Validated on construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config {name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} must be a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face `config.json` dict; raises UnsupportedModelError for what we do not compute."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (Llama uses 'silu')")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            max_pos = int(raw.get("max_position_embeddings", 2048))
            eos = raw.get("eos_token_id")
            eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
            head_dim = raw.get("head_dim") or hidden // heads
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(raw, max_pos),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                max_position_embeddings=max_pos,
                bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(f"config is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config is malformed: {e}") from None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Size of a model's paged KV cache: `num_blocks` blocks of `block_size` tokens, in every layer."""

    block_size: int = 16
    num_blocks: int = 256

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cache {name} must be an int >= 1, got {value!r}")


# ---------------------------------------------------------------------------------------- weights


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; linear weights are [out_features, in_features] as in HF checkpoints."""

    input_norm: torch.Tensor  # [hidden]
    q_proj: torch.Tensor  # [num_heads * head_dim, hidden]
    k_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]
    q_bias: torch.Tensor | None = None  # present iff attention_bias
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None  # present iff mlp_bias
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(slots=True)
class ModelWeights:
    """All weights, on one device in one dtype. `lm_head is embed_tokens` when embeddings are tied."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


# ---------------------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class Generation:
    """Result of greedy_generate.

    tokens: the generated ids (not the prompt), at most max_new_tokens, ending early at a stop token.
    logits: fp32 [len(tokens), vocab] when asked for: logits[i] is what tokens[i] was chosen from.
    num_imported_tokens: prompt tokens whose K/V came from prefix_pages (a multiple of block_size).
    num_prefilled_tokens: prompt tokens computed here (always >= 1: the last one gives the first logits).
    """

    tokens: list[int]
    logits: torch.Tensor | None
    num_imported_tokens: int
    num_prefilled_tokens: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, then back to the activation dtype before the weight, as transformers does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedLlama:
    """A Llama decoder over a PagedKVCache; one instance serves many sequences.

    Invariants: a sequence's cache holds K/V for its tokens 0 .. num_tokens - 1, in order, each written
    once; prefill and decode append, import_pages appends whole blocks; nothing is written for a call
    that raises (every block is reserved before any compute). Not thread-safe: one caller at a time.
    Outputs are fp32 logits whatever the model dtype.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, cache: CacheConfig | None = None) -> None:
        if len(weights.layers) != config.num_layers:
            raise ValueError(f"weights have {len(weights.layers)} layers; config says {config.num_layers}")
        self.config = config
        self.weights = weights
        self.cache_config = cache or CacheConfig()
        self.dtype = weights.embed_tokens.dtype
        self.device = weights.embed_tokens.device
        if self.device.type == "cuda" and config.head_dim not in planning.SUPPORTED_HEAD_DIMS:
            # Fail at load time rather than at the first decode step.
            raise UnsupportedModelError(
                f"head_dim {config.head_dim} has no CUDA decode kernel; supported: {planning.SUPPORTED_HEAD_DIMS}"
            )
        self.cache = PagedKVCache(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=self.cache_config.block_size,
            num_blocks=self.cache_config.num_blocks,
            dtype=self.dtype,
            device=self.device,
        )
        self._inv_freq = config.rope.inv_freq(config.head_dim).to(self.device)  # fp32 [head_dim / 2]
        self._scale = config.head_dim**-0.5
        self._generate_ids = itertools.count()

    # ------------------------------------------------------------------ cache-facing API

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    def page_layout(self) -> PageLayout:
        """Layout of the pages exchanged with the cache service (dtype, layers, kv heads, head dim, block)."""
        return self.cache.page_layout()

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens whose K/V the sequence holds (0 for an unknown sequence)."""
        return self.cache.num_tokens(seq_id)

    @torch.no_grad()
    def export_pages(self, seq_id: SeqId, block_indices: Sequence[int] | None = None) -> torch.Tensor:
        """Pages `[n, num_layers, 2, block_size, num_kv_heads, head_dim]` of the sequence's full blocks."""
        return self.cache.export_pages(seq_id, block_indices)

    @torch.no_grad()
    def import_pages(self, seq_id: SeqId, pages: torch.Tensor) -> int:
        """Append pages as the sequence's next full blocks (new sequence or block boundary); returns its length."""
        return self.cache.import_pages(seq_id, pages)

    def free(self, seq_id: SeqId) -> None:
        """Forget the sequence and release its blocks."""
        self.cache.free(seq_id)

    # ------------------------------------------------------------------ compute

    @torch.no_grad()
    def prefill(self, seq_id: SeqId, token_ids: TokenIds, start_pos: int | None = None) -> torch.Tensor:
        """Compute a chunk of a sequence's tokens at positions start_pos .. start_pos + n - 1.

        The sequence is created when new (start_pos must then be 0 or None). Otherwise start_pos must
        equal its current length (None means that): the positions before it are the cached prefix, from
        earlier prefills, decodes or imported pages. Returns fp32 logits [vocab] of the chunk's last token.
        Raises CacheFullError, changing nothing, when the chunk's blocks do not fit.
        """
        tokens = self._token_tensor(token_ids, "token_ids")
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("prefill needs at least one token")
        start = self.cache.num_tokens(seq_id)
        if start_pos is not None and start_pos != start:
            raise ValueError(
                f"prefill of sequence {seq_id!r} at start_pos {start_pos}, but it holds {start} tokens: "
                "a chunk must continue the sequence exactly"
            )
        slots = self.cache.reserve(seq_id, n)
        total = start + n
        positions = torch.arange(start, total, device=self.device)
        # Query i (position start + i) sees keys 0 .. start + i: the usual causal mask shifted by `start`.
        mask = torch.arange(total, device=self.device)[None, :] <= positions[:, None]  # [n, total] bool

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            keys, values = self.cache.gather_kv(layer, seq_id, total)  # [total, kv, d]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, d]
                keys.transpose(0, 1).unsqueeze(0),  # [1, kv, total, d]
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=self._scale,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)  # [n, heads, d]

        hidden = self._forward(tokens, positions, slots, attend)
        return self._logits(hidden[-1:])[0]

    @torch.no_grad()
    def decode(self, seq_ids: Sequence[SeqId], last_tokens: TokenIds) -> torch.Tensor:
        """One step for each of several distinct sequences: feed last_tokens[i] to seq_ids[i].

        Lengths may differ (ragged batch). Returns fp32 logits [len(seq_ids), vocab]. Raises
        CacheFullError, changing nothing, when the batch's new blocks do not fit.
        """
        seq_ids = list(seq_ids)
        tokens = self._token_tensor(last_tokens, "last_tokens")
        if tokens.shape[0] != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequences but {tokens.shape[0]} last_tokens")
        if not seq_ids:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
        for s in seq_ids:
            self.cache.manager.get(s)  # raises UnknownSequenceError before anything is reserved
        positions = torch.tensor([self.cache.num_tokens(s) for s in seq_ids], device=self.device)
        slots = self.cache.reserve_batch(seq_ids)
        block_tables = self.cache.block_tables(seq_ids)
        lengths = [self.cache.num_tokens(s) for s in seq_ids]
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=self.device)
        max_len = max(lengths)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return kernels.paged_attention_decode(
                q.contiguous(),
                self.cache.key_caches[layer],
                self.cache.value_caches[layer],
                block_tables,
                seq_lens,
                scale=self._scale,
                max_seq_len=max_len,  # known on the host: spares the CUDA path a device sync
            )

        hidden = self._forward(tokens, positions, slots, attend)
        return self._logits(hidden)

    def greedy_generate(
        self,
        prompt_ids: TokenIds,
        max_new_tokens: int,
        prefix_pages: torch.Tensor | None = None,
        *,
        stop_token_ids: Collection[int] = (),
        return_logits: bool = False,
    ) -> Generation:
        """Greedy decoding of one prompt in a private sequence that is freed at the end.

        prefix_pages: pages `[k, *page_shape]` for the prompt's first k full blocks (e.g. fetched from the
        cache service); they are imported instead of computed. The prompt's last token is always
        computed, since its logits start generation, so at most (len(prompt) - 1) // block_size pages
        are used and the rest are ignored. Stops after max_new_tokens tokens or at a stop token
        (included). Raises CacheFullError up front when the whole generation cannot fit.
        """
        prompt = self._token_tensor(prompt_ids, "prompt_ids")
        if prompt.shape[0] == 0:
            raise ValueError("prompt_ids must not be empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        bs = self.block_size
        n_pages = 0
        pages = prefix_pages
        if pages is not None:
            full = prompt.shape[0] // bs
            if pages.dim() != 6 or pages.shape[0] > full:
                raise ValueError(
                    f"prefix_pages {tuple(pages.shape)} must be [k, *page_shape] with k <= {full}, "
                    f"the prompt's full blocks ({prompt.shape[0]} tokens, block_size {bs})"
                )
            n_pages = min(pages.shape[0], (prompt.shape[0] - 1) // bs)
        # The last generated token is never fed back, so the cache holds prompt + max_new_tokens - 1 tokens.
        needed = math.ceil((prompt.shape[0] + max(max_new_tokens, 1) - 1) / bs)
        if needed > self.num_free_blocks:
            raise CacheFullError(
                f"a prompt of {prompt.shape[0]} tokens plus {max_new_tokens} new tokens needs {needed} KV blocks "
                f"of {bs} tokens; {self.num_free_blocks} of {self.cache.num_blocks} are free"
            )
        if max_new_tokens == 0:
            return Generation([], None, 0, 0)
        seq_id = f"__greedy_generate/{next(self._generate_ids)}"
        stops = set(stop_token_ids)
        out: list[int] = []
        all_logits: list[torch.Tensor] = []
        try:
            if pages is not None and n_pages:
                self.import_pages(seq_id, pages[:n_pages])
            logits = self.prefill(seq_id, prompt[n_pages * bs :])
            for step in range(max_new_tokens):
                token = int(torch.argmax(logits))
                out.append(token)
                if return_logits:
                    all_logits.append(logits)
                if token in stops or step == max_new_tokens - 1:
                    break
                logits = self.decode([seq_id], [token])[0]
        finally:
            if seq_id in self.cache.manager:
                self.free(seq_id)
        stacked = torch.stack(all_logits) if return_logits else None
        return Generation(out, stacked, n_pages * bs, prompt.shape[0] - n_pages * bs)

    # ------------------------------------------------------------------ internals

    def _token_tensor(self, token_ids: TokenIds, name: str) -> torch.Tensor:
        """int64 [n] on the model's device; every id in [0, vocab_size)."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise ValueError(f"{name} must be a 1-D integer tensor, got {token_ids.dtype} {tuple(token_ids.shape)}")
            tokens = token_ids.to(device=self.device, dtype=torch.int64)
        else:
            ids = list(token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise TypeError(f"{name} must hold ints")
            tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"{name} holds token id {bad}, outside [0, {self.config.vocab_size}) (vocab_size)")
        return tokens

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by its tokens' positions; angles in fp32, as transformers does."""
        freqs = positions[:, None].float() * self._inv_freq[None, :]  # [tokens, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [tokens, 1, head_dim]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm.

        tokens, positions, slots: [tokens] each; token i is written to cache slot slots[i] in every layer
        before `attend(layer, q [tokens, heads, d]) -> [tokens, heads, d]` runs, so attention sees it.
        """
        cfg = self.config
        n = tokens.shape[0]
        h = F.embedding(tokens, self.weights.embed_tokens)  # [n, hidden]
        for layer, w in enumerate(self.weights.layers):
            x = _rms_norm(h, w.input_norm, cfg.rms_norm_eps)
            q = F.linear(x, w.q_proj, w.q_bias).view(n, cfg.num_heads, cfg.head_dim)
            k = F.linear(x, w.k_proj, w.k_bias).view(n, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(x, w.v_proj, w.v_bias).view(n, cfg.num_kv_heads, cfg.head_dim)
            q = self._rope(q, positions)
            k = self._rope(k, positions)
            kernels.reshape_and_cache(
                k.contiguous(), v.contiguous(), self.cache.key_caches[layer], self.cache.value_caches[layer], slots
            )
            attn = attend(layer, q).reshape(n, cfg.num_heads * cfg.head_dim)
            h = h + F.linear(attn, w.o_proj, w.o_bias)
            x = _rms_norm(h, w.post_norm, cfg.rms_norm_eps)
            gated = F.silu(F.linear(x, w.gate_proj, w.gate_bias)) * F.linear(x, w.up_proj, w.up_bias)
            h = h + F.linear(gated, w.down_proj, w.down_bias)
        return _rms_norm(h, self.weights.norm, cfg.rms_norm_eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights.lm_head).float()
