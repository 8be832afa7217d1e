"""HDLA causal language model as transformers ``PreTrainedModel``s.

Each block: ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``; the mixer is built by
name (``config.mixer``) from the mixer registry. Prefill runs the chunk kernels and
stores each layer's final state in the cache; decoding advances those states with the
recurrent step (``fused_recurrent_hdla`` for HDLA, ``fused_recurrent_generalized`` for the others). The
mixers are those of the vision backbones (:mod:`hdla_vision.layers`), built for the causal use by
``HDLAConfig.mixer_arguments``.

Variable-length batches:
  * ``attention_mask`` (left or right padding, 1 = token, 0 = pad): pad tokens become identity
    steps of every layer's recurrence (see :mod:`hdla_vision.layers.mixer`), so no state flows
    between a sequence and its padding and a left-padded prompt decodes exactly like the
    unpadded one. Masks must be contiguous runs of ones (padding on one side only). Log-linear
    mixers place tokens on an absolute bucket grid and refuse left padding, and any padding with a
    cache (a ValueError naming ``attention_mask``); their cache must be an :class:`HDLACache`, whose
    token count gives the positions.
  * ``cu_seqlens`` (packed ``input_ids [1, total]`` with FlashAttention-style boundaries
    ``[0, l_1, l_1 + l_2, ..., total]``): the kernels take no ``cu_seqlens``, so the packed
    sequences are split into a right-padded batch inside the model (one sequence per row),
    run with the mask above, and packed back. Labels are not predicted across boundaries.
"""
import dataclasses
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..layers import create_mixer
from ..layers.gates import GateModule
from .cache import HDLACache, LayerCache
from .configuration_hdla import HDLAConfig


# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache`` (the old name
# deprecated there, to go in 6.0). The models take either argument and return the cache under the field name
# of the installed transformers, so that generate() finds it and nothing warns.
CACHE_NAME = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def cache_argument(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    """The cache passed as ``cache`` or as ``past_key_values`` (transformers before 5.24), not both."""
    if past_key_values is None:
        return cache
    if cache is not None:
        raise ValueError("cache / past_key_values: pass the cache once, as cache (past_key_values is its name in "
                         "transformers before 5.24)")
    return past_key_values


def cache_of(output) -> Optional[Cache]:
    """The cache of a model output, under the installed transformers' field name (:data:`CACHE_NAME`)."""
    return getattr(output, CACHE_NAME)


class SwiGLU(nn.Module):
    """``W_down(SiLU(W_gate x) * W_up x)``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HDLABlock(nn.Module):
    def __init__(self, config: HDLAConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_idx = layer_idx
        self.mixer = create_mixer(config.mixer, **config.mixer_arguments())
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor], cache: Optional[Cache]) -> torch.Tensor:
        layer_cache = None if cache is None else LayerCache(cache, self.layer_idx)
        x = x + self.mixer(self.mixer_norm(x), attention_mask=attention_mask, cache=layer_cache)
        return x + self.mlp(self.mlp_norm(x))


class HDLAPreTrainedModel(PreTrainedModel):
    config_class = HDLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["HDLABlock"]
    _supports_cache_class = True

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """No-op, as ``HDLAConfig.register_for_auto_class``: saves keep the ``hdla_vision_auto.py`` entry point."""

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        """transformers' per-module init, always through :meth:`_init_weights`.

        transformers treats a model defined outside its package as "custom code" and then marks a module
        initialised without calling ``_init_weights`` when all of its *own* parameters are flagged as
        initialised, which is vacuously true for a module with no parameters of its own. A gate module
        whose parameters live in child linears (:class:`~hdla_vision.layers.gates.VectorLogDecay`'s
        ``logits.up.bias``, ``BetaGate``, the data-dependent ``HeadInHeadMask``) was then skipped, and the
        child's generic init had already zeroed its bias: HDLA, GLA and KDA started with lambda = 1/2 on
        every channel (a memory of about one token) instead of the multi-timescale decay, and learned MQAR
        far later (issue 13). That shortcut is for code that writes parameters in place; every init here
        goes through transformers' flag-aware functions, so weights loaded from a checkpoint stay."""
        super()._initialize_weights(module)

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' defaults (normal(0, initializer_range) linears and embeddings, unit norms),
        except the mixers' gates, which take their starting values (``GateModule.initial_values``:
        decays with multi-timescale memory, beta at half its range, ...) through the flag-aware
        ``init.copy_`` (weights loaded from a checkpoint stay), and the depthwise short convs, which
        keep PyTorch's default (a 0.02-std conv would shrink q, k, v by ~30x at init)."""
        if isinstance(module, GateModule):
            for name, value in module.initial_values().items():
                init.copy_(module.get_parameter(name), value)
        elif isinstance(module, nn.Conv1d):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            super()._init_weights(module)


def split_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x [1, total, ...]`` -> right-padded ``[N, L_max, ...]`` and the mask ``[N, L_max]``."""
    cu = _check_cu_seqlens(cu_seqlens, x.shape[1])
    lengths = cu[1:] - cu[:-1]
    mask = torch.arange(int(lengths.max()), device=x.device)[None, :] < lengths[:, None].to(x.device)
    padded = x.new_zeros(len(lengths), mask.shape[1], *x.shape[2:])
    padded[mask] = x[0]
    return padded, mask


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [0, l_1, l_1 + l_2, ..., total]")
    cu = cu_seqlens.long()
    if len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, increase strictly and end at the packed length {total}, "
                         f"got {cu.tolist()}")
    return cu


class HDLAModel(HDLAPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` blocks and a final RMSNorm: ``last_hidden_state [B, T, C]``."""

    def __init__(self, config: HDLAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HDLABlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids ``[B, T]`` (or inputs_embeds ``[B, T, C]``); attention_mask ``[B, T]``;
        cu_seqlens ``[N + 1]`` for packed ``[1, total]`` inputs (no cache then); ``cache`` (or its older name
        ``past_key_values``) a transformers Cache, returned under :data:`CACHE_NAME`."""
        given = cache_argument(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, hidden_size]")
        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must have shape [B, T], got {list(input_ids.shape)}")
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.training or cu_seqlens is not None:
            use_cache = use_cache and given is not None
        if cu_seqlens is not None:
            if given is not None or inputs_embeds.shape[0] != 1 or attention_mask is not None:
                raise ValueError("cu_seqlens needs packed inputs of batch size 1, no attention_mask and no cache")
            hidden, mask = split_packed(inputs_embeds, cu_seqlens)
        else:
            hidden = inputs_embeds
            if use_cache and given is None:
                given = HDLACache(config=self.config)
            mask = create_recurrent_attention_mask(self.config, hidden, attention_mask, given)
        cache = given if use_cache else None
        all_hidden = []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden)
            hidden = layer(hidden, mask, cache)
        hidden = self.norm(hidden)
        if isinstance(cache, HDLACache):
            cache.advance(hidden.shape[1])
        if cu_seqlens is not None:
            hidden = hidden[mask].unsqueeze(0)
            all_hidden = [h[mask].unsqueeze(0) for h in all_hidden]
        if output_hidden_states:
            all_hidden.append(hidden)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            **{CACHE_NAME: cache},
        )


class HDLAForCausalLM(HDLAPreTrainedModel, GenerationMixin):
    """HDLAModel plus an LM head (tied to the embeddings when ``config.tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HDLAConfig):
        super().__init__(config)
        self.model = HDLAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a plain DynamicCache (it cannot count tokens); forward builds an HDLACache.
        return False

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # Keep the 2-D padding mask: generate() would turn it into 4-D attention masks for a
        # compileable cache, but the recurrent layers only need to know which tokens are padding.
        cache = kwargs.get(CACHE_NAME)
        if CACHE_NAME == "cache" and kwargs.get("next_sequence_length") is None and isinstance(cache, HDLACache):
            # transformers >= 5.24 does not cut a restarted prompt for a cache of linear layers: feed only the
            # tokens the HDLACache (which counts them) has not absorbed yet
            seen = cache.get_seq_length()
            if 0 < seen < input_ids.shape[1]:
                kwargs["next_sequence_length"] = input_ids.shape[1] - seen
        model_inputs = super().prepare_inputs_for_generation(input_ids, attention_mask=None, **kwargs)
        model_inputs.pop("attention_mask", None)
        if attention_mask is not None:
            model_inputs["attention_mask"] = attention_mask
        return model_inputs

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """logits ``[B, T, vocab]`` (last ``logits_to_keep`` positions if > 0); ``labels [B, T]`` are
        shifted inside (``-100`` ignored), and never predicted across ``cu_seqlens`` boundaries; the cache as
        :meth:`HDLAModel.forward` takes and returns it."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache_argument(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if cu_seqlens is not None:
                labels = labels.clone()
                labels[:, cu_seqlens[1:-1].long()] = -100  # a sequence's last token does not predict the next one's first
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_NAME: getattr(out, CACHE_NAME)})
