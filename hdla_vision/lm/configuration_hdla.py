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

GATE_ACTIVATIONS = ("silu", "sigmoid", "identity")
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
    """Decoder-only LM whose token mixer is chosen by name from the causal mixer registry.

    Fields (all keyword arguments):
        vocab_size, hidden_size, num_hidden_layers: embedding size and depth.
        mixer: causal mixer name (``"hdla"``, ``"gated_deltanet"``, ``"gated_deltaproduct"``, ...).
        mixer_kwargs: extra keyword arguments for that mixer (e.g. ``{"num_householder": 2}``;
            ``{"beta_range": 2.0}`` gives Gated DeltaNet / DeltaProduct beta in (0, 2), negative
            eigenvalues allowed as fla's ``allow_neg_eigval``, where their default is (0, 1)).
        num_heads, head_dim: heads and key dimension per head; head_dim_v defaults to head_dim
            (``head_dim_v = 2 * head_dim`` is fla's and Zoology's ``expand_v = 2`` for Gated DeltaNet).
        short_conv_size: depthwise causal conv on the q/k/v projections (0 turns it off).
        gate_act: activation of the output gate (paper eq. 29-30 use a plain gate; fla uses SiLU).
        intermediate_size: SwiGLU hidden size (defaults to the multiple of 32 nearest 8/3 hidden).
        rms_norm_eps, initializer_range, tie_word_embeddings, use_cache: as in other transformers LMs.
    """

    model_type = "hdla"
    keys_to_ignore_at_inference = ["past_key_values"]

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
            raise ValueError(f"HDLAConfig.mixer must be a registered causal mixer name, got {self.mixer!r}")
        if not isinstance(self.mixer_kwargs, dict):
            raise ValueError(f"HDLAConfig.mixer_kwargs must be a dict, got {type(self.mixer_kwargs).__name__}")
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
