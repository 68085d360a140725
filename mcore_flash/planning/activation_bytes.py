"""Activation memory, term by term: what each module of a layer saves for backward.

:func:`layer_terms` (one transformer layer) and :func:`non_layer_terms` (embedding, final
norm, output layer, loss) return :class:`Term` s, one per tensor (or kind of tensor) that
autograd keeps from the forward to the backward pass, per micro-batch on one device: named
after the module that saves it (the suffix
``mcore_flash.measured_memory.SavedBytes.per_layer()`` reports, ``"<layer>"`` for the
layer itself), its size in bytes an exact ``Fraction``. A :class:`Profile`
(:data:`PROFILES`) says how the device's kernels and the modelling convention save tensors
(fused or standard attention, statistics, norms, RoPE, SwiGLU, dropout masks); a recompute
mode (:data:`RECOMPUTE_MODES`) what the layer keeps; the tiled MLP and loss (sequence
tiling) what the MLP and the loss keep, :func:`mlp_tile_terms` what one MLP tile rebuilds
in its backward. :func:`sum_terms` and
:func:`by_module` add terms up; :func:`offloaded_layer` splits a layer's for activation
offload; :func:`korthikanti_table2` holds Korthikanti et al.'s formulas, which the
``korthikanti`` profile reproduces term by term (:func:`korthikanti_model`). The terms
module by module, per recompute mode, and their validation against measured bytes:
docs/planner.md ("Per-layer activation terms").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Optional

from .models import ModelShape

__all__ = [
    "Profile",
    "PROFILES",
    "RECOMPUTE_MODES",
    "Term",
    "layer_terms",
    "mlp_tile_tokens",
    "mlp_tile_terms",
    "non_layer_terms",
    "sum_terms",
    "by_module",
    "OffloadedLayer",
    "offloaded_layer",
    "korthikanti_table2",
    "korthikanti_model",
]

RECOMPUTE_MODES = ("none", "qkv", "attention", "full", "core_attention")
F = Fraction


@dataclass(frozen=True)
class Profile:
    """How the modules save tensors: the device's kernels and the modelling convention.

    Attributes:
        attention: ``"fused"`` (our FlashDotProductAttention) or ``"standard"`` (Megatron's
            DotProductAttention: scores/probabilities materialised).
        stats_bytes_per_row: fused attention statistics per (batch, head, query): 4 for the
            fp32 logsumexp the CPU/CUDA backends keep; 64 on Ascend, whose backend keeps the
            kernel's own ``softmax_max`` + ``softmax_sum``, each ``[B, N, S, 8]`` fp32 (as
            torch_npu's autograd and MindSpeed do).
        norm_stats: the norm keeps its fp32 statistics (RMSNorm: rstd 4 bytes per row;
            LayerNorm: mean + rstd, 8 bytes) besides its input.
        rope: ``"megatron"`` (unfused ``apply_rotary_pos_emb``: keeps cos and sin cast to
            the activation dtype, for q and for k) or ``"none"`` (nothing kept).
        swiglu_fused: the SwiGLU keeps only its input (our fused SwiGLU through megatron's
            activation hook, ``use_te_activation_func=True``, as the trainer builds it), else
            Megatron's unfused glu (input, silu output, a copy of the up half).
        softmax_fp32: standard attention's softmax runs (and saves its output) in fp32.
        gqa_expanded: standard attention repeats K/V to all query heads before the matmuls.
        causal_mask_saved: standard attention keeps an ``[s, s]`` bool causal mask, built
            by every layer (``get_default_causal_mask``, not cached) and kept by the
            masked fill of the unfused softmax (Megatron's fused CUDA kernel for
            ``s <= 4096`` needs none).
        dropout_mask_bytes: bytes per element of a dropout mask; None = the activation
            dtype (torch on the CPU keeps a mask of the input's dtype); 1 on CUDA (bool);
            1/8 on Ascend (bit mask).
        attention_dropout, hidden_dropout: probabilities (> 0 adds the dropout terms).
        dtype_bytes: the activation dtype's bytes, when the profile fixes it
            (Korthikanti: 2); None = given per call.
    """

    name: str
    attention: str = "fused"
    stats_bytes_per_row: int = 4
    norm_stats: bool = True
    rope: str = "megatron"
    swiglu_fused: bool = False
    softmax_fp32: bool = True
    gqa_expanded: bool = True
    causal_mask_saved: bool = True
    dropout_mask_bytes: Optional[Fraction] = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    dtype_bytes: Optional[int] = None

    def with_(self, **changes) -> "Profile":
        return replace(self, **changes)


# Our trainer always runs the fused SwiGLU (megatron's activation hook) on every device.
PROFILES: dict[str, Profile] = {
    "npu": Profile("npu", stats_bytes_per_row=64, swiglu_fused=True, dropout_mask_bytes=F(1, 8)),
    "cuda": Profile("cuda", stats_bytes_per_row=4, swiglu_fused=True, dropout_mask_bytes=F(1)),
    "cpu": Profile("cpu", stats_bytes_per_row=4, swiglu_fused=True, dropout_mask_bytes=None),
    # Korthikanti et al. 2022 (Table 2): fp16, standard attention with dropout, LayerNorm
    # input only, bool (1 byte) dropout masks, softmax output in fp16, no RoPE.
    "korthikanti": Profile(
        "korthikanti",
        attention="standard",
        norm_stats=False,
        rope="none",
        softmax_fp32=False,
        gqa_expanded=True,
        causal_mask_saved=False,
        dropout_mask_bytes=F(1),
        attention_dropout=0.1,
        hidden_dropout=0.1,
        dtype_bytes=2,
    ),
}


@dataclass(frozen=True)
class Term:
    """One saved tensor kind: ``module`` (layer-relative path), ``name``, exact ``bytes``.

    ``category`` is ``"activations"`` or ``"attention_stats"`` (``"embeddings_logits"``
    outside the layers; ``"transient"`` for :mod:`.transient_bytes`' peaks, never kept);
    ``scope`` is ``"attention"`` or ``"mlp"`` for layer terms (what the attention recompute
    drops), ``"layer"`` for the recompute input, ``"model"`` for terms outside the layers.
    """

    module: str
    name: str
    bytes: Fraction
    category: str = "activations"
    scope: str = "attention"


def _profile(profile) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if profile not in PROFILES:
        raise ValueError(
            f"unknown activation profile {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    return PROFILES[profile]


def _norm_stats_bytes(model: ModelShape, p: Profile) -> Fraction:
    """Bytes per token (row) of the fp32 statistics one norm keeps for backward: LayerNorm's
    mean + rstd 8, RMSNorm's rstd 4; 0 where the profile's norms keep none."""
    return F(8 if model.normalization == "LayerNorm" else 4) if p.norm_stats else F(0)


def _dims(
    model: ModelShape,
    p: Profile,
    seq: int,
    micro_batch: int,
    tp: int,
    cp: int,
    sp: bool,
    dtype_bytes,
):
    if sp and tp == 1:
        sp = False
    if seq % cp:
        raise ValueError(f"seq_length {seq} is not divisible by the context-parallel size {cp}")
    s_c = F(seq, cp)
    s_t = s_c / tp if sp else s_c
    if model.num_attention_heads % tp:
        raise ValueError(
            f"num_attention_heads ({model.num_attention_heads}) not divisible by TP size {tp}"
        )
    dtype = p.dtype_bytes if p.dtype_bytes is not None else dtype_bytes
    if dtype is None:
        raise ValueError(f"profile {p.name!r} needs dtype_bytes (2 for bf16/fp16, 4 for fp32)")
    mask = F(dtype) if p.dropout_mask_bytes is None else F(p.dropout_mask_bytes)
    g_local = F(model.num_query_groups, tp) if model.num_query_groups >= tp else F(1)
    return s_c, s_t, F(micro_batch), F(dtype), mask, F(model.num_attention_heads, tp), g_local


def _attention_terms(model: ModelShape, p: Profile, dims: tuple, recompute: str) -> list[Term]:
    """The attention sub-block's terms with no recompute of its own (``core_attention``
    aside): input norm, QKV input, RoPE, q, k, v, the kernel's saved outputs, the bias-dropout-add mask."""
    s_c, s_t, b, B, M, a_t, g_t = dims
    h, d = F(model.hidden_size), F(model.head_dim)
    stat = _norm_stats_bytes(model, p)
    attn: list[Term] = [
        Term("input_layernorm", "input", s_t * b * h * B),
        Term("input_layernorm", "statistics (fp32)", s_t * b * stat),
        Term("self_attention.linear_qkv", "input", s_t * b * h * B),
    ]
    if p.rope == "megatron" and model.position_embedding_type == "rope":
        rot = F(int(model.head_dim * model.rotary_percent))
        attn.append(Term("self_attention", "RoPE cos/sin for q and k", 4 * s_c * rot * B))
    kv_heads = a_t if (p.attention == "standard" and p.gqa_expanded) else g_t
    q = Term("self_attention.core_attention", "q", s_c * b * a_t * d * B)
    k = Term("self_attention.core_attention", "k", s_c * b * kv_heads * d * B)
    v = Term("self_attention.core_attention", "v", s_c * b * kv_heads * d * B)
    attn += [q, k, v]
    if p.attention == "fused":
        attn += _fused_kernel_terms(p, dims, d, recompute)
    elif p.attention == "standard":
        attn += _standard_attention_terms(p, dims, d, recompute)
    else:
        raise ValueError(f"profile attention {p.attention!r}: 'fused' or 'standard'")
    if p.hidden_dropout > 0:
        attn.append(Term("<layer>", "attention bias-dropout-add mask", s_t * b * h * M))
    return attn


def _fused_kernel_terms(p: Profile, dims: tuple, d: Fraction, recompute: str) -> list[Term]:
    """What the fused kernel keeps besides q, k, v: its output and softmax statistics;
    under ``core_attention`` recompute only its output, as linear_proj's input."""
    s_c, s_t, b, B, M, a_t, g_t = dims
    if recompute == "core_attention":  # checkpoint keeps q, k, v; linear_proj keeps the output
        return [
            Term("self_attention.linear_proj", "input (attention output)", s_c * b * a_t * d * B)
        ]
    return [
        Term("self_attention.core_attention", "out", s_c * b * a_t * d * B),
        Term(
            "self_attention.core_attention",
            "softmax statistics",
            b * a_t * s_c * p.stats_bytes_per_row,
            category="attention_stats",
        ),
    ]


def _standard_attention_terms(p: Profile, dims: tuple, d: Fraction, recompute: str) -> list[Term]:
    """What Megatron's standard attention keeps besides q, k, v: the softmax output, the
    causal mask, the dropout mask and probabilities (none of those under ``core_attention``
    recompute), and linear_proj's input."""
    s_c, s_t, b, B, M, a_t, g_t = dims
    terms: list[Term] = []
    if recompute != "core_attention":
        scores = b * a_t * s_c * s_c  # elements of one [b, a/t, s, s] tensor
        softmax = F(4) if p.softmax_fp32 else B
        terms.append(
            Term(
                "self_attention.core_attention.scale_mask_softmax",
                "softmax output",
                scores * softmax,
            )
        )
        if p.causal_mask_saved:
            mask_name = "causal mask [s, s] bool (built by every layer)"
            terms.append(
                Term("self_attention.core_attention.scale_mask_softmax", mask_name, s_c * s_c)
            )
        if p.attention_dropout > 0:
            terms.append(
                Term("self_attention.core_attention.attention_dropout", "dropout mask", scores * M)
            )
            terms.append(
                Term("self_attention.core_attention", "dropped-out probabilities", scores * B)
            )
        elif softmax != B:
            terms.append(
                Term(
                    "self_attention.core_attention",
                    "probabilities cast to the dtype",
                    scores * B,
                )
            )
    terms.append(
        Term("self_attention.linear_proj", "input (attention output)", s_c * b * a_t * d * B)
    )
    return terms


def _mlp_intermediate_terms(
    model: ModelShape, p: Profile, dims: tuple, tp: int, tokens: Fraction
) -> list[Term]:
    """The MLP's ``[tokens, b, *f/tp]`` intermediates: the activation's input (and Megatron's
    unfused SwiGLU's copies) and the fc2 input; ``tokens`` is ``s_c``, or one tile's tokens
    under the tiled MLP (:func:`mlp_tile_terms`)."""
    b, B = dims[2], dims[3]
    f, t = F(model.ffn_hidden_size), F(tp)
    terms = []
    if model.gated:
        swiglu_module = "mlp.activation_func" if p.swiglu_fused else "mlp"
        terms.append(
            Term(
                swiglu_module, "fc1 output (SwiGLU input)", tokens * b * 2 * f / t * B, scope="mlp"
            )
        )
        if not p.swiglu_fused:
            terms.append(Term("mlp", "silu(gate) output", tokens * b * f / t * B, scope="mlp"))
            terms.append(
                Term(
                    "mlp",
                    "up-projection copy (x_linear + offset)",
                    tokens * b * f / t * B,
                    scope="mlp",
                )
            )
    else:
        terms.append(
            Term("mlp", "fc1 output (activation input)", tokens * b * f / t * B, scope="mlp")
        )
    terms.append(Term("mlp.linear_fc2", "input", tokens * b * f / t * B, scope="mlp"))
    return terms


def _mlp_terms(model: ModelShape, p: Profile, dims: tuple, tp: int, tiled: bool) -> list[Term]:
    """The MLP sub-block's terms: pre-MLP norm, fc1 input, the activation's input (and
    Megatron's unfused SwiGLU's copies), fc2 input, the bias-dropout-add mask. ``tiled`` (the
    tiled MLP, ``--mlp-chunk-size`` shorter than ``s_c``): the tiles' checkpoints hold the MLP
    input (the fc1 input's storage) and none of the intermediates, rebuilt per tile in backward."""
    s_c, s_t, b, B, M, a_t, g_t = dims
    h = F(model.hidden_size)
    stat = _norm_stats_bytes(model, p)
    mlp_terms = [
        Term("pre_mlp_layernorm", "input", s_t * b * h * B, scope="mlp"),
        Term("pre_mlp_layernorm", "statistics (fp32)", s_t * b * stat, scope="mlp"),
    ]
    if tiled:
        mlp_terms.append(
            Term(
                "mlp", "input (the tiles' checkpoints: the fc1 input)", s_t * b * h * B, scope="mlp"
            )
        )
    else:
        mlp_terms.append(Term("mlp.linear_fc1", "input", s_t * b * h * B, scope="mlp"))
        mlp_terms += _mlp_intermediate_terms(model, p, dims, tp, s_c)
    if p.hidden_dropout > 0:
        mlp_terms.append(Term("<layer>", "MLP bias-dropout-add mask", s_t * b * h * M, scope="mlp"))
    return mlp_terms


def mlp_tile_tokens(seq_length: int, cp: int, mlp_chunk_size: Optional[int]) -> Optional[Fraction]:
    """Tokens of one tile of the tiled MLP (``--mlp-chunk-size``), or None where the MLP runs
    untiled: no tile size, or one of at least the CP rank's ``seq_length / cp`` tokens (the
    trainer's ``TiledMLP`` then calls megatron's MLP as is)."""
    if mlp_chunk_size is None or mlp_chunk_size >= F(seq_length, cp):
        return None
    return F(mlp_chunk_size)


def mlp_tile_terms(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    profile="npu",
    dtype_bytes: Optional[int] = 2,
    mlp_chunk_size: Optional[int] = None,
) -> list[Term]:
    """The MLP intermediates one tile of the tiled MLP rebuilds in its backward (the
    ``[N, b, *f/tp]`` terms of :func:`layer_terms` at ``N`` = :func:`mlp_tile_tokens`
    tokens); none where the MLP runs untiled."""
    tokens = mlp_tile_tokens(seq_length, cp, mlp_chunk_size)
    if tokens is None:
        return []
    p = _profile(profile)
    dims = _dims(model, p, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes)
    return _mlp_intermediate_terms(model, p, dims, tp, tokens)


def _qkv_kept(attn: list[Term], p: Profile, layer_input_bytes: Fraction) -> list[Term]:
    """The attention terms ``qkv`` recompute keeps: the layer input (as the input norm's
    saved input), the kernel's out and statistics, the bias-dropout-add mask."""
    if p.attention != "fused":
        raise ValueError(
            "recompute 'qkv' keeps the fused kernel's output: it needs the fused attention profile"
        )
    kernel_outputs = [
        t
        for t in attn
        if t.module == "self_attention.core_attention" and t.name not in ("q", "k", "v")
    ]
    after_kernel = [t for t in attn if t.module == "<layer>"]  # the bias-dropout-add mask
    return (
        [Term("input_layernorm", "input (the layer input)", layer_input_bytes)]
        + kernel_outputs
        + after_kernel
    )


def layer_terms(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    recompute: str = "none",
    profile="npu",
    dtype_bytes: Optional[int] = 2,
    mlp_chunk_size: Optional[int] = None,
) -> list[Term]:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one device;
    ``mlp_chunk_size``: tokens per tile of the tiled MLP (None: untiled; the MLP is tiled
    where :func:`mlp_tile_tokens` says so)."""
    p = _profile(profile)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}: choose one of {RECOMPUTE_MODES}")
    dims = _dims(model, p, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes)
    s_c, s_t, b, B, M, a_t, g_t = dims
    input_bytes = s_t * b * F(model.hidden_size) * B
    layer_input = Term("<layer>", "layer input (recompute checkpoint)", input_bytes, scope="layer")
    if recompute == "full":
        return [layer_input]
    attn = _attention_terms(model, p, dims, recompute)
    tiled = mlp_tile_tokens(seq_length, cp, mlp_chunk_size) is not None
    mlp_terms = _mlp_terms(model, p, dims, tp, tiled)
    if recompute == "attention":
        attn = [layer_input]
    elif recompute == "qkv":
        attn = _qkv_kept(attn, p, input_bytes)
    return [term for term in attn + mlp_terms if term.bytes]


def non_layer_terms(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    recompute: str = "none",
    profile="npu",
    dtype_bytes: Optional[int] = 2,
    first_stage: bool = True,
    last_stage: bool = True,
    loss_chunk_size: Optional[int] = None,
) -> list[Term]:
    """Saved bytes outside the layers, per micro-batch: embedding, final norm, output layer, loss.

    ``module`` is the model-level path (``embedding.word_embeddings``, ``output_layer``,
    ``""`` for the loss, ``decoder`` for tensors the block's checkpoints keep).
    ``loss_chunk_size`` (the tiled loss, ``--loss-compute-mode chunk``; None: megatron's
    cross-entropy over the whole sequence's logits): the loss keeps, besides the output
    layer's input, the per-token fp32 maximum and sum of exponentials and, with ``b > 1``,
    its ``[s, b]`` int64 copy of the labels (at ``b = 1`` the transpose is a view of the
    batch's labels), never the ``[s, b, V/tp]`` softmax.
    """
    p = _profile(profile)
    s_c, s_t, b, B, M, a_t, g_t = _dims(
        model, p, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes
    )
    h, V, t = F(model.hidden_size), F(model.vocab_size), F(tp)
    stat = _norm_stats_bytes(model, p)
    terms: list[Term] = []

    def add(module, name, nbytes, category="embeddings_logits"):
        if nbytes:
            terms.append(Term(module, name, nbytes, category=category, scope="model"))

    if first_stage:
        add("embedding.word_embeddings", "token ids (int64)", b * s_c * 8)
        if tp > 1:
            add("embedding.word_embeddings", "vocab-range mask (bool)", b * s_c)
        if model.position_embedding_type == "learned_absolute":
            add("embedding.position_embeddings", "position ids (int64)", b * s_c * 8)
        if p.hidden_dropout > 0:
            add("embedding.embedding_dropout", "dropout mask", s_t * b * h * M)
    if recompute == "full" and model.position_embedding_type == "rope" and p.rope == "megatron":
        rot = F(int(model.head_dim * model.rotary_percent))
        add(
            "decoder",
            "RoPE frequencies (fp32, shared by the layer checkpoints)",
            s_c * rot * 4,
            "activations",
        )
    if last_stage:
        add("decoder.final_layernorm", "input", s_t * b * h * B)
        add("decoder.final_layernorm", "statistics (fp32)", s_t * b * stat)
        add("output_layer", "input", s_t * b * h * B)
        if loss_chunk_size is None:
            add("", "cross-entropy softmax (fp32)", s_c * b * V / t * 4)
            add("", "cross-entropy target mask (bool)", s_c * b)
            add("", "cross-entropy masked targets (int64)", s_c * b * 8)
        else:
            add("", "tiled loss: per-token max and sum of exponentials (fp32)", 2 * s_c * b * 4)
            if b > 1:
                add("", "tiled loss: labels [s, b] (int64, a transposed copy)", s_c * b * 8)
    return terms


def sum_terms(terms, category: Optional[str] = None) -> Fraction:
    return sum(
        (term.bytes for term in terms if category is None or term.category == category), F(0)
    )


@dataclass(frozen=True)
class OffloadedLayer:
    """One layer's bytes under activation offload (``--activation-offload-layers``), one
    micro-batch, from its kept terms (:func:`offloaded_layer`).

    Attributes:
        kept: ``S``, the storages of its kept tensors (:func:`layer_terms`' sum): what the
            layer holds on the device when it is not offloaded.
        on_device: ``R``, what stays on the device while the layer is parked: under ``qkv``
            recompute the layer input (the boundary holds it itself; the offload skips it).
        parked: ``P = S - R``, the device storages released after the layer's forward.
        fetched: ``V = P + D``, the bytes of its host copies and of the buffers fetched back
            before its backward: the offload copies each saved tensor object (one copy per
            object, not per storage), so a storage saved through two tensors is copied twice:
            ``D`` is the fused kernel's output, which ``linear_proj`` saves again as its input
            (a reshaped view of it) wherever the kernel's output is kept (``none``, ``qkv``).
            The tiled MLP's tiles save views of the MLP input, one per tile, which together
            hold its rows once: copied once, as the untiled ``linear_fc1`` input is.
    """

    kept: Fraction
    on_device: Fraction
    parked: Fraction
    fetched: Fraction


def offloaded_layer(terms, recompute: str) -> OffloadedLayer:
    """:class:`OffloadedLayer` of a layer that keeps ``terms`` (:func:`layer_terms` under
    ``recompute``)."""
    kept = sum_terms(terms)
    on_device = sum(
        (t.bytes for t in terms if recompute == "qkv" and t.name == "input (the layer input)"),
        F(0),
    )
    twice = sum(
        (t.bytes for t in terms if (t.module, t.name) == ("self_attention.core_attention", "out")),
        F(0),
    )
    return OffloadedLayer(kept, on_device, kept - on_device, kept - on_device + twice)


def by_module(terms) -> dict[str, Fraction]:
    """Terms summed by module path (what ``SavedBytes.per_layer()`` reports per layer)."""
    out: dict[str, Fraction] = {}
    for term in terms:
        out[term.module] = out.get(term.module, F(0)) + term.bytes
    return out


# ------------------------------------------------------------------------------------------
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# ------------------------------------------------------------------------------------------


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> Fraction:
    """Table 2: activation bytes per layer.

    Modes: ``none`` sbh(34 + 5as/h) (t = 1); ``tp`` sbh(10 + 24/t + 5as/(ht));
    ``tp_sp`` sbh(34/t + 5as/(ht)); ``tp_selective`` sbh(10 + 24/t);
    ``tp_sp_selective`` 34sbh/t; ``full`` 2sbh.
    """
    s, b, h, a, t = map(F, (s, b, h, a, t))
    sbh = s * b * h
    table = {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp_sp": sbh * (34 / t + 5 * a * s / (h * t)),
        "tp_selective": sbh * (10 + 24 / t),
        "tp_sp_selective": 34 * sbh / t,
        "full": 2 * sbh,
    }
    if mode not in table:
        raise ValueError(f"mode {mode!r}: choose one of {list(table)}")
    return table[mode]


def korthikanti_model(
    hidden_size: int, num_attention_heads: int, num_layers: int = 1, vocab_size: int = 51200
) -> ModelShape:
    """The GPT the paper models: 4h GELU MLP with biases, LayerNorm, MHA, learned positions."""
    return ModelShape(
        "korthikanti-gpt",
        num_layers,
        hidden_size,
        4 * hidden_size,
        num_attention_heads,
        num_attention_heads,
        vocab_size,
        normalization="LayerNorm",
        activation="gelu",
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
    )
