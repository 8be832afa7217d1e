"""Configuration of the HDLA causal language model (transformers ``model_type = "hdla"``).

``save_pretrained`` also writes ``hdla_vision_auto.py`` (three imports from the installed
package) and an ``auto_map`` naming it, so a fresh process reloads a saved model with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` (or answering the
prompt) without ``import hdla_vision.lm``; after ``import hdla_vision.lm`` no remote code is
needed. transformers 5 resolves ``auto_map`` only through module files inside the saved
directory, loaded as remote code, hence the small file.
"""
import os
from typing import Any, Dict, Optional

from transformers import PreTrainedConfig

from ..layers.mixer import GATE_ACTIVATIONS

# The mixers' causal use (hdla_vision.layers.mixer): one forward scan, no biases on the projections.
LM_DIRECTIONS = ("fwd",)
# mixer arguments the config sets itself (mixer_kwargs may not)
CONFIG_MIXER_ARGUMENTS = ("dim", "num_heads", "head_dim", "head_dim_v", "directions", "qkv_bias", "proj_bias",
                          "short_conv_size", "gate_act", "norm_eps")
AUTO_MODULE = "hdla_vision_auto"
AUTO_MAP = {"AutoConfig": f"{AUTO_MODULE}.HDLAConfig", "AutoModel": f"{AUTO_MODULE}.HDLAModel",
            "AutoModelForCausalLM": f"{AUTO_MODULE}.HDLAForCausalLM"}
AUTO_MODULE_SOURCE = '''"""The classes of this saved hdla_vision causal LM, from the installed hdla-vision package.

transformers loads this file for the config's auto_map (trust_remote_code=True). Without it:
    import hdla_vision.lm  # registers model_type "hdla" with transformers' Auto classes
    AutoModelForCausalLM.from_pretrained(path)
"""
from hdla_vision.lm import HDLAConfig, HDLAForCausalLM, HDLAModel  # noqa: F401
'''


class HDLAConfig(PreTrainedConfig):
    """Decoder-only LM whose token mixer is chosen by name from the mixer registry (``hdla_vision.layers``).

    Fields (all keyword arguments):
        vocab_size, hidden_size, num_hidden_layers: embedding size and depth.
        mixer: mixer name (``"hdla"``, ``"gated_deltanet"``, ``"gated_deltaproduct"``, ...; the
            log-linear ``"loglinear_hdla"``, ``"loglinear_gated_deltanet"``, ...: the cache then holds
            each layer's Fenwick levels ``[B, H, num_levels, K, V]``, and padding before a token is
            refused, see :mod:`hdla_vision.layers.mixer`).
        mixer_kwargs: the mixer's own keyword arguments (e.g. ``{"num_householder": 2}``;
            ``{"beta_range": 2.0}`` gives Gated DeltaNet beta in (0, 2), negative eigenvalues allowed
            as fla's ``allow_neg_eigval``; Gated DeltaProduct has (0, 2) by default, its paper's range).
        num_heads, head_dim: heads and key dimension per head; head_dim_v defaults to head_dim
            (``head_dim_v = 2 * head_dim`` is fla's and Zoology's ``expand_v = 2`` for Gated DeltaNet).
        short_conv_size: depthwise causal conv on the q/k/v projections (0 turns it off).
        gate_act: activation of the output gate (paper eq. 29-30 use a plain gate; fla uses SiLU).
        intermediate_size: SwiGLU hidden size (defaults to the multiple of 32 nearest 8/3 hidden).
        rms_norm_eps, initializer_range, tie_word_embeddings, use_cache: as in other transformers LMs.

    The mixers are the classes the vision backbones use, built for the causal use by
    :meth:`mixer_arguments`: ``directions=("fwd",)`` (one forward scan, padding, cache and decoding),
    no bias on the q/k/v, output-gate and output projections, the norms' epsilon ``rms_norm_eps``.
    Their gate modules, defaults and parameter names are the vision mixers' (issue 18). Against the
    LM's earlier mixers (its own classes until then) this changed the parameters:

    * names: ``in_proj`` -> ``qkv``, ``gate_proj`` -> ``gate``, ``out_norm`` -> ``norm``, ``out_proj`` ->
      ``proj``; every gate lives under ``directions.0`` (``beta.proj``, ``decay.logits.{down,up}``,
      ``alpha.{proj,A_log,dt_bias}``, ``rwkv.*``, ``mask.*``).
    * the beta projections have a bias (starting at 0: beta = beta_range / 2).
    * HDLA, GLA, KDA: the per-channel decay is low rank (``decay_rank`` 16) with a bias whose start
      spreads memory lengths geometrically over [``min_memory``, ``max_memory``] = [2, 256] tokens
      (before: a full-rank projection with sigmoid(bias) uniform in (0.9, 0.999)).
    * RWKV-7: the decay and the in-context rate are rank-16 projections with biases (before: full
      rank); ``k_k``, ``k_a`` are ``[H * K]`` (before ``[H, K]``).
    * Gated DeltaProduct: beta in (0, 2) by default, its paper's range (before (0, 1)); Gated
      DeltaNet keeps (0, 1). ``beta_range`` in ``mixer_kwargs`` sets either.
    * the q/k L2 norms use ``rms_norm_eps`` as their epsilon, and run in the model's dtype.
    At hidden 128, 2 heads of 64, short conv 4, one mixer layer has (before -> now) parameters:
    hdla 100,288 -> 88,002; hdla_authors 75,648 -> 75,650; gla 100,032 -> 87,744; deltanet 83,776 ->
    83,778; gated_deltanet 84,036 -> 84,038; gated_deltaproduct 118,084 -> 118,088; kda 100,288 ->
    88,002; rwkv7 116,800 -> 92,224; hih_deltanet 83,808 -> 83,810; hih_gated_deltanet 84,068 -> 84,070.
    """

    model_type = "hdla"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        num_hidden_layers: int = 8,
        mixer: str = "hdla",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        num_heads: int = 4,
        head_dim: int = 64,
        head_dim_v: Optional[int] = None,
        short_conv_size: int = 0,
        gate_act: str = "silu",
        intermediate_size: Optional[int] = None,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.mixer = mixer
        self.mixer_kwargs = dict(mixer_kwargs or {})
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.short_conv_size = short_conv_size
        self.gate_act = gate_act
        if intermediate_size is None:
            intermediate_size = 32 * round(hidden_size * 8 / 3 / 32) or 32
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        super().__init__(**kwargs)
        self._validate()

    def mixer_arguments(self) -> Dict[str, Any]:
        """The keyword arguments that build each layer's mixer with ``create_mixer(self.mixer, ...)``."""
        return dict(
            dim=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            directions=LM_DIRECTIONS,
            qkv_bias=False,
            proj_bias=False,
            short_conv_size=self.short_conv_size,
            gate_act=self.gate_act,
            norm_eps=self.rms_norm_eps,
            **self.mixer_kwargs,
        )

    @property
    def layer_types(self):
        """Every layer keeps a fixed-size recurrent state: transformers' DynamicCache then builds
        one ``LinearAttentionLayer`` (conv state + recurrent state) per layer."""
        return ["linear_attention"] * self.num_hidden_layers

    def _validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "head_dim_v",
                    "intermediate_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HDLAConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.short_conv_size, int) or self.short_conv_size < 0 or self.short_conv_size == 1:
            raise ValueError(f"HDLAConfig.short_conv_size must be 0 (off) or an int >= 2, got {self.short_conv_size!r}")
        if self.gate_act not in GATE_ACTIVATIONS:
            raise ValueError(f"HDLAConfig.gate_act must be one of {GATE_ACTIVATIONS}, got {self.gate_act!r}")
        if not isinstance(self.mixer, str):
            raise ValueError(f"HDLAConfig.mixer must be a registered mixer name, got {self.mixer!r}")
        if not isinstance(self.mixer_kwargs, dict):
            raise ValueError(f"HDLAConfig.mixer_kwargs must be a dict, got {type(self.mixer_kwargs).__name__}")
        fixed = sorted(set(self.mixer_kwargs) & set(CONFIG_MIXER_ARGUMENTS))
        if fixed:
            raise ValueError(f"HDLAConfig.mixer_kwargs may not set {fixed}: the config sets them (mixer_arguments)")
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            raise ValueError(f"HDLAConfig.rms_norm_eps must be a float > 0, got {self.rms_norm_eps!r}")

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """transformers' save, plus the ``auto_map`` and the module file it names (see the module docstring)."""
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, f"{AUTO_MODULE}.py"), "w") as handle:
            handle.write(AUTO_MODULE_SOURCE)
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """No-op: loading through ``auto_map`` calls this, and transformers would then copy this
        file into later saves instead of writing ``hdla_vision_auto.py``."""
