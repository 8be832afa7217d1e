"""The language model of Zoology's MQAR sweeps (HazyResearch/zoology, ``zoology/model.py``), with our mixers.

The MQAR preset ``loglinear_table2`` (:mod:`hdla_vision.lm.mqar_loglinear`) follows the Log-Linear
Attention paper's Table 2, which follows Arora et al. (2024), i.e. Zoology's configs of 2024-2025
(``zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py``,
``zoology/experiments/models_repo.py``: ``add_gated_delta_net``). Their model is not
:class:`~hdla_vision.lm.HDLAForCausalLM`'s; this module builds it, as Zoology's code computes it:

* ``ModelConfig(block_type="TransformerBlock", n_layers=2, max_position_embeddings=0,
  state_mixer=torch.nn.Identity)``: token embeddings (no position embeddings), two blocks, a final
  LayerNorm, the LM head tied to the embeddings; no MLP anywhere.
* ``sequence_mixer=Hybrid(configs=[conv_mixer, mixer])``: ``Hybrid`` builds ONE of its configs per
  layer, ``configs[layer_idx % 2]``, so layer 0 is a ``BaseConv`` (kernel 3) and layer 1 the
  recall mixer (Gated DeltaNet in Zoology; here any registered mixer, log-linear ones included).
* ``BaseConv(kernel_size=3)``: ``y = conv(u) * (u W + b) + u`` with a depthwise causal conv of
  width 3 (with bias) and a dense projection with bias.
* ``TransformerBlock.forward`` (pre-norm, LayerNorm eps 1e-5, dropout on the block input: the
  embedding dropout ``embed_dropout`` in layer 0, ``resid_dropout`` = 0 after)::

      residual = dropout(hidden) + residual        (residual = dropout(hidden) in layer 0)
      residual = sequence_mixer(norm1(residual)) + residual
      hidden   = state_mixer(norm2(residual))      (Identity: hidden = norm2(residual))

  so the Identity "state mixer" adds the block's normalised residual to the stream of the next
  block (and the last block's to the input of the final LayerNorm): kept, it is what Zoology runs.
* init (``_init_weights``, non-Mamba blocks): linear weights N(0, 0.02), biases 0, embeddings
  N(0, 0.02); the convolutions keep PyTorch's default. Our mixers' gates then take their own
  starting values (``mixer.init_weights()``), as in :class:`~hdla_vision.lm.HDLAForCausalLM`.

The mixer is built for the causal use with the arguments :class:`~hdla_vision.lm.HDLAConfig` gives
(``directions=("fwd",)``, no q/k/v or output biases), with fla's norm epsilon 1e-5.
"""
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import causal_conv1d
from ..layers import create_mixer

ZOOLOGY_INIT_STD = 0.02
ZOOLOGY_NORM_EPS = 1e-5


@dataclass
class ZoologyLMConfig:
    """Settings of :class:`ZoologyLM`: vocabulary, width, layers (even layers are ``BaseConv``, odd
    ones the mixer, as Zoology's two-config ``Hybrid``), the mixer and its arguments."""
    vocab_size: int
    d_model: int
    mixer: str
    num_heads: int
    head_dim: int
    head_dim_v: int
    num_layers: int = 2
    conv_kernel: int = 3
    short_conv_size: int = 4
    gate_act: str = "silu"
    mixer_kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_heads", "head_dim", "head_dim_v", "num_layers", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ZoologyLMConfig.{name} must be a positive int, got {value!r}")
        if self.num_layers < 2:
            raise ValueError(f"ZoologyLMConfig.num_layers must be >= 2 (layer 0 is the BaseConv, layer 1 the "
                             f"mixer), got {self.num_layers}")

    def describe(self) -> dict:
        """The settings as a JSON-able dict, with the layer pattern spelled out."""
        layers = ["base_conv" if i % 2 == 0 else self.mixer for i in range(self.num_layers)]
        return dict(architecture="zoology", layers=layers, mlp=None, norm="LayerNorm", tie_word_embeddings=True,
                    **asdict(self))


class BaseConv(nn.Module):
    """Zoology's ``BaseConv`` with a short kernel: ``u [B, T, C] -> conv(u) * (u W + b) + u``."""

    def __init__(self, dim: int, kernel_size: int):
        super().__init__()
        self.projection = nn.Linear(dim, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size, groups=dim, padding=kernel_size - 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u [B, T, C]``; the conv is causal (``nn.Conv1d`` padded on both sides with its right end dropped, as
        Zoology computes it), in one ``causal_conv1d``."""
        conv = causal_conv1d(u, self.conv.weight[:, 0], self.conv.bias)
        return conv * self.projection(u) + u


class ZoologyBlock(nn.Module):
    """Zoology's ``TransformerBlock`` with the Identity state mixer (module docstring)."""

    def __init__(self, dim: int, sequence_mixer: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=ZOOLOGY_NORM_EPS)
        self.sequence_mixer = sequence_mixer
        self.norm2 = nn.LayerNorm(dim, eps=ZOOLOGY_NORM_EPS)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], dropout: float):
        """``hidden, residual [B, T, C]`` -> the next block's ``(hidden, residual)``."""
        dropped = F.dropout(hidden, dropout, self.training) if dropout > 0 else hidden
        residual = dropped if residual is None else dropped + residual
        residual = self.sequence_mixer(self.norm1(residual)) + residual
        return self.norm2(residual), residual


class ZoologyLM(nn.Module):
    """Embeddings, ``num_layers`` :class:`ZoologyBlock` (BaseConv, mixer, BaseConv, ...), final
    LayerNorm, tied LM head: ``input_ids [B, T] -> logits [B, T, vocab]``."""

    def __init__(self, config: ZoologyLMConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(ZoologyBlock(config.d_model, self._sequence_mixer(i))
                                    for i in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=ZOOLOGY_NORM_EPS)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        self.lm_head.weight = self.embed_tokens.weight

    def _sequence_mixer(self, layer: int) -> nn.Module:
        c = self.config
        if layer % 2 == 0:
            return BaseConv(c.d_model, c.conv_kernel)
        return create_mixer(c.mixer, dim=c.d_model, num_heads=c.num_heads, head_dim=c.head_dim,
                            head_dim_v=c.head_dim_v, directions=("fwd",), qkv_bias=False, proj_bias=False,
                            short_conv_size=c.short_conv_size, gate_act=c.gate_act, norm_eps=ZOOLOGY_NORM_EPS,
                            **c.mixer_kwargs)

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=ZOOLOGY_INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for layer in self.layers:
            if hasattr(layer.sequence_mixer, "init_weights"):
                layer.sequence_mixer.init_weights()

    def hidden_states(self, input_ids: torch.Tensor, embed_dropout: float = 0.0) -> torch.Tensor:
        """``input_ids [B, T]`` -> final normalised hidden states ``[B, T, C]``; ``embed_dropout``
        is Zoology's dropout on layer 0's input (active in training mode only)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, embed_dropout if index == 0 else 0.0)
        return self.norm(hidden + residual)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids))
