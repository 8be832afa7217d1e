"""Causal language models on the HDLA kernels (transformers ``model_type = "hdla"``).

Importing this package registers ``HDLAConfig`` with ``AutoConfig`` and the models with
``AutoModel`` / ``AutoModelForCausalLM``. The token mixers (``"hdla"``, ``"gated_deltanet"``,
``"gated_deltaproduct"``, ``"gla"``, ``"deltanet"``, ``"kda"``, ``"rwkv7"``, ``"hih_deltanet"``,
``"hih_gated_deltanet"``, ``"hdla_authors"``) are those of the vision backbones, from
:mod:`hdla_vision.layers`, built for the causal use (``directions=("fwd",)``).

    import hdla_vision.lm
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("hdla", vocab_size=32000, hidden_size=512, num_hidden_layers=8,
                                  num_heads=4, head_dim=64, short_conv_size=4, mixer="hdla")
    model = AutoModelForCausalLM.from_config(config)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)  # left padding is fine

Prefill runs the chunk kernels; decoding keeps one fp32 state ``[B, H, K, V]`` per layer (plus
a short-conv window) in an :class:`HDLACache` and advances it with ``fused_recurrent_hdla`` (HDLA) or
``fused_recurrent_generalized`` (the mixers on ``chunk_generalized``).
Packed batches: ``model(packed_ids [1, total], cu_seqlens=...)``; padding: ``attention_mask``.

``save_pretrained`` writes an ``auto_map`` and ``hdla_vision_auto.py`` (imports from this
package), so ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` reloads a
saved model in a process that never imported ``hdla_vision.lm``.

transformers comes with the ``lm`` extra (``pip install "hdla-vision[lm]"``); without it,
importing this package raises an ImportError that says so.
"""
from .._extras import raise_missing_extra

try:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
except ImportError as _err:
    raise_missing_extra(_err, "transformers", "lm", "hdla_vision.lm")

from .configuration_hdla import HDLAConfig
from .cache import HDLACache, LayerCache
from .modeling_hdla import CACHE_NAME, HDLAForCausalLM, HDLAModel, HDLAPreTrainedModel, cache_of, split_packed

AutoConfig.register(HDLAConfig.model_type, HDLAConfig, exist_ok=True)
AutoModel.register(HDLAConfig, HDLAModel, exist_ok=True)
AutoModelForCausalLM.register(HDLAConfig, HDLAForCausalLM, exist_ok=True)

__all__ = [
    "HDLAConfig",
    "HDLACache",
    "HDLAPreTrainedModel",
    "HDLAModel",
    "HDLAForCausalLM",
    "LayerCache",
    "split_packed",
    "CACHE_NAME",
    "cache_of",
]
